"""The bug zoo: deliberately broken variants of the engine, its rank aggregation and its
policies, each a bug that keeps coming back in KV connectors. The model checker must
catch every one of them within its default budget (tests/test_bug_zoo.py).

Variants never edit the real code: they subclass a part of the engine (``Transfers``,
named by an ``Engine`` subclass's ``transfers_class``) or ``Engine``'s own event handlers,
swap a broken ``RankAggregator`` into ``engine.state.ranks``, or put a broken policy on
the stack.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs

from kvlife.lifecycle.config import EngineConfig
from kvlife.lifecycle.engine.blocks import DeviceBlockPool
from kvlife.lifecycle.engine.core import Engine, Job, Recorder
from kvlife.lifecycle.engine.events import Abort, LookupAnswer
from kvlife.lifecycle.engine.ranks import RankAggregator, ReportOutcome, ReportStatus
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


# ---- 1. a stale lookup applied after abort -------------------------------------------------
class StaleLookupAfterAbort(Engine):
    """Abort leaves the lookup in flight, and answers are matched by request id only."""

    def _on_abort(self, event: Abort) -> None:
        req = self.requests.get(event.request_id)
        if req is not None and req.state == "lookup_pending":
            self.lifecycle.finish(req, "aborted", "aborted", "client aborted")  # no DiscardLookup
            return
        super()._on_abort(event)

    def _on_lookup_answer(self, event: LookupAnswer) -> None:
        req = self.requests.get(event.request_id)
        if req is not None and req.state == "lookup_pending":
            event = attrs.evolve(event, epoch=req.epoch)  # whatever epoch asked
        super()._on_lookup_answer(event)


# ---- 2. a load counted done after one of two ranks ------------------------------------------
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


# ---- 3. finished_sending and finished_recving swapped ---------------------------------------
class SwappedSendRecvTransfers(Transfers):
    def job_outcome(self, job: Job, failed: Sequence[int]) -> None:
        swapped = attrs.evolve(job, kind="store" if job.kind == "load" else "load")
        super().job_outcome(swapped, failed)


class SwappedSendRecv(Engine):
    transfers_class = SwappedSendRecvTransfers


# ---- 4. a store covering placeholder tokens ----------------------------------------------------
class StoreScheduledTokens:
    """Stores what is scheduled, placeholders of in-flight steps included."""

    name = "store-scheduled"

    def store_limit(self, req: RequestView, engine: EngineView) -> Decision[int]:
        return Decision(req.computed_tokens, "store every scheduled token")


# ---- 5. a block freed while a store still reads it ---------------------------------------------
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


# ---- 6. a duplicate load of an in-flight block ----------------------------------------------------
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


# ---- 7. an abort during a load that frees the blocks early ---------------------------------------
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


# ---- 8. a failed load retried forever with its stale hit ----------------------------------------
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


# ---- 9. a duplicate rank report counted twice -----------------------------------------------------
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


@attrs.frozen
class ZooBug:
    name: str
    what: str
    invariants: tuple[int, ...]  # the first is the one a correct checker names; others also count
    stack: Callable[[], PolicyStack] = lambda: PolicyStack([])
    engine_factory: Callable[..., Engine] = Engine


ZOO: tuple[ZooBug, ...] = (
    ZooBug("stale_lookup_after_abort", "a stale lookup applied after abort", (4,),
           lambda: PolicyStack([AsyncLookups()]), StaleLookupAfterAbort),
    ZooBug("load_done_after_one_rank", "a load counted done after one of two ranks", (3, 2),
           engine_factory=_first_rank_done),
    ZooBug("send_recv_swapped", "finished_sending and finished_recving swapped", (7,),
           engine_factory=SwappedSendRecv),
    ZooBug("store_covers_placeholders", "a store covering placeholder tokens", (5,),
           lambda: PolicyStack([StoreScheduledTokens()])),
    ZooBug("free_under_store", "a block freed while a store still reads it", (2,),
           engine_factory=StoreTakesNoReference),
    ZooBug("duplicate_inflight_load", "a duplicate load of an in-flight block", (6,),
           lambda: PolicyStack([ShareLoads()]), ForgetsInFlightLoads),
    ZooBug("abort_frees_loading_blocks", "an abort during a load that frees the blocks early", (2,),
           engine_factory=AbortCancelsLoad),
    ZooBug("failed_load_retried_forever", "a failed load retried forever with its stale hit", (4, 7),
           engine_factory=KeepsFailedBlocks),
    ZooBug("duplicate_report_counted_twice", "a duplicate rank report counted twice", (3, 2),
           engine_factory=_with_ranks(CountsDuplicateReports)),
)

__all__ = ["ZOO", "ZooBug"]
