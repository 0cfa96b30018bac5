"""Per-rank transfer reports folded into one outcome per job (invariant 3).

A job runs on every tensor-parallel rank. It is done only when each expected rank has
reported it exactly once; the failed blocks are the union over ranks and come out
together with the completion. A duplicate or unknown report is a finding, not a crash.
"""

from __future__ import annotations

import enum

import attrs

BlockHash = int


class ReportStatus(enum.Enum):
    PENDING = "pending"  # recorded; other ranks still owe their report
    DONE = "done"  # this report was the last one owed
    DUPLICATE = "duplicate"  # this rank had already reported this job
    UNKNOWN_JOB = "unknown_job"  # no such job in flight (finished long ago, or never)
    BAD_RANK = "bad_rank"  # rank outside 0..world_size-1


@attrs.define(slots=True)
class _Pending:
    reported: list[bool]
    failed: set[BlockHash]
    remaining: int


@attrs.frozen
class ReportOutcome:
    status: ReportStatus
    failed: tuple[BlockHash, ...] = ()  # union over ranks, sorted; set when DONE


class RankAggregator:
    def __init__(self, world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self._jobs: dict[int, _Pending] = {}

    def open(self, job_id: int) -> None:
        if job_id in self._jobs:
            raise AssertionError(f"job {job_id} opened twice")
        self._jobs[job_id] = _Pending([False] * self.world_size, set(), self.world_size)

    def in_flight(self, job_id: int) -> bool:
        return job_id in self._jobs

    def close(self, job_id: int) -> None:
        """Stop waiting for a job's reports (reclaimed at its deadline): a later report
        for it is UNKNOWN_JOB here; the engine records it as late."""
        self._jobs.pop(job_id, None)

    def missing_ranks(self, job_id: int) -> tuple[int, ...]:
        pending = self._jobs[job_id]
        return tuple(r for r, done in enumerate(pending.reported) if not done)

    def report(self, job_id: int, rank: int, failed: tuple[BlockHash, ...]) -> ReportOutcome:
        pending = self._jobs.get(job_id)
        if pending is None:
            return ReportOutcome(ReportStatus.UNKNOWN_JOB)
        if not 0 <= rank < self.world_size:
            return ReportOutcome(ReportStatus.BAD_RANK)
        if pending.reported[rank]:
            return ReportOutcome(ReportStatus.DUPLICATE)
        pending.reported[rank] = True
        pending.failed.update(failed)
        pending.remaining -= 1
        if pending.remaining:
            return ReportOutcome(ReportStatus.PENDING)
        del self._jobs[job_id]
        return ReportOutcome(ReportStatus.DONE, tuple(sorted(pending.failed)))
