"""Invariant 2: no device block is freed or reused under a transfer in flight.

Transfer jobs hold no device block reference (vLLM's connector cannot hold one either):
the blocks under a transfer are kept safe by the lifecycle. So, from the jobs' moves (a
load or join writes its target blocks; a store reads its blocks; a join reads its owner's
block once the owner landed), the frees and the steps' block tables:

- no block a load or a join still moves is freed (a load given up at its deadline keeps
  its blocks: quarantined until its late report or its reclaim), written or read by a
  step, or written by another transfer; a transfer given up at its deadline still writes
  its blocks (a silent rank may be copying), but what it reads no longer matters (a
  given-up store's copy is not kept, a given-up join's blocks are not trusted);
- a block a store still reads is freed only by a preemption that flushes the store (the
  step planned in the same pass names it in ``flush``: the workers finish it before that
  step writes anything), and written only by that step or a later one; a step flushes only
  stores in flight (not given up) of requests that pass preempted, each once;
- a job is reclaimed only at its reclaim deadline (before it, its ranks may still move its
  blocks);
- live, under async scheduling with a connector (vLLM's defer_block_free): no block is
  freed while a step in flight writes it (a load into a reused block is not ordered
  against that write).
"""

from __future__ import annotations

from typing import Any

from kvlife.specs.observers.base import Context, Event, Observer, missing_ranks
from kvlife.specs.observers.picture import Job, Move

_Use = tuple[Job, str]  # (job, "read" | "write")


class Blocks(Observer):
    invariants = (2,)

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.busy: dict[int, list[_Use]] = {}  # device block -> the open jobs that move it
        # A free or write under a store not (yet) flushed: (line, block, store job, what),
        # resolved by a flush in the pass's step, a finding at the end of the handling.
        self.pending: list[tuple[int | None, int, Job, str]] = []
        self.writes: dict[int, set[int]] = {}  # step in flight -> the device blocks it writes
        self.preempted: set[str] = set()  # requests preempted in this handling

    # ---- jobs -----------------------------------------------------------------------------
    def on_job(self, ev: Event) -> None:
        job = ev.job
        if job is None or job.kind == "prefetch" or job.moves is None:
            return
        for move in job.moves:
            role = "read" if job.kind == "store" else "write"
            assert move.device is not None
            self._use(job, move.device, role)
            if job.after is not None:
                source = self._source(job, move)
                if source is not None:
                    self._use(job, source, "read", owner=job.after)

    def on_start_load(self, ev: Event) -> None:
        """Live: a join whose command names no load to follow reads its source at once."""
        job = ev.job
        if job is None or job.after is not None or job.moves is None or not job.open:
            return
        for move in job.moves:
            if move.tier == "device" and move.slot is not None:
                self._use(job, move.slot, "read")

    def _source(self, job: Job, move: Move) -> int | None:
        """The owner's device block a join copies ``move``'s block from."""
        owner = self.picture.jobs.get(job.after) if job.after is not None else None
        found = [m.device for m in owner.moves or () if m.block_hash == move.block_hash] if owner else []
        return found[0] if found else move.slot

    def _use(self, job: Job, block: int, role: str, owner: int | None = None) -> None:
        for other, other_role in self.busy.get(block, ()):
            if other is job or other.job_id == owner or not other.open or (other_role == "read" and other.timed_out):
                continue
            if role == "read" and other_role == "read":
                continue
            if other.kind == "store" and other_role == "read" and role == "write":
                if other.flushed_in is None:
                    self.pending.append((self.ctx.line, block, other,
                                         f"{job.kind} job {job.job_id} writes device block {block}"))
                continue
            self.fail(2, f"{job.kind} job {job.job_id} uses device block {block} while {other.kind} job "
                         f"{other.job_id} still moves it")
        self.busy.setdefault(block, []).append((job, role))

    def on_job_complete(self, ev: Event) -> None:
        assert ev.job is not None
        self._release(ev.job)

    def on_reclaim(self, ev: Event) -> None:
        job = ev.job
        if job is None or not job.open:
            return
        deadline, t = self.settings.reclaim_deadline_ms, self.ctx.t
        if deadline is not None and job.t is not None and t is not None and t < job.t + deadline:
            self.fail(2, f"{job.kind} job {job.job_id} reclaimed at t={t:g}, before its deadline "
                         f"t={job.t + deadline:g}: ranks {missing_ranks(self.settings.ranks, job.reported)} may still "
                         f"be moving its blocks")
        self._release(job)

    def _release(self, job: Job) -> None:
        for move in job.moves or ():
            for block in (move.device, move.slot, self._source(job, move) if job.after is not None else None):
                uses = self.busy.get(block) if block is not None else None
                if uses:
                    uses[:] = [use for use in uses if use[0] is not job]
                    if not uses:
                        del self.busy[block]  # type: ignore[arg-type]

    # ---- frees and steps ------------------------------------------------------------------
    def on_free(self, ev: Event) -> None:
        blocks = ev.get("blocks") or []
        if self.writes:
            for step_id, written in self.writes.items():
                if not written.isdisjoint(blocks):
                    self.fail(2, f"device blocks {sorted(written.intersection(blocks))} freed while step {step_id}, "
                                 f"which no output has ended yet, still writes them (async scheduling with a "
                                 f"connector frees them at that output)")
                    break
        for block in blocks:
            for job, role in self.busy.get(block, ()):
                if not job.open or (role == "read" and job.timed_out):
                    continue
                if job.kind == "store" and role == "read":
                    if job.flushed_in is None:
                        self.pending.append((self.ctx.line, block, job, f"device block {block} freed"))
                    continue
                self.fail(2, f"device block {block} freed while {job.kind} job {job.job_id} still moves it (ranks "
                             f"{missing_ranks(self.settings.ranks, job.reported)} have not reported)")

    def on_transition(self, ev: Event) -> None:
        if ev.get("trigger") == "preempted" and ev.req is not None:
            self.preempted.add(ev.req.rid)

    def _flushes(self, step: Any) -> None:
        for job_id in step.flush:
            job = self.picture.job(job_id)
            problem = "an unknown job" if job is None else self._unflushable(job, step.step_id)
            if problem is not None:
                self.fail(2, f"step {step.step_id} flushes {problem}: a step flushes only the stores in flight of the "
                             f"requests its pass preempted")
                return

    def _unflushable(self, job: Job, step_id: int) -> str | None:
        """Why ``job`` may not be flushed by step ``step_id`` (None: it may)."""
        if job.kind != "store":
            why = "not a store"
        elif not job.open:
            why = "ended"
        elif job.timed_out:
            why = "given up"
        elif job.flushed_in not in (None, step_id):
            why = f"flushed by step {job.flushed_in} already"
        elif job.rid not in self.preempted:
            why = "whose request this pass did not preempt"
        else:
            return None
        return f"{job.kind} job {job.job_id} of {job.rid}, {why}"

    def on_plan(self, ev: Event) -> None:
        step = ev.data
        assert step is not None
        if step.flush:
            self._flushes(step)
        if self.pending:
            flushed = set(step.flush)
            self.pending = [p for p in self.pending if p[2].job_id not in flushed and p[2].open]
        if not step.complete:
            return
        written: set[int] = set()
        for entry in step.entries:
            table = entry.table or ()
            first, last = entry.before // self.bt, (entry.before + entry.n - 1) // self.bt
            written.update(table[first:last + 1])
            if self.busy and not self.busy.keys().isdisjoint(table):
                self._step_uses(step.step_id, step.flush, entry.rid, table, first, last)
        if self.settings.deferred_frees and written:
            self.writes[step.step_id] = written

    def _step_uses(self, step_id: int, flush: tuple[int, ...], rid: str, table: tuple[int, ...], first: int,
                   last: int) -> None:
        for i, block in enumerate(table):
            writes = first <= i <= last
            for job, role in self.busy.get(block, ()):
                if not job.open or (role == "read" and (not writes or job.timed_out)):
                    continue
                if job.kind == "store" and (job.flushed_in is not None or job.job_id in flush):
                    continue  # the workers finish a flushed store before this step writes anything
                self.fail(2, f"step {step_id}: {rid} {'writes' if writes else 'reads'} device block {block} while "
                             f"{job.kind} job {job.job_id} still moves it")

    def on_output(self, ev: Event) -> None:
        step_id = ev.data.step_id
        for done in [s for s in self.writes if s <= step_id]:
            del self.writes[done]

    def on_end(self, ev: Event) -> None:
        self.preempted = set()
        pending, self.pending = self.pending, []
        if self.picture.cut is not None:
            return
        for line, _block, job, what in pending:
            if job.open:
                self.fail(2, f"{what} while store job {job.job_id} still moves it (ranks "
                             f"{missing_ranks(self.settings.ranks, job.reported)} have not reported) and no step "
                             f"planned in this pass flushes it", line)
