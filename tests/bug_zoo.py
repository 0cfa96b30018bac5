"""The bug zoo: deliberately broken variants of the engine, its rank aggregation and its
policies, each a bug that keeps coming back in KV connectors. The model checker must
catch every one of them within its default budget (tests/test_bug_zoo.py).

Variants never edit the real code: they subclass ``Engine`` and override private
methods, swap a broken ``RankAggregator`` into ``engine.ranks``, or put a broken policy
on the stack.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs

from kvlife.lifecycle.config import EngineConfig
from kvlife.lifecycle.engine.core import Engine, Job, Recorder
from kvlife.lifecycle.engine.events import Abort, LookupAnswer
from kvlife.lifecycle.engine.ranks import RankAggregator, ReportOutcome, ReportStatus
from kvlife.policies.base import Decision, EngineView, RequestView
from kvlife.policies.stack import PolicyStack
from kvlife.specs.model_check import AsyncLookups, ShareLoads
from kvlife.transfer.index import TierIndex


@contextlib.contextmanager
def _no_block_releases(engine: Engine) -> Iterator[None]:
    """Inside, releasing device blocks does nothing (for jobs whose references are gone)."""
    engine.pool.release = lambda blocks: []  # type: ignore[method-assign]
    try:
        yield
    finally:
        del engine.pool.release


# ---- 1. a stale lookup applied after abort -------------------------------------------------
class StaleLookupAfterAbort(Engine):
    """Abort leaves the lookup in flight, and answers are matched by request id only."""

    def _on_abort(self, event: Abort) -> None:
        req = self.requests.get(event.request_id)
        if req is not None and req.state == "lookup_pending":
            self._finish(req, "aborted", "aborted", "client aborted")  # no DiscardLookup
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
    engine.ranks = FirstRankDone(config.ranks, engine.jobs)
    return engine


# ---- 3. finished_sending and finished_recving swapped ---------------------------------------
class SwappedSendRecv(Engine):
    def _job_outcome(self, job: Job, failed: Sequence[int]) -> None:
        swapped = attrs.evolve(job, kind="store" if job.kind == "load" else "load")
        super()._job_outcome(swapped, failed)


# ---- 4. a store covering placeholder tokens ----------------------------------------------------
class StoreScheduledTokens:
    """Stores what is scheduled, placeholders of in-flight steps included."""

    name = "store-scheduled"

    def store_limit(self, req: RequestView, engine: EngineView) -> Decision[int]:
        return Decision(req.computed_tokens, "store every scheduled token")


# ---- 5. a block freed while a store still reads it ---------------------------------------------
class StoreTakesNoReference(Engine):
    def _maybe_store(self, req: Any) -> None:
        self.pool.retain = lambda blocks: None  # type: ignore[method-assign]
        try:
            super()._maybe_store(req)
        finally:
            del self.pool.retain

    def _release_job(self, job: Job, failed: Sequence[int]) -> None:
        if job.kind != "store":
            super()._release_job(job, failed)
            return
        with _no_block_releases(self):  # the reference it never took is not given back
            super()._release_job(job, failed)


# ---- 6. a duplicate load of an in-flight block ----------------------------------------------------
class ForgetsInFlightLoads(Engine):
    """Never publishes its loads as in flight, so nobody can join them."""

    def _start_load(self, req: Any, moves: list[Any]) -> None:
        before = set(self.in_flight_loads)
        super()._start_load(req, moves)
        for block_hash in sorted(set(self.in_flight_loads) - before):
            del self.in_flight_loads[block_hash]


# ---- 7. an abort during a load that frees the blocks early ---------------------------------------
class AbortCancelsLoad(Engine):
    """Abort 'cancels' the request's loads by dropping their block references at once."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cancelled: set[int] = set()

    def _on_abort(self, event: Abort) -> None:
        req = self.requests.get(event.request_id)
        if req is not None and req.state == "loading":
            for job_id in req.load_jobs:
                job = self.jobs.get(job_id)
                if job is not None and job.request_id == req.request_id and job_id not in self.cancelled:
                    self.cancelled.add(job_id)
                    self.pool.release(m.device_block for m in job.moves)
        super()._on_abort(event)

    def _release_job(self, job: Job, failed: Sequence[int]) -> None:
        if job.job_id not in self.cancelled:
            super()._release_job(job, failed)
            return
        with _no_block_releases(self):  # already dropped at the abort
            super()._release_job(job, failed)


# ---- 8. a failed load retried forever with its stale hit ----------------------------------------
class KeepsFailedBlocks(Engine):
    """A failed block stays in its tier, so the next lookup hits it again, and again."""

    def _release_job(self, job: Job, failed: Sequence[int]) -> None:
        tiers = list(self.tiers.values())
        for tier in tiers:
            tier.discard = lambda blocks: []  # type: ignore[method-assign]
        try:
            super()._release_job(job, failed)
        finally:
            for tier in tiers:
                del tier.discard


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
        engine.ranks = aggregator(config.ranks)
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
