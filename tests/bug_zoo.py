"""The bug zoo: deliberately broken variants of the engine, its rank aggregation and its
policies, each a bug that keeps coming back in KV connectors. The model checker must
catch every one of them within its default budget, naming one invariant for each
(tests/test_bug_zoo.py).

The first generation (1-9) are the recurring connector bugs of docs/design.md; the
second (10-21) the bugs reported against vLLM and LMCache in 2026 (issue 11) and the
provenance bugs that only a symbolic content model sees; the last two break deadlines (a
lookup that never expires, a silent rank's blocks never reclaimed). Variants never edit the real
code: they subclass a part of the engine (``Transfers``, named by an ``Engine`` subclass's
``transfers_class``; ``Scheduler``, swapped in by an ``Engine`` subclass) or ``Engine``'s
own event handlers, swap a broken ``RankAggregator`` into ``engine.state.ranks``, or put a
broken policy on the stack.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs

from kvlife.lifecycle.config import EngineConfig
from kvlife.lifecycle.engine.blocks import DeviceBlockPool
from kvlife.lifecycle.engine.core import Engine, Job, Recorder
from kvlife.lifecycle.engine.events import Abort, Arrival, LookupAnswer, SubmitLookup, TransferReport
from kvlife.lifecycle.engine.ranks import RankAggregator, ReportOutcome, ReportStatus
from kvlife.lifecycle.engine.request import Request
from kvlife.lifecycle.engine.scheduler import Entry, Scheduler
from kvlife.lifecycle.engine.transfers import Transfers
from kvlife.policies.base import Decision, EngineView, RequestView
from kvlife.policies.stack import PolicyStack
from kvlife.specs.model_check import AsyncLookups, ShareLoads
from kvlife.transfer.index import TierIndex


@contextlib.contextmanager
def _no_block_releases(pool: DeviceBlockPool) -> Iterator[None]:
    """Inside, releasing device blocks does nothing (for jobs whose references are gone)."""
    pool.release = lambda blocks: []  # type: ignore[method-assign]
    try:
        yield
    finally:
        del pool.release


def _with_scheduler(scheduler: type[Scheduler], transfers: type[Transfers] = Transfers) -> type[Engine]:
    """An engine whose scheduler (and transfer part) is a broken subclass."""

    class Variant(Engine):
        transfers_class = transfers

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.scheduler = scheduler(self.state, self.lifecycle, self.transfers)

    Variant.__name__ = f"EngineWith{scheduler.__name__}"
    return Variant


# ---- 1. an old lookup answer applied to a newer lookup ----------------------------------
class StaleLookupApplied(Engine):
    """Answers are matched by request id only: an answer of an older epoch (or one the
    last admission already consumed) is applied to the newer lookup that is pending."""

    def _on_lookup_answer(self, event: LookupAnswer) -> None:
        req = self.requests.get(event.request_id)
        if req is not None and req.state == "lookup_pending":
            event = attrs.evolve(event, epoch=req.epoch)  # whatever epoch asked
        super()._on_lookup_answer(event)


# ---- 2. a lookup left in flight at abort --------------------------------------------------
class LookupNotDiscarded(Engine):
    """Abort finishes a request in lookup_pending without discarding its lookup."""

    def _on_abort(self, event: Abort) -> None:
        req = self.requests.get(event.request_id)
        if req is not None and req.state == "lookup_pending":
            self.lifecycle.finish(req, "aborted", "aborted", "client aborted")  # no DiscardLookup
            return
        super()._on_abort(event)


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


def _first_rank_done(config: EngineConfig, stack: PolicyStack, tiers: Sequence[TierIndex] | None = None,
                     recorder: Recorder | None = None) -> Engine:
    engine = Engine(config, stack, tiers=tiers, recorder=recorder)
    engine.state.ranks = FirstRankDone(config.ranks, engine.jobs)
    return engine


# ---- 4. finished_sending and finished_recving swapped ---------------------------------------
class SwappedSendRecvTransfers(Transfers):
    def job_outcome(self, job: Job, failed: Sequence[int], cause: str | None = None) -> None:
        swapped = attrs.evolve(job, kind="store" if job.kind == "load" else "load")
        super().job_outcome(swapped, failed, cause)


class SwappedSendRecv(Engine):
    transfers_class = SwappedSendRecvTransfers


# ---- 5. a store covering placeholder tokens ----------------------------------------------------
class StoreScheduledTokens:
    """Stores what is scheduled, placeholders of in-flight steps included."""

    name = "store-scheduled"

    def store_limit(self, req: RequestView, engine: EngineView) -> Decision[int]:
        return Decision(req.computed_tokens, "store every scheduled token")


# ---- 6. a block freed while a store still reads it ---------------------------------------------
class StoreTakesNoReferenceTransfers(Transfers):
    def maybe_store(self, req: Any) -> None:
        pool = self.state.pool
        pool.retain = lambda blocks: None  # type: ignore[method-assign]
        try:
            super().maybe_store(req)
        finally:
            del pool.retain

    def release_job(self, job: Job, failed: Sequence[int]) -> None:
        if job.kind != "store":
            super().release_job(job, failed)
            return
        with _no_block_releases(self.state.pool):  # the reference it never took is not given back
            super().release_job(job, failed)


class StoreTakesNoReference(Engine):
    transfers_class = StoreTakesNoReferenceTransfers


# ---- 7. a duplicate load of an in-flight block ----------------------------------------------------
class ForgetsInFlightLoadsTransfers(Transfers):
    """Never publishes its loads as in flight, so nobody can join them."""

    def start_load(self, req: Any, moves: list[Any]) -> None:
        in_flight = self.state.in_flight_loads
        before = set(in_flight)
        super().start_load(req, moves)
        for block_hash in sorted(set(in_flight) - before):
            del in_flight[block_hash]


class ForgetsInFlightLoads(Engine):
    transfers_class = ForgetsInFlightLoadsTransfers


# ---- 8. an abort during a load that frees the blocks early ---------------------------------------
class CancelledLoadsTransfers(Transfers):
    """Releasing a load cancelled at abort gives nothing back: it was dropped already."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cancelled: set[int] = set()

    def release_job(self, job: Job, failed: Sequence[int]) -> None:
        if job.job_id not in self.cancelled:
            super().release_job(job, failed)
            return
        with _no_block_releases(self.state.pool):  # already dropped at the abort
            super().release_job(job, failed)


class AbortCancelsLoad(Engine):
    """Abort 'cancels' the request's loads by dropping their block references at once."""

    transfers_class = CancelledLoadsTransfers

    def _on_abort(self, event: Abort) -> None:
        assert isinstance(self.transfers, CancelledLoadsTransfers)
        cancelled = self.transfers.cancelled
        req = self.requests.get(event.request_id)
        if req is not None and req.state == "loading":
            for job_id in req.load_jobs:
                job = self.jobs.get(job_id)
                if job is not None and job.request_id == req.request_id and job_id not in cancelled:
                    cancelled.add(job_id)
                    self.pool.release(m.device_block for m in job.moves)
        super()._on_abort(event)


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


class KeepsFailedBlocks(Engine):
    transfers_class = KeepsFailedBlocksTransfers


# ---- 10. a duplicate rank report counted twice -----------------------------------------------------
class CountsDuplicateReports(RankAggregator):
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


def _with_ranks(aggregator: type[RankAggregator]) -> Callable[..., Engine]:
    def factory(config: EngineConfig, stack: PolicyStack, tiers: Sequence[TierIndex] | None = None,
                recorder: Recorder | None = None) -> Engine:
        engine = Engine(config, stack, tiers=tiers, recorder=recorder)
        engine.state.ranks = aggregator(config.ranks)
        return engine

    return factory


# ---- 11. a head that can never fit parks the queue (vllm#57841) ------------------------------------
class _AdmitsWhatNeverFits(Scheduler):
    def _never_fits(self, req: Request) -> bool:
        return False


class QueuesOversizedPrompts(_with_scheduler(_AdmitsWhatNeverFits)):  # type: ignore[misc]
    """vllm#57841: requests parked forever behind a head that can never be scheduled. A
    prompt larger than the whole device is queued instead of failed at arrival (and the
    admission's own check is gone too); FIFO admission stops at it, every tick, and nothing
    behind it ever runs."""

    def _on_arrival(self, event: Arrival) -> None:
        pool = self.state.pool
        capacity = pool.capacity
        pool.capacity = 1 << 30  # the arrival's size check sees an unbounded device
        try:
            super()._on_arrival(event)
        finally:
            pool.capacity = capacity


# ---- 12. a pending lookup asked again on every pass (vllm#49829) -------------------------------------
class LooksUpEveryPass(Scheduler):
    """vllm#49829: lookups pending with no bound (one request made 1.27M lookup() calls).
    Every scheduler pass asks the connector again for a request whose lookup is pending,
    and the connector submits a new lookup each time."""

    def tick(self) -> None:
        state = self.state
        for req in state.waiting:
            if req.state == "lookup_pending":
                state.stats.async_lookups += 1
                state.commands.append(SubmitLookup(req.request_id, req.epoch, state.hit_candidates(req)))
        super().tick()


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
        self.state.ranks = CompletesPerHandle(self.state.config.ranks, self.state.jobs)


# ---- 14. a completion applied to a request already running (vllm#56194) --------------------------------
class LateCompletionTransfers(Transfers):
    """vllm#56194: a completion arriving for a request that is already running. The load
    was given up at its deadline (the request went back to waiting and runs again,
    recomputing); when its late report comes, the completion handler takes the request
    as one whose load landed and moves it out of loading, which it no longer is in."""

    def on_transfer_report(self, event: TransferReport) -> None:
        job = self.state.jobs.get(event.job_id)
        late = job is not None and job.kind == "load" and job.timed_out
        super().on_transfer_report(event)
        if job is None or not late or event.job_id in self.state.jobs:
            return
        for rid, _ in job.waiters:
            req = self.state.requests[rid]
            if req.state == "running":
                self.lifecycle.move(req, "load_done", "its load reported (late)")


class LateCompletion(Engine):
    transfers_class = LateCompletionTransfers


# ---- 15. a finish-time store of the never-written last token (vllm#54193) ------------------------------
class StoresLastTokenAtFinish(Engine):
    """vllm#54193: the finish-time store takes the request's length as its watermark,
    which includes the last sampled token: its KV was never written (no step takes it
    as input), so the store copies a block with a hole in it."""

    def _finish_generation(self, req: Request, reason: str) -> None:
        watermark = req.prompt_tokens + req.generated
        real_ask = self.lifecycle.ask

        def ask(r: Request, hook: str, *args: Any) -> Any:
            return watermark if hook == "store_limit" and r is req else real_ask(r, hook, *args)

        computed = req.computed
        self.lifecycle.ask = ask  # type: ignore[method-assign]
        req.computed = max(computed, watermark)
        try:
            self.transfers.maybe_store(req)
        finally:
            del self.lifecycle.ask
            req.computed = computed
        super()._finish_generation(req, reason)


# ---- 16. computed tokens kept across preemption (vllm#36752) -----------------------------------------
class KeepsComputedScheduler(Scheduler):
    """vllm#36752: the cached/computed-token count is not reset on preemption. Admitted
    again, the request resumes from its old count as if those tokens were cached, over
    blocks that were freed (and reused) when it was preempted."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kept: dict[str, int] = {}

    def _preempt(self, req: Request) -> None:
        self.kept[req.request_id] = req.computed
        super()._preempt(req)

    def _try_admit(self, req: Request, budget: int, entries: list[Entry], candidates: tuple[int, ...]) -> str:
        outcome = super()._try_admit(req, budget, entries, candidates)
        kept = self.kept.pop(req.request_id, 0) if outcome in ("running", "loading") else 0
        if outcome == "running":
            n = entries[-1][1]
            start = min(kept, req.known_tokens - n)
            if start > req.computed - n:
                req.computed = start + n
        return outcome


# ---- 17. an async hit recorded twice, the second as 0 (vllm#28585) --------------------------------------
class RecordsHitTwiceScheduler(Scheduler):
    """vllm#28585: async connector hits recorded twice, the second time with 0 external
    tokens. When a landed load is taken into running, the admission bookkeeping runs
    again and records the request's tier hit as 0 blocks."""

    def _take_landed(self, budget: int, entries: list[Entry]) -> tuple[int, bool]:
        landed = [req for req in self.state.holding if not req.load_jobs]
        out = super()._take_landed(budget, entries)
        for req in landed:
            if req.state == "running" and req.preemptions == 0:
                req.tier_hit_blocks = dict.fromkeys(req.tier_hit_blocks, 0)
        return out


# ---- 18. a failed store that stays visible to lookups (LMCache#4991) ------------------------------------
class FailedStoreVisibleTransfers(Transfers):
    """LMCache#4991: a store that failed on some rank is published like a good one: the
    tier index lists the block, lookups hit it, loads read bytes that were never written."""

    def release_job(self, job: Job, failed: Sequence[int]) -> None:
        if job.kind == "store":  # counted as failed (the counters stay right), kept as good
            self.state.stats.failed_blocks += len(set(failed) & {move.block_hash for move in job.moves})
            failed = ()
        super().release_job(job, failed)


class FailedStoreVisible(Engine):
    transfers_class = FailedStoreVisibleTransfers


# ---- 19. preempted blocks never released ----------------------------------------------------------------
class LeaksPreemptedScheduler(Scheduler):
    """Preemption forgets the request's block table without dropping its references: the
    blocks stay held forever, and the device shrinks until requests wait forever."""

    def _preempt(self, req: Request) -> None:
        req.block_table = []
        super()._preempt(req)


# ---- 20. a failed load's blocks published in the device cache -------------------------------------------
class PublishesFailedLoadTransfers(Transfers):
    """The device blocks of a failed load are published under their hashes like the
    good ones: a later hit (the request itself, recomputing) reads garbage."""

    def release_job(self, job: Job, failed: Sequence[int]) -> None:
        super().release_job(job, failed)
        if job.kind == "load" and not job.timed_out:
            for move in job.moves:
                if move.block_hash in failed:
                    self.state.pool.register(move.device_block, move.block_hash)


class PublishesFailedLoad(Engine):
    transfers_class = PublishesFailedLoadTransfers


# ---- 21. blocks published before their step's output (async scheduling) ---------------------------------
class RegistersEarlyScheduler(Scheduler):
    """Blocks are published in the device prefix cache as soon as a step is planned to
    compute them, not when its output confirms them: under async scheduling a request
    admitted meanwhile hits blocks whose content is still being computed."""

    def _emit_plan(self, entries: list[Entry], sync_keys: list[int]) -> None:
        super()._emit_plan(entries, sync_keys)
        state = self.state
        bt = state.config.block_tokens
        for req, _, _ in entries:
            full = min(req.computed // bt, len(req.block_table))
            state.ensure_hashes(req, full)
            while req.registered_blocks < full:
                state.pool.register(req.block_table[req.registered_blocks], req.hashes[req.registered_blocks])
                req.registered_blocks += 1


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


class PrefetchIgnoresFailures(Engine):
    transfers_class = PrefetchIgnoresFailuresTransfers


class NeverExpiresLookups(Engine):
    """vllm#49829's other half: a lookup that never answers keeps its request in
    lookup_pending for ever (no lookup deadline)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lifecycle.expire_lookups = lambda: None  # type: ignore[method-assign]


class NeverReclaimsTransfers(Transfers):
    """A job some rank never reports keeps its blocks for ever, even after its request
    was aborted (what VLLM_NIXL_ABORT_REQUEST_TIMEOUT exists for)."""

    def reclaim_jobs(self, deadline: float) -> None:
        return


class NeverReclaims(Engine):
    transfers_class = NeverReclaimsTransfers


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
           "docs/design.md (stale lookups)", lambda: PolicyStack([AsyncLookups()]), StaleLookupApplied),
    ZooBug("lookup_not_discarded_at_abort", "a lookup left in flight when its request is aborted", 4,
           "docs/design.md (stale lookups)", lambda: PolicyStack([AsyncLookups()]), LookupNotDiscarded),
    ZooBug("load_done_after_one_rank", "a load counted done after one of its ranks", 3,
           "docs/design.md (TP ranks)", engine_factory=_first_rank_done),
    # 11: a request whose stores are reported is not released at the step output that
    # should release it (before the drain finds it stuck, 7).
    ZooBug("send_recv_swapped", "finished_sending and finished_recving swapped", 11,
           "docs/design.md", engine_factory=SwappedSendRecv),
    ZooBug("store_covers_placeholders", "a store covering placeholder tokens", 5,
           "vllm#27644", lambda: PolicyStack([StoreScheduledTokens()])),
    ZooBug("free_under_store", "a block freed while a store still reads it", 2,
           "docs/design.md", engine_factory=StoreTakesNoReference),
    ZooBug("duplicate_inflight_load", "a duplicate load of an in-flight block", 6,
           "docs/design.md", lambda: PolicyStack([ShareLoads()]), ForgetsInFlightLoads),
    ZooBug("abort_frees_loading_blocks", "an abort during a load that frees the blocks early", 2,
           "docs/design.md", engine_factory=AbortCancelsLoad),
    ZooBug("failed_load_retried_forever", "a failed load retried forever with its stale hit", 12,
           "docs/design.md", engine_factory=KeepsFailedBlocks),
    ZooBug("duplicate_report_counted_twice", "a duplicate rank report counted twice", 3,
           "docs/design.md", engine_factory=_with_ranks(CountsDuplicateReports)),
    # 1: a prompt that can never run is queued instead of failed at its arrival (the fix of
    # vllm#57841), before the drain sees the queue behind it parked (7).
    ZooBug("head_of_line_never_fits", "requests parked forever behind a head that can never be scheduled", 1,
           "vllm#57841", engine_factory=QueuesOversizedPrompts),
    ZooBug("lookup_every_pass", "a pending lookup submitted again on every scheduler pass", 12,
           "vllm#49829", engine_factory=_with_scheduler(LooksUpEveryPass)),
    ZooBug("completion_per_rank_handle", "a completion reported twice by per-rank handles", 3,
           "vllm#54518", engine_factory=CompletesTwice),
    ZooBug("completion_for_running_request", "a late load completion applied to a request already running", 1,
           "vllm#56194", engine_factory=LateCompletion),
    ZooBug("finish_store_includes_last_token", "a finish-time store watermark that includes the never-written "
           "last token", 5, "vllm#54193", engine_factory=StoresLastTokenAtFinish),
    # 8: admitted again, it computes from its old count over fewer blocks than its tokens need;
    # 10: it reads blocks freed and reused under it as its own. Which one the derandomized
    # search meets first moves with the process's incidental state (tests/test_bug_zoo.py):
    # 10 since EngineConfig resolves device_blocks and ranks once (issue 24, item 11).
    ZooBug("computed_kept_across_preemption", "cached-token counts not reset on preemption", 10,
           "vllm#36752", engine_factory=_with_scheduler(KeepsComputedScheduler)),
    ZooBug("async_hit_recorded_twice", "async hits recorded twice, the second as 0", 13,
           "vllm#28585", engine_factory=_with_scheduler(RecordsHitTwiceScheduler)),
    ZooBug("failed_store_visible", "a failed store that stays visible to lookups", 10,
           "LMCache#4991", engine_factory=FailedStoreVisible),
    ZooBug("preempted_blocks_never_released", "a preempted request's blocks never released", 7,
           "issue 11 (801 of 1,000 requests waiting forever)", engine_factory=_with_scheduler(LeaksPreemptedScheduler)),
    ZooBug("failed_load_published", "a failed load's blocks published in the device cache", 10,
           "issue 11 (content provenance)", engine_factory=PublishesFailedLoad),
    ZooBug("published_before_output", "blocks published while their step is still in flight", 10,
           "issue 11 (content provenance)", engine_factory=_with_scheduler(RegistersEarlyScheduler)),
    ZooBug("failed_prefetch_landed", "prefetch blocks marked landed after a failure", 10,
           "issue 11 (content provenance)", engine_factory=PrefetchIgnoresFailures),
    ZooBug("lookup_never_expires", "an unanswered lookup pending for ever (no lookup deadline)", 7,
           "vllm#49829; issue 11 (deadlines are transitions)", lambda: PolicyStack([AsyncLookups()]),
           NeverExpiresLookups),
    ZooBug("silent_rank_never_reclaimed", "a job a rank never reports holds its blocks for ever", 7,
           "vLLM VLLM_NIXL_ABORT_REQUEST_TIMEOUT (480 s); issue 11 (deadlines are transitions)",
           engine_factory=NeverReclaims),
)

__all__ = ["ZOO", "LeaksPreemptedScheduler", "ZooBug"]
