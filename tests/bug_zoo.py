"""The bug zoo: deliberately broken variants of the engine, its rank aggregation and its
policies, each a bug that keeps coming back in KV connectors. The model checker must
catch every one of them within its default budget, naming one invariant for each
(tests/test_bug_zoo.py).

The first generation (1-9) are the recurring connector bugs of docs/design.md; the
second (10-22) the bugs reported against vLLM and LMCache in 2026 (issue 11) and the
provenance bugs only a symbolic content model sees; then two that break deadlines (a
lookup that never expires, a silent rank's blocks never reclaimed); the last four break
the one-lifecycle engine's own mechanisms (issue 22): a store not flushed at a
preemption, a join copying before its owner landed, a held request freed before its
stores were reported, a stale step output applied to the step in flight.

Variants never edit the real code: each subclasses a part of the engine and names it in
an ``Engine`` subclass's class attribute (``transfers_class``, ``core_class``,
``scheduler_class``), overrides one of ``Engine``'s own handlers, swaps a broken
``RankAggregator`` into the core's state, or puts a broken policy on the stack. Each
is caught for its own bug: the unmodified engine passes the checker.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs

from kvlife.lifecycle.config import EngineConfig
from kvlife.lifecycle.engine.connector import ConnectorCore
from kvlife.lifecycle.engine.core import Engine, Job, Recorder
from kvlife.lifecycle.engine.events import Command, StartLoad, StepOutput, SubmitLookup, TransferReport
from kvlife.lifecycle.engine.jobs import Transfers
from kvlife.lifecycle.engine.ranks import RankAggregator, ReportOutcome, ReportStatus
from kvlife.lifecycle.engine.request import SchedRequest, Status
from kvlife.lifecycle.engine.scheduler import Scheduler
from kvlife.lifecycle.engine.vllm_shapes import KVConnectorOutput
from kvlife.lifecycle.engine.worker_book import OutputAggregator
from kvlife.policies.base import Decision, EngineView, RequestView
from kvlife.policies.loading import load_stack
from kvlife.policies.stack import PolicyStack
from kvlife.specs.lifecycle import Trigger
from kvlife.specs.model_check import AsyncLookups, ShareLoads
from kvlife.transfer.index import TierIndex


def _engine(name: str, **parts: Any) -> type[Engine]:
    """An ``Engine`` whose named parts (``core_class``, ``scheduler_class``,
    ``transfers_class``) are broken subclasses."""
    return type(name, (Engine,), parts)


def _with_scheduler(scheduler: type[Scheduler]) -> type[Engine]:
    """An engine whose scheduler is a broken subclass."""
    return _engine(f"EngineWith{scheduler.__name__}", scheduler_class=scheduler)


def _with_ranks(aggregator: Callable[[int, dict[int, Job]], RankAggregator]) -> Callable[..., Engine]:
    """An engine whose rank aggregation is broken (``aggregator(world_size, jobs)``)."""

    def factory(config: EngineConfig, stack: PolicyStack, tiers: Sequence[TierIndex] | None = None,
                recorder: Recorder | None = None) -> Engine:
        engine = Engine(config, stack, tiers=tiers, recorder=recorder)
        engine.core.state.ranks = aggregator(config.ranks, engine.jobs)
        return engine

    return factory


# ---- 1. an old lookup answer applied to a newer lookup ----------------------------------
class StaleLookupAppliedCore(ConnectorCore):
    """Answers are matched by request id only: an answer of an older epoch (or one the
    last admission already consumed) is applied to the newer lookup that is pending."""

    def on_lookup_answer(self, request_id: str, epoch: int, tiers: Sequence[str] | None) -> None:
        req = self.state.requests.get(request_id)
        if req is not None and req.state == "lookup_pending":
            epoch = req.epoch  # whatever epoch asked
        super().on_lookup_answer(request_id, epoch, tiers)


# ---- 2. a lookup left in flight at abort --------------------------------------------------
class LookupNotDiscardedCore(ConnectorCore):
    """Abort finishes a request in lookup_pending without discarding its lookup."""

    def request_finished(self, request_id: str, reason: str, why: str | None = None,
                         held: bool | None = None) -> bool:
        req = self.state.requests.get(request_id)
        if req is None or req.state != "lookup_pending" or reason != "aborted":
            return super().request_finished(request_id, reason, why, held)
        self._finish(req, Trigger.ABORTED, "aborted", why or "client aborted")  # no DiscardLookup
        return False


# ---- 3. a load counted done after one of its ranks --------------------------------------------
class FirstRankDone(RankAggregator):
    """For loads, the first rank to finish speaks for all of them."""

    def __init__(self, world_size: int, jobs: dict[int, Job]) -> None:
        super().__init__(world_size)
        self.engine_jobs = jobs

    def report(self, job_id: int, rank: int, failed: tuple[int, ...]) -> ReportOutcome:
        job = self.engine_jobs.get(job_id)
        if job is None or job.kind != "load" or job_id not in self._jobs:
            return super().report(job_id, rank, failed)
        del self._jobs[job_id]
        return ReportOutcome(ReportStatus.DONE, tuple(sorted(failed)))


# ---- 4. finished_sending and finished_recving swapped ---------------------------------------
class SwappedAggregator(OutputAggregator):
    def aggregate(self, outputs: Sequence[tuple[set[str], set[str], set[int]]]) -> tuple[
            tuple[str, ...], tuple[str, ...], frozenset[int]]:
        recving, sending, invalid = super().aggregate(outputs)
        return sending, recving, invalid


class SwappedSendRecv(Engine):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.aggregator = SwappedAggregator(self.core.state.config.ranks)


# ---- 5. a store covering placeholder tokens ----------------------------------------------------
class StoreScheduledTokens:
    """Stores what is scheduled, placeholders of in-flight steps included."""

    name = "store-scheduled"

    def store_limit(self, req: RequestView, engine: EngineView) -> Decision[int]:
        return Decision(req.computed_tokens, "store every scheduled token")


class StoresScheduledTransfers(Transfers):
    """The engine takes the store policy's limit as it is, not clamped to the tokens step
    outputs confirmed: with a limit of the scheduled tokens, it stores the blocks of steps
    still in flight, placeholders included."""

    def maybe_store(self, req: Any) -> None:
        confirmed, req.confirmed = req.confirmed, max(req.confirmed, req.computed)
        try:
            super().maybe_store(req)
        finally:
            req.confirmed = confirmed


# ---- 6. a finished request's blocks freed though its stores still read them ------------------------
class IgnoresHoldScheduler(Scheduler):
    """The connector says hold (a store reads the blocks); the scheduler frees them at once."""

    def _finish(self, req: SchedRequest, reason: str, status: Status | None = None) -> bool:
        super()._finish(req, reason, status)
        return False


# ---- 7. a duplicate load of an in-flight block ----------------------------------------------------
class IgnoresJoinsCore(ConnectorCore):
    """The policy sees the blocks in flight and says join; the engine loads them itself all
    the same, a second load of blocks already in flight."""

    def update_state_after_alloc(self, request_id: str, block_ids: Sequence[int], num_external_tokens: int,
                                 chunk: Any = None) -> None:
        req = self.state.requests.get(request_id)
        if req is not None:
            req.joins = {}
        super().update_state_after_alloc(request_id, block_ids, num_external_tokens, chunk)


# ---- 8. an abort during a load that frees the blocks early ---------------------------------------
class AbortFreesLoadingScheduler(Scheduler):
    """An abort frees a loading request's blocks at once, not when its load reports."""

    def finish_requests(self, request_id: str, reason: str = "aborted") -> bool:
        req = self.requests.get(request_id)
        if req is None or req.finished or req.status != Status.WAITING_FOR_REMOTE_KVS:
            return super().finish_requests(request_id, reason)
        self._unqueue(req)
        self._free_request(req, reason, delay=False)
        return True


# ---- 9. a failed load retried forever with its stale hit ----------------------------------------
class KeepsFailedBlocksTransfers(Transfers):
    """A failed block stays in its tier, so the next lookup hits it again, and again."""

    def release_job(self, job: Job, failed: Sequence[int]) -> None:
        tiers = list(self.state.tiers.values())
        for tier in tiers:
            tier.discard = lambda blocks: []  # type: ignore[method-assign]
        try:
            super().release_job(job, failed)
        finally:
            for tier in tiers:
                del tier.discard


# ---- 10. a duplicate rank report counted twice -----------------------------------------------------
class CountsDuplicateReports(RankAggregator):
    def __init__(self, world_size: int, jobs: dict[int, Job] | None = None) -> None:
        super().__init__(world_size)

    def report(self, job_id: int, rank: int, failed: tuple[int, ...]) -> ReportOutcome:
        pending = self._jobs.get(job_id)
        if pending is None:
            return ReportOutcome(ReportStatus.UNKNOWN_JOB)
        if not 0 <= rank < self.world_size:
            return ReportOutcome(ReportStatus.BAD_RANK)
        pending.reported[rank] = True  # no check that this rank already reported
        pending.failed.update(failed)
        pending.remaining -= 1
        if pending.remaining > 0:
            return ReportOutcome(ReportStatus.PENDING)
        del self._jobs[job_id]
        return ReportOutcome(ReportStatus.DONE, tuple(sorted(pending.failed)))


# ---- 11. a head that can never fit parks the queue (vllm#57841) ------------------------------------
class QueuesOversizedScheduler(Scheduler):
    """vllm#57841: requests parked forever behind a head that can never be scheduled. A
    prompt larger than the whole device is queued instead of failed at arrival."""

    def add_request(self, request_id: str, prompt_tokens: int, block_hashes: Sequence[int],
                    max_tokens: int | None = None, resumable: bool = False) -> None:
        capacity = self.pool.capacity
        self.pool.capacity = 1 << 30  # the arrival's size check sees an unbounded device
        try:
            super().add_request(request_id, prompt_tokens, block_hashes, max_tokens, resumable)
        finally:
            self.pool.capacity = capacity


# ---- 12. a pending lookup asked again on every pass (vllm#49829) -------------------------------------
class LooksUpEveryPassCore(ConnectorCore):
    """vllm#49829: lookups pending with no bound (one request made 1.27M lookup() calls).
    Every scheduler pass that asks for a request whose lookup is pending submits a new one."""

    def get_num_new_matched_tokens(self, request_id: str, num_computed_tokens: int) -> tuple[int | None, bool]:
        state = self.state
        req = state.requests[request_id]
        if req.state == "lookup_pending":
            state.stats.async_lookups += 1
            state.commands.append(SubmitLookup(req.request_id, req.epoch, state.hit_candidates(req)))
        return super().get_num_new_matched_tokens(request_id, num_computed_tokens)


# ---- 13. a completion reported twice by per-rank handles (vllm#54518) --------------------------------
class CompletesPerHandle(RankAggregator):
    """vllm#54518: each rank's handle reports the transfer finished, so a rank reporting a
    load or store that already completed completes it once more."""

    def __init__(self, world_size: int, jobs: dict[int, Job]) -> None:
        super().__init__(world_size)
        self.engine_jobs = jobs
        self.done: set[int] = set()

    def report(self, job_id: int, rank: int, failed: tuple[int, ...]) -> ReportOutcome:
        if job_id in self.done and 0 <= rank < self.world_size:
            return ReportOutcome(ReportStatus.DONE, tuple(sorted(failed)))
        outcome = super().report(job_id, rank, failed)
        if outcome.status is ReportStatus.DONE and job_id in self.engine_jobs:
            self.done.add(job_id)
        return outcome


class CompletesTwiceTransfers(Transfers):
    """Keeps finished jobs, so a second completion finds the job to complete again."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.finished: dict[int, Job] = {}

    def on_transfer_report(self, event: TransferReport) -> None:
        job = self.state.jobs.get(event.job_id) or self.finished.get(event.job_id)
        if job is not None and event.job_id not in self.state.jobs:
            self.state.jobs[event.job_id] = job
        super().on_transfer_report(event)
        if job is not None and event.job_id not in self.state.jobs:
            self.finished[event.job_id] = job


class CompletesTwice(Engine):
    transfers_class = CompletesTwiceTransfers

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.core.state.ranks = CompletesPerHandle(self.core.state.config.ranks, self.jobs)


# ---- 14. a completion applied to a request already running (vllm#56194) --------------------------------
class LateCompletionTransfers(Transfers):
    """vllm#56194: a completion arriving for a request that is already running. The load
    was reclaimed at its deadline (the request failed it and runs again, recomputing); when
    the silent rank's late report comes, the completion handler takes the request as one
    whose load landed and moves it out of loading, which it no longer is in."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reclaimed_loads: dict[int, str] = {}  # reclaimed load job -> its request

    def on_late_report(self, event: TransferReport) -> None:
        super().on_late_report(event)
        if event.job_id in self.state.reclaimed:
            return  # another rank still owes it
        rid = self.reclaimed_loads.pop(event.job_id, None)
        req = self.state.requests.get(rid) if rid is not None else None
        if req is not None and req.state == "running":
            self.lifecycle.move(req, Trigger.LOAD_DONE, "its load reported (late)")

    def reclaim_jobs(self, deadline: float) -> None:
        loads = {job_id: job.request_id for job_id, job in self.state.jobs.items() if job.kind == "load"}
        super().reclaim_jobs(deadline)
        self.reclaimed_loads.update((j, r) for j, r in loads.items() if j in self.state.reclaimed)


# ---- 15. a finish-time store of the never-written last token (vllm#54193) ------------------------------
class StoresLastTokenCore(ConnectorCore):
    """vllm#54193: the finish-time store takes the request's length as its watermark,
    which includes the last sampled token: its KV was never written (no step takes it as
    input), so the store copies a block with a hole in it."""

    def request_finished(self, request_id: str, reason: str, why: str | None = None,
                         held: bool | None = None) -> bool:
        transfers, lifecycle = self.transfers, self.lifecycle
        store = transfers.maybe_store

        def store_with_last_token(req: Any) -> None:
            watermark = req.prompt_tokens + req.generated
            ask = lifecycle.ask
            lifecycle.ask = lambda r, hook, *args: (  # type: ignore[method-assign]
                watermark if hook == "store_limit" and r is req else ask(r, hook, *args))
            confirmed, req.confirmed = req.confirmed, max(req.confirmed, watermark)
            computed, req.computed = req.computed, max(req.computed, watermark)
            try:
                store(req)
            finally:
                del lifecycle.ask
                req.confirmed, req.computed = confirmed, computed

        transfers.maybe_store = store_with_last_token  # type: ignore[method-assign]
        try:
            return super().request_finished(request_id, reason, why, held)
        finally:
            del transfers.maybe_store


# ---- 16. computed tokens kept across preemption (vllm#36752) -----------------------------------------
class KeepsComputedScheduler(Scheduler):
    """vllm#36752: the computed-token count is not reset on preemption. Admitted again, the
    request resumes from its old count as if those tokens were cached, over blocks that
    it never wrote in this epoch."""

    def _preempt(self, req: SchedRequest) -> None:
        kept = req.num_computed_tokens
        super()._preempt(req)
        req.num_computed_tokens = kept


# ---- 17. an async hit recorded twice, the second as 0 (vllm#28585) --------------------------------------
class RecordsHitTwiceCore(ConnectorCore):
    """vllm#28585: async connector hits recorded twice, the second time with 0 external
    tokens. When a landed load is taken into running, the admission bookkeeping runs
    again and records the request's tier hit as 0 blocks."""

    def update_state_after_alloc(self, request_id: str, block_ids: Sequence[int], num_external_tokens: int,
                                 chunk: Any = None) -> None:
        req = self.state.requests[request_id]
        promoting = req.state == "loading"
        super().update_state_after_alloc(request_id, block_ids, num_external_tokens, chunk)
        if promoting and req.preemptions == 0:
            req.tier_hit_blocks = dict.fromkeys(req.tier_hit_blocks, 0)


# ---- 18. a failed store that stays visible to lookups (LMCache#4991) ------------------------------------
class FailedStoreVisibleTransfers(Transfers):
    """LMCache#4991: a store that failed on some rank is published like a good one: the
    tier index lists the block, lookups hit it, loads read bytes that were never written."""

    def release_job(self, job: Job, failed: Sequence[int]) -> None:
        if job.kind == "store":  # counted as failed (the counters stay right), kept as good
            self.state.stats.failed_blocks += len(set(failed) & {move.block_hash for move in job.moves})
            failed = ()
        super().release_job(job, failed)


# ---- 19. preempted blocks never released ----------------------------------------------------------------
class LeaksPreemptedScheduler(Scheduler):
    """Preemption forgets the request's block table without dropping its references: the
    blocks stay held forever, and the device shrinks until requests wait forever."""

    def _preempt(self, req: SchedRequest) -> None:
        req.blocks = []
        super()._preempt(req)


# ---- 20. a failed load's blocks published in the device cache -------------------------------------------
class PublishesFailedLoadScheduler(Scheduler):
    """The device blocks of a failed load are published under their hashes like the good
    ones: a later hit (the request itself, recomputing) reads garbage."""

    def _landed(self, req: SchedRequest) -> None:
        hashes = req.block_hashes
        for i in range(req.num_cached_blocks, min(len(req.blocks), len(hashes))):
            self.pool.cache(req.blocks[i], hashes[i])
        super()._landed(req)


# ---- 21. blocks published before their load landed ---------------------------------------------------------
class CachesLoadsEarlyScheduler(Scheduler):
    """An async load's blocks are published in the device prefix cache when they are
    allocated, not when the load lands: a request admitted meanwhile hits blocks the load
    is still writing."""

    def _allocate(self, req: SchedRequest, n: int, local: list[int], external: int, delay_cache: bool,
                  reserved: int) -> bool:
        return super()._allocate(req, n, local, external, False, reserved)


# ---- 22. a failed prefetch marked landed -------------------------------------------------------------------
class PrefetchIgnoresFailuresTransfers(Transfers):
    """A prefetch whose blocks failed to land is marked landed: the host tier lists the
    blocks it never received, and the request it was for reads them from there."""

    def on_prefetch_report(self, event: TransferReport) -> None:
        state = self.state
        host = state.tiers.get("host")
        job = state.prefetches.get(event.job_id)
        if host is None or job is None:
            super().on_prefetch_report(event)
            return
        req = state.requests.get(job.request_id)
        before = req.lookup if req is not None else None
        complete_store = host.complete_store
        host.complete_store = lambda blocks, ok=True: complete_store(blocks, ok=True)  # type: ignore[method-assign]
        try:
            super().on_prefetch_report(event)
        finally:
            del host.complete_store
        if event.job_id in state.prefetches or req is None or before is None or req.epoch != job.epoch:
            return
        pulled = {m.block_hash for m in job.moves}
        candidates = state.hit_candidates(req)
        req.lookup = tuple(host.name if i < len(candidates) and candidates[i] in pulled else tier
                           for i, tier in enumerate(before[: len(candidates)]))


# ---- 23. a lookup that never expires ------------------------------------------------------------------------
class NeverExpiresCore(ConnectorCore):
    """vllm#49829's other half: a lookup that never answers keeps its request in
    lookup_pending for ever (no lookup deadline)."""

    def _expire_lookups(self) -> None:
        return


# ---- 24. a silent rank's blocks never reclaimed -------------------------------------------------------------
class NeverReclaimsTransfers(Transfers):
    """A job some rank never reports keeps its blocks for ever, even after its request
    was aborted (what VLLM_NIXL_ABORT_REQUEST_TIMEOUT exists for)."""

    def reclaim_jobs(self, deadline: float) -> None:
        return


# ---- 25. a store not flushed at preemption --------------------------------------------------------------------
class NoFlushTransfers(Transfers):
    """A preempted request's stores in flight are not flushed: the scheduler frees its
    blocks at the preemption and hands them on while the stores still read them."""

    def flush_stores(self, req: Any) -> None:
        return


# ---- 26. a join that reads before its owner landed ----------------------------------------------------------------
class JoinsUnordered(Engine):
    """A join's command does not name the load it follows: the workers copy the owner's
    device blocks at once, before the owner's load has landed in them (its record still
    says whom it joins)."""

    def handle(self, event: Any) -> list[Command]:
        commands = super().handle(event)  # (the same list: a driver may have read it as it grew)
        commands[:] = [attrs.evolve(c, after=None) if type(c) is StartLoad and c.after is not None else c
                       for c in commands]
        return commands


# ---- 27. a held request freed before its stores reported ---------------------------------------------------------
class FreesHeldEarlyScheduler(Scheduler):
    """A held request's blocks are freed with the first step output after it finished,
    not when its stores are reported (finished_sending)."""

    def _transfers_finished(self, output: KVConnectorOutput) -> None:
        super()._transfers_finished(output)
        for req in [r for r in self.requests.values() if r.free_on_sending]:
            self._free_blocks(req)


# ---- 28. a stale step output applied to the step in flight ---------------------------------------------------------
class AppliesStaleOutputs(Engine):
    """A step output is applied to the oldest step in flight whatever step it names: a
    stale one (a step delivered already, of an epoch preempted since; or a later one early)
    confirms the tokens and stops of the step now in flight."""

    def _on_step_output(self, event: StepOutput) -> None:
        steps = self.scheduler.steps
        if steps and next(iter(steps)) != event.step_id:
            event = attrs.evolve(event, step_id=next(iter(steps)))
        super()._on_step_output(event)


# ---- 29. a fenced preemption victim (a zero-progress cascade) ----------------------------------------------------
class PreemptsFencedScheduler(Scheduler):
    """vllm#49674: the allocation retry takes a victim whose blocks a step in flight still
    writes (the check vLLM 0.33 makes, ``_request_blocks_can_be_freed``, left out). Its
    blocks are freed later all the same (the deferral stays), so the preemption makes no
    room now and the next victim is taken."""

    _freeing = False

    def _can_free(self, req: SchedRequest) -> bool:
        return super()._can_free(req) if self._freeing else True

    def _free_request_blocks(self, req: SchedRequest) -> None:
        self._freeing = True
        try:
            super()._free_request_blocks(req)
        finally:
            self._freeing = False


# ---- 30. blocks still in flight kept as hits when patience runs out -------------------------------------------------
class KeepsPrefetchingHitsTransfers(Transfers):
    """When a request's patience with its prefetch runs out, it keeps its whole answer: the
    blocks the prefetch still has in flight count as hits too, so its load reads them from
    their lower tier while the prefetch pulls them into the host tier (the same blocks read
    twice; the rule is that they are computed)."""

    def prefetch_gate(self, req: Any) -> bool:
        answer = req.lookup
        waiting = super().prefetch_gate(req)
        if not waiting and answer is not None and req.lookup is not None and len(req.lookup) < len(answer):
            req.lookup = answer
        return waiting


@attrs.frozen
class ZooBug:
    name: str
    what: str
    invariant: int  # the one invariant a correct checker names for it
    source: str = ""  # where the bug was reported
    stack: Callable[[], PolicyStack] = lambda: PolicyStack([])
    engine_factory: Callable[..., Engine] = Engine


ZOO: tuple[ZooBug, ...] = (
    ZooBug("stale_lookup_applied", "an old lookup answer applied to the newer lookup pending", 4,
           "docs/design.md (stale lookups)", lambda: PolicyStack([AsyncLookups()]),
           _engine("StaleLookupApplied", core_class=StaleLookupAppliedCore)),
    ZooBug("lookup_not_discarded_at_abort", "a lookup left in flight when its request is aborted", 4,
           "docs/design.md (stale lookups)", lambda: PolicyStack([AsyncLookups()]),
           _engine("LookupNotDiscarded", core_class=LookupNotDiscardedCore)),
    ZooBug("load_done_after_one_rank", "a load counted done after one of its ranks", 3,
           "docs/design.md (TP ranks)", engine_factory=_with_ranks(FirstRankDone)),
    ZooBug("send_recv_swapped", "finished_sending and finished_recving swapped", 11,
           "docs/design.md", engine_factory=SwappedSendRecv),
    ZooBug("store_covers_placeholders", "a store covering placeholder tokens", 5,
           "vllm#27644", lambda: PolicyStack([StoreScheduledTokens()]),
           _engine("StoresScheduled", transfers_class=StoresScheduledTransfers)),
    ZooBug("free_under_store", "a finished request's blocks freed while its stores still read them", 2,
           "docs/design.md", engine_factory=_with_scheduler(IgnoresHoldScheduler)),
    ZooBug("duplicate_inflight_load", "a duplicate load of an in-flight block", 6,
           "docs/design.md", lambda: PolicyStack([ShareLoads()]),
           _engine("IgnoresJoins", core_class=IgnoresJoinsCore)),
    ZooBug("abort_frees_loading_blocks", "an abort during a load that frees the blocks early", 2,
           "docs/design.md", engine_factory=_with_scheduler(AbortFreesLoadingScheduler)),
    ZooBug("failed_load_retried_forever", "a failed load retried forever with its stale hit", 12,
           "docs/design.md", engine_factory=_engine("KeepsFailedBlocks", transfers_class=KeepsFailedBlocksTransfers)),
    ZooBug("duplicate_report_counted_twice", "a duplicate rank report counted twice", 3,
           "docs/design.md", engine_factory=_with_ranks(CountsDuplicateReports)),
    # 1: a prompt that can never run is queued instead of failed at its arrival (the fix of
    # vllm#57841), before the drain sees the queue behind it parked (7).
    ZooBug("head_of_line_never_fits", "requests parked forever behind a head that can never be scheduled", 1,
           "vllm#57841", engine_factory=_with_scheduler(QueuesOversizedScheduler)),
    ZooBug("lookup_every_pass", "a pending lookup submitted again on every scheduler pass", 12,
           "vllm#49829", lambda: PolicyStack([AsyncLookups()]),
           _engine("LooksUpEveryPass", core_class=LooksUpEveryPassCore)),
    ZooBug("completion_per_rank_handle", "a completion reported twice by per-rank handles", 3,
           "vllm#54518", engine_factory=CompletesTwice),
    ZooBug("completion_for_running_request", "a late load completion applied to a request already running", 1,
           "vllm#56194", engine_factory=_engine("LateCompletion", transfers_class=LateCompletionTransfers)),
    ZooBug("finish_store_includes_last_token", "a finish-time store watermark that includes the never-written "
           "last token", 5, "vllm#54193", engine_factory=_engine("StoresLastToken", core_class=StoresLastTokenCore)),
    # 10: admitted again, it reads its old count's tokens from blocks it never wrote.
    ZooBug("computed_kept_across_preemption", "computed-token counts not reset on preemption", 10,
           "vllm#36752", engine_factory=_with_scheduler(KeepsComputedScheduler)),
    ZooBug("async_hit_recorded_twice", "async hits recorded twice, the second as 0", 13,
           "vllm#28585", engine_factory=_engine("RecordsHitTwice", core_class=RecordsHitTwiceCore)),
    ZooBug("failed_store_visible", "a failed store that stays visible to lookups", 10,
           "LMCache#4991", engine_factory=_engine("FailedStoreVisible", transfers_class=FailedStoreVisibleTransfers)),
    ZooBug("preempted_blocks_never_released", "a preempted request's blocks never released", 7,
           "issue 11 (801 of 1,000 requests waiting forever)", engine_factory=_with_scheduler(LeaksPreemptedScheduler)),
    ZooBug("failed_load_published", "a failed load's blocks published in the device cache", 10,
           "issue 11 (content provenance)", engine_factory=_with_scheduler(PublishesFailedLoadScheduler)),
    ZooBug("published_before_landing", "a load's blocks published in the device cache before it landed", 10,
           "issue 11 (content provenance)", engine_factory=_with_scheduler(CachesLoadsEarlyScheduler)),
    ZooBug("failed_prefetch_landed", "prefetch blocks marked landed after a failure", 10,
           "issue 11 (content provenance)",
           engine_factory=_engine("PrefetchIgnoresFailures", transfers_class=PrefetchIgnoresFailuresTransfers)),
    ZooBug("lookup_never_expires", "an unanswered lookup pending for ever (no lookup deadline)", 7,
           "vllm#49829; issue 11 (deadlines are transitions)", lambda: PolicyStack([AsyncLookups()]),
           _engine("NeverExpires", core_class=NeverExpiresCore)),
    ZooBug("silent_rank_never_reclaimed", "a job a rank never reports holds its blocks for ever", 7,
           "vLLM VLLM_NIXL_ABORT_REQUEST_TIMEOUT (480 s); issue 11 (deadlines are transitions)",
           engine_factory=_engine("NeverReclaims", transfers_class=NeverReclaimsTransfers)),
    ZooBug("store_not_flushed_at_preemption", "a preempted request's store not flushed: its block freed and reused "
           "while the store still reads it", 2, "issue 22 (R3b)",
           engine_factory=_engine("NoFlush", transfers_class=NoFlushTransfers)),
    ZooBug("join_before_owner_landed", "a join that copies its owner's blocks before the owner's load landed", 10,
           "issue 22 (joins)", lambda: PolicyStack([ShareLoads()]), JoinsUnordered),
    ZooBug("held_freed_before_stores_reported", "a held request's blocks freed before its stores were reported", 2,
           "issue 22 (R7)", engine_factory=_with_scheduler(FreesHeldEarlyScheduler)),
    ZooBug("stale_output_applied", "a stale step output (of an epoch preempted since, or early) applied to the step "
           "in flight", 4, "issue 26 (epochs as data)", engine_factory=AppliesStaleOutputs),
    ZooBug("preempts_fenced_victim", "a preemption victim whose blocks a step in flight still writes: no room made, "
           "the next victim taken (a zero-progress cascade)", 7, "vllm#49674",
           engine_factory=_with_scheduler(PreemptsFencedScheduler)),
    ZooBug("keeps_prefetching_hits", "blocks a prefetch still has in flight kept as hits when patience runs out",
           12, "issue 26 (prefetch patience)", lambda: load_stack(["prefetch-timeout"]),
           _engine("KeepsPrefetchingHits", transfers_class=KeepsPrefetchingHitsTransfers)),
)

__all__ = ["ZOO", "LeaksPreemptedScheduler", "ZooBug", "_with_scheduler"]
