"""The sans-IO engine: input events in, commands out.

Like h11 for HTTP, the ``Engine`` never reads a clock, starts a thread, touches torch or
opens a socket. Drivers (the simulator, the live runtime, the vLLM-order driver) feed it
``kvlife.lifecycle.engine.events`` inputs through ``Engine.handle`` and carry out the
commands it returns.

It is vLLM's shape, in two parts, composed:

- ``scheduler.Scheduler``: kvlife's model of vLLM 0.33's scheduler (token budget, running
  requests first, FIFO admission, preemption, its device block pool);
- ``connector.ConnectorCore``: the connector core, the same object ``KVLifeConnector``
  runs inside vLLM. The scheduler calls it only through vLLM's connector calls.

Follow one request: ``Arrival`` queues it (``Scheduler.add_request`` →
``on_new_request``); a ``Tick`` is one scheduler pass (``Scheduler.schedule``): it asks the
core for the request's external hit (``get_num_new_matched_tokens``: a sync lookup, or an
async one through ``lookup_pending`` and ``LookupAnswer``), allocates its blocks and tells
the core (``update_state_after_alloc``: a load, ``loading``, or ``running``), then hands the
core the step (``build_connector_meta``), whose jobs go to the driver with the step's plan;
``StepOutput`` appends the sampled tokens, finishes stopped requests (``request_finished``:
held in ``sending`` while stores read their blocks), applies the workers' reports
(``update_connector_output``) and their results (a landed load is promoted by the next
pass, a held request's blocks freed at ``finished_sending``), then ``take_events``: the
tokens are confirmed and the blocks they fill stored.

Retention: by default every request stays in ``engine.requests`` for good. With
``Engine(..., retire=fn)`` a finished request leaves it once nothing refers to it any more
(no hold, no job that reads or writes its blocks, no prefetch wait): ``fn(request)`` is
called first (the simulator folds it into ``metrics.RequestTotals``). The ids of retired
requests are kept (``state.retired``) so that a duplicate arrival, an abort or a stale
lookup answer for one is handled and recorded exactly as if it were still there.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import ClassVar

from kvlife.lifecycle.config import EngineConfig
from kvlife.lifecycle.engine.blocks import DeviceBlockPool
from kvlife.lifecycle.engine.connector import ConnectorCore, ConnectorMeta
from kvlife.lifecycle.engine.connector_api import ConnectorAPI, LookupClient
from kvlife.lifecycle.engine.events import (
    Abort,
    Arrival,
    Command,
    InputEvent,
    LookupAnswer,
    Scheduled,
    StartLoad,
    StartPrefetch,
    StartStore,
    StepOutput,
    Tick,
    TransferReport,
    input_to_record,
)
from kvlife.lifecycle.engine.jobs import Transfers
from kvlife.lifecycle.engine.ranks import RankAggregator
from kvlife.lifecycle.engine.request import Request
from kvlife.lifecycle.engine.scheduler import Scheduler
from kvlife.lifecycle.engine.state import CoreState, Job, PrefetchJob, Recorder, Retire, Stats
from kvlife.lifecycle.engine.vllm_shapes import KVConnectorOutput, WorkerMeta
from kvlife.lifecycle.engine.worker_book import OutputAggregator, WorkerBook
from kvlife.policies.base import EngineView
from kvlife.policies.stack import PolicyStack
from kvlife.transfer.index import TierIndex

__all__ = ["Engine", "CoreState", "Job", "PrefetchJob", "Recorder", "Retire", "Stats"]


def meta_commands(meta: ConnectorMeta) -> list[Command]:
    """The jobs a step's connector metadata carries, as commands for the driver."""
    commands: list[Command] = []
    for load in meta.loads:
        commands.append(StartLoad(load.job_id, load.request_id, load.moves, load.after))
    for store in meta.stores:
        commands.append(StartStore(store.job_id, store.request_id, store.moves))
    for pull in meta.prefetches:
        commands.append(StartPrefetch(pull.job_id, pull.request_id, pull.moves))
    return commands


class Engine:
    """The engine: the scheduler and the connector core, and the dispatch of each input."""

    # The parts' classes. A deliberately broken variant (tests/bug_zoo.py) subclasses a
    # part (``Transfers``, ``ConnectorCore``, ``Scheduler``) and names it here; the real
    # code is never edited.
    transfers_class: ClassVar[type[Transfers]] = Transfers
    core_class: ClassVar[type[ConnectorCore]] = ConnectorCore
    scheduler_class: ClassVar[type[Scheduler]] = Scheduler

    def __init__(
        self,
        config: EngineConfig,
        policies: PolicyStack,
        tiers: Sequence[TierIndex] | None = None,
        recorder: Recorder | None = None,
        reference: bool = False,
        retire: Retire | None = None,
        lookups: LookupClient | None = None,
        record_calls: bool = False,
    ) -> None:
        self.core = self.core_class(config, policies, tiers, recorder, reference, retire)
        core = self.core
        if type(core.transfers) is not self.transfers_class:
            core.transfers = self.transfers_class(core.state, core.lifecycle)
        # ``lookups``: the connector answers its own async lookups (as inside vLLM) instead
        # of the driver (``LookupAnswer`` inputs).
        # ``record_calls``: the trace's inputs are written from the connector calls they cause
        # (``ConnectorAPI(record_inputs=True)``, as ``KVLifeConnector`` writes them inside
        # vLLM), not as ``handle`` takes them: only inputs vLLM's calls show are recorded.
        self.record_calls = record_calls
        self.connector = ConnectorAPI(core, clock=lambda: core.state.now, lookups=lookups,
                                      record_inputs=record_calls, refresh_hashes=False)
        self.scheduler = self.scheduler_class(config, self.connector)
        core.lifecycle.device = self.scheduler.pool
        core.transfers.hold_blocks = self.scheduler.pool.hold
        core.transfers.unhold_blocks = self.scheduler.release_held
        # The ranks the driver plays: what each reports with a step output (``worker_book``),
        # combined as vLLM combines its workers' outputs.
        self.workers = [WorkerBook() for _ in range(config.ranks)]
        self.aggregator = OutputAggregator(config.ranks)
        self._worker_steps: deque[tuple[int, tuple[str, ...], tuple[int, ...]]] = deque()

    @property
    def state(self) -> CoreState:
        return self.core.state

    def handle(self, event: InputEvent) -> list[Command]:
        """Apply one input event; return the commands the driver must carry out."""
        core = self.core
        state = core.state
        if event.t < state.now:
            raise ValueError(f"time went backwards: {event.t} < {state.now}")
        state.now = event.t
        if state.recorder is not None and not self.record_calls:
            state.recorder(input_to_record(event))
        kind = type(event)
        if kind is Tick:
            plan, meta = self.scheduler.schedule()
            self._to_workers(meta)
            commands = core.take_commands()
            commands.extend(meta_commands(meta))
            commands.append(plan)
        else:
            if kind is StepOutput:
                self._on_step_output(event)  # type: ignore[arg-type]
            elif kind is TransferReport:
                report: TransferReport = event  # type: ignore[assignment]
                self._worker_done(report.job_id, report.rank, report.failed)
                self.connector.update_connector_output(KVConnectorOutput(
                    kv_connector_worker_meta=WorkerMeta(((report.job_id, report.rank, report.failed),))))
            elif kind is LookupAnswer:
                core.on_lookup_answer(event.request_id, event.epoch, event.tiers)  # type: ignore[union-attr]
            elif kind is Arrival:
                self.scheduler.add_request(event.request_id, event.prompt_tokens,  # type: ignore[union-attr]
                                           event.block_hashes, event.max_tokens,  # type: ignore[union-attr]
                                           event.resumable)  # type: ignore[union-attr]
            elif kind is Abort:
                self._on_abort(event)  # type: ignore[arg-type]
            else:  # pragma: no cover - the union is closed
                raise TypeError(f"not an input event: {event!r}")
            commands = core.take_commands()
        if state.retiring:
            core.retire_finished()
        return commands

    def _on_abort(self, event: Abort) -> None:
        if not self.scheduler.finish_requests(event.request_id):
            state = self.core.state
            req = state.requests.get(event.request_id)
            gone = "finished" if event.request_id in state.retired else None
            self.core.lifecycle.warn("abort_ignored", req=event.request_id, state=gone if req is None else req.state)

    def _to_workers(self, meta: ConnectorMeta) -> None:
        """Each rank's book takes the step's jobs now (their reports may come before the
        step's output); the held requests and the jobs given up when the rank runs the step,
        before it reports the step's output (``_worker_step``)."""
        for book in self.workers:
            for job in (*meta.loads, *meta.stores):
                book.add(job.job_id, job.kind, job.request_id, [m.block_hash for m in job.moves],
                         [m.device_block for m in job.moves], job.after if job.kind == "load" else None)
        if meta.hold_finished or meta.abandon:
            self._worker_steps.append((meta.step_id, meta.hold_finished, meta.abandon))

    def _worker_step(self, step_id: int) -> None:
        """The ranks ran step ``step_id``: its held requests and abandoned jobs take effect."""
        while self._worker_steps and self._worker_steps[0][0] <= step_id:
            _, holds, abandon = self._worker_steps.popleft()
            for book in self.workers:
                book.hold(holds)
                for job_id in abandon:
                    entry = book.jobs.get(job_id)
                    if entry is not None:
                        book.done(job_id, [h for h, _ in entry.moves])

    def _worker_done(self, job_id: int, rank: int, failed: Sequence[int]) -> None:
        if 0 <= rank < len(self.workers):
            self.workers[rank].done(job_id, failed)

    def _on_step_output(self, event: StepOutput) -> None:
        """vLLM's ``update_from_output``: the step's tokens (stops finish their requests),
        then its connector output, the workers' reports and what they report finished."""
        core = self.core
        scheduler = self.scheduler
        if not scheduler.steps or next(iter(scheduler.steps)) != event.step_id:
            core.lifecycle.warn("unknown_step", step=event.step_id)
            return
        if event.failed_ranks:
            self._fail_step(scheduler.steps[event.step_id][2])
        scheduled = {req.request_id for req, _, samples in scheduler.steps[event.step_id][0] if samples}
        for rid, _ in event.finished:
            if rid not in scheduled:
                core.lifecycle.warn("finish_for_unscheduled_request", req=rid, step=event.step_id)
        self._worker_step(event.step_id)
        for job_id, rank, failed in event.reports:
            self._worker_done(job_id, rank, failed)
        recving, sending, invalid = self.aggregator.aggregate([book.take() for book in self.workers])
        state = core.state
        given_up, state.given_up_loads = state.given_up_loads, set()
        output = KVConnectorOutput(set(sending) or None, set(recving) or None,
                                   WorkerMeta(event.reports) if event.reports else None, set(invalid))
        scheduler.update_from_output(event.step_id, dict(event.finished), output, given_up)

    def _fail_step(self, planned: Sequence[Scheduled]) -> None:
        """The step wrote no KV on some rank: the blocks it was to write leave the prefix
        cache, so no hit serves them (those of a request that finished while it ran too),
        and every request whose blocks include one is aborted, with the blocks it computed
        over it (a later step of its own, or of a request that hit them) leaving the cache
        as well: nothing computed over the step's garbage is read again."""
        scheduler = self.scheduler
        bt = scheduler.block_tokens
        bad: set[int] = set()
        for entry in planned:
            first = entry.computed_before // bt
            bad.update(entry.block_table[first:-(-(entry.computed_before + entry.num_tokens) // bt)])
        victims: dict[str, None] = {}
        grew = True
        while grew:  # a victim's later blocks are bad too, and may be another request's hit
            grew = False
            for req in scheduler.requests.values():
                if req.finished or req.request_id in victims:
                    continue
                first_bad = next((i for i, block in enumerate(req.blocks) if block in bad), None)
                if first_bad is not None:
                    bad.update(req.blocks[first_bad:])
                    victims[req.request_id] = None
                    grew = True
        scheduler.pool.forget(sorted(bad))
        for rid in victims:
            scheduler.finish_requests(rid)

    # ---- what drivers and checks read ------------------------------------------------------------
    @property
    def config(self) -> EngineConfig:
        return self.core.state.config

    @property
    def now(self) -> float:
        return self.core.state.now

    @property
    def requests(self) -> dict[str, Request]:
        return self.core.state.requests

    @property
    def state_counts(self) -> dict[str, int]:
        return self.core.state.state_counts

    @property
    def stats(self) -> Stats:
        return self.core.state.stats

    @property
    def pool(self) -> DeviceBlockPool:
        return self.scheduler.pool

    @property
    def tiers(self) -> dict[str, TierIndex]:
        return self.core.state.tiers

    @property
    def ranks(self) -> RankAggregator:
        return self.core.state.ranks

    @property
    def jobs(self) -> dict[int, Job]:
        return self.core.state.jobs

    @property
    def prefetch_waits(self) -> dict[str, PrefetchJob]:
        return self.core.state.prefetch_waits

    @property
    def prefetches(self) -> dict[int, PrefetchJob]:
        return self.core.state.prefetches

    @property
    def recorder(self) -> Recorder | None:
        """Where the engine writes its trace records; drivers append their own (warnings, the cut)."""
        return self.core.state.recorder

    @property
    def answers(self) -> dict[tuple[str, str, str], int]:
        """Every policy answer given, per (policy, hook, value)."""
        return self.core.lifecycle.answers

    def output_tokens(self, request_id: str) -> int | None:
        """Tokens the request has output so far, as the scheduler counts them (a token a
        preempted request's step still delivers included); None once it left the scheduler."""
        return self.scheduler.output_tokens(request_id)

    def busy(self) -> bool:
        """True while the core has work (``CoreState.busy``) or the scheduler still keeps a
        finished request's blocks: an aborted request's load ended, and the step output that
        brings its ``finished_recving`` gives them back (vLLM's engine steps on for it)."""
        return self.core.state.busy() or any(r.finished for r in self.scheduler.requests.values())

    def progress(self) -> tuple[int, int, int]:
        """Changes since the start (transitions, transfer results, free device blocks): a
        driver compares two readings to tell whether an input changed anything."""
        return self.core.state.moves, self.scheduler.results, self.scheduler.pool.free

    def next_wakeup(self) -> float | None:
        return self.core.state.next_wakeup()

    def stranded(self) -> list[str]:
        """Invariant 7 once inputs have stopped: every request not finished, as
        ``"id:state"``, in arrival order (a request parked behind a head that never fits,
        or deferred forever by a policy, never finishes either)."""
        return [f"{r.request_id}:{r.state}" for r in self.core.state.unfinished()]

    def check_invariants(self) -> None:
        """Invariant 8 on the device and every tier (cheap enough for tests, not per event)."""
        self.scheduler.check_accounting()
        for tier in self.core.state.tiers.values():
            tier.check_accounting()

    def sync_lookup(self, hashes: Sequence[int]) -> tuple[str, ...]:
        return self.core.state.sync_lookup(hashes)

    def engine_view(self) -> EngineView:
        return self.core.lifecycle.engine_view()
