"""The simulated driver: a discrete-event loop with a virtual clock and a cost model.

It turns a workload into engine inputs and carries out the engine's commands by
scheduling their completions in virtual time: a step costs prefill and decode time (plus
any lookups paid inline), a lookup answers after its latency, a transfer report comes
from each rank after latency + bytes / bandwidth + that rank's jitter. The tier indexes
are the very ones the engine holds (``kvlife.transfer.index``); only the bytes are modelled.
Everything random comes from one ``random.Random(seed)``, so a run is reproducible.

Ctrl-C or SIGTERM (``kvlife.lifecycle.drivers.interrupts``) stops the loop between two
events: an ``interrupted`` record (``cut_record``) ends the trace and the interrupt is
re-raised.
"""

from __future__ import annotations

import heapq
import random
from collections import Counter
from collections.abc import Callable
from typing import Any

import attrs

from kvlife.lifecycle.config import RunConfig
from kvlife.lifecycle.drivers import interrupts
from kvlife.lifecycle.engine.core import Engine, Recorder
from kvlife.lifecycle.engine.events import (
    Arrival,
    InputEvent,
    LookupAnswer,
    StartLoad,
    StartPrefetch,
    StartStore,
    StepOutput,
    StepPlan,
    SubmitLookup,
    Tick,
    TransferReport,
)
from kvlife.lifecycle.workloads.mooncake import WorkloadRequest
from kvlife.policies.stack import PolicyStack

Progress = Callable[[int, int], None]


@attrs.define
class SimResult:
    engine: Engine
    workload: list[WorkloadRequest]
    makespan_ms: float
    events: int
    stranded: list[str]


class Simulator:
    def __init__(
        self,
        config: RunConfig,
        workload: list[WorkloadRequest],
        policies: PolicyStack,
        recorder: Recorder | None = None,
        progress: Progress | None = None,
        reference: bool = False,
        check_every: int | None = None,
    ) -> None:
        self.config = config
        self.workload = workload
        self.engine = Engine(config.engine, policies, recorder=recorder, reference=reference)
        self.rng = random.Random(config.sim.seed)
        self.progress = progress
        # Check block accounting (invariants 2 and 8) every N events; tests use it.
        self.check_every = check_every
        self._queue: list[tuple[float, int, InputEvent]] = []
        self._seq = 0
        self._output_len = {w.request_id: w.output_length for w in workload}
        self._plans: dict[int, StepPlan] = {}
        self._steps_in_flight = 0
        self._tick_pending = False
        self._tiers = {t.name: t for t in config.engine.tiers}
        self._pending_lookup: dict[tuple[str, int], tuple[int, ...]] = {}
        # Ticks pushed because a prefetch patience runs out (engine.next_wakeup), by heap seq.
        self._wakeup_seqs: set[int] = set()
        self._wakeup_times: set[float] = set()

    def _push(self, t: float, event: InputEvent) -> None:
        heapq.heappush(self._queue, (t, self._seq, event))
        self._seq += 1

    def run(self) -> SimResult:
        with interrupts.held() as gate:
            try:
                return self._run(gate)
            except KeyboardInterrupt as exc:
                if self.engine.recorder is not None:
                    self.engine.recorder(cut_record(self.engine, exc, len(self.workload), gate.clean,
                                                    steps=self._steps_in_flight))
                raise

    def _run(self, gate: interrupts.StopGate) -> SimResult:
        for w in self.workload:
            self._push(w.arrival_ms, Arrival(w.arrival_ms, w.request_id, w.input_length, w.hash_ids))
        finished_before = 0
        events = 0
        now = 0.0
        max_in_flight = 2 if self.config.engine.async_scheduling else 1
        engine = self.engine
        while self._queue:
            if gate.pending is not None:
                gate.check()
            now, seq, event = heapq.heappop(self._queue)
            if isinstance(event, StepOutput):
                event = self._with_finishes(event)
                self._steps_in_flight -= 1
            elif isinstance(event, Tick):
                if seq in self._wakeup_seqs:
                    self._wakeup_seqs.discard(seq)
                    self._wakeup_times.discard(now)
                    if self._tick_pending or self._steps_in_flight >= max_in_flight:
                        continue  # a regular tick comes anyway (after the step in flight)
                self._tick_pending = False
            elif isinstance(event, LookupAnswer):
                event = self._answer_lookup(event)
            commands = engine.handle(event)
            events += 1
            if self.check_every is not None and events % self.check_every == 0:
                engine.check_invariants()
            made_plan = False
            for command in commands:
                if isinstance(command, StepPlan):
                    made_plan = True
                    self._start_step(now, command)
                elif isinstance(command, StartLoad | StartStore):
                    self._start_transfer(now, command)
                elif isinstance(command, StartPrefetch):
                    self._start_prefetch(now, command)
                elif isinstance(command, SubmitLookup):
                    key = (command.request_id, command.epoch)
                    if key in self._pending_lookup:
                        continue  # idempotent: one answer per (request, epoch)
                    # The lookup reads the tiers when it completes (see _answer_lookup).
                    t = now + self.config.engine.lookup_latency_ms
                    self._pending_lookup[key] = command.block_hashes
                    self._push(t, LookupAnswer(t, command.request_id, command.epoch, ()))
            # Tick again after any event, unless the last tick found nothing to do and
            # nothing has changed since (no spinning in idle time).
            if (
                not self._tick_pending
                and self._steps_in_flight < max_in_flight
                and not (isinstance(event, Tick) and not made_plan)
                and engine.busy()
            ):
                self._tick_pending = True
                self._push(now, Tick(now))
            wake = engine.next_wakeup() if engine.prefetch_waits else None
            if wake is not None and wake not in self._wakeup_times:
                self._wakeup_times.add(wake)
                self._wakeup_seqs.add(self._seq)
                self._push(wake, Tick(wake))
            if self.progress is not None:
                done = engine.state_counts["finished"]
                if done - finished_before >= 200:
                    finished_before = done
                    self.progress(done, len(self.workload))
        if self.progress is not None:
            self.progress(engine.state_counts["finished"], len(self.workload))
        engine.check_invariants()
        return SimResult(engine, self.workload, now, events, engine.stranded())

    def _start_step(self, now: float, plan: StepPlan) -> None:
        sim = self.config.sim
        duration = plan.sync_lookups * self.config.engine.lookup_latency_ms
        if plan.entries:
            duration += sim.decode_step_ms + sim.decode_per_request_ms * len(plan.entries)
            duration += plan.prefill_tokens / sim.prefill_tokens_per_s * 1000.0
        self._plans[plan.step_id] = plan
        self._steps_in_flight += 1
        self._push(now + duration, StepOutput(now + duration, plan.step_id))

    def _with_finishes(self, event: StepOutput) -> StepOutput:
        plan = self._plans.pop(event.step_id)
        finished = model_finishes(plan, self.engine, self._output_len, self.config.sim.max_output_tokens)
        return StepOutput(event.t, event.step_id, finished)

    def _start_transfer(self, now: float, command: StartLoad | StartStore) -> None:
        self._report_after_transfer(now, command.job_id, [(m.block_hash, m.tier) for m in command.moves])

    def _start_prefetch(self, now: float, command: StartPrefetch) -> None:
        # Tier to tier: paced by the slowest source tier; failures drawn per source block.
        self._report_after_transfer(now, command.job_id, [(m.block_hash, m.src_tier) for m in command.moves])

    def _report_after_transfer(self, now: float, job_id: int, blocks: list[tuple[int, str]]) -> None:
        """One report per rank after latency + shard bytes / bandwidth of the slowest tier
        involved, plus that rank's jitter; each block fails with its tier's failure rate."""
        ranks = self.config.engine.ranks
        base = 0.0
        for name, count in Counter(tier_name for _, tier_name in blocks).items():
            tier = self._tiers[name]
            shard_bytes = count * self.config.sim.block_bytes / ranks
            base = max(base, tier.latency_ms + shard_bytes / (tier.bandwidth_gbps * 1e9) * 1000.0)
        jitter = self.config.sim.rank_jitter_ms
        for rank in range(ranks):
            failed = tuple(
                h for h, name in blocks
                if self._tiers[name].failure_rate and self.rng.random() < self._tiers[name].failure_rate
            )
            t = now + base + (self.rng.uniform(0.0, jitter) if jitter else 0.0)
            self._push(t, TransferReport(t, job_id, rank, failed))

    def _answer_lookup(self, event: LookupAnswer) -> LookupAnswer:
        hashes = self._pending_lookup.pop((event.request_id, event.epoch), ())
        return attrs.evolve(event, tiers=self.engine.sync_lookup(hashes))


def model_finishes(
    plan: StepPlan, engine: Engine, output_lengths: dict[str, int], max_output_tokens: int | None
) -> tuple[tuple[str, str], ...]:
    """The model's side of a step output: which sampling requests stop, and why. A
    request stops at its workload output length, or at the length limit if lower."""
    finished = []
    requests = engine.requests
    for entry in plan.entries:
        if not entry.samples:
            continue
        req = requests[entry.request_id]
        if req.state != "running":
            continue
        produced = req.generated + 1
        target = output_lengths[entry.request_id]
        if max_output_tokens is not None and max_output_tokens < target and produced >= max_output_tokens:
            finished.append((entry.request_id, "length"))
        elif produced >= target:
            finished.append((entry.request_id, "stopped"))
    return tuple(finished)


def cut_record(
    engine: Engine, exc: BaseException, workload_size: int, clean: bool, **open_work: int
) -> dict[str, Any]:
    """The ``interrupted`` record a driver writes last when a run is cut short: the engine's
    time, the signal, whether the cut fell between engine calls (``clean``) and the work
    still open (``kvlife validate`` does not hold that work to invariants 3 and 7)."""
    requests = {state: n for state, n in engine.state_counts.items() if n and state != "finished"}
    return {
        "kind": "interrupted",
        "t": engine.now,
        "signal": interrupts.signal_name(exc),
        "clean": clean,
        "requests": requests,
        "finished": engine.state_counts["finished"],
        "not_arrived": max(0, workload_size - len(engine.requests)),
        "jobs": sum(1 for job in engine.jobs.values() if not job.timed_out),
        "quarantined_jobs": sum(1 for job in engine.jobs.values() if job.timed_out),
        "prefetches": len(engine.prefetches),
        **open_work,
    }
