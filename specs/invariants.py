"""An independent observer of the invariants of DESIGN.md ("Invariants"): 0-8 and 10-13 (14 in fast_twin).

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
  ``sharing``. From records alone also: 10 at the tiers (no load or prefetch reads a tier
  copy whose store or prefetch failed), 12's stale hit and, with ``finish_after_stores``,
  11's "finished only after every store is reported". 8 needs the pools. A store of a block past the prompt
  names it by the derived hash (``kvlife.lifecycle.engine.blocks.derived_block_hash``); a
  store that covers a position whose token a step in flight sampled is a store of a
  placeholder.
- a run cut short by Ctrl-C or SIGTERM ends with an ``interrupted`` record: work open at
  the cut (jobs some rank has not reported, requests waiting on IO) is not held to 3 and
  7; everything before the cut is checked as usual, and nothing may follow the record.
- live (the model checker): records plus commands, which carry every move, every freed
  block and every step's block table; the block-level checks come from the commands (the
  same records are then ignored for them). A driver that feeds each command as soon as
  the engine issues it (``feed_commands`` between records, as the model checker does)
  gives the observer the exact order of the handling; one that feeds them after
  ``handle`` returns still gets every check, with a store issued just before a finish seen
  after it. Live mode adds: 10 on the device (every block a step reads holds the tokens
  it should, written by this request in this epoch, or confirmed: a hit, a load, a join),
  11's token budget and ``max_running`` (when given), 12's one lookup at a time, and 13
  (through ``hit_probe``). Block/tier accounting (8) is delegated to
  ``engine.check_invariants()`` through ``accounting``.

Provenance (10) is symbolic: each device block and each tier copy carries which block
hash it holds, how many of that block's tokens were written, and how many of them were
confirmed (a step output arrived for the step that wrote them, or the copy was loaded
from a confirmed copy). A failed load leaves garbage in its device blocks; a failed
store or prefetch leaves no copy.

Call ``feed_record`` for every record in order (input records open a new handling),
``feed_commands`` with what ``handle`` returned (live only), ``end_input`` after each
handling (live; in trace mode the next input record closes the previous one) and
``finish`` when inputs stop.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeGuard

import attrs

from kvlife.specs.table import TABLE

IO_WAIT_STATES = ("lookup_pending", "loading", "sending")
# Triggers after which a request's older lookups are stale (its epoch moved on).
_EPOCH_BUMPS = frozenset({"preempted", "load_failed", "completed", "aborted", "failed", "lookup_expired"})

INVARIANTS: dict[int, str] = {
    0: "well-formed trace",
    1: "legal transitions; finished absorbs; a fail decision finishes",
    2: "no block freed or reused under an in-flight transfer",
    3: "a job is done only after every rank reported it exactly once; given up at its deadline",
    4: "lookup answers apply only to the epoch that asked",
    5: "stores cover only computed tokens",
    6: "no two in-flight loads bring the same block (load sharing on)",
    7: "every transfer ends; every request finishes (liveness)",
    8: "block accounting",
    9: "loaded bytes match what was computed (live runs)",
    10: "provenance: hits, loads, joins and stores read only complete, confirmed blocks",
    11: "scheduling: token budget, max_running, output limit, FIFO admission; finished only after every store "
        "is reported",
    12: "bounded work: one lookup at a time, lookup_reuse obeyed, no retry of a copy that failed to load",
    13: "accounting: a request's recorded hit is what its first admission skipped; counters match the trace; "
        "stores offered",
    14: "the decode fast path does exactly what the step-by-step path does",
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


@attrs.define(slots=True)
class _Prov:
    """What a device block or a tier copy holds (invariant 10)."""

    key: int | None  # the block hash whose tokens it holds (None: nothing usable)
    filled: int  # tokens of that block written
    confirmed: int  # of those, tokens a step output (or a confirmed source) vouches for
    writer: tuple[str, int] | None = None  # (request, epoch) whose step wrote it; None: a copy
    bad: str | None = None  # why nothing in it may be read (a failed load, a load in flight)


_UNKNOWN = _Prov(None, 0, 0, bad="unknown")


@attrs.define(slots=True, eq=False)
class _Job:
    job_id: int
    kind: str  # "load" | "store" | "prefetch"
    request_id: str
    moves: tuple[Any, ...] | None = None  # BlockMove (live) or _Move (trace, prefetch); None: unknown
    timed_out: bool = False  # a rank missed the deadline: the engine gave up on its result
    reclaimed: bool = False  # its blocks were reclaimed at the reclaim deadline: it has ended
    abandoned: bool = False  # a prefetch its request stopped waiting for: nothing it lands is valid
    started: float | None = None  # when it started (the job record or command), for its deadlines
    reported: set[int] = attrs.Factory(set)
    failed: set[int] = attrs.Factory(set)
    complete: bool = False  # every rank reported (the observer's own count)
    done_recorded: bool = False  # the engine said job_done
    # What each move read when the job started (its provenance), by block hash.
    sources: dict[int, _Prov] = attrs.Factory(dict)
    # A store: its request's valid tokens when it was issued (the job record), so a
    # finish later in the same handling does not change what 5 compares with.
    valid_at: int | None = None


@attrs.define(slots=True, eq=False)
class _Req:
    hashes: tuple[int, ...]
    request_id: str = ""
    prompt_tokens: int = 0
    state: str = "waiting"
    epoch: int = 0
    lookup_epoch: int | None = None  # epoch of the lookup in flight
    lookup_t: float | None = None  # when that lookup was submitted (its deadline counts from it)
    outstanding_lookup: bool = False  # a SubmitLookup not yet answered or discarded (12)
    valid_tokens: int = 0  # tokens whose KV is known good (confirmed or hit)
    fresh: bool = False  # admitted; the next step entry tells the hit length
    scheduled_end: int = 0  # the furthest token a step was seen to compute
    index: dict[int, int] | None = None  # hash -> first block position (built lazily)
    stores: list[_Job] = attrs.Factory(list)  # its store jobs not yet ended (11)
    hold: bool | None = None  # the last hold_at_finish answer for it (11)
    # 13: how the first admission went: None (not yet), "pending" (its first chunk tells
    # the hit), "unknown" (its first load failed: no figure to check), "checked".
    hit_state: str | None = None
    hit_due: int | None = None  # hit blocks to compare with the engine's count at the end of the handling
    failed_from: int | None = None  # 12: first block position whose load failed for it
    # 10: the device blocks of its leading full blocks that passed in epoch passed_epoch (and
    # hold the same provenance since: InvariantObserver._set_device).
    passed: list[int] = attrs.Factory(list)
    passed_epoch: int = -1
    max_tokens: int | None = None  # its output limit (arrival's max_tokens), when known (11)
    arrival_blocks: int = 0  # block hashes its arrival named (a plan names no more than it may compute)
    # 12: async lookups submitted over its life; an answer of its current epoch not yet
    # consumed; the lookup_reuse decision now and before the last change (and when that was).
    lookups: int = 0
    answer_held: bool = False
    answered_in_epoch: bool = False  # an answer of its current epoch was applied (then kept or consumed)
    limit_warned: bool = False  # a lookup_limit warning was recorded for it
    reuse: str | None = None
    reuse_before: str | None = None
    reuse_changed_at: int = -1
    # 11: when it entered sending: the first step id planned after it, and the ticks seen then.
    sending_step: int | None = None
    sending_ticks: int = 0
    # 13: confirmed tokens as the engine counts them (the hit, plus each step output's own
    # tokens), and how far each tier's store offers were checked.
    confirmed_count: int = 0
    store_checked: dict[str, int] = attrs.Factory(dict)
    finish_trigger: str | None = None
    admission: str | None = None  # its last admission decision (11: a deferred request may be overtaken)
    finished_at: float | None = None  # when the model finished it, or it was aborted or failed (13)
    preemptions: int = 0  # preempted transitions seen (13)
    # 11 (work conservation): tokens computed or in flight in this epoch, samples in flight
    # in this epoch, and sampled tokens delivered (kept across a preemption: it recomputes them).
    computed: int = 0
    in_flight_samples: int = 0
    generated: int = 0
    # 13 (hit maximality): leading blocks the device prefix cache held when it was admitted
    # straight to running; its first chunk must start at or past them.
    cached_at_admit: int | None = None
    answer_reuses: int = 0  # 13: lookup_reuse records since its last answer
    landed: dict[int, str] = attrs.Factory(dict)  # 12: blocks its prefetch of this epoch landed, and where

    def hash_at(self, i: int) -> int:
        """The hash of this request's block ``i`` (a prompt block, or derived past it)."""
        if i >= len(self.hashes):
            from kvlife.lifecycle.engine.blocks import extend_hashes

            start = len(self.hashes)
            self.hashes = extend_hashes(self.hashes, self.request_id, i + 1)
            if self.index is not None:
                for j in range(start, len(self.hashes)):
                    self.index.setdefault(self.hashes[j], j)
        return self.hashes[i]

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
            self.hash_at(reach - 1)
            found = self.index.get(block_hash)
        return found

    def confirm(self, end: int) -> None:
        """A step output confirmed the request's tokens up to ``end``."""
        self.valid_tokens = max(self.valid_tokens, end)

    def restart(self) -> None:
        self.valid_tokens = 0
        self.computed = self.in_flight_samples = 0
        self.confirmed_count = 0
        self.fresh = False
        self.answer_held = False
        self.answered_in_epoch = False


# One block a step writes: (device block, the hash of the block it fills, tokens of it
# written once the step ran, writer (request, epoch)).
_Write = tuple[int, int, int, tuple[str, int]]


class InvariantObserver:
    def __init__(
        self,
        ranks: int,
        block_tokens: int,
        sharing: bool = False,
        accounting: Callable[[], None] | None = None,
        from_trace: bool = False,
        *,
        max_batched_tokens: int | None = None,
        max_running: int | None = None,
        tier_content_known: bool = False,
        hit_probe: Callable[[str], int | None] | None = None,
        finish_after_stores: bool | None = None,
        lookup_deadline_ms: float | None = None,
        transfer_deadline_ms: float | None = None,
        reclaim_deadline_ms: float | None = None,
        stats_probe: Callable[[], Any] | None = None,
        published_probe: Callable[[int], bool] | None = None,
        tier_probe: Callable[[str, int], bool] | None = None,
        max_async_lookups: int | None = None,
        store_rule: str | None = None,
        store_tiers: Sequence[str] = (),
        deferred_frees: bool = False,
        fifo: bool = False,
        finish_probe: Callable[[str], float | None] | None = None,
        device_blocks: int | None = None,
        wakeup_probe: Callable[[], float | None] | None = None,
        preemptions_probe: Callable[[str], int | None] | None = None,
    ) -> None:
        self.ranks = ranks
        self.block_tokens = block_tokens
        self.sharing = sharing
        self.accounting = accounting
        # Block-level facts (moves, freed blocks, step chunks) from records instead of commands.
        self.from_trace = from_trace
        # 11: the step budget and the running cap (None: not checked).
        self.max_batched_tokens = max_batched_tokens
        self.max_running = max_running
        # 10: every tier copy was written under the observer's eyes (or seeded with
        # ``seed_tier``), so a load of a copy it never saw written is a finding.
        self.tier_content_known = tier_content_known
        # 13: the prefix hit the engine recorded for a request (device + tier blocks).
        self.hit_probe = hit_probe
        # Deadlines (None: not checked). After every tick, nothing may be past one the engine
        # acts on at a tick (7); nothing may be acted on before its deadline (1 for a lookup
        # expired early, 2 for blocks reclaimed under a transfer that may still report).
        self.lookup_deadline_ms = lookup_deadline_ms
        self.transfer_deadline_ms = transfer_deadline_ms
        self.reclaim_deadline_ms = reclaim_deadline_ms
        self._pending_lookups: dict[str, float] = {}  # rid -> submission time, in submission order
        self._open_jobs: dict[int, _Job] = {}  # load/store jobs not ended, in start order
        self._open_pulls: dict[int, _Job] = {}  # prefetch jobs not seen to end, in start order
        # 13: the engine's counters (``engine.stats``), checked against what its records say.
        self.stats_probe = stats_probe
        self.tally = CounterTally()
        # 13: is this block hash published in the engine's device prefix cache? Every full
        # block a step output confirms must be (checked at the end of that handling).
        self.published_probe = published_probe
        self._publish_due: list[tuple[str, int, int]] = []  # (request, block position, hash)
        self._undelivered: set[int] = set()  # planned steps whose own output has not come
        # 13: does the engine's tier hold this block? A prefetch that landed put it there.
        self.tier_probe = tier_probe
        self._landed_due: list[tuple[int, str, int]] = []  # (prefetch job, tier, hash)
        # 3: with a transfer deadline, a load or store is given up (a rank_timeout warning)
        # at the first tick at or past started + deadline, and never before.
        self._job_started: dict[int, float] = {}  # open loads and stores not given up
        # 1: requests whose on_load_failure decision said "fail" in this handling.
        self._must_fail: set[str] = set()
        # 12: async lookups a request may submit over its life (engine.max_async_lookups).
        self.max_async_lookups = max_async_lookups
        # 13: the store policy's limit as a rule ("confirmed": the tokens step outputs
        # confirmed, baseline and placeholder-safe-stores; "computed": every scheduled
        # token; None: not checked) and the tiers every store goes to. At the end of each
        # handling, each block of a running (or just completed) request within that limit
        # was offered to every tier: stored, already there, evicted or refused by a full tier.
        self.store_rule = store_rule
        self.store_tiers = tuple(store_tiers)
        self._store_watch: set[str] = set()  # requests whose store offers are checked
        self._tier_seen: set[tuple[str, int]] = set()  # (tier, hash) some store/prefetch wrote or a tier held
        # 11: step ids planned (the highest), those whose own output has not come (with
        # their entries), the highest whose output came, and ticks seen: when sending may end.
        self._max_planned = -1
        self._own_steps: dict[int, list[tuple[str, int, int, int]]] = {}
        self._last_output = -1
        self._ticks = 0
        self._handlings = 0
        self._plan_records: dict[int, tuple[list[Any], list[Any], Any]] = {}  # live: a step record's chunks
        # 2: under async scheduling with tiers (vLLM's defer_block_free) a request's blocks are
        # given back only once no step in flight writes them: a load into a reused block is
        # not ordered against that write. Step -> the device blocks it writes, until its output.
        self.deferred_frees = deferred_frees
        self._own_writes: dict[int, set[int]] = {}
        # 11: the waiting queue, in the engine's order (arrivals at the back; a preempted
        # request, or one whose load failed, first in line), and requests that submitted a
        # lookup in this handling. Admission is FIFO: a request is admitted past one ahead of
        # it only if that one waits on a lookup, a prefetch or its admission policy.
        self.fifo = fifo
        # 13: the finish time the engine's metrics keep for a request (None: not kept); it
        # must be when the model finished it (completed, or entered sending), or when it
        # was aborted or failed: not when its stores drained.
        self.finish_probe = finish_probe
        # 1: a request fails only if its on_load_failure decision said so, or it can never fit
        # the device (its known tokens and the next need more than ``device_blocks``).
        self.device_blocks = device_blocks
        # 7: the engine's next_wakeup() (a driver ticks then): never later than the earliest
        # deadline still ahead that the observer knows (a lookup's, a transfer's, a reclaim).
        self.wakeup_probe = wakeup_probe
        # 13: the preemptions the engine counts for a request (its metrics), once inputs stop.
        self.preemptions_probe = preemptions_probe
        self._fail_told: set[str] = set()
        self._sending: set[str] = set()  # requests in sending (11: when they must leave it)
        self._oversized_now: str | None = None  # 1: a prompt that can never run, arrived in this handling
        self._queue: list[str] = []
        self._looked_up_now: set[str] = set()
        # 11's "finished only after every store is reported": live by default; a trace
        # validator opts in (a trace edited by hand may hold jobs the engine never saw).
        self.finish_after_stores = not from_trace if finish_after_stores is None else finish_after_stores
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
        self.running = 0  # requests in running (11)
        # 11 (work conservation): the requests sampling a token in each step without an output
        # yet, with their epoch; whether this tick's pass over the running requests may have
        # been cut short (a preemption or a failure since the tick began).
        self._samplers: dict[int, list[tuple[str, int]]] = {}
        self._pass_cut = False
        # 13 (prefetch waits): a request's patience answer (policy, ms) until its prefetch
        # job record; then its prefetch (job, its epoch, the patience deadline, policy); and
        # the prefetch jobs an admission pass certainly deferred a request for (FIFO: it
        # admitted one behind it while the prefetch was in flight and patience lasted).
        self._patience: dict[str, tuple[str, float]] = {}
        self._prefetch_of: dict[str, tuple[_Job, int, float, str]] = {}
        self._waited: dict[int, str] = {}
        # Current handling.
        self._input: Any = None
        self._line: int | None = None
        self._t: float | None = None
        self._completed_now: list[_Job] = []
        self._discard_due: list[tuple[str, int]] = []
        self._discarded_now: set[tuple[str, int]] = set()
        self._command_list: Sequence[Any] | None = None  # the engine's command list being fed
        self._command_fed = 0  # how many of its commands were fed
        self._hit_due: list[_Req] = []
        # Block level: from the commands (live) or the records (trace).
        # Steps without an output yet, in plan order: (request, epoch, computed before, tokens).
        self._steps: dict[int, list[tuple[str, int, int, int]]] = {}
        self._step_writes: dict[int, list[_Write]] = {}
        self._step_order: deque[int] = deque()
        self._busy_blocks: dict[int, list[_Job]] = {}  # device block -> in-flight jobs
        self._loading_hashes: dict[int, list[_Job]] = {}  # hash -> in-flight load jobs
        self._bad_in_tier: dict[tuple[str, int], int] = {}  # (tier, hash) -> failed load job
        # Provenance (10): device block -> what it holds; (tier, hash) -> what that copy holds.
        self._device: dict[int, _Prov] = {}
        self._tier: dict[tuple[str, int], _Prov] = {}
        # 10: device block -> requests that count it among their passed blocks (_Req.passed).
        self._readers: dict[int, set[str]] = {}

    def _set_device(self, block: int, prov: _Prov) -> None:
        """A device block holds something new: requests whose passed blocks (10) include it
        check it again."""
        self._device[block] = prov
        readers = self._readers.pop(block, None)
        if readers:
            for rid in readers:
                req = self.requests.get(rid)
                if req is not None:
                    req.passed_epoch = -1

    def seed_tier(self, tier: str, hashes: Iterable[int]) -> None:
        """Copies a tier held before the run started (a warm tier): complete and confirmed."""
        bt = self.block_tokens
        for h in hashes:
            self._tier[(tier, h)] = _Prov(h, bt, bt)
            self._tier_seen.add((tier, h))

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
            if self.stats_probe is not None:
                self.tally.feed(record)
            self._on_input(record)
            return
        self._line = line if line is not None else self._line
        t = record.get("t")
        if isinstance(t, (int, float)) and not isinstance(t, bool):
            self._t = float(t)
        if self.stats_probe is not None:
            self.tally.feed(record)
        if self.transfer_deadline_ms is not None:
            self._deadline_record(kind, record)
        if kind == "decision" and record.get("point") == "prefetch_patience" and isinstance(record.get("req"), str):
            value = record.get("value")
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._patience[record["req"]] = (str(record.get("policy")), float(value))
        if kind == "decision" and record.get("point") == "on_load_failure" and record.get("value") == "fail":
            self._must_fail.add(str(record.get("req")))
            self._fail_told.add(str(record.get("req")))
        elif kind == "transition" and record.get("to") == "finished":
            self._must_fail.discard(str(record.get("req")))
        if kind == "transition":
            self._on_transition(record)
        elif kind == "job":
            self._on_job(record)
        elif kind == "job_done":
            self._on_job_done(record)
        elif kind == "decision":
            point = record.get("point")
            req = self._req_of(record)
            value = record.get("value")
            if req is None:
                pass
            elif point == "hold_at_finish" and isinstance(value, bool):
                req.hold = value
            elif point == "admission" and isinstance(value, str):
                req.admission = value
            elif point == "lookup_reuse" and isinstance(value, str):
                req.reuse_before, req.reuse, req.reuse_changed_at = req.reuse, value, self._handlings
        elif kind == "lookup_reuse":
            self._on_lookup_reuse(record)
        elif kind == "store_rejected":
            req = self._req_of(record)
            tier = record.get("tier")
            if req is not None and isinstance(tier, str):
                # A full tier refused the offer: what is due now counts as offered to it.
                req.store_checked[tier] = max(req.store_checked.get(tier, 0), self._store_due(req))
        elif kind == "evict":
            tier, blocks = record.get("tier"), record.get("blocks")
            if isinstance(tier, str) and isinstance(blocks, list):
                for h in blocks:
                    if _is_int(h):
                        self._tier.pop((tier, h), None)
                        self._tier_seen.add((tier, h))
        elif kind == "reclaim":
            self._on_reclaim(record)
        elif kind == "abandon":
            job_id = record.get("job")
            job = self.jobs.get(job_id) if _is_int(job_id) else None
            if job is None or job.kind != "prefetch":
                self._fail(0, f"abandon record for job {job_id}, which is not a prefetch that started")
            else:
                job.abandoned = True
        elif kind == "stale_lookup":
            self._on_stale_lookup(record)
        elif kind == "warning":
            if record.get("what") == "rank_timeout":
                self._on_rank_timeout(record)
            elif record.get("what") == "lookup_limit" and (warned := self.requests.get(str(record.get("req")))):
                warned.limit_warned = True
            elif record.get("what") == "abort_ignored" and (live := self._req_of(record)) is not None \
                    and live.state != "finished" and self._input_is("abort"):
                # 1: an abort of a request that has not finished finishes it (at once, or
                # when the transfers that read its blocks end); only a finished or unknown
                # one's abort is ignored.
                self._fail(1, f"the abort of {live.request_id}, in {live.state}, is ignored (abort_ignored): "
                              f"an abort of an unfinished request must finish it")
            elif (record.get("what") in ("bad_rank_report", "duplicate_report")
                  and _is_int(rank := record.get("rank"))
                  and (0 <= rank < self.ranks) != (record["what"] == "duplicate_report")):
                # 3: a report from a rank the world has is a duplicate, any other a bad rank.
                self._fail(3, f"a report of job {record.get('job')} from rank {rank} is warned "
                              f"{record['what']}, with {self.ranks} ranks (0..{self.ranks - 1})")
        elif not self.from_trace:
            if kind == "step" and _is_int(step := record.get("step")):
                # Live: the plan (a command after this record) must say the same (0).
                self._plan_records[step] = (list(record.get("prompt") or []), list(record.get("fills") or []),
                                            record.get("prefill_tokens"))
            return  # live: freed blocks and step plans come from the commands
        elif kind == "free":
            blocks = record.get("blocks")
            if not isinstance(blocks, list) or not all(_is_int(b) for b in blocks):
                self._fail(0, "free record lacks a list of device blocks")
                return
            self._check_free_nonempty(blocks)
            self._on_free(blocks)
        elif kind == "step":
            self._on_step_record(record)

    def _on_stale_lookup(self, record: dict[str, Any]) -> None:
        """4: an answer is stale only if it is not for the lookup in flight: its request is
        gone or finished, not waiting on a lookup, or waiting on one of another epoch."""
        if not self._input_is("lookup_answer"):
            self._fail(4, f"stale_lookup record for {record.get('req')} outside a lookup answer")
            return
        req = self.requests.get(self._input.request_id)
        if req is not None and req.state == "lookup_pending" and req.lookup_epoch == self._input.epoch == req.epoch:
            self._fail(4, f"the answer to {req.request_id}'s pending lookup (epoch {req.epoch}) is dropped as "
                          f"stale: an answer for the epoch that asked must be applied")

    def _on_interrupted(self, record: dict[str, Any]) -> None:
        signal = record.get("signal")
        # A run an error ended part-way names the error instead of a signal (drivers.runner.error_record).
        if signal not in ("SIGINT", "SIGTERM") and not (signal is None and isinstance(record.get("error"), str)):
            self._fail(0, f"interrupted record: field 'signal' must be 'SIGINT' or 'SIGTERM' (or null, with an "
                          f"'error'), got {signal!r}")
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
        self._handlings += 1
        self._looked_up_now = set()
        if kind == "tick":
            self._ticks += 1
            self._pass_cut = False
        if kind == "arrival":
            if event.request_id not in self.requests:
                full = event.prompt_tokens // self.block_tokens
                self.requests[event.request_id] = _Req(
                    tuple(event.block_hashes[:full]), event.request_id, event.prompt_tokens,
                    max_tokens=getattr(event, "max_tokens", None), arrival_blocks=len(event.block_hashes))
                if self.fifo:
                    self._queue.append(event.request_id)
                if not self.from_trace and self._never_fits(event.prompt_tokens) is not None:
                    self._oversized_now = event.request_id
        elif kind == "transfer_report":
            job = self.jobs.get(event.job_id)
            if job is None or job.complete or job.reclaimed or not 0 <= event.rank < self.ranks:
                return
            if event.rank in job.reported:
                return  # a duplicate: must change nothing (checked through job_done)
            job.reported.add(event.rank)
            job.failed.update(event.failed)
            if len(job.reported) == self.ranks:
                self._complete(job)
        elif kind == "step_output":
            for rid, epoch in self._samplers.pop(event.step_id, ()):
                req = self.requests.get(rid)
                if req is not None and req.state == "running" and req.epoch == epoch:
                    req.in_flight_samples -= 1
                    req.generated += 1
            self._confirm_steps(event.step_id)

    def _confirm_steps(self, step_id: int) -> None:
        """The device runs steps in plan order, so the output of a step vouches for every
        earlier one too (a simulated step that pays sync lookups reports after the next
        one, and a trace does not list decode entries). Tokens count only if the request
        is still running in the epoch they were computed for: a preemption or abort in
        between voids them."""
        own = self._own_steps.pop(step_id, None)
        if own is not None:
            # The device runs steps in plan order: this output ends every earlier step's writes.
            for done in [s for s in self._own_writes if s <= step_id]:
                del self._own_writes[done]
            self._last_output = max(self._last_output, step_id)
            for rid, epoch, _before, n in own:
                req = self.requests.get(rid)
                if req is not None and req.state == "running" and req.epoch == epoch:
                    req.confirmed_count += n
        if step_id not in self._steps:
            return
        self._undelivered.discard(step_id)
        if self.published_probe is not None and not any(s < step_id for s in self._undelivered):
            # In order (every earlier step's own output came): the engine publishes
            # every block this output completes (a block it read from a hit or a load was
            # published then, and may since have been evicted in favour of another copy).
            bt = self.block_tokens
            for rid, epoch, before, n in self._steps[step_id]:
                req = self.requests.get(rid)
                if req is not None and req.state == "running" and req.epoch == epoch:
                    self._publish_due += [(rid, i, req.hash_at(i)) for i in range(before // bt, (before + n) // bt)]
        while self._step_order and self._step_order[0] <= step_id:
            done = self._step_order.popleft()
            for rid, epoch, before, n in self._steps.pop(done, ()):
                req = self.requests.get(rid)
                if req is not None and req.state == "running" and req.epoch == epoch:
                    req.confirm(before + n)
            for block, key, end, writer in self._step_writes.pop(done, ()):
                req = self.requests.get(writer[0])
                prov = self._device.get(block)
                if (prov is not None and prov.key == key and prov.writer == writer and req is not None
                        and req.state == "running" and req.epoch == writer[1]):
                    prov.confirmed = max(prov.confirmed, end)

    def _plan_step(self, step_id: int, entries: list[tuple[str, int, int, int]],
                   writes: list[_Write] | None = None) -> None:
        if step_id in self._steps:
            return  # a reused step id: the first plan keeps it
        self._max_planned = max(self._max_planned, step_id)
        self._own_steps[step_id] = entries
        self._steps[step_id] = entries
        if self.published_probe is not None:
            self._undelivered.add(step_id)
        if writes:
            self._step_writes[step_id] = writes
        self._step_order.append(step_id)

    def _complete(self, job: _Job) -> None:
        job.complete = True
        self._open_jobs.pop(job.job_id, None)
        self._completed_now.append(job)
        if job.moves is None:
            return
        bt = self.block_tokens
        if job.kind == "prefetch":
            for move in job.moves:
                if move.dst_tier is not None:
                    # The destination slot was written again: what it holds now is judged by
                    # its provenance (10), not by an earlier failed load of that block (12).
                    self._bad_in_tier.pop((move.dst_tier, move.block_hash), None)
                if job.abandoned and move.dst_tier is not None:
                    # 10: its request went on without it; the engine publishes nothing it lands.
                    self._tier[(move.dst_tier, move.block_hash)] = _Prov(
                        None, 0, 0, bad=f"prefetch job {job.job_id} was abandoned at its patience")
                    if move.block_hash in job.failed:
                        self._bad_in_tier[(move.tier, move.block_hash)] = job.job_id
                elif move.block_hash in job.failed:
                    # The engine drops a source copy that failed to be read, as for loads.
                    self._bad_in_tier[(move.tier, move.block_hash)] = job.job_id
                    if move.dst_tier is not None:  # 10: it never landed
                        self._tier[(move.dst_tier, move.block_hash)] = _Prov(
                            None, 0, 0, bad=f"prefetch job {job.job_id} failed to land it")
                elif move.dst_tier is not None:
                    self._tier[(move.dst_tier, move.block_hash)] = attrs.evolve(
                        job.sources.get(move.block_hash, _Prov(move.block_hash, bt, bt)), writer=None)
                    if self.tier_probe is not None:
                        self._landed_due.append((job.job_id, move.dst_tier, move.block_hash))
                    owner = self.requests.get(job.request_id)
                    wait = self._prefetch_of.get(job.request_id)
                    if owner is not None and wait is not None and wait[0] is job and wait[1] == owner.epoch \
                            and not job.abandoned:
                        owner.landed[move.block_hash] = move.dst_tier
            return
        for move in job.moves:
            _drop(self._busy_blocks, move.device_block, job)
            if job.kind == "load":
                _drop(self._loading_hashes, move.block_hash, job)
                if move.block_hash in job.failed:
                    self._bad_in_tier[(move.tier, move.block_hash)] = job.job_id
                    self._set_device(move.device_block, _Prov(None, 0, 0, bad=f"load job {job.job_id} failed"))
                    self._failed_load(job, move.block_hash)
                elif job.timed_out:
                    self._set_device(move.device_block, _Prov(None, 0, 0, bad=f"load job {job.job_id} timed out"))
                else:
                    source = job.sources.get(move.block_hash, _Prov(move.block_hash, bt, bt))
                    self._set_device(move.device_block, attrs.evolve(source, writer=None))
            elif move.block_hash not in job.failed and not job.timed_out:
                # A store rewrote the slot: the tier holds good bytes again (and a failed
                # store leaves bad ones, judged by 10, not by an earlier failed load: 12).
                self._bad_in_tier.pop((move.tier, move.block_hash), None)
                source = job.sources.get(move.block_hash, _Prov(move.block_hash, bt, bt))
                self._tier[(move.tier, move.block_hash)] = attrs.evolve(source, writer=None)
            else:
                # A failed store leaves no copy: whatever the slot holds is not that block.
                self._bad_in_tier.pop((move.tier, move.block_hash), None)
                self._tier[(move.tier, move.block_hash)] = _Prov(
                    None, 0, 0, bad=f"store job {job.job_id} {'timed out' if job.timed_out else 'failed'}")
        if job.kind == "store":
            self._store_ended(job)

    def _failed_load(self, job: _Job, block_hash: int) -> None:
        """12: the request that owns a load computes from its first block that failed."""
        req = self.requests.get(job.request_id)
        if req is None or req.state != "loading":
            return
        position = req.position(block_hash, self.block_tokens)
        if position is not None and (req.failed_from is None or position < req.failed_from):
            req.failed_from = position

    def _store_ended(self, job: _Job) -> None:
        req = self.requests.get(job.request_id)
        if req is not None and job in req.stores:
            req.stores.remove(job)

    def _on_transition(self, record: dict[str, Any]) -> None:
        rid, source, target, trigger = (record.get(k) for k in ("req", "from", "to", "trigger"))
        if not all(isinstance(x, str) for x in (rid, source, target, trigger)):
            self._fail(0, "transition record lacks req/from/to/trigger")
            return
        assert isinstance(rid, str) and isinstance(trigger, str) and isinstance(target, str)
        req = self.requests.get(rid)
        if req is None:
            self._fail(1, f"transition of {rid}, which never arrived")
            req = self.requests[rid] = _Req((), rid)
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
            req.outstanding_lookup = False
        if trigger == "lookup_expired":
            submitted = self._pending_lookups.get(rid)
            t = self._t
            if (self.lookup_deadline_ms is not None and submitted is not None and t is not None
                    and submitted + self.lookup_deadline_ms > t):
                self._fail(1, f"{rid}: lookup expired at t={t:g}, before its deadline "
                              f"t={submitted + self.lookup_deadline_ms:g} (submitted at t={submitted:g})")
            req.outstanding_lookup = False
        if trigger == "completed" and self.finish_after_stores:
            self._check_finish_after_stores(req)
        if trigger == "failed" and self.device_blocks is not None and rid not in self._fail_told:
            most = max(req.prompt_tokens, req.scheduled_end + 1) + 1  # its known tokens and the next, at most
            if -(-most // self.block_tokens) <= self.device_blocks:
                self._fail(1, f"{rid} failed in {req.state}, yet on_load_failure never said fail and its tokens fit "
                              f"the device ({-(-most // self.block_tokens)} of {self.device_blocks} blocks at most)")
        if trigger == "completed" and req.state == "sending" and not self.from_trace:
            self._check_sending_ends(req)
        if trigger == "send_started":
            req.sending_step, req.sending_ticks = self._max_planned + 1, self._ticks
            self._sending.add(rid)
        elif source == "sending":
            self._sending.discard(rid)
        if trigger == "preempted":
            req.preemptions += 1
        if trigger in ("preempted", "failed"):
            self._pass_cut = True
        if self.fifo:
            self._follow_queue(req, trigger, target)
        if trigger in ("aborted", "lookup_expired") and req.state == "lookup_pending" and req.lookup_epoch is not None:
            self._discard_due.append((rid, req.lookup_epoch))
        if req.state == "running" and target != "running":
            self.running -= 1
        elif target == "running" and req.state != "running":
            self.running += 1
        if trigger == "load_failed" and req.hit_state == "pending":
            req.hit_state = "unknown"  # the first admission's load failed: no figure to check
        req.state = target
        if trigger == "lookup_submitted":
            req.lookup_epoch = req.epoch
            if self.from_trace:
                # A trace has no SubmitLookup commands: each lookup_submitted is one (12's bound).
                req.lookups += 1
            self._pending_lookups.pop(rid, None)
            if self._t is not None:
                self._pending_lookups[rid] = self._t
        elif trigger == "lookup_answered":
            req.lookup_epoch = None
            req.answer_reuses = 0
            req.landed.clear()  # a new answer says where its blocks are
        if source == "lookup_pending":
            self._pending_lookups.pop(rid, None)
        if trigger in _EPOCH_BUMPS:
            req.epoch += 1
            req.lookup_epoch = None
            req.restart()
            req.answer_reuses = 0
            req.landed.clear()
        if trigger in ("admitted", "load_done"):
            req.fresh = True
            self._store_watch.add(rid)
        req.cached_at_admit = None
        if trigger == "admitted" and source == "waiting" and self.published_probe is not None:
            req.cached_at_admit = self._cached_prefix(req)
        if trigger == "lookup_answered":
            req.answer_held = req.answered_in_epoch = True
        if target == "finished":
            req.finish_trigger = trigger
        if (target == "finished" and not (trigger == "completed" and source == "sending")) \
                or trigger == "send_started":
            req.finished_at = self._t
        if trigger in ("admitted", "load_started") and req.hit_state is None:
            req.hit_state = "pending"

    def _follow_queue(self, req: _Req, trigger: str, target: str) -> None:
        """11: keep the waiting queue; an admission past a request ahead that could have
        gone (not waiting on a lookup, a prefetch or its policy) breaks FIFO."""
        rid = req.request_id
        queue = self._queue
        if trigger == "lookup_submitted":
            self._looked_up_now.add(rid)
        elif trigger in ("preempted", "load_failed"):
            if rid in queue:
                queue.remove(rid)
            queue.insert(0, rid)
        elif trigger in ("admitted", "load_started") and rid in queue:
            self._check_patience_kept(req, trigger)
            self._check_fits(req, trigger)
            ahead = queue[:queue.index(rid)]
            for other in ahead:
                self._note_prefetch_wait(other)
                if not self._may_be_passed(other):
                    self._fail(11, f"{rid} admitted ({trigger}) ahead of {other}, which was first in line and waits on "
                                   f"nothing (admission is FIFO: a request short of memory stops it)")
                    break
            queue.remove(rid)
        elif target == "finished" and rid in queue:
            queue.remove(rid)

    def _live_prefetch(self, req: _Req) -> tuple[_Job, float] | None:
        """``req``'s prefetch of its current epoch still in flight and not given up, with
        its patience deadline; None if it has none."""
        wait = self._prefetch_of.get(req.request_id)
        if wait is None:
            return None
        job, epoch, deadline, _policy = wait
        if epoch != req.epoch or job.complete or job.abandoned or job.reclaimed or job.timed_out:
            return None
        return job, deadline

    def _never_fits(self, known_tokens: int) -> int | None:
        """The blocks ``known_tokens`` and the next need, if more than the device has (such a
        request can never run); None if they fit or the device's size is unknown."""
        need = -(-(known_tokens + 1) // self.block_tokens)
        return need if self.device_blocks is not None and need > self.device_blocks else None

    def _check_fits(self, req: _Req, trigger: str) -> None:
        """11: a request whose known tokens and the next need more blocks than the device
        has can never run: it fails at its admission pass, it is never admitted."""
        need = self._never_fits(req.prompt_tokens + req.generated)
        if need is not None:
            self._fail(11, f"{req.request_id} admitted ({trigger}) though it needs {need} blocks for its known "
                           f"tokens and the next, and the device has {self.device_blocks}: it can never run")

    def _check_patience_kept(self, req: _Req, trigger: str) -> None:
        """11: a request whose prefetch is in flight waits for it while its patience lasts
        (``prefetch_patience``): it is admitted only once the prefetch landed or was given up."""
        live = self._live_prefetch(req)
        if live is not None and self._t is not None and self._t < live[1]:
            self._fail(11, f"{req.request_id} admitted ({trigger}) at t={self._t:g} while its prefetch job "
                           f"{live[0].job_id} is in flight and its patience lasts until t={live[1]:g}")

    def _note_prefetch_wait(self, rid: str) -> None:
        """13: ``rid``, waiting, was passed by an admission behind it: if its prefetch was in
        flight (of its epoch) and its patience lasted, the pass deferred it for that prefetch,
        which the engine counts (``stats.prefetch_waits``, once per prefetch)."""
        other = self.requests[rid]
        wait = self._prefetch_of.get(rid)
        if other.state != "waiting" or rid in self._looked_up_now or wait is None:
            return
        job, epoch, deadline, policy = wait
        if (epoch == other.epoch and not (job.complete or job.abandoned or job.reclaimed or job.timed_out)
                and self._t is not None):
            if self._t < deadline:
                self._waited[job.job_id] = policy
            else:
                # Its patience ran out: the pass that reached it gave up on the prefetch
                # (an abandon record) and went on; it may not defer it for the prefetch again.
                self._fail(11, f"{rid} is passed at t={self._t:g} still waiting on prefetch job {job.job_id}, "
                               f"whose patience ran out at t={deadline:g}: the pass must give up on it")

    def _may_be_passed(self, rid: str) -> bool:
        other = self.requests[rid]
        if other.state != "waiting" or rid in self._looked_up_now or other.admission == "defer":
            return True
        return any(job.kind == "prefetch" and job.request_id == rid and not job.complete and not job.abandoned
                   for job in self.jobs.values())

    def _check_sending_ends(self, req: _Req) -> None:
        """11: a request leaves ``sending`` with the output of a step planned after it
        entered it (vLLM reports finished_sending with a step's output), or, with no step in
        flight, at a tick after the one it entered in."""
        step = req.sending_step if req.sending_step is not None else self._max_planned + 1
        if self._last_output >= step or (not self._own_steps and self._ticks > req.sending_ticks):
            return
        why = (f"steps {sorted(self._own_steps)} are in flight" if self._own_steps
               else "no tick has run since it entered sending")
        self._fail(11, f"{req.request_id} completed from sending too early: no output yet of a step planned "
                       f"after it entered sending (step {step} or later; the last output was of step "
                       f"{self._last_output}) and {why}")

    def _check_sending_released(self) -> None:
        """11, the other way: a request in ``sending`` whose stores were all reported
        finishes with the output of a step planned after it entered ``sending`` (vLLM's
        finished_sending comes with it): it does not wait longer."""
        for rid in sorted(self._sending):
            req = self.requests[rid]
            if not any(not job.complete and not job.timed_out and not job.reclaimed for job in req.stores) \
                    and req.sending_step is not None and self._last_output >= req.sending_step:
                self._fail(11, f"{rid} stays in sending though its stores were all reported and the output of step "
                               f"{self._last_output} (planned after it entered sending) came")
                return

    def _on_lookup_reuse(self, record: dict[str, Any]) -> None:
        """12: a kept answer is used again only if the admission that used it before was
        told to keep it (``lookup_reuse`` = keep), or the request spent its lookups."""
        req = self._req_of(record)
        if req is None:
            return
        req.answer_reuses += 1
        uses = record.get("uses")
        if _is_int(uses) and uses != req.answer_reuses + 1:
            self._fail(13, f"{req.request_id}: the lookup_reuse record counts {uses} uses of its answer, this is use "
                           f"{req.answer_reuses + 1} (the first use writes no such record)")
        if self._lookups_spent(req):
            said = req.reuse_before if req.reuse_changed_at == self._handlings else req.reuse
            # The engine warns when a consumed answer hits the bound exactly (lookups that new
            # epochs made past it are kept without one).
            if said != "keep" and not req.limit_warned and req.lookups == self.max_async_lookups:
                self._fail(12, f"{req.request_id} keeps its answer past its lookup bound ({self.max_async_lookups}) "
                               f"without a lookup_limit warning")
            return
        # The decision asked just before this record (in this handling) is for this use;
        # the one that let the answer be kept is the one before it.
        said = req.reuse_before if req.reuse_changed_at == self._handlings else req.reuse
        if said != "keep":
            self._fail(12, f"{req.request_id}: an async lookup answer is used again, but the admission that used "
                           f"it was told {said or 'consume'} (lookup_reuse): it should have looked up again")

    def _req_of(self, record: dict[str, Any]) -> _Req | None:
        """The request a record names (None: none, or a field that is not a request id)."""
        rid = record.get("req")
        return self.requests.get(rid) if isinstance(rid, str) else None

    def _lookups_spent(self, req: _Req) -> bool:
        """12: the request submitted as many lookups as it may: it keeps its last answer."""
        return self.max_async_lookups is not None and req.lookups >= self.max_async_lookups

    def _store_due(self, req: _Req) -> int:
        """13: the leading blocks of ``req`` its stores must have been offered by now."""
        limit = req.confirmed_count if self.store_rule == "confirmed" else req.scheduled_end
        return min(limit, req.scheduled_end) // self.block_tokens

    def _check_store_offers(self) -> None:
        """13: every block within the store limit of a running request (or one that just
        completed) was offered to every tier: a store job wrote it (or is writing it), the
        tier held it, evicted it, or refused the offer (store_rejected)."""
        probe = self.tier_probe
        done: list[str] = []
        for rid in sorted(self._store_watch):
            req = self.requests[rid]
            if req.state == "finished":
                done.append(rid)
                if req.finish_trigger != "completed":
                    continue
            elif req.state not in ("running", "sending"):
                continue
            due = self._store_due(req)
            for tier in self.store_tiers:
                i = req.store_checked.get(tier, 0)
                while i < due:
                    h = req.hash_at(i)
                    if (tier, h) not in self._tier_seen and (probe is None or not probe(tier, h)):
                        self._fail(13, f"{rid}: block {i} (hash {h}) is within its store limit ({due} blocks), "
                                       f"yet it was never offered to the {tier} tier")
                        return
                    i += 1
                req.store_checked[tier] = i
        self._store_watch.difference_update(done)

    def _check_finish_after_stores(self, req: _Req) -> None:
        """11: ``completed`` comes only once every store of the request ended (every rank
        reported it, or its deadline passed), unless the policy said not to hold (the
        documented ``hold_at_finish=False``: the stores keep their own blocks)."""
        open_stores = [job for job in req.stores if not job.complete and not job.timed_out]
        if not open_stores:
            return
        jobs = ", ".join(f"{job.job_id} (ranks {sorted(set(range(self.ranks)) - job.reported)} to report)"
                         for job in open_stores)
        if req.state == "sending":
            self._fail(11, f"{req.request_id} completed from sending with store jobs {jobs} still in flight")
        elif req.hold is not False:
            said = "never asked hold_at_finish" if req.hold is None else "hold_at_finish said hold"
            self._fail(11, f"{req.request_id} completed with store jobs {jobs} still in flight ({said})")

    def _on_job(self, record: dict[str, Any]) -> None:
        job_id, op, rid = record.get("job"), record.get("op"), record.get("req")
        if not _is_int(job_id) or op not in ("load", "store", "prefetch") or not isinstance(rid, str):
            self._fail(0, "job record lacks job/op/req")
            return
        assert isinstance(op, str)
        if job_id in self.jobs:
            self._fail(7, f"job {job_id} started twice")
            return
        job = self.jobs[job_id] = _Job(job_id, op, rid, started=self._t)
        if op != "prefetch":
            self._open_jobs[job_id] = job
        else:
            self._open_pulls[job_id] = job
            patience, req = self._patience.pop(rid, None), self.requests.get(rid)
            if patience is not None and req is not None and self._t is not None:
                self._prefetch_of[rid] = (job, req.epoch, self._t + patience[1], patience[0])
        if op == "store":
            req = self.requests.get(rid)
            if req is not None:
                req.stores.append(job)
                job.valid_at = req.valid_tokens
        # Prefetch moves exist only in records (the observer ignores StartPrefetch), so
        # they are read in both modes; load/store moves come from the commands when live.
        if op == "prefetch" or self.from_trace:
            moves = self._moves_of(record, job_id, op)
            if moves is None:
                return
            if op == "prefetch":
                job.moves = moves
                for move in moves:
                    job.sources[move.block_hash] = self._read_tier(job, move.tier, move.block_hash)
                    if move.dst_tier is not None:
                        self._tier_seen.add((move.dst_tier, move.block_hash))
                    if self.published_probe is not None and self.published_probe(move.block_hash):
                        self._fail(12, f"prefetch job {job_id} pulls block {move.block_hash} into "
                                       f"{move.dst_tier}, which the device prefix cache holds: a wasted transfer")
            else:
                self._start_moves(job, moves)

    def _moves_of(self, record: dict[str, Any], job_id: int, op: str) -> tuple[_Move, ...] | None:
        raw = record.get("moves")
        if raw is None:
            self._note("job records without moves: invariants 2, 5 and 6 were not checked for them", 2, 5, 6, 10)
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

    def _read_tier(self, job: _Job, tier: str, block_hash: int) -> _Prov:
        """A load or prefetch reads the copy of ``block_hash`` in ``tier``: 12 (no copy that
        failed to load) and 10 (the copy is complete and confirmed). Returns what it read."""
        bt = self.block_tokens
        bad = self._bad_in_tier.get((tier, block_hash))
        if bad is not None:
            self._fail(12, f"{job.kind} job {job.job_id} reads block {block_hash} from {tier}, which failed to "
                           f"load in job {bad} and was never stored again (a stale hit: a retry without bound)")
            return _Prov(block_hash, bt, bt)
        prov = self._tier.get((tier, block_hash))
        if prov is None:
            if self.tier_content_known:
                self._fail(10, f"{job.kind} job {job.job_id} reads block {block_hash} from {tier}, which holds "
                               f"no copy of it (never stored there, or evicted since)")
            return _Prov(block_hash, bt, bt)
        if prov.bad is not None or prov.key != block_hash or prov.filled < bt or prov.confirmed < bt:
            self._fail(10, f"{job.kind} job {job.job_id} reads block {block_hash} from {tier}, whose copy "
                           f"{_describe(prov, bt, block_hash)}")
        return prov

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
                self._failed_load(job, move.block_hash)
        if job.kind == "store":
            self._store_ended(job)

    def _check_free_nonempty(self, blocks: Sequence[int]) -> None:
        if not blocks:
            self._fail(0, "a free of no device blocks: a release that frees nothing tells the driver nothing")

    def _on_free(self, blocks: Iterable[int]) -> None:
        if self.deferred_frees and not self.from_trace and self._own_writes:
            blocks = list(blocks)
            for step_id, written in sorted(self._own_writes.items()):
                if not written.isdisjoint(blocks):
                    self._fail(2, f"device blocks {sorted(written.intersection(blocks))} freed while step {step_id}, "
                                  f"which no output has ended yet, still writes them (async scheduling with tiers "
                                  f"frees them at that output)")
                    break
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
        if job.reclaimed:
            self._fail(3, f"job {job_id} completed after it was reclaimed at its deadline (a late report must "
                          f"be ignored)")
            return
        job.done_recorded = True
        ev = self._input
        if not (self._input_is("transfer_report") and ev.job_id == job_id):
            self._fail(3, f"job {job_id} completed without a report for it")
        elif not job.complete:
            missing = sorted(set(range(self.ranks)) - job.reported)
            self._fail(3, f"{job.kind} job {job_id} counted done with ranks {missing} still to report "
                          f"(reported: {sorted(job.reported)})")
        if job.kind == "prefetch" and bool(record.get("abandoned", False)) != job.abandoned:
            self._fail(13, f"prefetch job {job_id}: job_done says abandoned={bool(record.get('abandoned', False))}, "
                           f"but it was {'' if job.abandoned else 'not '}abandoned when its request's patience ran out")
        late = record.get("late")
        if isinstance(late, bool) and late != job.timed_out:
            self._fail(3, f"{job.kind} job {job_id}: job_done says late={late}, but it was "
                          f"{'' if job.timed_out else 'not '}given up at its deadline")
        failed = record.get("failed")
        if job.complete and isinstance(failed, int) and failed != len(job.failed):
            self._fail(3, f"job {job_id}: {failed} failed blocks reported, the union over ranks is "
                          f"{len(job.failed)}")

    def end_input(self) -> None:
        """Close the current handling: checks that need all of its records."""
        # A cut inside a handling (a second Ctrl-C does not wait) may have come before the
        # engine recorded the completion: only a cut between handlings says it is clean.
        cut_inside = self.cut is not None and self.cut.get("clean") is False
        if self._oversized_now is not None:
            rid, self._oversized_now = self._oversized_now, None
            if self.requests[rid].state != "finished" and self.cut is None:
                self._fail(1, f"{rid}'s prompt and its first output token need more than the device's "
                              f"{self.device_blocks} blocks, yet it did not fail at its arrival: it can never run")
        for job in self._completed_now:
            if not job.done_recorded and not cut_inside:
                self._fail(3, f"{job.kind} job {job.job_id}: every rank reported, yet it was not completed")
        self._completed_now = []
        for rid, epoch in self._discard_due:
            if not self.from_trace and (rid, epoch) not in self._discarded_now:
                self._fail(4, f"{rid} left lookup_pending (aborted or expired) but its lookup (epoch {epoch}) "
                              f"was not discarded")
        self._discard_due = []
        self._discarded_now = set()
        if self._input_is("tick") and self.cut is None:
            self._check_deadlines()
        if self.max_running is not None and self.running > self.max_running:
            self._fail(11, f"{self.running} requests running, max_running is {self.max_running}")
        if self._hit_due:
            self._check_hits()
        if self.transfer_deadline_ms is not None and getattr(self._input, "type", None) == "tick":
            now, deadline = float(self._input.t), self.transfer_deadline_ms
            for job_id, started in sorted(self._job_started.items()):
                if now - started >= deadline:
                    self._fail(3, f"job {job_id} started at t={started:g} is past its {deadline:g} ms deadline at "
                                  f"t={now:g}, yet the tick did not give it up")
        if self.store_rule is not None and self._store_watch and self.cut is None:
            self._check_store_offers()
        if self._sending and not self.from_trace and self.cut is None and self._input_is("step_output"):
            self._check_sending_released()
        if self.wakeup_probe is not None and self._input is not None and self.cut is None:
            self._check_wakeup()
        if self.tier_probe is not None and self.tier_content_known and self.cut is None:
            for (tier, h), prov in self._tier.items():
                # (A copy that failed to be read is dropped by the engine: 12 judges it.)
                if prov.bad is None and prov.key == h and (tier, h) not in self._bad_in_tier \
                        and not self.tier_probe(tier, h):
                    self._fail(13, f"the {tier} tier no longer holds block {h}, yet no evict record said so")
                    break
        if self._landed_due:
            due_landed, self._landed_due = self._landed_due, []
            for job_id, tier, h in due_landed:
                if self.tier_probe is not None and not self.tier_probe(tier, h):
                    self._fail(13, f"prefetch job {job_id} landed block {h} in {tier}, yet {tier} does not hold it")
                    break
        if self._publish_due:
            due, self._publish_due = self._publish_due, []
            probe = self.published_probe
            missing = [(rid, i, h) for rid, i, h in due if probe is not None and not probe(h)]
            if missing:
                rid, i, h = missing[0]
                self._fail(13, f"{rid}: block {i} (hash {h}) was confirmed by a step output but is not published in "
                               f"the device prefix cache ({len(missing)} such blocks)")
        for rid in sorted(self._must_fail):
            state = self.requests[rid].state if rid in self.requests else "?"
            self._fail(1, f"{rid}: on_load_failure said fail, yet it went on in {state} instead of finishing")
        self._must_fail = set()
        if self.accounting is not None and self._input is not None:
            try:
                self.accounting()
            except AssertionError as exc:
                self._fail(2 if "job" in str(exc) else 8, f"engine accounting: {exc}")
        self._input = None

    def _check_wakeup(self) -> None:
        now = self._t
        if now is None:
            return
        ahead: list[tuple[float, str]] = []
        if self.lookup_deadline_ms is not None:
            ahead += [(t + self.lookup_deadline_ms, f"the lookup deadline of {rid}")
                      for rid, t in self._pending_lookups.items()]
        transfer, reclaim = self.transfer_deadline_ms, self.reclaim_deadline_ms
        for job in [*self._open_jobs.values(), *self._open_pulls.values()]:
            if job.complete or job.reclaimed or job.started is None:
                continue
            if transfer is not None and not job.timed_out and job.kind != "prefetch":
                ahead.append((job.started + transfer, f"the transfer deadline of {job.kind} job {job.job_id}"))
            if reclaim is not None:
                ahead.append((job.started + reclaim, f"the reclaim deadline of {job.kind} job {job.job_id}"))
        for rid, (job, epoch, deadline, _policy) in self._prefetch_of.items():
            waiter = self.requests.get(rid)
            if (waiter is not None and waiter.state == "waiting" and waiter.epoch == epoch
                    and not (job.complete or job.abandoned or job.reclaimed or job.timed_out)):
                ahead.append((deadline, f"the prefetch patience of {rid} (job {job.job_id})"))
        future = [(t, what) for t, what in ahead if t > now and not math.isinf(t)]
        wake = self.wakeup_probe() if self.wakeup_probe is not None else None
        if wake is not None and wake <= now:
            self._fail(7, f"the engine's next wakeup is t={wake:g}, not after now (t={now:g}): a driver would tick "
                          f"at once, for ever")
            return
        if not future:
            if wake is not None:
                self._fail(7, f"the engine's next wakeup is t={wake:g}, but no deadline is ahead: a wakeup for nothing")
            return
        due, what = min(future)
        if wake is not None and wake < due:
            self._fail(7, f"the engine's next wakeup is t={wake:g}, before the first deadline ahead ({what} at "
                          f"t={due:g}): a wakeup for nothing")
        if wake is None or wake > due:
            self._fail(7, f"the engine's next wakeup is {wake} at t={now:g}, after {what} at t={due:g}: a driver that "
                          f"ticks only then misses it")

    def _check_deadlines(self) -> None:
        """7 after a tick: the engine acts on every deadline at a tick, so none may have
        passed with nothing done: no lookup still pending past ``lookup_deadline_ms``, no
        job some rank owes a report past ``transfer_deadline_ms`` not given up, none past
        ``reclaim_deadline_ms`` not reclaimed (its blocks would leak to a silent rank)."""
        t = self._t
        if t is None:
            return
        deadline = self.lookup_deadline_ms
        if deadline is not None:
            for rid, submitted in self._pending_lookups.items():
                if submitted + deadline > t:
                    break  # in submission order: the rest are younger
                self._fail(7, f"{rid}: its lookup of t={submitted:g} is still pending after a tick at t={t:g}, "
                              f"past its deadline t={submitted + deadline:g} (lookup_deadline_ms {deadline:g})")
                break
        transfer, reclaim = self.transfer_deadline_ms, self.reclaim_deadline_ms
        if transfer is None and reclaim is None:
            return
        for job in self._open_jobs.values():
            started = job.started
            if started is None:
                continue
            if reclaim is not None and t >= started + reclaim:
                missing = sorted(set(range(self.ranks)) - job.reported)
                self._fail(7, f"{job.kind} job {job.job_id} of {job.request_id}: ranks {missing} silent since "
                              f"t={started:g}, yet not reclaimed after a tick at t={t:g} (reclaim_deadline_ms "
                              f"{reclaim:g}): its blocks leak")
                return
            if transfer is not None and not job.timed_out and t - started >= transfer:
                missing = sorted(set(range(self.ranks)) - job.reported)
                self._fail(7, f"{job.kind} job {job.job_id} of {job.request_id}: ranks {missing} silent since "
                              f"t={started:g}, yet not given up after a tick at t={t:g} (transfer_deadline_ms "
                              f"{transfer:g})")
                return
            if (reclaim is None or t < started + reclaim) and (transfer is None or t - started < transfer):
                break  # in start order: the rest are younger
        if reclaim is not None:
            for job in list(self._open_pulls.values()):
                if job.complete or job.reclaimed:
                    del self._open_pulls[job.job_id]
                elif job.started is not None and t >= job.started + reclaim:
                    missing = sorted(set(range(self.ranks)) - job.reported)
                    self._fail(7, f"prefetch job {job.job_id} of {job.request_id}: ranks {missing} silent since "
                                  f"t={job.started:g}, yet not reclaimed after a tick at t={t:g} "
                                  f"(reclaim_deadline_ms {reclaim:g}): its tier slots leak")
                    return
                else:
                    break  # in start order: the rest are younger

    def _on_reclaim(self, record: dict[str, Any]) -> None:
        """The engine reclaimed a job some rank never reported: its blocks go back (no longer
        busy: freeing them is not 2), what it moved holds nothing usable (10), and a report
        for it later must change nothing (3). Only at its deadline (2 before)."""
        job_id = record.get("job")
        job = self.jobs.get(job_id) if _is_int(job_id) else None
        if job is None:
            self._fail(0, f"reclaim record for job {job_id}, which never started")
            return
        if job.complete or job.reclaimed:
            self._fail(3, f"{job.kind} job {job_id} reclaimed after it had ended")
            return
        t = self._t
        if (self.reclaim_deadline_ms is not None and job.started is not None and t is not None
                and t < job.started + self.reclaim_deadline_ms):
            self._fail(2, f"{job.kind} job {job_id} reclaimed at t={t:g}, before its deadline "
                          f"t={job.started + self.reclaim_deadline_ms:g}: ranks "
                          f"{sorted(set(range(self.ranks)) - job.reported)} may still be moving its blocks")
            return
        job.reclaimed = True
        self._open_jobs.pop(job.job_id, None)
        if job.moves is None:
            return
        for move in job.moves:
            if job.kind == "prefetch":
                if move.dst_tier is not None:
                    self._tier[(move.dst_tier, move.block_hash)] = _Prov(
                        None, 0, 0, bad=f"prefetch job {job.job_id} was reclaimed")
                continue
            _drop(self._busy_blocks, move.device_block, job)
            if job.kind == "load":
                _drop(self._loading_hashes, move.block_hash, job)
                self._device[move.device_block] = _Prov(None, 0, 0, bad=f"load job {job.job_id} was reclaimed")
            else:
                self._tier[(move.tier, move.block_hash)] = _Prov(
                    None, 0, 0, bad=f"store job {job.job_id} was reclaimed")
        if job.kind == "store":
            self._store_ended(job)

    def _deadline_record(self, kind: Any, record: dict[str, Any]) -> None:
        job_id, t = record.get("job"), record.get("t")
        if kind == "job" and record.get("op") in ("load", "store") and _is_int(job_id) and isinstance(t, int | float):
            self._job_started[job_id] = float(t)
        elif kind == "job_done" and _is_int(job_id):
            self._job_started.pop(job_id, None)
        elif kind == "warning" and record.get("what") == "rank_timeout" and _is_int(job_id):
            started = self._job_started.pop(job_id, None)
            deadline = self.transfer_deadline_ms
            if started is not None and deadline is not None and isinstance(t, int | float) and t - started < deadline:
                self._fail(3, f"job {job_id} given up at t={t:g}, before its deadline "
                              f"(started t={started:g}, {deadline:g} ms)")

    def _check_hits(self) -> None:
        """13: what the engine recorded as a request's prefix hit is what its first
        admission skipped (checked once the handling that started its first chunk ended)."""
        probe = self.hit_probe
        due, self._hit_due = self._hit_due, []
        if probe is None:
            return
        for req in due:
            recorded = probe(req.request_id)
            if recorded is not None and recorded != req.hit_due:
                skipped = (req.hit_due or 0) * self.block_tokens
                self._fail(13, f"{req.request_id}: the engine records a prefix hit of {recorded} blocks, "
                               f"its first admission skipped {req.hit_due} (tokens 0..{skipped} were not computed)")

    # ---- commands (live) -------------------------------------------------------------------
    def feed_new_commands(self, commands: Sequence[Any]) -> None:
        """Feed what ``commands`` (the engine's list for the handling under way, replaced at
        each input) holds beyond what was fed from it already: a recorder sees commands
        before ``handle`` returns them."""
        if commands is not self._command_list:
            self._command_list, self._command_fed = commands, 0
        if len(commands) > self._command_fed:
            new = commands[self._command_fed:]
            self._command_fed = len(commands)
            self.feed_commands(new)

    def feed_commands(self, commands: Iterable[Any]) -> None:
        from kvlife.lifecycle.engine.events import (
            DiscardLookup,
            FreeBlocks,
            StartLoad,
            StartStore,
            StepPlan,
            SubmitLookup,
        )

        for command in commands:
            if isinstance(command, SubmitLookup):
                self.tally.counts["async_lookups"] += 1
                self._on_submit_lookup(command)
            elif isinstance(command, DiscardLookup):
                self._discarded_now.add((command.request_id, command.epoch))
                req = self.requests.get(command.request_id)
                if req is not None and not req.outstanding_lookup:
                    self._fail(4, f"{command.request_id}: lookup of epoch {command.epoch} discarded, but it has no "
                                  f"lookup in flight (in {req.state})")
                if req is not None:
                    req.outstanding_lookup = False
            elif isinstance(command, StartLoad | StartStore):
                self._on_start(command, "load" if isinstance(command, StartLoad) else "store")
            elif isinstance(command, FreeBlocks):
                self._check_free_nonempty(command.device_blocks)
                self._on_free(command.device_blocks)
            elif isinstance(command, StepPlan):
                self._on_plan(command)

    def _on_submit_lookup(self, command: Any) -> None:
        req = self.requests.get(command.request_id)
        # The command may come before (commands fed as issued) or after (fed when the
        # handling returned) the request's lookup_submitted transition.
        epoch = None if req is None else (req.lookup_epoch if req.state == "lookup_pending" else req.epoch)
        if req is None or epoch != command.epoch:
            self._fail(4, f"lookup for {command.request_id} submitted with epoch {command.epoch}, "
                          f"request epoch is {None if req is None else req.epoch}")
            return
        if req.outstanding_lookup:
            self._fail(12, f"lookup for {command.request_id} (epoch {command.epoch}) submitted while its previous "
                           f"lookup is still unanswered: lookups per request are unbounded")
        bound = self.max_async_lookups
        if bound is not None and req.answered_in_epoch and req.lookups >= bound:
            self._fail(12, f"{command.request_id} looked up again after its answer was consumed, its lookup number "
                           f"{req.lookups + 1}; past {bound} (engine.max_async_lookups) it must keep the answer")
        req.lookups += 1
        if req.answer_held and req.reuse == "keep" and not self._lookups_spent(req):
            self._fail(12, f"{command.request_id} looked up again although it holds an answer of this epoch "
                           f"and lookup_reuse said keep")
        req.outstanding_lookup = True
        req.answer_held = False

    def _on_start(self, command: Any, kind: str) -> None:
        job = self.jobs.get(command.job_id)
        if job is None:  # no recorder attached: the command alone opens the job
            job = self.jobs[command.job_id] = _Job(command.job_id, kind, command.request_id, started=self._t)
            self._open_jobs[command.job_id] = job
            req = self.requests.get(command.request_id)
            if kind == "store" and req is not None:
                req.stores.append(job)
        self._start_moves(job, tuple(command.moves))

    def _start_moves(self, job: _Job, moves: tuple[Any, ...]) -> None:
        """A load or store job starts moving these blocks: invariants 2, 5, 6, 10 and 12."""
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
                landed = req.landed.get(move.block_hash) if req is not None else None
                if landed is not None and move.tier != landed and self.tier_probe is not None \
                        and self.tier_probe(landed, move.block_hash):
                    self._fail(12, f"load job {job.job_id} ({job.request_id}) reads block {move.block_hash} from "
                                   f"{move.tier}, though its own prefetch landed it in {landed}, which holds it")
                if self._loading_hashes.get(move.block_hash):
                    self.tally.counts["redundant_block_loads"] += 1  # a second load of a block in flight
                if self.sharing:
                    for other in self._loading_hashes.get(move.block_hash, ()):
                        self._fail(6, f"load job {job.job_id} ({job.request_id}) brings block "
                                      f"{move.block_hash} that load job {other.job_id} "
                                      f"({other.request_id}) is already loading")
                job.sources[move.block_hash] = self._read_tier(job, move.tier, move.block_hash)
                if req is not None:
                    self._check_retry(job, req, move.block_hash)
                if not self.from_trace:
                    self._set_device(move.device_block, _Prov(None, 0, 0, bad=f"load job {job.job_id} in flight"))
                continue
            # A store: 5 (the request computed those tokens), then 10 (the device block holds them).
            unconfirmed = False
            if self.chunks_known:
                position = req.position(move.block_hash, bt) if req is not None else None
                if position is None:
                    unconfirmed = True
                    self._fail(5, f"store job {job.job_id} writes block {move.block_hash}, not a block "
                                  f"{job.request_id} has computed")
                elif req is not None and (position + 1) * bt > (valid := _valid(job, req)):
                    unconfirmed = True
                    self._fail(5, _unconfirmed_store(job, req, (position + 1) * bt, valid))
            if self.from_trace:
                continue
            prov = self._device.get(move.device_block, _UNKNOWN)
            good = prov.bad is None and prov.key == move.block_hash and prov.filled >= bt
            if not unconfirmed and not (good and prov.confirmed >= bt):
                held = _describe(prov, bt, move.block_hash)
                self._fail(10, f"store job {job.job_id} of {job.request_id} reads device block "
                               f"{move.device_block} as block {move.block_hash}, but it {held}")
            job.sources[move.block_hash] = _Prov(move.block_hash, prov.filled if good else 0,
                                                 prov.confirmed if good else 0)
        for move in moves:
            self._busy_blocks.setdefault(move.device_block, []).append(job)
            if kind == "load":
                self._loading_hashes.setdefault(move.block_hash, []).append(job)
            else:
                self._tier_seen.add((move.tier, move.block_hash))

    def _check_retry(self, job: _Job, req: _Req, block_hash: int) -> None:
        """12: after a load of its block i failed, a request never loads block i or a
        later one again (the engine computes from the first failed block instead), so
        retries per request are bounded by its blocks."""
        position = req.position(block_hash, self.block_tokens)
        if position is None:
            return
        if req.failed_from is not None and position >= req.failed_from and job.request_id == req.request_id:
            self._fail(12, f"load job {job.job_id}: {req.request_id} loads its block {position} again, after its "
                           f"load of block {req.failed_from} failed (retries are unbounded)")

    def _cached_prefix(self, req: _Req) -> int:
        """13: how many leading blocks of ``req``'s hit candidates the device prefix cache
        holds now (the full blocks of its known tokens, but at least one token is always
        computed). An admission takes at least these: blocks it retained stay cached."""
        assert self.published_probe is not None
        known = req.prompt_tokens + req.generated
        count = 0
        while count < (known - 1) // self.block_tokens and self.published_probe(req.hash_at(count)):
            count += 1
        return count

    def _scheduled(self, step_id: int, rid: str, computed_before: int, tokens: int) -> _Req | None:
        """The observer's record of a request a step schedules (None: it never arrived)."""
        req = self.requests.get(rid)
        if req is None:
            self._fail(1, f"step {step_id} schedules {rid}, which never arrived")
            return None
        if req.state != "running":
            self._fail(1, f"step {step_id} schedules {rid} in state {req.state}")
        req.scheduled_end = max(req.scheduled_end, computed_before + tokens)
        if req.fresh and req.cached_at_admit is not None \
                and computed_before < req.cached_at_admit * self.block_tokens:
            self._fail(13, f"{rid} was admitted with its first {req.cached_at_admit} blocks in the device prefix "
                           f"cache, but its first step computes from token {computed_before}: a hit takes the "
                           f"longest cached prefix")
        if req.fresh:
            # The first chunk after an admission starts where the hit (device cache or a
            # completed load) ends: those tokens are valid content.
            req.valid_tokens = computed_before
            req.confirmed_count = computed_before
            req.fresh = False
            if req.hit_state == "pending":
                req.hit_state = "checked"
                req.hit_due = computed_before // self.block_tokens
                self._hit_due.append(req)
        return req

    def _on_plan(self, plan: Any) -> None:
        bt = self.block_tokens
        entries = []
        writes: list[_Write] = []
        total = 0
        prompt_chunks: list[list[Any]] = []
        fills: list[list[Any]] = []
        for entry in plan.entries:
            total += entry.num_tokens
            req = self._scheduled(plan.step_id, entry.request_id, entry.computed_before, entry.num_tokens)
            if req is None:
                continue
            self._check_entry(plan.step_id, req, entry)
            end = entry.computed_before + entry.num_tokens
            chunk = [entry.request_id, entry.computed_before, entry.num_tokens]
            if entry.computed_before < req.prompt_tokens:
                prompt_chunks.append(chunk)
            elif end % bt < entry.num_tokens:
                fills.append(chunk)
            first = entry.computed_before // bt
            last = (entry.computed_before + entry.num_tokens - 1) // bt
            table = entry.block_table
            busy = self._busy_blocks
            for i, block in enumerate(table) if busy and not busy.keys().isdisjoint(table) else ():
                for job in busy.get(block, ()):
                    if job.kind == "load" or first <= i <= last:
                        self._fail(2, f"step {plan.step_id}: {entry.request_id} "
                                      f"{'writes' if first <= i <= last else 'reads'} device block {block} "
                                      f"while {job.kind} job {job.job_id} still moves it")
            self._step_provenance(plan.step_id, req, entry, writes)
            entries.append((entry.request_id, req.epoch, entry.computed_before, entry.num_tokens))
            req.computed = end
            if entry.samples:
                req.in_flight_samples += 1
                self._samplers.setdefault(plan.step_id, []).append((entry.request_id, req.epoch))
        if self.max_batched_tokens is not None and total > self.max_batched_tokens:
            self._fail(11, f"step {plan.step_id} schedules {total} tokens, the budget is {self.max_batched_tokens}")
        elif self.max_batched_tokens is not None and getattr(plan, "totals", None) is None:
            self._check_work_conserved(plan, total)
        if self.deferred_frees and writes:
            self._own_writes[plan.step_id] = {w[0] for w in writes}
        recorded = self._plan_records.pop(plan.step_id, None)
        if recorded is not None and (recorded[0] != prompt_chunks or recorded[1] != fills):
            self._fail(0, f"step {plan.step_id}: the step record lists prompt chunks {recorded[0]} and fills "
                          f"{recorded[1]}, the plan computes {prompt_chunks} and fills {fills}")
        # Prefill tokens (what the cost model prices as prefill): every chunk of more than one token.
        prefill = sum(e.num_tokens for e in plan.entries if e.num_tokens > 1)
        if getattr(plan, "prefill_tokens", prefill) != prefill:
            self._fail(0, f"step {plan.step_id}: the plan's prefill_tokens is {plan.prefill_tokens!r}, its entries "
                          f"hold {prefill} tokens in chunks of more than one")
        if recorded is not None and recorded[2] is not None and recorded[2] != prefill:
            self._fail(0, f"step {plan.step_id}: the step record says {recorded[2]} prefill tokens, the plan has "
                          f"{prefill} in chunks of more than one token")
        self._plan_step(plan.step_id, entries, writes)

    def _check_work_conserved(self, plan: Any, total: int) -> None:
        """11: a step that leaves token budget unused leaves out no running request that has
        tokens to compute, needs no new device block for them, and has not already
        sampled its last token (delivered or in flight: no step past ``max_tokens``). A
        preemption or a failure this tick may cut the pass short, and a request short of a
        block may stop it (waiting for an in-flight step to give blocks back): then the
        step is not judged."""
        assert self.max_batched_tokens is not None
        if self._pass_cut or total >= self.max_batched_tokens:
            return
        planned = {e.request_id for e in plan.entries}
        idle: list[_Req] = []
        bt = self.block_tokens
        for req in self.requests.values():
            if req.state != "running" or req.request_id in planned:
                continue
            known = req.prompt_tokens + req.generated + req.in_flight_samples
            if known <= req.computed:
                continue  # every known token is computed: it waits for its sample
            if req.max_tokens is not None and req.generated + req.in_flight_samples >= req.max_tokens:
                continue  # its last token is sampled already
            if -(-(req.computed + min(known - req.computed, self.max_batched_tokens)) // bt) > -(-req.computed // bt):
                return  # a chunk of it may need a new block: it may have stopped the pass
            idle.append(req)
        if idle:
            req = idle[0]
            self._fail(11, f"step {plan.step_id} schedules {total} of {self.max_batched_tokens} budget tokens but "
                           f"leaves out running {req.request_id}, which has "
                           f"{req.prompt_tokens + req.generated + req.in_flight_samples - req.computed} tokens to "
                           f"compute ({req.computed} computed) and needs no new block (work conservation)")

    def _check_entry(self, step_id: int, req: _Req, entry: Any) -> None:
        """11: a step computes at least one token of a request, never a position past the
        last one it may compute (its prompt plus ``max_tokens`` - 1: the last sampled token
        is never an input), and names no block hashes beyond what that allows."""
        bt = self.block_tokens
        end = entry.computed_before + entry.num_tokens
        table = getattr(entry, "block_table", None)
        if table is not None and len(table) != -(-end // bt):
            self._fail(8, f"step {step_id}: {req.request_id} computes tokens up to {end} with {len(table)} device "
                          f"blocks; it needs {-(-end // bt)} (a request holds the blocks of its tokens, no more)")
        if entry.num_tokens <= 0:
            self._fail(11, f"step {step_id} schedules {entry.num_tokens} tokens of {req.request_id}")
        if req.max_tokens is not None and end > req.prompt_tokens + req.max_tokens - 1:
            self._fail(11, f"step {step_id} computes {req.request_id} up to token {end}, past its last input "
                           f"{req.prompt_tokens + req.max_tokens - 1} (prompt {req.prompt_tokens} + max_tokens "
                           f"{req.max_tokens} - 1)")
        hashes = getattr(entry, "block_hashes", None)
        if hashes is not None:
            # Its known tokens never exceed one more than the furthest it ever computed.
            most = max(req.arrival_blocks, -(-(max(req.scheduled_end, req.prompt_tokens) + 1) // bt))
            if len(hashes) > most + 1:
                self._fail(11, f"step {step_id} names {len(hashes)} block hashes for {req.request_id}, which has at "
                               f"most {most} blocks of known tokens")
            elif len(hashes) < end // bt:
                # The driver writes each block's content under its hash (live runs).
                self._fail(11, f"step {step_id} fills {end // bt} full blocks of {req.request_id} but names only "
                               f"{len(hashes)} block hashes")

    def _step_provenance(self, step_id: int, req: _Req, entry: Any, writes: list[_Write]) -> None:
        """10 for one step entry: the blocks holding tokens 0..computed_before hold this
        request's tokens (its own writes of this epoch, in flight or not, or confirmed
        blocks: device-cache hits, loads, joins); then the step writes its chunk."""
        bt = self.block_tokens
        before, n, table = entry.computed_before, entry.num_tokens, entry.block_table
        me = (req.request_id, req.epoch)
        # Full blocks that passed for this request in this epoch still pass while the device
        # holds the very same provenance objects in them: those only ever gain confirmed or
        # written tokens in place (a long decode would re-read its whole context every step).
        # A replaced block drops the request's passed blocks (_set_device); the block table's
        # prefix is compared whole.
        passed: list[int] = req.passed if req.passed_epoch == req.epoch else []
        start = len(passed)
        if start and (start > len(table) or tuple(table[:start]) != tuple(passed)):
            start = 0
            passed = []
        req.passed, req.passed_epoch = passed, req.epoch
        readers = self._readers
        for i in range(start, -(-before // bt)):
            need = min(bt, before - i * bt)
            if i >= len(table):
                self._fail(10, f"step {step_id}: {req.request_id} reads {before} cached tokens with a block table "
                               f"of {len(table)} blocks")
                return
            prov = self._device.get(table[i], _UNKNOWN)
            key = req.hash_at(i)
            own = prov.writer == me
            if prov.bad is not None or prov.key != key or prov.filled < need or (not own and prov.confirmed < need):
                what = "its own block" if own else "a hit"
                self._fail(10, f"step {step_id}: {req.request_id} reads device block {table[i]} as its block {i} "
                               f"({what}: tokens {i * bt}..{i * bt + need - 1}), but it {_describe(prov, need, key)}")
                return
            if need == bt and len(passed) == i:
                passed.append(table[i])
                readers.setdefault(table[i], set()).add(req.request_id)
        end = before + n
        for i in range(before // bt, -(-end // bt)):
            if i >= len(table):
                self._fail(10, f"step {step_id}: {req.request_id} computes tokens up to {end} with a block table "
                               f"of {len(table)} blocks")
                return
            block = table[i]
            key = req.hash_at(i)
            upto = min(bt, end - i * bt)
            current = self._device.get(block)
            if current is not None and current.writer == me and current.key == key and i * bt < before:
                current.filled = max(current.filled, upto)
            elif current is not None and current.writer is None and current.key == key and current.bad is None \
                    and current.filled >= upto:
                pass  # a loaded or hit block recomputed in part: the same tokens again
            else:
                self._set_device(block, _Prov(key, upto, 0, me))
            writes.append((block, key, upto, me))

    # ---- end of inputs -------------------------------------------------------------------------
    def finish(self) -> None:
        """Invariant 7 once inputs stop: every job ended on every rank, every request finished."""
        self.end_input()
        self._line = None
        if self.stats_probe is not None:
            # Once inputs stop (the counters only grow, so a drift shows at the end; a bug
            # that breaks a rule and, through it, a counter is reported by its rule first).
            stats = self.stats_probe()
            for problem in self.tally.compare(stats):
                self._fail(13, f"engine counters disagree with its trace: {problem}")
            waits, deferrals = getattr(stats, "prefetch_waits", None), getattr(stats, "deferrals", None)
            if isinstance(waits, int) and waits < len(self._waited):
                self._fail(13, f"stats.prefetch_waits is {waits}, but admissions passed requests waiting on "
                               f"{len(self._waited)} prefetches in flight (jobs {sorted(self._waited)})")
            elif isinstance(deferrals, dict):
                for policy, n in Counter(self._waited.values()).items():
                    if deferrals.get(policy, 0) < n:
                        self._fail(13, f"stats.deferrals[{policy!r}] is {deferrals.get(policy, 0)}, but {n} "
                                       f"requests waited on their prefetches under its patience")
        open_jobs = [job for job in self.jobs.values() if not job.complete and not job.reclaimed]
        waiting_on_io = [(rid, req) for rid, req in self.requests.items() if req.state in IO_WAIT_STATES]
        if self.cut is not None:
            # Cut short: the reports and answers this work waited for never had a chance.
            signal = self.cut.get("signal")
            t = self.cut.get("t")
            cause = f"interrupted ({signal})" if signal is not None else f"ended by an error ({self.cut.get('error')})"
            self.unchecked.append(
                f"run {cause} at t={t}: {len(open_jobs)} job(s) and {len(waiting_on_io)} "
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
            elif self.finish_probe is not None and (kept := self.finish_probe(rid)) != req.finished_at:
                self._fail(13, f"{rid}: the engine's metrics keep finish time {kept}, the trace says it finished at "
                               f"t={req.finished_at}")
                break
            if self.preemptions_probe is not None and (counted := self.preemptions_probe(rid)) is not None \
                    and counted != req.preemptions:
                self._fail(13, f"{rid}: the engine counts {counted} preemptions of it, the trace has {req.preemptions}")
                break

    def states(self) -> dict[str, str]:
        return {rid: req.state for rid, req in self.requests.items()}


class CounterTally:
    """13, counters: what the engine's records say its counters (``engine.stats``, which
    ``kvlife run`` reports) must be. Each counter is incremented where the engine writes
    the record counted here; a counter that drifts from its records misreports the run."""

    JOBS = {"load": ("loads", "blocks_loaded"), "store": ("stores", "blocks_stored"),
            "prefetch": ("prefetches", "blocks_prefetched")}

    # failed_blocks: the failed blocks each job_done record counts.
    COUNTED = ("ticks", "steps", "sync_lookups", "async_lookups", "stale_lookup_answers", "failed_lookups",
               "preemptions", "prefetch_gave_up", "loads", "blocks_loaded", "stores", "blocks_stored",
               "prefetches", "blocks_prefetched", "redundant_block_loads", "expired_lookups", "failed_blocks")

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.warnings: Counter[str] = Counter()
        self.defers: Counter[str] = Counter()
        self._failed_answer = False  # the lookup answer being handled says the lookup failed

    def feed(self, record: dict[str, Any]) -> None:
        kind = record.get("kind")
        if kind == "input":
            kind_in = record.get("type")
            if kind_in == "tick":
                self.counts["ticks"] += 1
            self._failed_answer = kind_in == "lookup_answer" and record.get("tiers") is None
        elif kind == "step":
            self.counts["steps"] += 1
            self.counts["sync_lookups"] += int(record.get("sync_lookups") or 0)
        elif kind == "stale_lookup":
            self.counts["stale_lookup_answers"] += 1
        elif kind == "transition" and record.get("trigger") == "lookup_answered" and self._failed_answer:
            self.counts["failed_lookups"] += 1
        elif kind == "job" and record.get("op") in self.JOBS:
            jobs, blocks = self.JOBS[str(record.get("op"))]
            self.counts[jobs] += 1
            self.counts[blocks] += int(record.get("blocks") or 0)
        elif kind == "job_done":
            self.counts["failed_blocks"] += int(record.get("failed") or 0)
        elif kind == "transition" and record.get("trigger") == "preempted":
            self.counts["preemptions"] += 1
        elif kind == "transition" and record.get("trigger") == "lookup_expired":
            self.counts["expired_lookups"] += 1
        elif kind == "warning":
            self.warnings[str(record.get("what"))] += 1
        elif kind == "decision" and record.get("point") == "admission" and record.get("value") == "defer":
            self.defers[str(record.get("policy"))] += 1
        elif kind == "decision" and record.get("point") == "prefetch_patience" and record.get("value") == "compute":
            self.counts["prefetch_gave_up"] += 1

    def compare(self, stats: Any) -> list[str]:
        problems = []
        for name in self.COUNTED:
            value = getattr(stats, name, None)
            if isinstance(value, int) and value != self.counts[name]:
                problems.append(f"stats.{name} is {value}, the trace says {self.counts[name]}")
        warnings = getattr(stats, "warnings", None)
        if isinstance(warnings, dict) and {k: v for k, v in warnings.items() if v} != dict(self.warnings):
            problems.append(f"stats.warnings is {dict(warnings)}, the trace has {dict(self.warnings)}")
        timeouts = getattr(stats, "rank_timeouts", None)
        if isinstance(timeouts, int) and timeouts != self.warnings["rank_timeout"]:
            problems.append(f"stats.rank_timeouts is {timeouts}, the trace warns {self.warnings['rank_timeout']}")
        deferrals, waits = getattr(stats, "deferrals", None), getattr(stats, "prefetch_waits", None)
        # A deferral is an admission decision to defer (recorded when it changes) or a wait
        # for a prefetch (stats.prefetch_waits, by the patience policy).
        if isinstance(deferrals, dict) and isinstance(waits, int) and (
                sum(deferrals.values()) != sum(self.defers.values()) + waits
                or any(deferrals.get(p, 0) < n for p, n in self.defers.items())):
            problems.append(f"stats.deferrals is {dict(deferrals)}: the trace has {dict(self.defers)} "
                                f"admission deferrals and stats.prefetch_waits is {waits}")
        return problems


def _describe(prov: _Prov, need: int, key: int | None = None) -> str:
    """What a device block or tier copy holds, for a provenance finding; ``need``: how many
    of its tokens were read, ``key``: the block hash they should be of."""
    if prov is _UNKNOWN:
        return "was never written"
    if prov.bad is not None:
        return f"holds no usable content ({prov.bad})"
    if key is not None and prov.key != key:
        return f"holds block {prov.key}"
    who = f" (written by {prov.writer[0]} in epoch {prov.writer[1]})" if prov.writer is not None else ""
    if prov.filled < need:
        return f"holds only {prov.filled} of the {need} tokens read{who}"
    return (f"holds {prov.filled} tokens of which only {prov.confirmed} were confirmed by a step output"
            f"{who}: a block published or copied before its step's output")


def _valid(job: _Job, req: _Req) -> int:
    return req.valid_tokens if job.valid_at is None else job.valid_at


def _unconfirmed_store(job: _Job, req: _Req, end: int, valid: int) -> str:
    """Invariant 5's message: which of the stored positions no step output vouched for,
    and which of them are placeholders (tokens sampled by steps whose output has not
    arrived: their KV is being written by a step in flight, the bug of vLLM #27644)."""
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
