"""The workers the model checker plays: which report each rank still owes, for every job.

A job comes to the workers with a step's commands (``StartLoad``, ``StartStore``,
``StartPrefetch``); each rank reports it once. The adversary picks which report comes
when, within the protocol's rules, and this book keeps them:

- a join (``StartLoad.after``) copies what its owner load brings: a rank reports it only
  once that rank reported the owner, with the owner's failed blocks among its own (as the
  simulator does); a rank that went silent on the owner is silent on its joins too;
- a store flushed by a preemption (``StepPlan.flush``) is finished by the workers before
  that step writes anything: every rank still owing it reports it no later than the
  step's output (a silent rank too: a worker that runs the step has flushed it);
- a rank may go silent on a job (its report lost): only a deadline ends the job then, and
  the report may still come, late.
"""

from __future__ import annotations

from typing import Any

import attrs

Report = tuple[int, int, tuple[int, ...]]  # (job, rank, failed block hashes)


@attrs.define(slots=True, eq=False)
class Owed:
    command: Any  # StartLoad | StartStore | StartPrefetch
    ranks: list[int]  # the ranks that still owe a report
    flushed_in: int | None = None  # a flushed store: the step whose output it must come with


class WorkerModel:
    def __init__(self, ranks: int) -> None:
        self.world = ranks
        self.owed: dict[int, Owed] = {}
        self.silent: list[tuple[int, int]] = []  # (job, rank) whose report was lost
        self.sent: list[tuple[int, int]] = []  # every (job, rank) reported, for duplicates
        self.owner_reports: dict[int, dict[int, tuple[int, ...]]] = {}  # load -> rank -> failed
        self.corrupt: set[tuple[str, int]] = set()  # (tier, hash) copies that fail every read
        self.kinds: dict[int, str] = {}  # job -> "load" | "store" | "prefetch"
        self.commands: dict[int, Any] = {}

    # ---- jobs in ---------------------------------------------------------------------------
    def start(self, command: Any, kind: str) -> None:
        self.kinds[command.job_id] = kind
        self.commands[command.job_id] = command
        owed = self.owed[command.job_id] = Owed(command, list(range(self.world)))
        after = getattr(command, "after", None)
        if after is not None:
            for job, rank in list(self.silent):
                if job == after and rank in owed.ranks:
                    self._silence(command.job_id, rank)

    def flush(self, job_ids: tuple[int, ...], step_id: int) -> None:
        """Stores a preemption flushed: every rank reports them with ``step_id``'s output at
        the latest (a rank silent on one reports it too: a worker that runs the step has
        flushed it)."""
        for job_id in job_ids:
            revived = [r for j, r in self.silent if j == job_id]
            self.silent = [p for p in self.silent if p[0] != job_id]
            owed = self.owed.get(job_id)
            if owed is None and revived and job_id in self.commands:
                owed = self.owed[job_id] = Owed(self.commands[job_id], [])
            if owed is not None:
                owed.ranks.extend(revived)
                if owed.flushed_in is None:
                    owed.flushed_in = step_id

    # ---- what may be reported ----------------------------------------------------------------
    def reportable(self) -> list[tuple[int, int]]:
        """(job, rank) pairs whose report may come now, in job order."""
        out = []
        for job_id in sorted(self.owed):
            owed = self.owed[job_id]
            after = getattr(owed.command, "after", None)
            done = self.owner_reports.get(after, {}) if after is not None else None
            out += [(job_id, r) for r in owed.ranks if done is None or r in done]
        return out

    def jobs_of(self, kind: str) -> list[int]:
        return [j for j in self.owed if self.kinds.get(j) == kind and self.reportable_job(j)]

    def reportable_job(self, job_id: int) -> bool:
        return any(j == job_id for j, _ in self.reportable())

    def take(self, job_id: int, rank_pick: int, fail: bool) -> Report:
        """The report of one rank of ``job_id`` (picked among those that may report)."""
        ranks = [r for j, r in self.reportable() if j == job_id]
        return self.take_rank(job_id, ranks[rank_pick % len(ranks)], fail)

    def take_rank(self, job_id: int, rank: int, fail: bool) -> Report:
        owed = self.owed[job_id]
        owed.ranks.remove(rank)
        if not owed.ranks:
            del self.owed[job_id]
        failed = self._failed(owed.command, rank, fail)
        if self.kinds.get(job_id) == "load":
            self.owner_reports.setdefault(job_id, {})[rank] = failed
        self.sent.append((job_id, rank))
        self._rewritten(owed, failed)
        return (job_id, rank, failed)

    def _failed(self, command: Any, rank: int, fail: bool) -> tuple[int, ...]:
        moves = command.moves
        failed = {moves[0].block_hash} if fail and moves else set()
        after = getattr(command, "after", None)
        if after is not None:
            mine = {m.block_hash for m in moves}
            failed = set(self.owner_reports.get(after, {}).get(rank, ())) & mine
        elif self.kinds.get(command.job_id) == "load":
            failed.update(m.block_hash for m in moves if (m.tier, m.block_hash) in self.corrupt)
        elif self.kinds.get(command.job_id) == "prefetch":
            failed.update(m.block_hash for m in moves if (m.src_tier, m.block_hash) in self.corrupt)
        return tuple(sorted(failed))

    def _rewritten(self, owed: Owed, failed: tuple[int, ...]) -> None:
        """The last rank of a store or prefetch reported: what it wrote is sound again."""
        if owed.ranks or owed.command is None:
            return
        kind = self.kinds.get(owed.command.job_id)
        for m in owed.command.moves if kind in ("store", "prefetch") else ():
            if m.block_hash not in failed:
                self.corrupt.discard((m.dst_tier if kind == "prefetch" else m.tier, m.block_hash))

    def due_with(self, step_id: int) -> list[tuple[int, int]]:
        """The reports that must come with the output of ``step_id`` (flushed stores)."""
        return [(job_id, r) for job_id, owed in sorted(self.owed.items())
                if owed.flushed_in is not None and owed.flushed_in <= step_id for r in owed.ranks]

    # ---- silence -------------------------------------------------------------------------------
    def silenceable(self) -> list[int]:
        """Jobs a rank may go silent on (not a flushed store: the step that flushes it ends it)."""
        return sorted(j for j, owed in self.owed.items() if owed.flushed_in is None and owed.ranks)

    def silence(self, job_id: int, rank_pick: int) -> int:
        owed = self.owed[job_id]
        rank = owed.ranks[rank_pick % len(owed.ranks)]
        self._silence(job_id, rank)
        for other, joined in list(self.owed.items()):  # its joins cannot copy what never landed
            if getattr(joined.command, "after", None) == job_id and rank in joined.ranks:
                self._silence(other, rank)
        return rank

    def _silence(self, job_id: int, rank: int) -> None:
        owed = self.owed[job_id]
        owed.ranks.remove(rank)
        if not owed.ranks:
            del self.owed[job_id]
        self.silent.append((job_id, rank))

    def late(self, index: int) -> tuple[int, int]:
        """A silent rank reports after all."""
        job_id, rank = self.silent.pop(index % len(self.silent))
        self.sent.append((job_id, rank))
        if self.kinds.get(job_id) == "load":
            self.owner_reports.setdefault(job_id, {})[rank] = ()
        return job_id, rank

    def silent_open(self, open_jobs: set[int]) -> bool:
        return any(job in open_jobs for job, _ in self.silent)
