"""What the records of a kvlife trace add up to: nothing missing, nothing repeated.

``kvlife validate`` checks every record against the spec and the invariants through the
observer of ``kvlife.specs.invariants``; that observer follows requests and jobs. This
module checks what it does not follow, from the records alone, with rules that hold for
every trace the engine writes (so a finding is never a false alarm on a real run):

* **Inputs and the records they must cause.** An arrival of a request that already
  arrived is warned ``duplicate_arrival``; a lookup answer is applied (``lookup_answered``)
  or recorded ``stale_lookup``; an abort finishes its request (``aborted``) or is warned
  ``abort_ignored``; the output of a step not in flight is warned ``unknown_step``.
* **Steps.** Step ids count up from 0, one ``step`` record each, planned only by a tick;
  a run that ended (no ``interrupted`` record, no stall) delivered every step's output.
* **Decisions** are recorded only when a request's answer at a hook changes: the same
  answer twice in a row is a repeated record.
* **Device blocks** (invariant 8). A block is freed only while something holds it: a
  second ``free`` of it with no record in between that could take it (a transition, a
  step, a job) is a repeated record; at the end of a run every block a job moved was
  freed after it, unless a job that never ended still holds it (quarantined); a load fills
  only a free block, and a block holds one block hash until it is freed, so a job that
  moves a block another job moved, no free in between, loads nothing into it and stores
  the same hash from it.
* **Tier slots** (invariant 8). Each tier holds at most its ``capacity_blocks``: the
  blocks stores and prefetches surely put there, less what ``evict`` records (and failed
  or given-up jobs) took out, never exceed it; an ``evict`` names only blocks the tier
  holds. A disk tier's blocks recovered from an earlier run are in the header.
* **Requests.** As many requests arrive as the header's ``workload.requests`` (with an
  ``interrupted`` record: those that arrived plus ``not_arrived``).

Traces recorded from another connector (a header ``source`` of ``vllm:...``) follow their
own driver's rules and are not held to these.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeGuard

from kvlife.specs.invariants import Violation

# Records that may take a device block (allocation, a prefix-cache hit, a job's pin): a
# block freed before one of them may be freed again after it.
_MAY_TAKE_BLOCKS = frozenset({"transition", "step", "job"})


def _int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


class TraceStructure:
    """Feed every record after the header (``feed``), then ``finish``; ``findings`` holds
    what does not add up, each with its line."""

    def __init__(self, tiers: dict[str, int], expected_requests: int | None,
                 recovered: dict[str, list[int]] | None = None) -> None:
        self.capacity = dict(tiers)  # tier -> capacity_blocks
        self.expected_requests = expected_requests
        self.findings: list[Violation] = []
        self.notes: list[str] = []
        self._line: int | None = None
        self._t: float | None = None
        # The handling in progress: its input record, and what it recorded so far.
        self._input: dict[str, Any] | None = None
        self._input_line: int | None = None
        self._input_first = False  # an arrival of a request id not seen before
        self._seen: list[dict[str, Any]] = []
        self._arrived: set[str] = set()
        self._next_step = 0
        self._planned: set[int] = set()  # steps planned whose output has not come
        self._decisions: dict[tuple[str, str], tuple[Any, Any, Any]] = {}
        self._freed: set[int] = set()  # blocks freed since the last record that may take one
        # device block -> (the last job that moved it, the block hash it held), until freed
        self._moved: dict[int, tuple[int, int]] = {}
        self._jobs: dict[int, dict[str, Any]] = {}  # job id -> its record, until it ends
        self._sure: dict[str, set[int]] = {name: set() for name in self.capacity}
        self._maybe: dict[str, set[int]] = {name: set() for name in self.capacity}
        for tier, hashes in (recovered or {}).items():
            if tier in self._sure:
                self._sure[tier].update(hashes)
        self.cut: dict[str, Any] | None = None
        self.stalled = False
        self.skipped: set[int] = set()  # invariants the records did not allow checking

    def _fail(self, invariant: int, message: str, line: int | None = None) -> None:
        self.findings.append(Violation(invariant, message, line if line is not None else self._line, self._t))

    # ---- records ---------------------------------------------------------------------------
    def feed(self, record: dict[str, Any], line: int) -> None:
        if self.cut is not None:
            return  # nothing may follow the cut (the observer reports each record after it)
        kind = record.get("kind")
        self._line = line
        t = record.get("t")
        if isinstance(t, (int, float)) and not isinstance(t, bool):
            self._t = float(t)
        if kind == "input":
            self._close_handling()
            self._input, self._input_line, self._seen = record, line, []
            rid = record.get("request_id")
            self._input_first = False
            if record.get("type") == "arrival" and isinstance(rid, str) and rid not in self._arrived:
                self._input_first = True
                self._arrived.add(rid)
            return
        if kind == "interrupted":
            self._close_handling()
            self.cut = record
            return
        self._seen.append(record)
        if kind in _MAY_TAKE_BLOCKS:
            self._freed.clear()
        if kind == "step":
            self._on_step(record)
        elif kind == "decision":
            self._on_decision(record)
        elif kind == "free":
            self._on_free(record.get("blocks"))
        elif kind == "job":
            self._on_job(record)
        elif kind == "job_done":
            self._on_job_done(record)
        elif kind == "reclaim":
            self._forget_job(record.get("job"), doubtful=True)
        elif kind == "abandon":
            job = self._jobs.get(record["job"]) if _int(record.get("job")) else None
            if job is not None:
                self._doubt(job)
        elif kind == "evict":
            self._on_evict(record)
        elif kind == "warning" and record.get("what") == "stalled":
            self.stalled = True

    def _close_handling(self) -> None:
        """The records an input must cause, once its handling is complete."""
        event, seen = self._input, self._seen
        self._input = None
        if event is None:
            return
        kind = event.get("type")
        line = self._input_line

        def has(record_kind: str, **fields: Any) -> bool:
            return any(r.get("kind") == record_kind and all(r.get(k) == v for k, v in fields.items()) for r in seen)

        if kind == "arrival" and not self._input_first:
            rid = event.get("request_id")
            if not has("warning", what="duplicate_arrival", req=rid):
                self._fail(0, f"a second arrival of {rid} without a duplicate_arrival warning (the engine warns "
                              f"and ignores it): a repeated input record", line)
        elif kind == "lookup_answer":
            rid = event.get("request_id")
            if not (has("stale_lookup", req=rid) or has("transition", req=rid, trigger="lookup_answered")):
                self._fail(0, f"the lookup answer for {rid} was neither applied (lookup_answered) nor recorded "
                              f"stale (stale_lookup): a repeated input, or its records are missing", line)
        elif kind == "abort":
            rid = event.get("request_id")
            if not (has("warning", what="abort_ignored", req=rid) or has("transition", req=rid, trigger="aborted")):
                self._fail(0, f"the abort of {rid} neither finished it (aborted) nor was warned abort_ignored: "
                              f"a repeated input, or its records are missing", line)
        elif kind == "step_output":
            step = event.get("step_id")
            if not _int(step):
                return  # the input's own check reports the field
            if step in self._planned:
                self._planned.discard(step)
            elif not has("warning", what="unknown_step", step=step):
                self._fail(0, f"the output of step {step}, which is not in flight (never planned, or its output "
                              f"came already), without an unknown_step warning: a repeated input, or a step record "
                              f"is missing", line)

    def _on_step(self, record: dict[str, Any]) -> None:
        step = record.get("step")
        if not _int(step):
            return  # the observer reports the shape
        if self._input is None or self._input.get("type") != "tick":
            self._fail(0, f"step {step} planned outside a tick (only a tick plans a step)")
        if step != self._next_step:
            what = (f"step {step} again: a step is planned once" if step < self._next_step
                    else f"step {step} follows step {self._next_step - 1}: step record(s) "
                         f"{self._next_step}..{step - 1} are missing")
            self._fail(0, f"{what} (step ids count up by one)")
        self._next_step = max(self._next_step, step + 1)
        self._planned.add(step)

    def _on_decision(self, record: dict[str, Any]) -> None:
        rid, point = record.get("req"), record.get("point")
        if not (isinstance(rid, str) and isinstance(point, str)):
            return
        answer = (record.get("policy"), record.get("value"), record.get("reason"))
        if self._decisions.get((rid, point)) == answer:
            self._fail(0, f"{rid}'s {point} decision repeats its previous answer ({answer[0]}: {answer[1]!r}); "
                          f"the engine records an answer only when it changes: a repeated record")
        self._decisions[(rid, point)] = answer

    # ---- device blocks -------------------------------------------------------------------------
    def _on_free(self, blocks: Any) -> None:
        if not isinstance(blocks, list):
            return  # the observer reports the shape
        again = sorted({b for b in blocks if _int(b) and b in self._freed}
                       | {b for b in blocks if _int(b) and blocks.count(b) > 1})
        if again:
            self._fail(8, f"device block(s) {again[:10]} freed again with nothing in between that could take them "
                          f"(a transition, a step or a job): a repeated free record")
        for b in blocks:
            if _int(b):
                self._freed.add(b)
                self._moved.pop(b, None)

    def _on_job(self, record: dict[str, Any]) -> None:
        job_id, op, moves = record.get("job"), record.get("op"), record.get("moves")
        if moves is None:  # an older trace: what jobs move is unknown, so are the slots and blocks
            self.skipped.add(8)
        if not (_int(job_id) and isinstance(moves, list)):
            return
        self._jobs[job_id] = record
        for move in moves:
            if not (isinstance(move, list) and len(move) == 3 and _int(move[0])):
                return  # the observer reports the shape
            if op == "prefetch":
                self._add(move[2], move[0])
            else:
                held = self._moved.get(move[1]) if _int(move[1]) else None
                if held is not None and (op == "load" or held[1] != move[0]):
                    # A load fills a block just taken from the free ones, and a block holds
                    # one block hash until it is freed and taken again.
                    what = "loads into" if op == "load" else f"stores block {move[0]} from"
                    self._fail(8, f"{op} job {job_id} {what} device block {move[1]}, which job {held[0]} moved "
                                  f"(holding block {held[1]}) and no free record has released since: a free "
                                  f"record is missing")
                if _int(move[1]):
                    self._moved[move[1]] = (job_id, move[0])
                if op == "store":
                    self._add(move[2], move[0])
        for tier in {m[2] for m in moves if op != "load" and isinstance(m[2], str)}:
            count = len(self._sure.get(tier, ()))
            cap = self.capacity.get(tier)
            if cap is not None and count > cap:
                self._fail(8, f"{op} job {job_id} puts the {tier} tier at {count} blocks at least, over its "
                              f"capacity of {cap}: an evict record is missing")

    def _add(self, tier: Any, block: int) -> None:
        if isinstance(tier, str) and tier in self._sure:
            self._sure[tier].add(block)

    def _on_job_done(self, record: dict[str, Any]) -> None:
        job_id = record.get("job")
        failed, late = record.get("failed"), record.get("late")
        doubtful = bool(failed) or late is True or record.get("abandoned") is True
        self._forget_job(job_id, doubtful)

    def _forget_job(self, job_id: Any, doubtful: bool) -> None:
        """A job ended (done or reclaimed): when some of what it moved may have been
        dropped from its tiers (failed blocks, a given-up store, an abandoned prefetch), its
        blocks there are no longer sure."""
        job = self._jobs.pop(job_id, None) if _int(job_id) else None
        if job is not None and doubtful:
            self._doubt(job)

    def _doubt(self, job: dict[str, Any]) -> None:
        for move in job.get("moves") or ():
            if not isinstance(move, list) or len(move) < 3:
                continue  # a malformed move: the job record's own finding (invariant 0)
            for tier in (move[1], move[2]) if job.get("op") == "prefetch" else (move[2],):
                if isinstance(tier, str) and tier in self._sure and _int(move[0]) and move[0] in self._sure[tier]:
                    self._sure[tier].discard(move[0])
                    self._maybe[tier].add(move[0])

    def _on_evict(self, record: dict[str, Any]) -> None:
        tier, blocks = record.get("tier"), record.get("blocks")
        if not (isinstance(tier, str) and tier in self._sure and isinstance(blocks, list)):
            return
        sure, maybe = self._sure[tier], self._maybe[tier]
        absent = [b for b in blocks if _int(b) and b not in sure and b not in maybe]
        if absent:
            self._fail(8, f"the {tier} tier evicts block(s) {absent[:10]}, which it does not hold (never stored "
                          f"there, or evicted already): a repeated evict record")
        for b in blocks:
            if _int(b):
                sure.discard(b)
                maybe.discard(b)

    # ---- the end ---------------------------------------------------------------------------------
    def finish(self, complete: bool) -> None:
        """``complete``: the trace did not end in a truncated line."""
        self._close_handling()
        self._line = None
        if not complete:
            return
        cut = self.cut
        if cut is not None:
            not_arrived = cut.get("not_arrived")
            if (self.expected_requests is not None and cut.get("clean") is True and _int(not_arrived)
                    and len(self._arrived) + not_arrived != self.expected_requests):
                self._fail(0, f"the header announces {self.expected_requests:,} requests; {len(self._arrived):,} "
                              f"arrived and the interrupted record counts {not_arrived:,} not arrived: arrival "
                              f"records are missing or repeated")
            return
        if self.stalled:
            self.notes.append("the live stall watchdog stopped the run: its steps in flight and the requests that "
                              "never arrived are not held to the end-of-run checks")
            return
        if self.expected_requests is not None and len(self._arrived) != self.expected_requests:
            self._fail(0, f"the header announces {self.expected_requests:,} requests, {len(self._arrived):,} arrived "
                          f"and the trace has no interrupted record (the run ended): arrival records are missing")
        if self._planned:
            missing = sorted(self._planned)
            self._fail(0, f"step(s) {missing[:10]} never got their output, and the run ended (no interrupted "
                          f"record): step_output records are missing")
        if 8 in self.skipped:
            return
        held_by_open_jobs = self._blocks_of(self._jobs.values())
        never_freed = sorted(b for b in self._moved if b not in held_by_open_jobs)
        if never_freed:
            self._fail(8, f"device block(s) {never_freed[:10]} (moved by job {self._moved[never_freed[0]][0]}) were "
                          f"never freed after it, and no job still holds them: a free record is missing")

    @staticmethod
    def _blocks_of(jobs: Iterable[dict[str, Any]]) -> set[int]:
        return {m[1] for job in jobs if job.get("op") != "prefetch" for m in job.get("moves") or ()
                if isinstance(m, list) and len(m) == 3 and _int(m[1])}
