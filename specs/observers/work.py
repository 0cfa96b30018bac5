"""Invariant 12: bounded work per request.

- At most one lookup in flight: a new one only after the last was answered or discarded
  (live: the ``SubmitLookup`` commands).
- An async answer is used again only if the last ``lookup_reuse`` answer said ``keep``
  (vLLM consumes it lazily: at the next match after a use, a ``consume`` answer means a
  new lookup); a new lookup after a consumed answer only within
  ``engine.max_async_lookups`` (at the bound the answer is kept, with a ``lookup_limit``
  warning); no new lookup while a kept answer of this epoch is held.
- No load or prefetch reads a tier copy that failed to load, until a store or prefetch
  wrote it again (a stale hit: retries without bound); a request never loads its block
  past the first one whose load failed for it.
- Live: when patience runs out on a prefetch (its ``abandon`` record), its request keeps
  the hits of its answer before the first block the prefetch still has in flight, and no
  more: that block and the rest are computed (checked at the next record, before anything
  else reads the answer).
- Live: a load reads what its request's own prefetch landed from where it landed. (A
  prefetch starts at arrival, from the connector, which does not see the device's prefix
  cache, as in vLLM: a prefetch of a block the device holds is not a finding.)
"""

from __future__ import annotations

import attrs

from kvlife.specs.observers.base import Context, Event, Observer
from kvlife.specs.observers.picture import Job, Req


@attrs.define(slots=True)
class _Lookups:
    count: int = 0  # async lookups submitted over its life
    outstanding: bool = False  # live: a SubmitLookup not yet answered or discarded
    held: bool = False  # an answer of its current epoch, not consumed
    answered: bool = False  # an answer of its current epoch was applied
    warned: bool = False  # a lookup_limit warning was recorded for it
    reuse: str | None = None  # the lookup_reuse answer now, and before its last change
    reuse_before: str | None = None
    changed_at: int = -1  # the handling that changed it
    reuses: int = 0  # lookup_reuse records since its last answer
    failed_from: int | None = None  # its first block whose load failed
    landed: dict[int, str] = attrs.Factory(dict)  # blocks its prefetch of this epoch landed, and where


class Work(Observer):
    invariants = (12,)

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.of: dict[str, _Lookups] = {}
        self.bad: dict[tuple[str, int], int] = {}  # (tier, hash) -> the load job it failed in
        # After a prefetch's abandon: (its request, its job, the answer it must keep, the answer it had).
        self.cut_due: tuple[str, int, tuple[str, ...], tuple[str, ...]] | None = None

    def _of(self, rid: str) -> _Lookups:
        found = self.of.get(rid)
        if found is None:
            found = self.of[rid] = _Lookups()
        return found

    def _spent(self, mine: _Lookups, count: int) -> bool:
        bound = self.settings.max_async_lookups
        return bound is not None and count >= bound

    # ---- lookups ----------------------------------------------------------------------------
    def on_submit_lookup(self, ev: Event) -> None:
        rid = ev.data.request_id
        req, mine = self.picture.requests.get(rid), self._of(rid)
        # Fed as issued, before its transition counted it; or after the handling.
        before = mine.count - (1 if req is not None and req.state == "lookup_pending" else 0)
        if mine.outstanding:
            self.fail(12, f"lookup for {rid} (epoch {ev.data.epoch}) submitted while its previous lookup is still "
                          f"unanswered: lookups per request are unbounded")
        bound = self.settings.max_async_lookups
        if bound is not None and mine.answered and before >= bound:
            self.fail(12, f"{rid} looked up again after its answer was consumed, its lookup number {before + 1}; "
                          f"past {bound} (engine.max_async_lookups) it must keep the answer")
        if mine.held and mine.reuse == "keep" and not self._spent(mine, before):
            self.fail(12, f"{rid} looked up again although it holds an answer of this epoch and lookup_reuse said "
                          f"keep")
        mine.outstanding, mine.held = True, False

    def on_discard_lookup(self, ev: Event) -> None:
        self._of(ev.data.request_id).outstanding = False

    def on_transition(self, ev: Event) -> None:
        req, trigger = ev.req, ev.get("trigger")
        assert req is not None
        mine = self._of(req.rid)
        if trigger == "lookup_submitted":
            mine.count += 1
        elif trigger == "lookup_answered":
            mine.outstanding, mine.held, mine.answered, mine.reuses = False, True, True, 0
            mine.landed.clear()
        if ev.source == "lookup_pending" and trigger != "lookup_answered":
            mine.outstanding = False
        if trigger in ("preempted", "load_failed", "completed", "aborted", "failed", "lookup_expired",
                       "send_started", "turn_ended"):
            mine.held = mine.answered = False
            mine.reuses = 0
            mine.landed.clear()

    def on_decision(self, ev: Event) -> None:
        if ev.get("point") == "lookup_reuse" and isinstance(ev.get("value"), str):
            mine = self._of(str(ev.get("req")))
            mine.reuse_before, mine.reuse, mine.changed_at = mine.reuse, str(ev.get("value")), self.picture.handlings

    def on_warning(self, ev: Event) -> None:
        if ev.get("what") == "lookup_limit":
            self._of(str(ev.get("req"))).warned = True
        elif ev.get("what") == "rank_timeout":
            job = self.picture.job(ev.get("job"))
            if job is not None and job.kind == "load" and job.open and not job.timed_out:
                self._failed(job, [m.block_hash for m in job.moves or ()])

    def on_lookup_reuse(self, ev: Event) -> None:
        """A kept answer used again: the admission that used it before said keep (the
        answer asked in this very handling is for this use), or the request spent its lookups."""
        rid = str(ev.get("req"))
        if rid not in self.picture.requests:
            return
        mine = self._of(rid)
        mine.reuses += 1
        said = mine.reuse_before if mine.changed_at == self.picture.handlings else mine.reuse
        if self._spent(mine, mine.count):
            if said != "keep" and not mine.warned and mine.count == self.settings.max_async_lookups:
                self.fail(12, f"{rid} keeps its answer past its lookup bound ({self.settings.max_async_lookups}) "
                              f"without a lookup_limit warning")
        elif said != "keep":
            self.fail(12, f"{rid}: an async lookup answer is used again, but the admission that used it was told "
                          f"{said or 'consume'} (lookup_reuse): it should have looked up again")

    # ---- prefetch patience ----------------------------------------------------------------------
    def on_abandon(self, ev: Event) -> None:
        job, probe = ev.job, self.ctx.probe
        if job is None or probe is None:
            return
        req = self.picture.requests.get(job.rid)
        if req is None:
            return
        answer, _ = probe.lookup(req.rid)  # (the record comes before the engine cuts it)
        moving = {m.block_hash for m in job.moves or ()}
        candidates = min(len(answer), req.hit_candidates(self.bt))
        keep = next((i for i in range(candidates) if req.hash_at(i) in moving), candidates)
        self.cut_due = (req.rid, job.job_id, answer[:keep], answer)

    def on_record(self, ev: Event) -> None:
        if self.cut_due is not None and ev.get("kind") != "abandon":
            self._cut_kept()

    def on_end(self, ev: Event) -> None:
        if self.cut_due is not None:
            self._cut_kept()

    def _cut_kept(self) -> None:
        assert self.cut_due is not None and self.ctx.probe is not None
        rid, job_id, keep, answer = self.cut_due
        self.cut_due = None
        kept, _ = self.ctx.probe.lookup(rid)
        if kept != keep:
            self.fail(12, f"patience ran out on {rid}'s prefetch job {job_id}: of its answer {list(answer)} it keeps "
                          f"{list(kept)}; the hits before the first block the prefetch still has in flight, "
                          f"{list(keep)}, are kept, and no more")

    # ---- loads and prefetches -----------------------------------------------------------------
    def on_job(self, ev: Event) -> None:
        job, req = ev.job, ev.req
        if job is None or job.moves is None or job.kind == "store" or job.join:
            return
        for move in job.moves:
            bad = self.bad.get((move.tier, move.block_hash))
            if bad is not None:
                self.fail(12, f"{job.kind} job {job.job_id} reads block {move.block_hash} from {move.tier}, which "
                              f"failed to load in job {bad} and was never stored again (a stale hit: a retry without "
                              f"bound)")
            if job.kind == "load" and req is not None:
                self._own_prefetch(job, req, move.block_hash, move.tier)
                self._retry(job, req, move.block_hash)

    def _own_prefetch(self, job: Job, req: Req, block_hash: int, tier: str) -> None:
        landed = self._of(req.rid).landed.get(block_hash)
        probe = self.ctx.probe
        if landed is not None and tier != landed and probe is not None and probe.in_tier(landed, block_hash):
            self.fail(12, f"load job {job.job_id} ({req.rid}) reads block {block_hash} from {tier}, though its own "
                          f"prefetch landed it in {landed}, which holds it")

    def _retry(self, job: Job, req: Req, block_hash: int) -> None:
        position = req.position(block_hash, self.bt)
        first = self._of(req.rid).failed_from
        if position is not None and first is not None and position >= first:
            self.fail(12, f"load job {job.job_id}: {req.rid} loads its block {position} again, after its load of "
                          f"block {first} failed (retries are unbounded)")

    def on_job_complete(self, ev: Event) -> None:
        job = ev.job
        assert job is not None
        for move in job.moves or ():
            failed = move.block_hash in job.failed
            if job.kind == "load" and not job.join and failed:
                self.bad[(move.tier, move.block_hash)] = job.job_id
            elif job.kind == "store" and not failed:
                self.bad.pop((move.tier, move.block_hash), None)
            elif job.kind == "prefetch":
                self._pulled(job, move.block_hash, move.tier, str(move.dst), failed)
        if job.kind == "load" and job.failed:
            self._failed(job, sorted(job.failed))

    def _pulled(self, job: Job, block_hash: int, source: str, dst: str, failed: bool) -> None:
        self.bad.pop((dst, block_hash), None)  # the target slot was written again
        if failed:
            self.bad[(source, block_hash)] = job.job_id  # the engine drops a source copy it failed to read
            return
        wait = self.picture.prefetch_of.get(job.rid)
        req = self.picture.requests.get(job.rid)
        if req is not None and wait is not None and wait[0] is job and wait[1] == req.epoch and not job.abandoned:
            self._of(job.rid).landed[block_hash] = dst

    def _failed(self, job: Job, hashes: list[int]) -> None:
        """A load of a loading request failed: it computes from its first failed block."""
        req = self.picture.requests.get(job.rid)
        if req is None or req.state != "loading" or job.epoch != req.epoch:
            return
        mine = self._of(req.rid)
        for block_hash in hashes:
            position = req.position(block_hash, self.bt)
            if position is not None and (mine.failed_from is None or position < mine.failed_from):
                mine.failed_from = position
