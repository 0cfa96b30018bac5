"""An independent observer of invariants 1-8 (DESIGN.md, "Invariants").

The observer never asks the engine what happened: it rebuilds its own picture from the
stream a run produces — input events, trace records and, when it runs live beside the
engine, the commands ``Engine.handle`` returns — and checks that picture against the
spec. Two modes share the same code:

- from a trace (``kvlife validate``, ``from_trace=True``): records only. ``job`` records
  carry their moves, ``free`` records the device blocks whose last reference went away,
  ``step`` records the prompt chunks they compute (``prompt``) and the other chunks that
  fill a block (``fills``: generated tokens), so 1-7 are checkable: 2 as "no block
  freed or loaded into while a load/store job that moves it still owes a rank report"
  (a trace has no block tables, so a step writing into a busy block is not visible), 5
  from the chunks confirmed by step outputs plus the hit length at admission, 6 when
  ``sharing``. 8 needs the pools. A store of a block past the prompt names it by the
  derived hash (``kvlife.lifecycle.engine.blocks.derived_block_hash``); a store that
  covers a position whose token a step in flight sampled is a store of a placeholder.
- a run cut short by Ctrl-C or SIGTERM ends with an ``interrupted`` record: work open at
  the cut (jobs some rank has not reported, requests waiting on IO) is not held to 3 and
  7; everything before the cut is checked as usual, and nothing may follow the record.
- live (the model checker): records plus commands, which carry every move, every freed
  block and every step's block table; the block-level checks come from the commands (the
  same records are then ignored for them). Block/tier accounting (8) is delegated to
  ``engine.check_invariants()`` through ``accounting``.

Call ``feed_record`` for every record in order (input records open a new handling),
``feed_commands`` with what ``handle`` returned (live only), ``end_input`` after each
handling (live; in trace mode the next input record closes the previous one) and
``finish`` when inputs stop.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, TypeGuard

import attrs

from kvlife.specs.table import TABLE

IO_WAIT_STATES = ("lookup_pending", "loading", "sending")
# Triggers after which a request's older lookups are stale (its epoch moved on).
_EPOCH_BUMPS = frozenset({"preempted", "load_failed", "completed", "aborted", "failed"})

INVARIANTS: dict[int, str] = {
    0: "well-formed trace",
    1: "legal transitions; finished absorbs",
    2: "no block freed or reused under an in-flight transfer",
    3: "a job is done only after every rank reported it exactly once",
    4: "lookup answers apply only to the epoch that asked",
    5: "stores cover only computed tokens",
    6: "no two in-flight loads bring the same block (load sharing on)",
    7: "every transfer ends; nothing stranded",
    8: "block accounting",
}


@attrs.frozen
class Violation:
    invariant: int
    message: str
    line: int | None = None
    t: float | None = None

    def __str__(self) -> str:
        where = f"line {self.line}: " if self.line is not None else ""
        when = f"t={self.t:g} " if self.t is not None else ""
        return f"{where}{when}invariant {self.invariant} ({INVARIANTS.get(self.invariant, '?')}): {self.message}"


class InvariantViolation(AssertionError):
    def __init__(self, violation: Violation) -> None:
        super().__init__(str(violation))
        self.violation = violation


@attrs.frozen(slots=True)
class _Move:
    """One block of a job as a trace records it. Duck-types ``BlockMove`` (live mode);
    a prefetch moves tier to tier: no device block, ``tier`` is its source."""

    block_hash: int
    device_block: int | None
    tier: str
    dst_tier: str | None = None


@attrs.define(slots=True, eq=False)
class _Job:
    job_id: int
    kind: str  # "load" | "store" | "prefetch"
    request_id: str
    moves: tuple[Any, ...] | None = None  # BlockMove (live) or _Move (trace, prefetch); None: unknown
    timed_out: bool = False  # a rank missed the deadline: the engine gave up on its result
    reported: set[int] = attrs.Factory(set)
    failed: set[int] = attrs.Factory(set)
    complete: bool = False  # every rank reported (the observer's own count)
    done_recorded: bool = False  # the engine said job_done


@attrs.define(slots=True, eq=False)
class _Req:
    hashes: tuple[int, ...]
    request_id: str = ""
    prompt_tokens: int = 0
    state: str = "waiting"
    epoch: int = 0
    lookup_epoch: int | None = None  # epoch of the lookup in flight
    valid_tokens: int = 0  # tokens whose KV is known good (confirmed or hit)
    fresh: bool = False  # admitted; the next step entry tells the hit length
    scheduled_end: int = 0  # the furthest token a step was seen to compute
    index: dict[int, int] | None = None  # hash -> first block position (built lazily)

    def position(self, block_hash: int, block_tokens: int) -> int | None:
        """The block ``block_hash`` names in this request: a prompt block, or a block of
        generated tokens (derived hash) up to the furthest token a step computed."""
        if self.index is None:
            self.index = {}
            for i, h in enumerate(self.hashes):
                self.index.setdefault(h, i)
        found = self.index.get(block_hash)
        reach = -(-self.scheduled_end // block_tokens)
        if found is None and reach > len(self.hashes):
            from kvlife.lifecycle.engine.blocks import extend_hashes

            start = len(self.hashes)
            self.hashes = extend_hashes(self.hashes, self.request_id, reach)
            for i in range(start, reach):
                self.index.setdefault(self.hashes[i], i)
            found = self.index.get(block_hash)
        return found

    def confirm(self, end: int) -> None:
        """A step output confirmed the request's tokens up to ``end``."""
        self.valid_tokens = max(self.valid_tokens, end)

    def restart(self) -> None:
        self.valid_tokens = 0
        self.fresh = False


class InvariantObserver:
    def __init__(
        self,
        ranks: int,
        block_tokens: int,
        sharing: bool = False,
        accounting: Callable[[], None] | None = None,
        from_trace: bool = False,
    ) -> None:
        self.ranks = ranks
        self.block_tokens = block_tokens
        self.sharing = sharing
        self.accounting = accounting
        # Block-level facts (moves, freed blocks, step chunks) from records instead of commands.
        self.from_trace = from_trace
        # Invariant 5 needs every step's prompt chunks; a trace without them cannot tell.
        self.chunks_known = not from_trace
        self._chunks_missing = False
        self.unchecked: list[str] = []  # what the records did not allow to check
        self.skipped: set[int] = set()  # invariants not (fully) checked for lack of records
        self.violations: list[Violation] = []
        self.cut: dict[str, Any] | None = None  # the interrupted record, once seen
        self.requests: dict[str, _Req] = {}
        self.jobs: dict[int, _Job] = {}
        self.lines = 0
        # Current handling.
        self._input: Any = None
        self._line: int | None = None
        self._t: float | None = None
        self._completed_now: list[_Job] = []
        self._discard_due: list[tuple[str, int]] = []
        # Block level: from the commands (live) or the records (trace).
        # Steps without an output yet, in plan order: (request, epoch, computed before, tokens).
        self._steps: dict[int, list[tuple[str, int, int, int]]] = {}
        self._step_order: deque[int] = deque()
        self._busy_blocks: dict[int, list[_Job]] = {}  # device block -> in-flight jobs
        self._loading_hashes: dict[int, list[_Job]] = {}  # hash -> in-flight load jobs
        self._bad_in_tier: dict[tuple[str, int], int] = {}  # (tier, hash) -> failed load job

    # ---- reporting -----------------------------------------------------------------------
    def _fail(self, invariant: int, message: str) -> None:
        self.violations.append(Violation(invariant, message, self._line, self._t))

    # ---- records ---------------------------------------------------------------------------
    def feed_record(self, record: dict[str, Any], line: int | None = None) -> None:
        kind = record.get("kind")
        self.lines += 1
        if self.cut is not None:
            self._line = line if line is not None else self._line
            self._fail(0, f"{kind} record after the interrupted record: the run had ended")
            return
        if kind == "interrupted":
            self._line = line if line is not None else self._line
            self._on_interrupted(record)
            return
        if kind == "input":
            self.end_input()
            self._line = line
            self._on_input(record)
            return
        self._line = line if line is not None else self._line
        t = record.get("t")
        if isinstance(t, (int, float)) and not isinstance(t, bool):
            self._t = float(t)
        if kind == "transition":
            self._on_transition(record)
        elif kind == "job":
            self._on_job(record)
        elif kind == "job_done":
            self._on_job_done(record)
        elif kind == "stale_lookup" and not self._input_is("lookup_answer"):
            self._fail(4, f"stale_lookup record for {record.get('req')} outside a lookup answer")
        elif kind == "warning":
            if record.get("what") == "rank_timeout":
                self._on_rank_timeout(record)
        elif not self.from_trace:
            return  # live: freed blocks and step plans come from the commands
        elif kind == "free":
            blocks = record.get("blocks")
            if not isinstance(blocks, list) or not all(_is_int(b) for b in blocks):
                self._fail(0, "free record lacks a list of device blocks")
                return
            self._on_free(blocks)
        elif kind == "step":
            self._on_step_record(record)

    def _on_interrupted(self, record: dict[str, Any]) -> None:
        signal = record.get("signal")
        if signal not in ("SIGINT", "SIGTERM"):
            self._fail(0, f"interrupted record: field 'signal' must be 'SIGINT' or 'SIGTERM', got {signal!r}")
        t = record.get("t")
        if not isinstance(t, (int, float)) or isinstance(t, bool):
            self._fail(0, f"interrupted record: field 't' must be a number, got {t!r}")
        self.cut = record

    def _note(self, what: str, *invariants: int) -> None:
        self.skipped.update(invariants)
        if what not in self.unchecked:
            self.unchecked.append(what)

    def _input_is(self, kind: str) -> bool:
        return self._input is not None and self._input.type == kind

    def _on_input(self, record: dict[str, Any]) -> None:
        from kvlife.lifecycle.engine.events import BadEvent, input_from_record

        # Live records still hold tuples; the trace format (and the parser) has lists.
        record = {k: list(v) if isinstance(v, tuple) else v for k, v in record.items()}
        try:
            event = input_from_record(record)
        except BadEvent as exc:
            self._input = None
            self._fail(0, f"bad input record: {exc}")
            return
        self._input = event
        self._t = float(event.t)
        self._on_event(event)

    def feed_input(self, event: Any) -> None:
        """Live mode: the engine records the input itself, so this is only for drivers
        that run without a recorder."""
        self.end_input()
        self._input = event
        self._t = float(event.t)
        self._on_event(event)

    def _on_event(self, event: Any) -> None:
        kind = event.type
        if kind == "arrival":
            if event.request_id not in self.requests:
                full = event.prompt_tokens // self.block_tokens
                self.requests[event.request_id] = _Req(tuple(event.block_hashes[:full]), event.request_id,
                                                       event.prompt_tokens)
        elif kind == "transfer_report":
            job = self.jobs.get(event.job_id)
            if job is None or job.complete or not 0 <= event.rank < self.ranks:
                return
            if event.rank in job.reported:
                return  # a duplicate: must change nothing (checked through job_done)
            job.reported.add(event.rank)
            job.failed.update(event.failed)
            if len(job.reported) == self.ranks:
                self._complete(job)
        elif kind == "step_output":
            self._confirm_steps(event.step_id)

    def _confirm_steps(self, step_id: int) -> None:
        """The device runs steps in plan order, so the output of a step vouches for every
        earlier one too (a simulated step that pays sync lookups reports after the next
        one, and a trace does not list decode entries). Tokens count only if the request
        is still running in the epoch they were computed for: a preemption or abort in
        between voids them."""
        if step_id not in self._steps:
            return
        while self._step_order and self._step_order[0] <= step_id:
            for rid, epoch, before, n in self._steps.pop(self._step_order.popleft(), ()):
                req = self.requests.get(rid)
                if req is not None and req.state == "running" and req.epoch == epoch:
                    req.confirm(before + n)

    def _plan_step(self, step_id: int, entries: list[tuple[str, int, int, int]]) -> None:
        if step_id in self._steps:
            return  # a reused step id: the first plan keeps it
        self._steps[step_id] = entries
        self._step_order.append(step_id)

    def _complete(self, job: _Job) -> None:
        job.complete = True
        self._completed_now.append(job)
        if job.moves is None:
            return
        if job.kind == "prefetch":
            for move in job.moves:
                if move.block_hash in job.failed:
                    # The engine drops a source copy that failed to be read, as for loads.
                    self._bad_in_tier[(move.tier, move.block_hash)] = job.job_id
                elif move.dst_tier is not None:
                    self._bad_in_tier.pop((move.dst_tier, move.block_hash), None)
            return
        for move in job.moves:
            _drop(self._busy_blocks, move.device_block, job)
            if job.kind == "load":
                _drop(self._loading_hashes, move.block_hash, job)
                if move.block_hash in job.failed:
                    self._bad_in_tier[(move.tier, move.block_hash)] = job.job_id
            elif move.block_hash not in job.failed:
                # A successful store rewrites the slot: the tier holds good bytes again.
                self._bad_in_tier.pop((move.tier, move.block_hash), None)

    def _on_transition(self, record: dict[str, Any]) -> None:
        rid, source, target, trigger = (record.get(k) for k in ("req", "from", "to", "trigger"))
        if not all(isinstance(x, str) for x in (rid, source, target, trigger)):
            self._fail(0, "transition record lacks req/from/to/trigger")
            return
        assert isinstance(rid, str) and isinstance(trigger, str) and isinstance(target, str)
        req = self.requests.get(rid)
        if req is None:
            self._fail(1, f"transition of {rid}, which never arrived")
            req = self.requests[rid] = _Req(())
        expected = TABLE.edges.get((req.state, trigger))
        if req.state == "finished":
            self._fail(1, f"{rid} moved out of finished ({trigger} -> {target}): finished absorbs")
        elif source != req.state:
            self._fail(1, f"{rid}: transition from {source!r} but it was in {req.state!r}")
        elif expected is None:
            self._fail(1, f"{rid}: trigger {trigger!r} is not allowed in state {req.state!r}")
        elif expected != target:
            self._fail(1, f"{rid}: {trigger!r} from {req.state!r} leads to {expected!r}, not {target!r}")
        if trigger == "lookup_answered":
            ev = self._input
            if not (self._input_is("lookup_answer") and ev.request_id == rid):
                self._fail(4, f"{rid}: lookup answered without a lookup answer for it")
            elif ev.epoch != req.lookup_epoch:
                self._fail(4, f"{rid}: answer of epoch {ev.epoch} applied to the lookup of epoch "
                              f"{req.lookup_epoch} (stale)")
        if trigger == "aborted" and req.state == "lookup_pending" and req.lookup_epoch is not None:
            self._discard_due.append((rid, req.lookup_epoch))
        req.state = target
        if trigger == "lookup_submitted":
            req.lookup_epoch = req.epoch
        elif trigger == "lookup_answered":
            req.lookup_epoch = None
        if trigger in _EPOCH_BUMPS:
            req.epoch += 1
            req.lookup_epoch = None
            req.restart()
        if trigger in ("admitted", "load_done"):
            req.fresh = True

    def _on_job(self, record: dict[str, Any]) -> None:
        job_id, op, rid = record.get("job"), record.get("op"), record.get("req")
        if not _is_int(job_id) or op not in ("load", "store", "prefetch") or not isinstance(rid, str):
            self._fail(0, "job record lacks job/op/req")
            return
        assert isinstance(op, str)
        if job_id in self.jobs:
            self._fail(7, f"job {job_id} started twice")
            return
        job = self.jobs[job_id] = _Job(job_id, op, rid)
        # Prefetch moves exist only in records (the observer ignores StartPrefetch), so
        # they are read in both modes; load/store moves come from the commands when live.
        if op == "prefetch" or self.from_trace:
            moves = self._moves_of(record, job_id, op)
            if moves is None:
                return
            if op == "prefetch":
                job.moves = moves
            else:
                self._start_moves(job, moves)

    def _moves_of(self, record: dict[str, Any], job_id: int, op: str) -> tuple[_Move, ...] | None:
        raw = record.get("moves")
        if raw is None:
            self._note("job records without moves: invariants 2, 5 and 6 were not checked for them", 2, 5, 6)
            return None
        moves: list[_Move] = []
        if isinstance(raw, list):
            for item in raw:
                if not (isinstance(item, list) and len(item) == 3 and _is_int(item[0])):
                    break
                if op == "prefetch" and isinstance(item[1], str) and isinstance(item[2], str):
                    moves.append(_Move(item[0], None, item[1], item[2]))
                elif op != "prefetch" and _is_int(item[1]) and isinstance(item[2], str):
                    moves.append(_Move(item[0], item[1], item[2]))
                else:
                    break
            else:
                return tuple(moves)
        shape = "[block_hash, src_tier, dst_tier]" if op == "prefetch" else "[block_hash, device_block, tier]"
        self._fail(0, f"{op} job {job_id}: field 'moves' must be a list of {shape}")
        return None

    def _on_rank_timeout(self, record: dict[str, Any]) -> None:
        job_id = record.get("job")
        job = self.jobs.get(job_id) if _is_int(job_id) else None
        if job is None or job.complete or job.timed_out:
            return
        job.timed_out = True
        if job.kind == "load" and job.moves is not None:
            # Given up on: its blocks are never registered, so it no longer "brings" them
            # (the engine lets a new load start); it still holds its device blocks (2).
            for move in job.moves:
                _drop(self._loading_hashes, move.block_hash, job)

    def _on_free(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            for job in self._busy_blocks.get(block, ()):
                self._fail(2, f"device block {block} freed while {job.kind} job {job.job_id} "
                              f"still moves it (ranks {sorted(set(range(self.ranks)) - job.reported)} "
                              f"have not reported)")

    def _on_step_record(self, record: dict[str, Any]) -> None:
        step_id, chunks = record.get("step"), record.get("prompt")
        if not _is_int(step_id):
            self._fail(0, "step record lacks an integer 'step'")
            return
        if chunks is None:
            self.chunks_known = False
            self._chunks_missing = True
            self._note("step records without prompt chunks: invariant 5 was not checked", 5)
            return
        if not isinstance(chunks, list) or not all(
            isinstance(c, list) and len(c) == 3 and isinstance(c[0], str) and _is_int(c[1]) and _is_int(c[2])
            for c in chunks
        ):
            self._fail(0, f"step {step_id}: field 'prompt' must be a list of [request_id, computed_before, tokens]")
            return
        fills = record.get("fills", [])
        if not isinstance(fills, list) or not all(
            isinstance(c, list) and len(c) == 3 and isinstance(c[0], str) and _is_int(c[1]) and _is_int(c[2])
            for c in fills
        ):
            self._fail(0, f"step {step_id}: field 'fills' must be a list of [request_id, computed_before, tokens]")
            return
        self.chunks_known = not self._chunks_missing
        entries = []
        for rid, before, n in chunks + fills:
            req = self._scheduled(step_id, rid, before, n)
            if req is not None:
                entries.append((rid, req.epoch, before, n))
        self._plan_step(step_id, entries)

    def _on_job_done(self, record: dict[str, Any]) -> None:
        job_id = record.get("job")
        job = self.jobs.get(job_id) if isinstance(job_id, int) else None
        if job is None:
            self._fail(3, f"job_done for job {job_id}, which never started")
            return
        if job.done_recorded:
            self._fail(3, f"job {job_id} completed twice")
            return
        job.done_recorded = True
        ev = self._input
        if not (self._input_is("transfer_report") and ev.job_id == job_id):
            self._fail(3, f"job {job_id} completed without a report for it")
        elif not job.complete:
            missing = sorted(set(range(self.ranks)) - job.reported)
            self._fail(3, f"{job.kind} job {job_id} counted done with ranks {missing} still to report "
                          f"(reported: {sorted(job.reported)})")
        failed = record.get("failed")
        if job.complete and isinstance(failed, int) and failed != len(job.failed):
            self._fail(3, f"job {job_id}: {failed} failed blocks reported, the union over ranks is "
                          f"{len(job.failed)}")

    def end_input(self) -> None:
        """Close the current handling: checks that need all of its records."""
        # A cut inside a handling (a second Ctrl-C does not wait) may have come before the
        # engine recorded the completion: only a cut between handlings says it is clean.
        cut_inside = self.cut is not None and self.cut.get("clean") is False
        for job in self._completed_now:
            if not job.done_recorded and not cut_inside:
                self._fail(3, f"{job.kind} job {job.job_id}: every rank reported, yet it was not completed")
        self._completed_now = []
        self._discard_due = []
        if self.accounting is not None and self._input is not None:
            try:
                self.accounting()
            except AssertionError as exc:
                self._fail(2 if "job" in str(exc) else 8, f"engine accounting: {exc}")
        self._input = None

    # ---- commands (live) -------------------------------------------------------------------
    def feed_commands(self, commands: Iterable[Any]) -> None:
        from kvlife.lifecycle.engine.events import (
            DiscardLookup,
            FreeBlocks,
            StartLoad,
            StartStore,
            StepPlan,
            SubmitLookup,
        )

        commands = list(commands)
        discarded = {(c.request_id, c.epoch) for c in commands if isinstance(c, DiscardLookup)}
        for rid, epoch in self._discard_due:
            if (rid, epoch) not in discarded:
                self._fail(4, f"{rid} aborted in lookup_pending but its lookup (epoch {epoch}) was not discarded")
        self._discard_due = []
        for command in commands:
            if isinstance(command, SubmitLookup):
                req = self.requests.get(command.request_id)
                if req is None or req.lookup_epoch != command.epoch:
                    self._fail(4, f"lookup for {command.request_id} submitted with epoch {command.epoch}, "
                                  f"request epoch is {None if req is None else req.epoch}")
            elif isinstance(command, StartLoad | StartStore):
                self._on_start(command, "load" if isinstance(command, StartLoad) else "store")
            elif isinstance(command, FreeBlocks):
                self._on_free(command.device_blocks)
            elif isinstance(command, StepPlan):
                self._on_plan(command)

    def _on_start(self, command: Any, kind: str) -> None:
        job = self.jobs.get(command.job_id)
        if job is None:  # no recorder attached: the command alone opens the job
            job = self.jobs[command.job_id] = _Job(command.job_id, kind, command.request_id)
        self._start_moves(job, tuple(command.moves))

    def _start_moves(self, job: _Job, moves: tuple[Any, ...]) -> None:
        """A load or store job starts moving these blocks: invariants 2, 4 (stale hit), 5, 6."""
        job.moves = moves
        kind = job.kind
        req = self.requests.get(job.request_id)
        bt = self.block_tokens
        for move in moves:
            for other in self._busy_blocks.get(move.device_block, ()):
                if kind == "load" or other.kind == "load":
                    self._fail(2, f"{kind} job {job.job_id} uses device block {move.device_block} while "
                                  f"{other.kind} job {other.job_id} still moves it")
            if kind == "load":
                if self.sharing:
                    for other in self._loading_hashes.get(move.block_hash, ()):
                        self._fail(6, f"load job {job.job_id} ({job.request_id}) brings block "
                                      f"{move.block_hash} that load job {other.job_id} "
                                      f"({other.request_id}) is already loading")
                bad = self._bad_in_tier.get((move.tier, move.block_hash))
                if bad is not None:
                    self._fail(4, f"load job {job.job_id} reads block {move.block_hash} from {move.tier}, "
                                  f"which failed to load in job {bad} and was never stored again (stale hit)")
            elif self.chunks_known:
                position = req.position(move.block_hash, bt) if req is not None else None
                if position is None:
                    self._fail(5, f"store job {job.job_id} writes block {move.block_hash}, not a block "
                                  f"{job.request_id} has computed")
                elif req is not None and (position + 1) * bt > req.valid_tokens:
                    self._fail(5, _unconfirmed_store(job, req, (position + 1) * bt))
        for move in moves:
            self._busy_blocks.setdefault(move.device_block, []).append(job)
            if kind == "load":
                self._loading_hashes.setdefault(move.block_hash, []).append(job)

    def _scheduled(self, step_id: int, rid: str, computed_before: int, tokens: int) -> _Req | None:
        """The observer's record of a request a step schedules (None: it never arrived)."""
        req = self.requests.get(rid)
        if req is None:
            self._fail(1, f"step {step_id} schedules {rid}, which never arrived")
            return None
        if req.state != "running":
            self._fail(1, f"step {step_id} schedules {rid} in state {req.state}")
        req.scheduled_end = max(req.scheduled_end, computed_before + tokens)
        if req.fresh:
            # The first chunk after an admission starts where the hit (device cache or a
            # completed load) ends: those tokens are valid content.
            req.valid_tokens = computed_before
            req.fresh = False
        return req

    def _on_plan(self, plan: Any) -> None:
        bt = self.block_tokens
        entries = []
        for entry in plan.entries:
            req = self._scheduled(plan.step_id, entry.request_id, entry.computed_before, entry.num_tokens)
            if req is None:
                continue
            first = entry.computed_before // bt
            last = (entry.computed_before + entry.num_tokens - 1) // bt
            for i, block in enumerate(entry.block_table):
                for job in self._busy_blocks.get(block, ()):
                    if job.kind == "load" or first <= i <= last:
                        self._fail(2, f"step {plan.step_id}: {entry.request_id} "
                                      f"{'writes' if first <= i <= last else 'reads'} device block {block} "
                                      f"while {job.kind} job {job.job_id} still moves it")
            entries.append((entry.request_id, req.epoch, entry.computed_before, entry.num_tokens))
        self._plan_step(plan.step_id, entries)

    # ---- end of inputs -------------------------------------------------------------------------
    def finish(self) -> None:
        """Invariant 7 once inputs stop: every job ended on every rank, nothing stranded."""
        self.end_input()
        self._line = None
        open_jobs = [job for job in self.jobs.values() if not job.complete]
        waiting_on_io = [(rid, req) for rid, req in self.requests.items() if req.state in IO_WAIT_STATES]
        if self.cut is not None:
            # Cut short: the reports and answers this work waited for never had a chance.
            signal = self.cut.get("signal")
            t = self.cut.get("t")
            self.unchecked.append(
                f"run interrupted ({signal}) at t={t}: {len(open_jobs)} job(s) and {len(waiting_on_io)} "
                f"request(s) waiting on IO were open at the cut; invariants 3 and 7 hold for the rest"
            )
            return
        for job in open_jobs:
            missing = sorted(set(range(self.ranks)) - job.reported)
            self._fail(7, f"{job.kind} job {job.job_id} of {job.request_id}: ranks {missing} never reported")
        # Every request, whatever its state: one parked in waiting or running forever (a head
        # that never fits, a policy that always defers, blocks never released) never finishes.
        for rid, req in self.requests.items():
            if req.state != "finished":
                self._fail(7, f"{rid} stranded in {req.state}: never finished")

    def states(self) -> dict[str, str]:
        return {rid: req.state for rid, req in self.requests.items()}


def _unconfirmed_store(job: _Job, req: _Req, end: int) -> str:
    """Invariant 5's message: which of the stored positions no step output vouched for,
    and which of them are placeholders (tokens sampled by steps whose output has not
    arrived: their KV is being written by a step in flight, the bug of vLLM #27644)."""
    valid = req.valid_tokens
    message = f"store job {job.job_id} of {job.request_id} covers tokens up to {end}, only {valid} are computed"
    first_placeholder = max(valid + 1, req.prompt_tokens)
    if first_placeholder < end:
        return (f"{message}: positions {first_placeholder}..{end - 1} are placeholders "
                f"(sampled by steps whose output has not arrived)")
    return f"{message} (the rest are in flight)"


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _drop(index: dict[int, list[_Job]], key: int, job: _Job) -> None:
    jobs = index.get(key)
    if jobs is None:
        return
    if job in jobs:
        jobs.remove(job)
    if not jobs:
        del index[key]
