"""The sans-IO engine: input events in, commands out.

Like h11 for HTTP, the ``Engine`` never reads a clock, starts a thread, touches torch or
opens a socket. Drivers (the simulator, the live runtime) feed it
``kvlife.lifecycle.engine.events`` inputs through ``Engine.handle`` and carry out the
commands it returns. Every state change goes through the compiled spec table
(``kvlife.specs.table``) and is recorded with its trigger and reason.

The engine is composed of parts, each given what it works on when it is built:

- ``state.EngineState``: everything the engine knows (requests, queues, block pool, tiers,
  jobs, counters, ``now``, the commands of the current event). One object, shared.
- ``lifecycle.Lifecycle(state, policies)``: moving a request through the table, asking
  the policy stack, recording, finishing a request and releasing its blocks.
- ``transfers.Transfers(state, lifecycle)``: load, store and prefetch jobs, rank reports,
  deadlines.
- ``scheduler.Scheduler(state, lifecycle, transfers)``: the tick (budget, running first,
  FIFO admission, preemption).
- ``Engine`` (here): owns them and the handlers of the request-facing events.

Follow one request: ``Arrival`` puts it in ``waiting`` (``Engine._on_arrival``); a ``Tick``
runs ``Scheduler.tick``, which looks it up in the tiers (sync, or async through
``lookup_pending`` and ``Engine._on_lookup_answer``), asks the admission policy and either
starts a load (``loading``, ``Transfers.start_load``) or schedules compute (``running``);
``StepOutput`` confirms computed tokens, starts stores and finishes requests
(``Engine._on_step_output``); a finished request whose blocks a store still reads waits
in ``sending``; ``TransferReport``s from every rank complete jobs (``Transfers.on_report``)
and move the requests that waited on them on.

Retention: by default every request stays in ``engine.requests`` for good. With
``Engine(..., retire=fn)`` a finished request leaves it once nothing refers to it any more
(no store job still counted on it, no load job that will tell it its outcome, no prefetch
wait): ``fn(request)`` is called first (the simulator folds it into
``metrics.RequestTotals``). This is checked after each event, so a request whose store is
still in flight leaves when that job completes. The ids of retired requests are kept
(``state.retired``) so that a duplicate arrival, an abort or a stale lookup answer for one
is handled and recorded exactly as if it were still there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar, cast

from kvlife.lifecycle.config import EngineConfig
from kvlife.lifecycle.engine.blocks import DeviceBlockPool
from kvlife.lifecycle.engine.events import (
    Abort,
    Arrival,
    Command,
    DiscardLookup,
    InputEvent,
    LookupAnswer,
    StepOutput,
    StepPlan,
    Tick,
    TransferReport,
    input_to_record,
)
from kvlife.lifecycle.engine.lifecycle import Lifecycle
from kvlife.lifecycle.engine.ranks import RankAggregator
from kvlife.lifecycle.engine.request import Request
from kvlife.lifecycle.engine.scheduler import Scheduler
from kvlife.lifecycle.engine.state import EngineState, Job, PrefetchJob, Recorder, Retire, Stats
from kvlife.lifecycle.engine.transfers import Transfers
from kvlife.policies.base import EngineView
from kvlife.policies.stack import PolicyStack
from kvlife.specs.table import ReferenceRequest
from kvlife.transfer.index import TierIndex

__all__ = ["Engine", "EngineState", "Job", "PrefetchJob", "Recorder", "Retire", "Stats"]


# Inputs after which admission finds what it found before, if it found the head of the
# queue blocked (``scheduler.Scheduler._cohort_admit``): an arrival joins the queue's end.
_QUIET_INPUTS = (Tick, StepOutput, Arrival)


class _RetiringLifecycle(Lifecycle):
    """``Lifecycle`` that notes every request it finishes, for the engine to let go of."""

    def finish(self, req: Request, trigger: str, reason: str, why: str) -> None:
        super().finish(req, trigger, reason, why)
        self.state.retiring[req.request_id] = req


class Engine:
    """The engine: owns the state and the parts, dispatches each input event."""

    # The transfer part's class. A deliberately broken variant (tests/bug_zoo.py)
    # subclasses ``Transfers`` and names it here; the real code is never edited.
    transfers_class: ClassVar[type[Transfers]] = Transfers

    def __init__(
        self,
        config: EngineConfig,
        policies: PolicyStack,
        tiers: Sequence[TierIndex] | None = None,
        recorder: Recorder | None = None,
        reference: bool = False,
        retire: Retire | None = None,
    ) -> None:
        self.state = EngineState(config, tiers, recorder, reference, retire)
        self.lifecycle = (Lifecycle if retire is None else _RetiringLifecycle)(self.state, policies)
        self.transfers = self.transfers_class(self.state, self.lifecycle)
        self.scheduler = Scheduler(self.state, self.lifecycle, self.transfers)

    def handle(self, event: InputEvent) -> list[Command]:
        """Apply one input event; return the commands the driver must carry out."""
        state = self.state
        if event.t < state.now:
            raise ValueError(f"time went backwards: {event.t} < {state.now}")
        state.now = event.t
        if state.recorder is not None:
            state.recorder(input_to_record(event))
        commands: list[Command] = []
        state.commands = commands
        if state.cohort is not None and type(event) not in _QUIET_INPUTS:
            state.cohort.quiet_head = None  # it may change what admission finds
        if isinstance(event, Tick):
            self.scheduler.tick()
        elif isinstance(event, StepOutput):
            self._on_step_output(event)
        elif isinstance(event, TransferReport):
            self.transfers.on_report(event)
        elif isinstance(event, LookupAnswer):
            self._on_lookup_answer(event)
        elif isinstance(event, Arrival):
            self._on_arrival(event)
        elif isinstance(event, Abort):
            self._on_abort(event)
        else:  # pragma: no cover - the union is closed
            raise TypeError(f"not an input event: {event!r}")
        if state.retiring:
            self._retire_finished()
        return commands

    def pure_decode_steps(self) -> tuple[int, float]:
        """How many (output, tick) pairs ``handle_decode_steps`` may take now, and the time
        they must all come before: while the step in flight is one of the decode cohort's
        members alone, the next ticks plan such steps too and change nothing else (no
        special, no admission pass, no deadline, no transfer, nothing to release or
        retire). (0, now) when the engine cannot vouch for even one."""
        state = self.state
        cohort = state.cohort
        none = (0, state.now)
        if (cohort is None or cohort.planned is None or cohort.planned or not cohort.members
                or len(state.steps) != 1 or next(iter(state.steps.values())) is not cohort.planned
                or state.holding or state.sent or state.jobs or state.prefetches or state.lookup_timers
                or state.prefetch_waits or state.deferred_frees or state.retiring
                or len(cohort.members) > state.config.max_batched_tokens):
            return none
        if any(req.state == "running" for req in cohort.outsiders):
            return none
        until = math.inf
        if state.waiting:  # admission would find its head blocked again (Scheduler._cohort_admit)
            if not self.scheduler.admission_quiet(cohort):
                return none
            until = cohort.quiet_until
        return min(cohort.expiry) - cohort.step, until

    def handle_decode_steps(self, times: Sequence[float]) -> StepPlan:
        """For each time ``t`` in order: the output of the step in flight at ``t``, with
        no request stopping, then a tick at ``t``, which plans the next step (the one whose
        output comes at the next time). Exactly ``handle(StepOutput(t, step, ()))`` then
        ``handle(Tick(t))`` for each, records included, but for no more pairs than
        ``pure_decode_steps`` vouches for and before its time; returns the last tick's plan
        (a light plan: the members' totals). The simulator skips ahead with it; asked for
        more, it raises ``ValueError``."""
        state = self.state
        cohort = state.cohort
        steps, until = self.pure_decode_steps()
        if not times or len(times) > steps or times[-1] >= until \
                or any(b < a for a, b in zip((state.now, *times), times, strict=False)):
            raise ValueError(f"handle_decode_steps: {len(times)} steps up to t={times[-1] if times else None} "
                             f"asked, {steps} pure decode steps before t={until} vouched for")
        assert cohort is not None
        count = len(cohort.members)
        before = cohort.before
        step_id = next(iter(state.steps))
        k = len(times)
        recorder = state.recorder
        if recorder is not None:
            # What the outputs, the ticks and the steps they plan record (``input_to_record``,
            # ``Scheduler._emit_plan``), step by step.
            for j, t in enumerate(times):
                recorder({"kind": "input", "type": "step_output", "t": t, "step_id": step_id + j, "finished": []})
                recorder({"kind": "input", "type": "tick", "t": t})
                recorder({"kind": "step", "t": t, "step": step_id + j + 1, "requests": count,
                          "prefill_tokens": 0, "sync_lookups": 0, "prompt": []})
        # Their effect, all at once: k outputs of members alone (``_on_step_output``) and k
        # ticks that each plan one (``Scheduler._cohort_tick``, ``_emit_plan``).
        last = step_id + k
        state.now = times[-1]
        del state.steps[step_id]
        state.last_output_step = max(state.last_output_step, last - 1)
        state.next_step_id = last + 1
        state.stats.ticks += k
        state.stats.steps += k
        before += (k - 1) * count
        planned: list[tuple[Request, int, int, bool]] = []
        state.steps[last] = planned
        cohort.planned = planned
        cohort.outputs += k
        cohort.step += k
        cohort.before = before + count
        self.scheduler.fast_steps += k
        return StepPlan(last, (), 0, (), (count, count, 2 * before + 2 * count, before))

    def _retire_finished(self) -> None:
        """Let go of the finished requests nothing refers to any more (retention on). Only
        a new finish, a completed job or a job given up can change that: the mark records
        those counts at the last look, so an event that changes none of them costs nothing."""
        state = self.state
        done_jobs = state.next_job_id - len(state.jobs) - len(state.prefetches)
        mark = (done_jobs, state.stats.rank_timeouts, len(state.retiring))
        if mark == state.retire_mark:
            return
        told: set[str] | None = None  # requests a load job in flight will tell its outcome
        for rid, req in list(state.retiring.items()):
            if req.store_jobs or rid in state.prefetch_waits or rid in state.wants_prefetch:
                continue
            if told is None:
                told = {w for job in state.jobs.values() if job.kind == "load" and not job.timed_out
                        for w, _ in job.waiters}
            if rid in told:
                continue
            del state.retiring[rid]
            del state.requests[rid]
            state.retired[rid] = req.epoch
            state.sync_lookup_version.pop(rid, None)
            if state.reference is not None:
                state.reference.pop(rid, None)
            cast(Retire, state.retire)(req)
        state.retire_mark = (done_jobs, state.stats.rank_timeouts, len(state.retiring))

    # ---- request-facing events -------------------------------------------------------------
    def _on_arrival(self, event: Arrival) -> None:
        state = self.state
        lifecycle = self.lifecycle
        if event.request_id in state.requests or event.request_id in state.retired:
            lifecycle.warn("duplicate_arrival", req=event.request_id)
            return
        block_tokens = state.config.block_tokens
        full_blocks = event.prompt_tokens // block_tokens
        req = Request(
            request_id=event.request_id,
            seq=state.next_seq,
            arrival_ms=event.t,
            prompt_tokens=event.prompt_tokens,
            hashes=tuple(event.block_hashes[:full_blocks]),
            resumable=event.resumable,
            block_tokens=block_tokens,
            max_tokens=event.max_tokens,
        )
        state.next_seq += 1
        state.requests[req.request_id] = req
        state.state_counts["waiting"] += 1
        if state.reference is not None:
            state.reference[req.request_id] = ReferenceRequest(req.request_id)
        if state.blocks_for(req.prompt_tokens + 1) > state.pool.capacity:
            lifecycle.finish(req, "failed", "error", f"prompt needs more than the {state.pool.capacity} device blocks")
            return
        state.waiting.append(req)
        # No full block to hit: nothing to look up early (or ever, for this prompt).
        action = lifecycle.ask(req, "on_arrival") if state.tiers and state.hit_candidates(req) else "none"
        if action in ("lookup", "prefetch"):
            if action == "prefetch":
                state.wants_prefetch[req.request_id] = req.epoch
            lifecycle.submit_lookup(req, f"early {action} at arrival")

    def _on_lookup_answer(self, event: LookupAnswer) -> None:
        state = self.state
        req = state.requests.get(event.request_id)
        if req is None or req.state != "lookup_pending" or req.epoch != event.epoch:
            state.stats.stale_lookup_answers += 1
            retired = state.retired.get(event.request_id) if req is None else None
            self.lifecycle.record(
                {
                    "kind": "stale_lookup",
                    "t": state.now,
                    "req": event.request_id,
                    "epoch": event.epoch,
                    "current_epoch": retired if req is None else req.epoch,
                    "state": (None if retired is None else "finished") if req is None else req.state,
                }
            )
            return
        if event.tiers is None:
            state.stats.failed_lookups += 1
            req.lookup = ()
            reason = "lookup failed: treated as a miss"
        else:
            req.lookup = tuple(t for t in event.tiers if t in state.tiers)
            reason = f"lookup answered: {len(req.lookup)} blocks in tiers"
        req.lookup_async = True
        req.lookup_answered_ms = state.now
        req.lookup_uses = 0
        self.lifecycle.move(req, "lookup_answered", reason)  # it kept its place in the queue
        if state.wants_prefetch.pop(req.request_id, None) == req.epoch:
            self.transfers.start_prefetch(req)

    def _on_abort(self, event: Abort) -> None:
        state = self.state
        req = state.requests.get(event.request_id)
        if req is None or req.state == "finished":
            gone = "finished" if event.request_id in state.retired else None
            self.lifecycle.warn("abort_ignored", req=event.request_id, state=gone if req is None else req.state)
            return
        if req.state == "lookup_pending":
            state.commands.append(DiscardLookup(req.request_id, req.epoch))
        state.sync_lookup_version.pop(req.request_id, None)
        state.wants_prefetch.pop(req.request_id, None)
        state.prefetch_waits.pop(req.request_id, None)
        self.lifecycle.finish(req, "aborted", "aborted", "client aborted")

    def _on_step_output(self, event: StepOutput) -> None:
        state = self.state
        entries = state.steps.pop(event.step_id, None)
        if entries is None:
            self.lifecycle.warn("unknown_step", step=event.step_id)
            return
        now = state.now
        bt = state.config.block_tokens
        maybe_store = self.transfers.maybe_store
        finished = dict(event.finished)
        cohort = state.cohort
        if cohort is not None and entries is cohort.planned:
            requests = state.requests
            if finished and any(requests.get(rid) in cohort.members for rid in finished):
                state.drop_cohort()  # a member stops after all: every entry the ordinary way
            else:
                # A step of the decode cohort (``scheduler.Scheduler._cohort_tick``): each
                # member confirms the token it sampled (``DecodeCohort.settle`` counts it),
                # and that is all that happens to it; the specials are taken as in any step.
                cohort.planned = None
                cohort.outputs += 1
        for req, epoch, n, samples in entries:
            if req.state != "running" or req.epoch != epoch:
                continue  # preempted or aborted while the step ran: its output is void
            req.confirmed += n
            if samples:
                req.placeholders -= 1
                req.generated += 1
                if req.first_token_ms is None:
                    req.first_token_ms = now
            if req.confirmed >= (req.registered_blocks + 1) * bt:
                self._register_computed(req)
            if req.confirmed >= (req.stored_blocks + 1) * bt:
                maybe_store(req)  # before finishing: the last step's blocks are stored too
            reason = finished.pop(req.request_id, None)
            if reason is not None:
                self._finish_generation(req, reason)
        for rid in finished:
            self.lifecycle.warn("finish_for_unscheduled_request", req=rid, step=event.step_id)
        if event.step_id > state.last_output_step:
            state.last_output_step = event.step_id
        if state.deferred_frees:
            for step_id in sorted(s for s in state.deferred_frees if s <= event.step_id):
                for table in state.deferred_frees.pop(step_id):
                    freed = state.pool.release(reversed(table))
                    if freed:
                        self.lifecycle.free_blocks(freed)
        if state.sent:
            self.transfers.release_sent()

    def _register_computed(self, req: Request) -> None:
        """Publish the request's confirmed full blocks (prompt and generated tokens) in
        the device prefix cache."""
        state = self.state
        full = req.confirmed // state.config.block_tokens
        if full > len(req.hashes):
            state.ensure_hashes(req, full)
        pool = state.pool
        while req.registered_blocks < full:
            i = req.registered_blocks
            pool.register(req.block_table[i], req.hashes[i])
            req.registered_blocks += 1

    def _finish_generation(self, req: Request, reason: str) -> None:
        """The model stopped ``req``: finish it, or hold it in ``sending`` while stores
        still read its blocks (if the policy says so)."""
        state = self.state
        lifecycle = self.lifecycle
        state.running.remove(req)
        state.drop_cohort_of(req)
        if req.store_jobs and lifecycle.ask(req, "hold_at_finish", req.store_jobs):
            req.finish_reason = reason
            req.finish_ms = state.now
            req.sending_tick = state.stats.ticks
            req.sending_step = state.next_step_id
            lifecycle.move(req, "send_started", f"finished ({reason}); {req.store_jobs} stores still read its blocks")
            return
        lifecycle.finish(req, "completed", reason, f"finished ({reason})")

    # ---- what drivers and checks read (all of it lives in ``self.state``) -------------------
    @property
    def config(self) -> EngineConfig:
        return self.state.config

    @property
    def now(self) -> float:
        return self.state.now

    @property
    def requests(self) -> dict[str, Request]:
        return self.state.requests

    @property
    def state_counts(self) -> dict[str, int]:
        return self.state.state_counts

    @property
    def stats(self) -> Stats:
        return self.state.stats

    @property
    def pool(self) -> DeviceBlockPool:
        return self.state.pool

    @property
    def tiers(self) -> dict[str, TierIndex]:
        return self.state.tiers

    @property
    def ranks(self) -> RankAggregator:
        return self.state.ranks

    @property
    def jobs(self) -> dict[int, Job]:
        return self.state.jobs

    @property
    def prefetch_waits(self) -> dict[str, PrefetchJob]:
        return self.state.prefetch_waits

    @property
    def prefetches(self) -> dict[int, PrefetchJob]:
        return self.state.prefetches

    @property
    def recorder(self) -> Recorder | None:
        """Where the engine writes its trace records; drivers append their own (warnings, the cut)."""
        return self.state.recorder

    def busy(self) -> bool:
        return self.state.busy()

    def next_wakeup(self) -> float | None:
        return self.state.next_wakeup()

    def stranded(self) -> list[str]:
        return self.state.stranded()

    def check_invariants(self) -> None:
        self.state.check_invariants()

    def sync_lookup(self, hashes: Sequence[int]) -> tuple[str, ...]:
        return self.state.sync_lookup(hashes)

    def engine_view(self) -> EngineView:
        return self.state.engine_view()

    def _submit_lookup(self, req: Request, reason: str) -> None:
        """An async lookup submitted by hand (tests drive the idempotence check with it)."""
        self.lifecycle.submit_lookup(req, reason)
