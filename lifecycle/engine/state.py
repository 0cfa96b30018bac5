"""What the connector core knows: one explicit state object, and the records it keeps.

``CoreState`` is plain data: the requests as the connector sees them, the tier indexes,
the jobs in flight, per-rank report aggregation, the steps in flight (their scheduled
chunks, for the tokens each output confirms), what goes to the workers with the next step,
the counters, the time ``now`` and the commands produced for the call being handled.
``connector.ConnectorCore`` creates one and hands it to its parts (``lifecycle.Lifecycle``,
``jobs.Transfers``); no part keeps state of its own. The scheduler's state (queues, block
pool, vLLM's request records) is the scheduler's (``scheduler.Scheduler``).
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs

from kvlife.lifecycle.config import EngineConfig
from kvlife.lifecycle.engine.blocks import extend_hashes
from kvlife.lifecycle.engine.events import BlockMove, Command, TierMove
from kvlife.lifecycle.engine.ranks import RankAggregator
from kvlife.lifecycle.engine.request import Request
from kvlife.specs.names import RequestState
from kvlife.specs.table import TABLE, ReferenceRequest
from kvlife.transfer.index import TierIndex

Recorder = Callable[[dict[str, Any]], None]
# Given a finished request as it leaves the engine (CoreState.retire).
Retire = Callable[[Request], None]


@attrs.define(slots=True, eq=False)
class Job:
    job_id: int
    kind: str  # "load" or "store"
    request_id: str
    epoch: int  # the request's epoch it was started for
    moves: tuple[BlockMove, ...]
    started_ms: float
    # A join: this load copies device blocks another load fills (``after``: that job), once
    # it has landed, instead of reading the tier again.
    after: int | None = None
    timed_out: bool = False  # given up at its deadline: quarantined until reported or reclaimed
    flushed: bool = False  # its request was preempted: the workers finish it before the next step
    abandoned: bool = False  # given up: workers still owing it report it failed


@attrs.define(slots=True, eq=False)
class PrefetchJob:
    """A pull of lower-tier blocks into the host tier, started at arrival (early prefetch).

    It holds no device block: the source tier pins what it reads, the host tier reserves
    the slots it writes. Kept apart from ``CoreState.jobs`` (device loads and stores)."""

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
    failed_loads: int = 0  # load jobs some block of which failed
    failed_stores: int = 0  # store jobs likewise
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
    flushed_stores: int = 0  # stores of preempted requests finished before the next step


# One request's share of a step in flight, as the connector was told of it in
# build_connector_meta: (request, its epoch then, tokens computed before, tokens, samples).
StepEntry = tuple[Request, int, int, int, bool]


class CoreState:
    """Everything the connector core knows. Its parts read and change these fields directly."""

    __slots__ = (
        "config", "tiers", "ranks", "recorder", "reference", "now", "requests", "state_counts", "jobs",
        "in_flight_loads", "steps", "prefetches", "prefetch_waits", "wants_prefetch", "sync_lookup_version",
        "transfer_version", "lookup_timers", "reclaimed", "stats", "commands", "next_job_id", "next_seq",
        "out_loads", "out_stores", "out_prefetches", "out_flush", "out_abandon", "out_holds", "sync_keys",
        "retire", "retired", "retiring", "held_blocks", "given_up_loads",
        "held", "moves", "observing",
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
        self.ranks = RankAggregator(config.ranks)
        self.recorder = recorder  # gets every trace record; None: record nothing
        # Reference mode: a python-statemachine instance per request double-checks each move.
        self.reference: dict[str, ReferenceRequest] | None = {} if reference else None
        self.now = 0.0  # the driver's time of the call being handled (the core never reads a clock)

        self.requests: dict[str, Request] = {}
        self.state_counts: dict[str, int] = dict.fromkeys(TABLE.states, 0)
        self.jobs: dict[int, Job] = {}  # device loads and stores in flight (and quarantined ones)
        # hash -> the loads bringing it from a tier, oldest first, as (job, block, req): a
        # join copies from the first; a second load of a hash is redundant.
        self.in_flight_loads: dict[int, list[tuple[int, int, str]]] = {}
        self.steps: deque[tuple[int, list[StepEntry]]] = deque()  # steps in flight, oldest first
        self.prefetches: dict[int, PrefetchJob] = {}
        self.prefetch_waits: dict[str, PrefetchJob] = {}  # rid -> the prefetch it waits for
        self.wants_prefetch: dict[str, int] = {}  # rid -> epoch whose lookup answer starts one
        # A sync lookup's answer is kept until something in the tiers may have changed (a
        # transfer report): rid -> transfer version at its last sync lookup.
        self.sync_lookup_version: dict[str, int] = {}
        self.transfer_version = 0
        # Deadlines of the async lookups submitted, in submission order (so in deadline
        # order): (due, request id, its ``async_lookups`` count then).
        self.lookup_timers: deque[tuple[float, str, int]] = deque()
        # Jobs reclaimed at their deadline: job id -> the ranks whose report may still come.
        self.reclaimed: dict[int, set[int]] = {}
        self.stats = Stats()
        self.commands: list[Command] = []  # what the call being handled asks the driver to do
        self.next_job_id = 0
        self.next_seq = 0
        # What goes to the workers with the next step (``build_connector_meta``).
        self.out_loads: list[Job] = []
        self.out_stores: list[Job] = []
        self.out_prefetches: list[PrefetchJob] = []
        self.out_flush: list[int] = []
        self.out_abandon: list[int] = []
        self.out_holds: list[str] = []
        self.sync_keys: list[int] = []  # blocks each sync lookup of this pass asked about
        # Device blocks the core holds itself (quarantined jobs): job id -> blocks.
        self.held_blocks: dict[int, tuple[int, ...]] = {}
        # Requests whose load was given up at a deadline since the last step output: the
        # scheduler cuts each to 0 computed tokens with that output.
        self.given_up_loads: set[str] = set()
        # Finished requests whose blocks the scheduler holds until finished_sending, in the
        # order they finished (``Request.hold``).
        self.held: dict[str, Request] = {}
        self.moves = 0  # transitions made (a driver tells an idle pass from one that changed something)
        # Recording another connector (``ConnectorCore.observe_*``): its answers and jobs are
        # observed, not decided; no policy is asked, no tier index mirrors its storage.
        self.observing = False

        # Retention (see ``connector.ConnectorCore.retire_finished``).
        self.retire = retire
        self.retired: dict[str, int] = {}  # id -> epoch at the end
        self.retiring: dict[str, Request] = {}  # finished, still referred to

    def new_job_id(self) -> int:
        job_id = self.next_job_id
        self.next_job_id += 1
        return job_id

    def hit_candidates(self, req: Request) -> tuple[int, ...]:
        """The blocks a prefix hit may cover: the full blocks of its known tokens (the
        prompt, and after a preemption the tokens it generated), but at least one token
        is always computed, to produce the next output (vLLM: ``num_tokens - 1``)."""
        limit = (req.prompt_tokens + req.generated - 1) // self.config.block_tokens
        if limit > len(req.hashes):
            self.ensure_hashes(req, limit)
        return req.hashes[:limit]

    def ensure_hashes(self, req: Request, blocks: int) -> None:
        """Give ``req`` hashes for its first ``blocks`` blocks (derived past the prompt)."""
        if blocks > len(req.hashes):
            req.hashes = extend_hashes(req.hashes, req.request_id, blocks)

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

    def arrived(self) -> int:
        """Requests taken in so far (still in ``requests`` or retired); duplicates not counted."""
        return len(self.requests) + len(self.retired)

    def busy(self) -> bool:
        """True while some request is not finished or some job is in flight. A job given up
        after its deadline is quarantined, not work: nothing waits for it."""
        return (
            self.state_counts[RequestState.FINISHED] < len(self.requests) + len(self.retired)
            or bool(self.prefetches)
            or any(not job.timed_out for job in self.jobs.values())
            or bool(self.held)  # a step output must give their blocks back
        )

    def next_wakeup(self) -> float | None:
        """Earliest future time at which a deadline passes: a request's prefetch patience
        runs out, an async lookup expires (``lookup_deadline_ms``), a job's transfer or
        reclaim deadline passes. A driver should tick then even if nothing else happens
        (the core never sets timers; deadlines are acted on by the next tick)."""
        now = self.now
        soonest = math.inf
        for rid, wait in self.prefetch_waits.items():
            req = self.requests.get(rid)
            if req is None or req.epoch != wait.epoch or wait.job_id not in self.prefetches:
                continue
            if now < wait.deadline_ms < soonest:  # inf (wait_complete): its own report wakes it
                soonest = wait.deadline_ms
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
            for job in self.jobs.values():
                if not job.timed_out and now < job.started_ms + transfer:
                    soonest = min(soonest, job.started_ms + transfer)
                    break
        for job in self.jobs.values():
            if now < job.started_ms + reclaim:
                soonest = min(soonest, job.started_ms + reclaim)
                break
        for pull in self.prefetches.values():
            if now < pull.started_ms + reclaim:
                soonest = min(soonest, pull.started_ms + reclaim)
                break
        return soonest if soonest != math.inf else None

    def _lookup_timer_live(self, timer: tuple[float, str, int]) -> bool:
        req = self.requests.get(timer[1])
        return req is not None and req.state == RequestState.LOOKUP_PENDING and req.async_lookups == timer[2]

    def unfinished(self) -> list[Request]:
        """The requests not finished, in arrival order."""
        return [r for r in self.requests.values() if r.state != RequestState.FINISHED]


def moves_record(moves: Iterable[BlockMove], positions: Mapping[int, int] | None = None) -> list[list[int | str]]:
    """A job record's moves; a stored block whose name a reader cannot derive (inside vLLM,
    a block of generated tokens named by vLLM's hash) adds its position in its request."""
    if not positions:
        return [[m.block_hash, m.device_block, m.tier] for m in moves]
    out: list[list[int | str]] = []
    for m in moves:
        move: list[int | str] = [m.block_hash, m.device_block, m.tier]
        if m.block_hash in positions:
            move.append(positions[m.block_hash])
        out.append(move)
    return out


def count_tiers(tiers: Iterable[str]) -> dict[str, int]:
    """Blocks per tier, in order of first appearance (trace records keep that order)."""
    return dict(Counter(tiers))
