"""The simulated driver: a discrete-event loop with a virtual clock and a physical model.

It turns a workload into engine inputs and carries out the engine's commands by scheduling
their completions in virtual time (the model: ``docs/fidelity-model.md``):

- a step costs what ``profiles.step_cost.StepCostModel`` gives for its composition: each
  scheduled entry is a chunk of ``num_tokens`` new tokens on top of ``computed_before``
  tokens already in the KV cache (a decode is a chunk of one), on the run's model, hardware
  and TP degree (``drivers.physics``);
- lookups queue for the lookup service's workers (``drivers.lookup_service``: FIFO,
  ``base + per-key x keys``). Async lookups answer when served; sync lookups go through the
  same service at the tick and the step starts when the last one answers (that wait is the
  critical-path lookup time). A lookup of no keys (no full prompt block) answers at once;
- every rank moves its share of a transfer's blocks over its own links to the tiers
  (``drivers.links``, processor sharing: concurrent transfers on a link share its bandwidth),
  and reports when all its parts have drained, plus that rank's jitter; each block fails
  with its tier's failure rate;
- completions at step boundaries (``sim.completions = "step_boundary"``, the default): a
  transfer report that completes while a step is in flight comes with that step's output
  (``StepOutput.reports``, applied after its tokens, as vLLM applies a step's
  ``kv_connector_output``); a lookup answer right after it. With no step in flight a
  completion is delivered when it completes: an idle vLLM engine keeps stepping (empty
  steps) while requests wait for KV; we take such a step as instantaneous.
  ``"exact"`` delivers every completion at its own time, for comparison;
- every scheduler pass is a step (a pass that schedules nothing is an empty step whose
  output comes at once); steps run one after another on the device, so a step starts when
  the one before it ends (async scheduling plans the next while one runs). After an empty
  step's output the driver ticks again only if that output changed something, so idle time
  does not spin;
- a store flushed by a preemption (``StepPlan.flush``) is taken as done when its step
  starts: the time it would add to that step is not charged (flushes are rare: a preemption
  with a store in flight);
- a join (``StartLoad.after``) copies device blocks another load fills: each rank reports it
  with that load's report on the rank, its failed blocks those of the load.

The tier indexes are the very ones the engine holds (``kvlife.transfer.index``); only the
bytes are modelled. Everything random comes from one ``random.Random(seed)``, and ties in
time break by the order events were scheduled, so a run is reproducible.

The workload may be a stream (``mooncake.iter_mooncake``): arrivals are taken from it one
at a time, and only the next one waits in the event queue. It sorts before every other
event at the same time, and arrivals among themselves by workload order, exactly as if
all had been queued up front (a list that is not in arrival order is sorted first, stably).
With ``keep_requests=False`` a finished request leaves the engine once nothing refers to
it, folded into ``metrics.RequestTotals`` (``SimResult.retired``), and memory stays flat
however long the workload.

Ctrl-C or SIGTERM (``kvlife.lifecycle.drivers.interrupts``) stops the loop between two
events: an ``interrupted`` record (``cut_record``) ends the trace and the interrupt is
re-raised.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
from typing import TYPE_CHECKING, Any, cast

import attrs

from kvlife.lifecycle.config import RunConfig
from kvlife.lifecycle.drivers import interrupts
from kvlife.lifecycle.drivers.chaos import Chaos, Delivery
from kvlife.lifecycle.drivers.links import Link
from kvlife.lifecycle.drivers.lookup_service import LookupService
from kvlife.lifecycle.drivers.physics import Physics, rank_links, resolve
from kvlife.lifecycle.engine import records
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
from kvlife.lifecycle.engine.request import Request
from kvlife.lifecycle.metrics import RequestTotals
from kvlife.lifecycle.workloads.mooncake import WorkloadRequest
from kvlife.policies.stack import PolicyStack

if TYPE_CHECKING:
    from kvlife.lifecycle.drivers.online_check import OnlineCheck

Progress = Callable[[int, int], None]
# Heap keys of arrivals: below every other event's (those count up from 0), in workload
# order, so an arrival goes before anything else at its time, as when all were queued first.
_ARRIVAL_SEQ = -(1 << 62)
# The commands that start a transfer (compared by type: the hot loop of ``_feed``).
_TRANSFERS: frozenset[type] = frozenset((StartStore, StartLoad, StartPrefetch))


@attrs.define
class SimResult:
    engine: Engine
    workload: Sequence[WorkloadRequest]  # the list given; empty for a stream
    makespan_ms: float
    events: int
    stranded: list[str]
    # Time steps waited for sync lookups (None: the driver does not model it; the summary
    # then charges engine.lookup_latency_ms per sync lookup).
    critical_path_lookup_ms: float | None = None
    physics: Physics | None = None
    # The requests that left the engine (keep_requests=False), folded; the summary adds
    # those still in engine.requests (``RequestTotals.of``).
    retired: RequestTotals | None = None
    # ``--chaos``: how many of each perturbation (``drivers.chaos``); None: a plain run.
    chaos: dict[str, Any] | None = None
    # ``--check`` (or ``--chaos``): the online observer's findings (``drivers.online_check``).
    check: dict[str, Any] | None = None


class _LinkWake:
    """A link's next transfer may have drained: an internal event, never fed to the engine."""

    __slots__ = ("link",)

    def __init__(self, link: Link) -> None:
        self.link = link


class _Later:
    """A transfer a tick started, begun when that tick's sync lookups have answered."""

    __slots__ = ("command",)

    def __init__(self, command: StartLoad | StartStore | StartPrefetch) -> None:
        self.command = command


class Simulator:
    """``workload``: a list, or any iterable of requests in arrival order (a stream is read
    as the run goes; ``size``, when known, is its length, for progress and the
    ``interrupted`` record). ``keep_requests=False``: finished requests leave the engine
    (see the module docstring); the default keeps every request, for tests and tools that
    read ``engine.requests`` afterwards."""

    def __init__(
        self,
        config: RunConfig,
        workload: Iterable[WorkloadRequest],
        policies: PolicyStack,
        recorder: Recorder | None = None,
        progress: Progress | None = None,
        reference: bool = False,
        check_every: int | None = None,
        *,
        size: int | None = None,
        keep_requests: bool = True,
        engine_factory: Callable[..., Engine] | None = None,
    ) -> None:
        # Derived values (device blocks, ranks) filled in; a config resolved already stays as it is.
        self.config, self.physics = resolve(config)
        config = self.config
        if isinstance(workload, Sequence):
            self.workload: Sequence[WorkloadRequest] = workload
            ordered = all(a.arrival_ms <= b.arrival_ms for a, b in itertools.pairwise(workload))
            self._arrivals: Iterator[WorkloadRequest] = iter(
                workload if ordered else sorted(workload, key=lambda w: w.arrival_ms))
        else:
            self.workload = ()
            self._arrivals = iter(workload)
        self.size = size if size is not None else (len(workload) if isinstance(workload, Sized) else None)
        self.retired = None if keep_requests else RequestTotals()
        # --chaos: an adversary between the completions and the engine; --check (implied by
        # --chaos): the invariant observer beside the engine, between it and the recorder.
        self.chaos = Chaos(config.sim.chaos, config.engine.transfer_deadline_ms) if config.sim.chaos is not None \
            else None
        self.check: OnlineCheck | None = None
        if config.sim.check or self.chaos is not None:
            from kvlife.lifecycle.drivers.online_check import OnlineCheck  # the observer: only when asked

            self.check = OnlineCheck(config.engine, policies, recorder)
        if self.check is not None:
            recorder = self.check.record
        if engine_factory is not None:  # a deliberately broken engine (tests/bug_zoo.py)
            if not keep_requests or reference:
                raise ValueError("an engine_factory engine keeps its requests and has no reference mode")
            self.engine = engine_factory(config.engine, policies, recorder=recorder)
        else:
            self.engine = Engine(config.engine, policies, recorder=recorder, reference=reference,
                                 retire=None if keep_requests else self._retire)
        if self.check is not None:
            self.check.attach(self.engine)
        self.rng = random.Random(config.sim.seed)
        self.progress = progress
        # Check block accounting (invariants 2 and 8) every N events; tests use it.
        self.check_every = check_every
        self._queue: list[tuple[float, int, Any]] = []
        self._seq = 0
        self._events = 0
        self._progress_mark = 0  # finished requests at the last progress report
        # Per request that arrived and has not left the engine: its stop rule (stop_rule).
        self._stops: dict[str, tuple[int, str]] = {}
        self._max_output_tokens = config.sim.max_output_tokens
        self._taken = 0  # arrivals taken from the workload
        self._last_arrival = 0.0
        self._steps_in_flight = 0
        self._last_step_end = 0.0  # steps run one after another on the device
        self._max_in_flight = 2 if config.engine.async_scheduling else 1
        self._tick_pending: float | None = None  # the time of the tick queued, if one is
        self._idle_steps: set[int] = set()  # empty steps of passes that did nothing else
        self._tiers = {t.name: t for t in config.engine.tiers}
        self._failing_tiers = any(t.failure_rate for t in config.engine.tiers)
        self._jitter = config.sim.rank_jitter_ms
        self._pending_lookup: dict[tuple[str, int], tuple[int, ...]] = {}
        # Ticks pushed because a deadline passes (engine.next_wakeup), by heap seq.
        self._wakeup_seqs: set[int] = set()
        self._wakeup_times: set[float] = set()
        # Physics: the step cost, per-rank links, the lookup service.
        self._cost = self.physics.cost
        self._ranks = config.engine.ranks
        self._rank_block_bytes = self.physics.rank_block_bytes
        self._links = [rank_links(self.physics.hardware, config.engine.tiers) for _ in range(self._ranks)]
        self._link_due: dict[Link, float] = {}  # the time of each busy link's pending wake-up
        self._link_wakes = {link: _LinkWake(link) for links in self._links for tl in links.values()
                            for link in (tl.load, tl.store)}
        self._rank_jobs: dict[tuple[int, int], list[Any]] = {}  # (job, rank) -> [parts left, failed, jitter]
        self._flushed: set[int] = set()  # stores flushed before they started: reported as they start
        # Joins (``StartLoad.after``): load job -> the joins that copy from it; and per load
        # job, each rank's report so far (a join started after that rank reported copies at once).
        self._followers: dict[int, list[StartLoad]] = {}
        self._load_reports: dict[int, dict[int, tuple[int, ...]]] = {}
        self._load_jobs: dict[int, StartLoad] = {}
        self.lookups = LookupService(config.sim.lookup_workers, config.engine.lookup_latency_ms,
                                     config.sim.lookup_per_key_ms)
        self.critical_path_lookup_ms = 0.0
        self._exact = config.sim.completions == "exact"
        self._held_reports: list[TransferReport] = []  # reports waiting for the step output in flight
        self._held_answers: list[LookupAnswer] = []  # answers delivered right after it
        self._engine_lookup = self.engine.sync_lookup  # the tiers' answer

    def _push(self, t: float, event: Any) -> None:
        heapq.heappush(self._queue, (t, self._seq, event))
        self._seq += 1

    def _push_arrival(self) -> None:
        """Queue the workload's next arrival (the only one in the queue at any time)."""
        w = next(self._arrivals, None)
        if w is None:
            return
        if w.arrival_ms < self._last_arrival:
            raise ValueError(f"workload request {w.request_id!r} arrives at {w.arrival_ms} ms, before the "
                             f"{self._last_arrival} ms of the one before it: a stream must be in arrival order")
        self._last_arrival = w.arrival_ms
        self._stops.setdefault(w.request_id, stop_rule(w.output_length, self._max_output_tokens))
        heapq.heappush(self._queue, (w.arrival_ms, _ARRIVAL_SEQ + self._taken,
                                     Arrival(w.arrival_ms, w.request_id, w.input_length, w.hash_ids)))
        self._taken += 1

    def _retire(self, req: Request) -> None:
        """The engine lets ``req`` go: fold it into the totals, forget its stop rule."""
        cast(RequestTotals, self.retired).fold(req)
        self._stops.pop(req.request_id, None)

    def _total(self) -> int:
        """The workload's size: given, or (a stream of unknown length) what was taken so far."""
        return self.size if self.size is not None else self._taken

    def run(self) -> SimResult:
        with interrupts.held() as gate:
            try:
                return self._run(gate)
            except KeyboardInterrupt as exc:
                if self.engine.recorder is not None:
                    self.engine.recorder(cut_record(self.engine, exc, self._total(), gate.clean,
                                                    steps=self._steps_in_flight))
                raise

    def _run(self, gate: interrupts.StopGate) -> SimResult:
        self._push_arrival()
        now = 0.0
        engine = self.engine
        queue = self._queue
        pop = heapq.heappop
        while queue or self._idle_wake():
            if gate.pending is not None:
                gate.check()
            now, seq, event = pop(queue)
            kind = type(event)
            if kind is _LinkWake:
                self._wake(now, event.link)
                continue
            if kind is _Later:
                self._start_transfer(now, event.command)
                continue
            if kind is StepPlan:  # the step ends: its output, with the requests that stop
                if self._tick_pending == now and self._steps_in_flight < self._max_in_flight:
                    # Async scheduling: vLLM schedules the next step before it takes the
                    # output of the one after (its batch queue has room): the tick first.
                    self._push(now, event)
                    continue
                if self.chaos is not None:
                    later = self.chaos.delay_step(now, event.step_id, alone=self._max_in_flight == 1)
                    if later is not None:
                        self._push(later, event)
                        continue
                self._steps_in_flight -= 1
                finishes = step_finishes(event, engine, self._stops)
                reports, self._held_reports = tuple(self._held_reports), []
                output = StepOutput(now, event.step_id, finishes, tuple((r.job_id, r.rank, r.failed) for r in reports))
                idle = event.step_id in self._idle_steps
                self._idle_steps.discard(event.step_id)
                self._delivered_reports(reports)
                self._feed(now, output, idle=idle and not reports and not finishes)
                if self.chaos is not None:
                    stale = self.chaos.duplicate_step(now, output)
                    if stale is not None:
                        self._push(*stale)
                if self._held_answers:
                    held, self._held_answers = self._held_answers, []
                    for answer in held:
                        self._feed(now, LookupAnswer(now, answer.request_id, answer.epoch, answer.tiers))
                continue
            if kind is TransferReport:
                if self._steps_in_flight and not self._exact:
                    self._held_reports.append(event)
                    continue
                self._delivered_reports((event,))
            elif kind is LookupAnswer:
                event, instant = self._answer_lookup(event)
                if self.chaos is not None:
                    on_time = self._route_answer(now, event)
                    if on_time is None:
                        continue
                    event = on_time
                if self._steps_in_flight and not self._exact and not instant:
                    self._held_answers.append(cast(LookupAnswer, event))
                    continue
            elif kind is Arrival:
                self._push_arrival()
            elif kind is Tick:
                if seq in self._wakeup_seqs:
                    self._wakeup_seqs.discard(seq)
                    self._wakeup_times.discard(now)
                    if self._tick_pending is not None or self._steps_in_flight >= self._max_in_flight:
                        continue  # a regular tick comes anyway (after the step in flight)
                self._tick_pending = None
            elif kind is Delivery:  # --chaos: a completion the adversary held back or copied
                event = self._delivered(now, event)
                if type(event) is TransferReport:
                    if self._steps_in_flight and not self._exact:
                        self._held_reports.append(event)
                        continue
                    self._delivered_reports((event,))
                elif self._steps_in_flight and not self._exact:
                    self._held_answers.append(cast(LookupAnswer, event))
                    continue
            self._feed(now, event)  # (--chaos: a stale copy of a step output, too)
        if self.progress is not None:
            self.progress(engine.state_counts["finished"], self._total())
        engine.check_invariants()
        stranded = engine.stranded()
        if stranded and engine.recorder is not None:
            # Nothing is left to happen: say in the trace which requests never finished.
            for req in engine.state.unfinished():
                engine.recorder(records.warning(now, "stranded", origin="driver", req=req.request_id,
                                                state=req.state))
        if self.check is not None:
            self.check.finish()
        return SimResult(engine, self.workload, now, self._events, stranded,
                         self.critical_path_lookup_ms, self.physics, self.retired,
                         chaos=self.chaos.summary() if self.chaos is not None else None,
                         check=self.check.summary() if self.check is not None else None)

    def _push_wake(self, wake: float) -> None:
        """A tick at ``wake`` even if nothing else happens then (skipped if one comes anyway)."""
        if wake not in self._wakeup_times:
            self._wakeup_times.add(wake)
            self._wakeup_seqs.add(self._seq)
            self._push(wake, Tick(wake))

    def _idle_wake(self) -> bool:
        """Nothing is queued: if the engine has a deadline ahead, wake for it (True)."""
        wake = self.engine.next_wakeup()
        if wake is None:
            return False
        self._push_wake(wake)
        return True

    def _feed(self, now: float, event: InputEvent, idle: bool = False) -> None:
        """Hand one input to the engine and carry out its commands. ``idle``: the output of
        an empty step of a pass that did nothing else: the driver ticks again only if it
        changed something (commands, or a change the engine counts)."""
        engine = self.engine
        before = engine.progress() if idle else None
        commands = engine.handle(event)
        if self.check is not None:
            self.check.handled()
        self._events += 1
        if self.check_every is not None and self._events % self.check_every == 0:
            engine.check_invariants()
        quiet = False
        # A pass that looked the tiers up inline hands its work over when the lookups answer:
        # the step, and the transfers it started (vLLM's workers start them with the step).
        ready = now
        plan: StepPlan | None = None
        for command in commands:
            if type(command) is StepPlan:
                plan = cast(StepPlan, command)
                if plan.sync_lookup_keys:
                    ready = self._pay_sync_lookups(now, plan.sync_lookup_keys)
        if plan is not None:
            for job_id in plan.flush:
                self._flush(ready, job_id)
        for command in commands:
            kind = type(command)
            if kind is StepPlan:
                self._start_step(ready, cast(StepPlan, command))
            elif kind in _TRANSFERS:
                transfer = cast(StartStore | StartLoad | StartPrefetch, command)
                if ready > now:
                    self._push(ready, _Later(transfer))
                else:
                    self._start_transfer(now, transfer)
            elif kind is SubmitLookup:
                self._submit_lookup(now, cast(SubmitLookup, command))
        if plan is not None and not plan.entries and len(commands) == 1:
            quiet = True  # the pass found nothing to do: its (empty) step's output is idle
            self._idle_steps.add(plan.step_id)
        elif idle and not commands and engine.progress() == before:
            quiet = True  # an idle step's output that changed nothing: no spinning
        # Tick again after any event, unless the last pass found nothing to do and nothing
        # has changed since.
        if (
            self._tick_pending is None
            and self._steps_in_flight < self._max_in_flight
            and not quiet
            and engine.busy()  # some request unfinished, some job in flight, some blocks held
        ):
            self._tick_pending = now
            self._push(now, Tick(now))
        # A deadline (prefetch patience, lookup, transfer, reclaim) the engine acts on at
        # a tick: wake for it unless something queued comes first (it asks again then).
        wake = engine.next_wakeup()
        if wake is not None and (not self._queue or wake < self._queue[0][0]):
            self._push_wake(wake)
        if self.progress is not None:
            done = engine.state_counts["finished"]
            if done - self._progress_mark >= 200:
                self._progress_mark = done
                self.progress(done, self._total())

    # ---- chaos ---------------------------------------------------------------------------------
    def _route_report(self, t: float, report: TransferReport) -> None:
        """--chaos: a rank report completed at ``t``; queue its deliveries (a dropped one:
        a tick when the transfer deadline has passed, the report after it)."""
        deliveries, wake = cast(Chaos, self.chaos).route_report(t, report)
        if wake is not None:
            self._push_wake(wake)
        for when, delivery in deliveries:
            self._push(when, delivery)

    def _route_answer(self, now: float, answer: LookupAnswer) -> LookupAnswer | None:
        """--chaos: a lookup answered now; the answer if it is delivered now, else None
        (its deliveries queued)."""
        deliveries = cast(Chaos, self.chaos).route_answer(now, answer)
        on_time = None
        for when, delivery in deliveries:
            if when <= now and on_time is None:
                on_time = self._delivered(now, delivery)
            else:
                self._push(when, delivery)
        return cast(LookupAnswer | None, on_time)

    def _delivered(self, now: float, delivery: Delivery) -> TransferReport | LookupAnswer:
        """--chaos: a completion reaches the engine's door now (counted), stamped ``now``."""
        event = delivery.event
        old_epoch = False
        if type(event) is LookupAnswer:
            req = self.engine.requests.get(event.request_id)
            old_epoch = req is not None and req.state == "lookup_pending" and req.epoch != event.epoch
        cast(Chaos, self.chaos).delivered(delivery, old_epoch)
        return _at(event, now)

    # ---- steps -------------------------------------------------------------------------------
    def _pay_sync_lookups(self, now: float, key_counts: tuple[int, ...]) -> float:
        """Send the pass's sync lookups to the lookup service; when the last one answers."""
        ready = now
        submit = self.lookups.submit
        for keys in key_counts:
            if keys:  # nothing to look up answers at once
                ready = max(ready, submit(None, keys, now))
        self.critical_path_lookup_ms += ready - now
        return ready

    def _start_step(self, start: float, plan: StepPlan) -> None:
        """The step runs for the cost of its batch, once the step before it has ended (an
        empty step costs nothing)."""
        # Each entry is a chunk of n new tokens on top of b cached ones (a decode: n = 1):
        # n*b + n(n+1)/2 attention pairs, b + n KV tokens read or written.
        entries = plan.entries
        start = max(start, self._last_step_end)
        if entries:
            tokens = cached = twice_pairs = 0
            for entry in entries:
                n = entry.num_tokens
                b = entry.computed_before
                tokens += n
                cached += b
                twice_pairs += n * (b + b + n + 1)
            end = start + self._cost.totals_ms(tokens, len(entries), twice_pairs * 0.5, cached + tokens)
        else:
            end = start
        self._last_step_end = end
        self._steps_in_flight += 1
        self._push(end, plan)  # becomes the step's StepOutput when it pops

    def _flush(self, now: float, job_id: int) -> None:
        """A preemption flushed a store in flight: its ranks report it now (its link time
        left is not charged to the step). A store the same pass hands out (decided at the
        last output, flushed by this pass's preemption) is not started yet: it reports as
        it starts."""
        started = False
        for rank in range(self._ranks):
            entry = self._rank_jobs.pop((job_id, rank), None)
            if entry is not None:
                started = True
                self._push(now, TransferReport(now, job_id, rank, entry[1]))
        if not started:
            self._flushed.add(job_id)

    def _delivered_reports(self, reports: Iterable[TransferReport]) -> None:
        """Reports handed to the engine: a load's entries are kept until its last rank's."""
        for report in reports:
            seen = self._load_reports.get(report.job_id)
            if seen is not None and len(seen) >= self._ranks and report.job_id not in self._followers:
                self._load_reports.pop(report.job_id, None)
                self._load_jobs.pop(report.job_id, None)

    # ---- transfers -------------------------------------------------------------------------
    def _start_transfer(self, now: float, command: StartLoad | StartStore | StartPrefetch) -> None:
        """Every rank moves its share of each tier's blocks over its own link to that tier
        (a prefetch reads from its source tiers); its report comes when all its parts have
        drained, plus its jitter. Each block fails with its tier's failure rate. A join
        reports with the load it copies from."""
        store = type(command) is StartStore
        if isinstance(command, StartLoad) and command.after is not None:
            self._follow(now, command)
            return
        if isinstance(command, StartPrefetch):
            blocks = [(m.block_hash, m.src_tier) for m in command.moves]
        else:
            blocks = [(m.block_hash, m.tier) for m in command.moves]
        job_id = command.job_id
        if isinstance(command, StartLoad):
            self._load_jobs[job_id] = command
            self._load_reports[job_id] = {}
        counts: dict[str, int] = {}
        for _, tier_name in blocks:
            counts[tier_name] = counts.get(tier_name, 0) + 1
        tiers = self._tiers
        jitter = self._jitter
        rng = self.rng
        share = self._rank_block_bytes
        failing = self._failing_tiers
        flushed = job_id in self._flushed
        self._flushed.discard(job_id)
        for rank in range(self._ranks):
            failed = tuple(
                h for h, name in blocks
                if tiers[name].failure_rate and rng.random() < tiers[name].failure_rate
            ) if failing else ()
            delay = rng.uniform(0.0, jitter) if jitter else 0.0
            if flushed:
                self._push_report(now, TransferReport(now, job_id, rank, failed))
                continue
            links = self._links[rank]
            tid = (job_id, rank)
            for name, count in counts.items():
                pair = links[name]
                link = pair.store if store else pair.load
                link.start(tid, count * share, now, write=store and pair.store_is_write)
                self._schedule_wake(link)
            self._rank_jobs[tid] = [len(counts), failed, delay]

    def _follow(self, now: float, join: StartLoad) -> None:
        """A join copies what load ``join.after`` brings: on each rank, once that rank has
        reported the load (at once if it already has)."""
        owner = cast(int, join.after)
        self._followers.setdefault(owner, []).append(join)
        for rank, failed in sorted(self._load_reports.get(owner, {}).items()):
            self._report_follower(now, join, rank, failed)

    def _report_follower(self, t: float, join: StartLoad, rank: int, failed: tuple[int, ...]) -> None:
        mine = {m.block_hash for m in join.moves}
        self._push_report(t, TransferReport(t, join.job_id, rank, tuple(h for h in failed if h in mine)))

    def _push_report(self, t: float, report: TransferReport) -> None:
        seen = self._load_reports.get(report.job_id)
        if seen is not None:
            seen[report.rank] = report.failed
            for join in self._followers.get(report.job_id, ()):
                self._report_follower(t, join, report.rank, report.failed)
            if len(seen) >= self._ranks:
                self._followers.pop(report.job_id, None)
        if self.chaos is None:
            self._push(t, report)
        else:
            self._route_report(t, report)

    def _schedule_wake(self, link: Link) -> None:
        """Keep one wake-up pending at the link's next drain (earlier ones become stale)."""
        upcoming = link.next_completion()
        if upcoming is None:
            self._link_due.pop(link, None)
            return
        t = upcoming[0]
        if self._link_due.get(link) != t:
            self._link_due[link] = t
            self._push(t, self._link_wakes[link])

    def _wake(self, now: float, link: Link) -> None:
        if self._link_due.get(link) != now:
            return  # stale: a later start moved this link's next drain
        del self._link_due[link]
        for done, tid in link.advance(now):
            key = cast(tuple[int, int], tid)  # (job, rank): what _start_transfer started
            entry = self._rank_jobs.get(key)
            if entry is None:
                continue  # flushed: reported when its step started
            entry[0] -= 1
            if entry[0] == 0:
                del self._rank_jobs[key]
                t = max(now, done + entry[2])
                self._push_report(t, TransferReport(t, key[0], key[1], entry[1]))
        self._schedule_wake(link)

    # ---- lookups ---------------------------------------------------------------------------
    def _submit_lookup(self, now: float, command: SubmitLookup) -> None:
        key = (command.request_id, command.epoch)
        if key in self._pending_lookup:
            return  # idempotent: one answer per (request, epoch)
        # The answer reads the tiers when the lookup is served (see _answer_lookup).
        keys = len(command.block_hashes)
        t = self.lookups.submit(key, keys, now) if keys else now
        self._pending_lookup[key] = command.block_hashes
        if self.chaos is not None:  # an answer to an older lookup of it, kept back until now
            stale = self.chaos.replay(command.request_id, command.epoch)
            if stale is not None:
                self._push(now, stale)
        self._push(t, LookupAnswer(t, command.request_id, command.epoch, ()))

    def _answer_lookup(self, event: LookupAnswer) -> tuple[LookupAnswer, bool]:
        """The answer as the tiers stand when it is served; True when it had nothing to look
        up (answered at once, never held for a step boundary)."""
        hashes = self._pending_lookup.pop((event.request_id, event.epoch), ())
        answer = LookupAnswer(event.t, event.request_id, event.epoch, self._engine_lookup(hashes))
        return answer, not hashes


def _at(event: TransferReport | LookupAnswer, t: float) -> TransferReport | LookupAnswer:
    """A held completion, delivered at the step boundary ``t``."""
    if isinstance(event, TransferReport):
        return TransferReport(t, event.job_id, event.rank, event.failed)
    return LookupAnswer(t, event.request_id, event.epoch, event.tiers)


def stop_rule(output_length: int, max_output_tokens: int | None) -> tuple[int, str]:
    """The output length at which a request stops and why: its workload output length
    ("stopped"), or the length limit when that is lower ("length")."""
    if max_output_tokens is not None and max_output_tokens < output_length:
        return (max_output_tokens, "length")
    return (output_length, "stopped")


def stop_rules(output_lengths: dict[str, int], max_output_tokens: int | None) -> dict[str, tuple[int, str]]:
    """``stop_rule`` of every request."""
    return {rid: stop_rule(n, max_output_tokens) for rid, n in output_lengths.items()}


def step_finishes(plan: StepPlan, engine: Engine, stops: dict[str, tuple[int, str]]) -> tuple[
        tuple[str, str], ...]:
    """The model's side of a step output: which sampling requests stop, and why (a token a
    preempted request's step still delivers counts, as vLLM appends it)."""
    finished = []
    output_tokens = engine.output_tokens
    for entry in plan.entries:
        if entry.samples:
            rid = entry.request_id
            produced = output_tokens(rid)  # None: it finished (or left) meanwhile
            if produced is not None:
                limit, reason = stops[rid]
                if produced + 1 >= limit:
                    finished.append((rid, reason))
    return tuple(finished)


def cut_record(
    engine: Engine, exc: BaseException, workload_size: int, clean: bool, **open_work: int
) -> dict[str, Any]:
    """The ``interrupted`` record a driver writes last when a run is cut short: the engine's
    time, the signal, whether the cut fell between engine calls (``clean``) and the work
    still open (``kvlife validate`` does not hold that work to invariants 3 and 7)."""
    requests = {state: n for state, n in engine.state_counts.items() if n and state != "finished"}
    return records.interrupted(
        engine.now, interrupts.signal_name(exc), clean, requests, engine.state_counts["finished"],
        max(0, workload_size - engine.state.arrived()),
        sum(1 for job in engine.jobs.values() if not job.timed_out),
        sum(1 for job in engine.jobs.values() if job.timed_out), len(engine.prefetches), **open_work)
