"""What the engine knows: one explicit state object, and the records it keeps.

``EngineState`` is plain data: the requests and their queues, the device block pool, the
tier indexes, the jobs in flight, per-rank report aggregation, the counters, the virtual
time ``now`` and the commands produced for the event being handled. ``core.Engine``
creates one and hands it to each of its parts (``lifecycle.Lifecycle``,
``transfers.Transfers``, ``scheduler.Scheduler``); no part keeps engine state of its own.
The methods here only answer questions about the state (for drivers and checks); the
parts change it.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs

from kvlife.lifecycle.config import EngineConfig
from kvlife.lifecycle.engine.blocks import DeviceBlockPool, extend_hashes
from kvlife.lifecycle.engine.events import BlockMove, Command, TierMove
from kvlife.lifecycle.engine.ranks import RankAggregator
from kvlife.lifecycle.engine.request import Request
from kvlife.policies.base import EngineView
from kvlife.specs.table import TABLE, ReferenceRequest
from kvlife.transfer.index import TierIndex

Recorder = Callable[[dict[str, Any]], None]
# Given a finished request as it leaves the engine (EngineState.retire).
Retire = Callable[[Request], None]


@attrs.define(slots=True, eq=False)
class Job:
    job_id: int
    kind: str  # "load" or "store"
    request_id: str
    moves: tuple[BlockMove, ...]
    started_ms: float
    waiters: list[tuple[str, int]]  # (request id, epoch) told when the job completes
    timed_out: bool = False  # given up at its deadline: quarantined until reported or reclaimed


@attrs.define(slots=True, eq=False)
class DecodeCohort:
    """The running requests that just decode, one token a step, each for a known number of
    steps more: no prompt chunk, no block filled or allocated, no store, no finish
    (``scheduler.Scheduler._cohort_tick`` plans their share of a step as one sum, without
    looking at each; the other running requests of the step, its *specials*, are planned
    the ordinary way). A member's token counts are not kept up to date while it is one:
    ``settle`` brings them up to date from the steps planned and confirmed since it joined.
    A member leaves when its steps run out (``expiry``) and is a special for that step; a
    special that just decodes again joins. Anything else that needs a member's numbers
    drops the whole cohort first (``EngineState.drop_cohort``)."""

    # Member -> (the cohort step it joined at, its computed and generated tokens then).
    members: dict[Request, tuple[int, int, int]] = attrs.Factory(dict)
    expiry: dict[int, list[Request]] = attrs.Factory(dict)  # step index -> members it ends
    # The running requests that are not members, and some that left ``running`` since.
    outsiders: list[Request] = attrs.Factory(list)
    step: int = 0  # steps planned (the index of the next one)
    outputs: int = 0  # outputs taken of the steps planned
    before: int = 0  # the sum of the members' computed tokens before the next step
    # The specials' entries of the step in flight (``EngineState.steps``), until its output.
    planned: list[tuple[Request, int, int, bool]] | None = None
    # Admission found the head of ``waiting`` blocked and did nothing else (see
    # ``scheduler.Scheduler._cohort_admit``): it would again, before ``quiet_until`` (the
    # next deadline), while nothing it read has changed (``Scheduler.admission_quiet``):
    # the head's epoch, lookup answer and ``quiet_mark`` (the tiers' version, the device
    # blocks freed so far), its blocks in the device cache (``DeviceBlockPool.watch``) and
    # its blocks in the tiers (``quiet_loads``, each (hash, tier); looked at only when a
    # tier's ``removals`` moved since ``quiet_removals``).
    quiet_head: Request | None = None
    quiet_until: float = 0.0
    quiet_mark: tuple[int, tuple[str, ...] | None, int, int] = (0, None, 0, 0)
    quiet_loads: tuple[tuple[int, str], ...] = ()
    quiet_removals: tuple[tuple[TierIndex, int], ...] = ()  # each tier's removals when last checked

    def settle(self, req: Request) -> None:
        """Bring member ``req``'s token counts up to date: one computed token (a
        placeholder until its output) per step planned since it joined, one confirmed and
        generated per output taken."""
        joined, computed, generated = self.members[req]
        planned = self.step - joined
        confirmed = self.outputs - joined
        req.computed = computed + planned
        req.confirmed = computed + confirmed
        req.generated = generated + confirmed
        req.placeholders = planned - confirmed


@attrs.define(slots=True, eq=False)
class PrefetchJob:
    """A pull of lower-tier blocks into the host tier, started at arrival (early prefetch).

    It holds no device block: the source tier pins what it reads, the host tier reserves
    the slots it writes. Kept apart from ``EngineState.jobs`` (device loads and stores)."""

    job_id: int
    request_id: str
    epoch: int
    moves: tuple[TierMove, ...]
    started_ms: float
    deadline_ms: float  # started_ms + the patience the policy chose when it started
    patience_policy: str
    deferred: bool = False  # its request has been deferred at least once waiting for it
    # Patience ran out and its request went on without it: whatever lands later is not
    # published in the host tier (the engine no longer vouches for the copy).
    abandoned: bool = False


@attrs.define
class Stats:
    ticks: int = 0
    steps: int = 0
    sync_lookups: int = 0
    async_lookups: int = 0
    stale_lookup_answers: int = 0
    failed_lookups: int = 0
    loads: int = 0
    blocks_loaded: int = 0
    redundant_block_loads: int = 0
    joined_blocks: int = 0
    stores: int = 0
    blocks_stored: int = 0
    failed_blocks: int = 0
    preemptions: int = 0
    deferrals: dict[str, int] = attrs.Factory(dict)
    warnings: dict[str, int] = attrs.Factory(dict)
    rank_timeouts: int = 0
    duplicate_lookups: int = 0  # submissions ignored because one is already pending
    prefetches: int = 0
    blocks_prefetched: int = 0
    prefetch_waits: int = 0  # admissions deferred to wait for a prefetch
    prefetch_gave_up: int = 0  # patience ran out: the missing blocks are computed instead
    expired_lookups: int = 0  # async lookups unanswered at engine.lookup_deadline_ms (a miss)
    reclaimed_jobs: int = 0  # jobs whose blocks were reclaimed at engine.reclaim_deadline_ms
    late_reports: int = 0  # rank reports for a job already reclaimed (ignored)


# A scheduled step's entry, kept until its output arrives: (request, its epoch then, tokens, samples).
StepEntry = tuple[Request, int, int, bool]


class EngineState:
    """Everything the engine knows. The parts read and change these fields directly."""

    __slots__ = (
        "config", "tiers", "pool", "ranks", "recorder", "reference", "now",
        "requests", "waiting", "running", "holding", "sent", "state_counts", "jobs", "in_flight_loads", "steps",
        "prefetches", "prefetch_waits", "wants_prefetch", "sync_lookup_version", "transfer_version",
        "stats", "commands", "next_job_id", "next_step_id", "next_seq", "last_output_step",
        "defer_frees", "deferred_frees", "retire", "retired", "retiring", "retire_mark",
        "lookup_timers", "reclaimed", "fast_limits", "cohort",
    )

    def __init__(
        self,
        config: EngineConfig,
        tiers: Sequence[TierIndex] | None = None,
        recorder: Recorder | None = None,
        reference: bool = False,
        retire: Retire | None = None,
    ) -> None:
        self.config = config
        # The tier cascade, in lookup order (host, disk, remote).
        self.tiers: dict[str, TierIndex] = {}
        for tier in tiers if tiers is not None else [
            TierIndex(t.name, t.capacity_blocks, t.eviction) for t in config.tiers
        ]:
            self.tiers[tier.name] = tier
        self.pool = DeviceBlockPool(config.device_blocks)
        self.ranks = RankAggregator(config.ranks)
        self.recorder = recorder  # gets every trace record; None: record nothing
        # Reference mode: a python-statemachine instance per request double-checks each move.
        self.reference: dict[str, ReferenceRequest] | None = {} if reference else None
        self.now = 0.0  # virtual time of the event being handled (the core never reads a clock)

        self.requests: dict[str, Request] = {}
        # vLLM's waiting queue: arrivals at the back, preempted requests at the front; a
        # request whose async lookup is pending stays in place (vLLM skips it) in state
        # ``lookup_pending``.
        self.waiting: list[Request] = []
        self.running: list[Request] = []  # in admission order; preemption takes the last
        # Requests in ``loading``, in the order their loads started (vLLM's queue of
        # waiting requests that hold KV blocks). One whose loads all landed is taken
        # into ``running`` by the next tick, before any waiting request.
        self.holding: list[Request] = []
        # Requests in ``sending`` whose stores all reported, waiting for the output of the
        # first step planned after they finished: vLLM frees a held request's blocks when
        # a worker reports finished_sending, which it can do at the earliest in the output
        # of the next step (the worker hears of the finish from that step's scheduler
        # output). With no step in flight, the next tick releases them.
        self.sent: list[Request] = []
        self.state_counts: dict[str, int] = dict.fromkeys(TABLE.states, 0)

        self.jobs: dict[int, Job] = {}  # device loads and stores in flight (and quarantined ones)
        # hash -> the loads bringing it, oldest first, as (job, block, req): a join joins the
        # first; a load of a hash with any entry is redundant (stats.redundant_block_loads).
        self.in_flight_loads: dict[int, list[tuple[int, int, str]]] = {}
        self.steps: dict[int, list[StepEntry]] = {}  # step id -> its entries, until its output
        self.prefetches: dict[int, PrefetchJob] = {}
        self.prefetch_waits: dict[str, PrefetchJob] = {}  # rid -> the prefetch it waits for
        self.wants_prefetch: dict[str, int] = {}  # rid -> epoch whose lookup answer starts one
        # Sync lookups are re-done (and re-paid on the critical path) each time the scheduler
        # considers the request again, as vLLM's get_num_new_matched_tokens is; to keep an
        # idle simulation from spinning, only once something may have changed in the tiers
        # (a transfer report arrived). rid -> transfer version at the last sync lookup.
        self.sync_lookup_version: dict[str, int] = {}
        self.transfer_version = 0
        # Deadlines of the async lookups submitted, in submission order (so in deadline
        # order): (due, request id, its ``async_lookups`` count then). An entry whose lookup
        # was answered, discarded or submitted again is stale and skipped.
        self.lookup_timers: deque[tuple[float, str, int]] = deque()
        # Jobs reclaimed at their deadline: job id -> the ranks whose report may still come
        # (recorded as late and ignored; the entry goes when the last one came).
        self.reclaimed: dict[int, set[int]] = {}

        self.stats = Stats()
        self.commands: list[Command] = []  # what the event being handled asks the driver to do
        self.next_job_id = 0
        self.next_step_id = 0
        self.next_seq = 0
        self.last_output_step = -1  # the latest step whose output arrived
        # Async scheduling with a connector (tiers): a step in flight may still write a
        # request's blocks, and a load into a reused block is not ordered against that
        # write, so blocks are given back only after the last step in flight that
        # scheduled them produced its output, and such a request is never preempted
        # (vLLM's defer_block_free). step id -> block tables to release at its output.
        self.defer_frees = config.async_scheduling and bool(self.tiers)
        self.deferred_frees: dict[int, list[list[int]]] = {}

        # Retention. None (the default): every request stays in ``requests`` for good.
        # Given: a finished request leaves ``requests`` once nothing refers to it any more
        # (no store job, no load job waiting to tell it, no prefetch), handed to ``retire``
        # first (``metrics.RequestTotals.fold``); ``core.Engine`` does it after each event.
        self.retire = retire
        # Requests that left: id -> epoch at the end (a duplicate arrival and a stale lookup
        # answer are recorded as if the request were still there). About 100 bytes each.
        self.retired: dict[str, int] = {}
        self.retiring: dict[str, Request] = {}  # finished, still referred to
        self.retire_mark: tuple[int, int, int] = (0, 0, 0)  # see core.Engine._retire_finished

        # The decode fast path (``scheduler.DecodeCohort``), off unless a driver turns it on
        # by giving every request's stop rule here (request id -> (output length at which it
        # stops, reason); the simulator's): it must know no request finishes in a step it
        # plans without looking at each request. ``cohort``: the running requests that
        # decode together, None when it is dropped (an ordinary tick, a member leaving).
        self.fast_limits: Mapping[str, tuple[int, str]] | None = None
        self.cohort: DecodeCohort | None = None

    def settle_cohort(self) -> None:
        """Bring every member's token counts up to date, the cohort kept (settling is
        idempotent: counts are derived from when each joined), for a reader of them."""
        cohort = self.cohort
        if cohort is not None:
            for req in cohort.members:
                cohort.settle(req)

    def drop_cohort(self) -> None:
        """Drop the decode cohort, its members' token counts settled; in a step still in
        flight, each member gets its own entry, so its output is taken the ordinary way."""
        cohort = self.cohort
        if cohort is None:
            return
        self.settle_cohort()
        self.cohort = None
        planned = cohort.planned
        if planned is not None:
            planned.extend((req, req.epoch, 1, True) for req in cohort.members)

    def drop_cohort_of(self, req: Request) -> None:
        """``req`` leaves ``running``: if it is a member of the decode cohort, drop the cohort
        (its members' step counts no longer hold as a whole); a special's leaving is its own."""
        cohort = self.cohort
        if cohort is not None and req in cohort.members:
            self.drop_cohort()

    def new_job_id(self) -> int:
        job_id = self.next_job_id
        self.next_job_id += 1
        return job_id

    def hit_candidates(self, req: Request) -> tuple[int, ...]:
        """The blocks a prefix hit may cover: the full blocks of its known tokens (the
        prompt, and after a preemption the tokens it generated), but at least one token
        is always computed, to produce the next output (vLLM: ``num_tokens - 1``)."""
        limit = (req.known_tokens - 1) // self.config.block_tokens
        if limit > len(req.hashes):
            self.ensure_hashes(req, limit)
        return req.hashes[:limit]

    def ensure_hashes(self, req: Request, blocks: int) -> None:
        """Give ``req`` hashes for its first ``blocks`` blocks (derived past the prompt)."""
        if blocks > len(req.hashes):
            req.hashes = extend_hashes(req.hashes, req.request_id, blocks)

    def last_step_with(self, req: Request) -> int | None:
        """The latest step in flight that scheduled ``req`` in its current epoch."""
        last = None
        for step_id, entries in self.steps.items():
            for entry in entries:
                if entry[0] is req and entry[1] == req.epoch:
                    last = step_id
                    break
        return last

    def sent_released(self, req: Request) -> bool:
        """May ``req`` (in ``sending``, stores all reported) finish now? Once the output of
        a step planned after it finished arrived (vLLM's finished_sending comes with it),
        or, with no step in flight, once a tick ran since."""
        if self.last_output_step >= req.sending_step:
            return True
        return not self.steps and self.stats.ticks > req.sending_tick

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.config.block_tokens)

    def sync_lookup(self, hashes: Sequence[int]) -> tuple[str, ...]:
        """Tier of each leading block present in some tier (the cascade's answer)."""
        tiers = list(self.tiers.values())
        found: list[str] = []
        for block in hashes:
            for tier in tiers:
                if tier.contains(block):
                    found.append(tier.name)
                    break
            else:
                break
        return tuple(found)

    def engine_view(self) -> EngineView:
        """What a policy sees of the engine."""
        return EngineView(
            now_ms=self.now,
            running=len(self.running),
            waiting=len(self.waiting),
            loading=self.state_counts["loading"],
            free_device_blocks=self.pool.free,
            device_blocks=self.pool.capacity,
        )

    def arrived(self) -> int:
        """Requests taken in so far (still in ``requests`` or retired); duplicates not counted."""
        return len(self.requests) + len(self.retired)

    def busy(self) -> bool:
        """True while some request is not finished or some job is in flight. A job given up
        after its deadline is quarantined, not work: its blocks stay held, but nothing waits."""
        return (
            self.state_counts["finished"] < len(self.requests) + len(self.retired)  # (the cheap test first)
            or bool(self.prefetches)
            or any(not job.timed_out for job in self.jobs.values())
        )

    def next_wakeup(self) -> float | None:
        """Earliest future time at which a deadline passes: a request's prefetch patience
        runs out, an async lookup expires (``lookup_deadline_ms``), a job's transfer or
        reclaim deadline passes. A driver should tick then even if nothing else happens
        (the core never sets timers; deadlines are acted on by the next tick)."""
        now = self.now
        soonest = math.inf
        for rid, job in self.prefetch_waits.items():
            if self.requests[rid].epoch != job.epoch or job.job_id not in self.prefetches:
                continue
            if now < job.deadline_ms < soonest:  # inf (wait_complete): its own report wakes it
                soonest = job.deadline_ms
        timers = self.lookup_timers
        while timers and not self._lookup_timer_live(timers[0]):
            timers.popleft()  # answered, discarded or submitted again: forget it
        for timer in timers:
            if timer[0] >= soonest:
                break
            if timer[0] > now and self._lookup_timer_live(timer):
                soonest = timer[0]
                break
        config = self.config
        transfer = config.transfer_deadline_ms
        reclaim = config.reclaim_deadline_ms
        # Jobs are kept in start order: the first one past ``now`` is the soonest.
        if transfer is not None:
            for device_job in self.jobs.values():
                if not device_job.timed_out and now < device_job.started_ms + transfer:
                    soonest = min(soonest, device_job.started_ms + transfer)
                    break
        for device_job in self.jobs.values():
            if now < device_job.started_ms + reclaim:
                soonest = min(soonest, device_job.started_ms + reclaim)
                break
        for pull in self.prefetches.values():
            if now < pull.started_ms + reclaim:
                soonest = min(soonest, pull.started_ms + reclaim)
                break
        return soonest if soonest != math.inf else None

    def _lookup_timer_live(self, timer: tuple[float, str, int]) -> bool:
        req = self.requests.get(timer[1])
        return req is not None and req.state == "lookup_pending" and req.async_lookups == timer[2]

    def stranded(self) -> list[str]:
        """Invariant 7 once inputs have stopped: every request not finished, as
        ``"id:state"``, in arrival order. Waiting and running count as much as the states
        that wait on IO: a request parked behind a head that never fits, or deferred forever
        by a policy, never finishes either. (A retired request is finished: never here.)"""
        return [f"{r.request_id}:{r.state}" for r in self.unfinished()]

    def unfinished(self) -> list[Request]:
        """The requests not finished, in arrival order (what ``stranded`` names)."""
        return [r for r in self.requests.values() if r.state != "finished"]

    def check_invariants(self) -> None:
        """Invariants 2 and 8 on current state (cheap enough for tests, not per tick)."""
        self.settle_cohort()  # (the members' numbers up to date; the fast path goes on)
        self.pool.check_accounting()
        for tier in self.tiers.values():
            tier.check_accounting()
        for job in self.jobs.values():
            for move in job.moves:
                if self.pool.refs[move.device_block] <= 0:
                    raise AssertionError(
                        f"job {job.job_id} uses device block {move.device_block} with no reference"
                    )


def moves_record(moves: Iterable[BlockMove]) -> list[list[int | str]]:
    return [[m.block_hash, m.device_block, m.tier] for m in moves]


def count_tiers(tiers: Iterable[str]) -> dict[str, int]:
    """Blocks per tier, in order of first appearance (trace records keep that order)."""
    return dict(Counter(tiers))
