"""The engine's state and the small operations every part of it shares.

``EngineState`` holds what the engine knows (requests, queues, the device block pool,
the tier indexes, jobs in flight, per-rank aggregation) and the primitives the other
parts use: recording, moving a request through the compiled spec table, asking the
policy stack, finishing a request and releasing its blocks. The scheduler
(``kvlife.lifecycle.engine.scheduler``), the transfer jobs (``kvlife.lifecycle.engine.transfers``) and the event
handlers (``kvlife.lifecycle.engine.core``) build on it, in that order.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs

from kvlife.lifecycle.config import EngineConfig
from kvlife.lifecycle.engine.blocks import DeviceBlockPool
from kvlife.lifecycle.engine.events import (
    BlockMove,
    Command,
    FreeBlocks,
    SubmitLookup,
    TierMove,
)
from kvlife.lifecycle.engine.ranks import RankAggregator
from kvlife.lifecycle.engine.request import Request
from kvlife.policies.base import EngineView
from kvlife.policies.stack import PolicyStack
from kvlife.specs.table import TABLE, ReferenceRequest
from kvlife.transfer.index import TierIndex

Recorder = Callable[[dict[str, Any]], None]


@attrs.define(slots=True, eq=False)
class Job:
    job_id: int
    kind: str  # "load" or "store"
    request_id: str
    moves: tuple[BlockMove, ...]
    started_ms: float
    waiters: list[tuple[str, int]]  # (request id, epoch) told when the job completes
    timed_out: bool = False


@attrs.define(slots=True, eq=False)
class PrefetchJob:
    """A pull of lower-tier blocks into the host tier, started at arrival (early prefetch).

    It holds no device block: the source tier pins what it reads, the host tier reserves
    the slots it writes. Kept apart from ``Engine.jobs`` (device loads and stores)."""

    job_id: int
    request_id: str
    epoch: int
    moves: tuple[TierMove, ...]
    started_ms: float
    deadline_ms: float  # started_ms + the patience the policy chose when it started
    patience_policy: str
    deferred: bool = False  # its request has been deferred at least once waiting for it


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


class EngineState:
    def __init__(
        self,
        config: EngineConfig,
        policies: PolicyStack,
        tiers: Sequence[TierIndex] | None = None,
        recorder: Recorder | None = None,
        reference: bool = False,
    ) -> None:
        self.config = config
        self.policies = policies
        self.tiers: dict[str, TierIndex] = {}
        for tier in tiers if tiers is not None else [
            TierIndex(t.name, t.capacity_blocks, t.eviction) for t in config.tiers
        ]:
            self.tiers[tier.name] = tier
        self.pool = DeviceBlockPool(config.device_blocks)
        self.ranks = RankAggregator(config.ranks)
        self.recorder = recorder
        self.reference: dict[str, ReferenceRequest] | None = {} if reference else None
        self.now = 0.0
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # sorted by seq: FIFO, preempted ones keep their place
        self.running: list[Request] = []  # in admission order; preemption takes the last
        self.jobs: dict[int, Job] = {}
        self.in_flight_loads: dict[int, tuple[int, int, str]] = {}  # hash -> (job, block, req)
        self.steps: dict[int, list[tuple[Request, int, int, bool]]] = {}
        self.state_counts: dict[str, int] = dict.fromkeys(TABLE.states, 0)
        self.stats = Stats()
        self._next_job = 0
        self._next_step = 0
        self._next_seq = 0
        self._commands: list[Command] = []
        # Sync lookups are re-done (and re-paid on the critical path) each time the scheduler
        # considers the request again, as vLLM's get_num_new_matched_tokens is; to keep an
        # idle simulation from spinning, only once something may have changed in the tiers
        # (a transfer report arrived). rid -> transfer version at the last sync lookup.
        self._sync_lookup_version: dict[str, int] = {}
        self._transfer_version = 0
        self.prefetches: dict[int, PrefetchJob] = {}
        self.prefetch_waits: dict[str, PrefetchJob] = {}  # rid -> the prefetch it waits for
        self._wants_prefetch: dict[str, int] = {}  # rid -> epoch whose lookup answer starts one

    def busy(self) -> bool:
        """True while some request is not finished or some job is in flight. A job given up
        after its deadline is quarantined, not work: its blocks stay held, but nothing waits."""
        return (
            any(not job.timed_out for job in self.jobs.values())
            or bool(self.prefetches)
            or self.state_counts["finished"] < len(self.requests)
        )

    def next_wakeup(self) -> float | None:
        """Earliest future time at which a request's prefetch patience runs out: a driver
        should tick then even if nothing else happens (the core never sets timers)."""
        soonest: float | None = None
        for rid, job in self.prefetch_waits.items():
            if self.requests[rid].epoch != job.epoch or job.job_id not in self.prefetches:
                continue
            if not math.isfinite(job.deadline_ms):
                continue  # wait_complete: the prefetch's own report wakes the scheduler
            if self.now < job.deadline_ms and (soonest is None or job.deadline_ms < soonest):
                soonest = job.deadline_ms
        return soonest

    def stranded(self) -> list[str]:
        """Invariant 7 after inputs stop: requests stuck in a state that waits on IO."""
        return [
            f"{r.request_id}:{r.state}"
            for r in self.requests.values()
            if r.state in ("lookup_pending", "loading", "sending")
        ]

    def check_invariants(self) -> None:
        """Invariants 2 and 8 on current state (cheap enough for tests, not per tick)."""
        self.pool.check_accounting()
        for tier in self.tiers.values():
            tier.check_accounting()
        for job in self.jobs.values():
            for move in job.moves:
                if self.pool.refs[move.device_block] <= 0:
                    raise AssertionError(
                        f"job {job.job_id} uses device block {move.device_block} with no reference"
                    )

    def engine_view(self) -> EngineView:
        return EngineView(
            now_ms=self.now,
            running=len(self.running),
            waiting=len(self.waiting),
            loading=self.state_counts["loading"],
            free_device_blocks=self.pool.free,
            device_blocks=self.pool.capacity,
        )

    def _record(self, record: dict[str, Any]) -> None:
        if self.recorder is not None:
            self.recorder(record)

    def _warn(self, what: str, **fields: Any) -> None:
        self.stats.warnings[what] = self.stats.warnings.get(what, 0) + 1
        self._record({"kind": "warning", "t": self.now, "what": what, **fields})

    def _move(self, req: Request, trigger: str, reason: str) -> None:
        source = req.state
        target = TABLE.target(req.request_id, source, trigger)
        if self.reference is not None:
            ref = self.reference.setdefault(req.request_id, ReferenceRequest(req.request_id))
            if ref.fire(trigger) != target:
                raise AssertionError(f"reference and table disagree on {req.request_id} {trigger}")
        req.state = target
        self.state_counts[source] -= 1
        self.state_counts[target] += 1
        if self.recorder is not None:
            self.recorder(
                {
                    "kind": "transition",
                    "t": self.now,
                    "req": req.request_id,
                    "from": source,
                    "to": target,
                    "trigger": trigger,
                    "reason": reason,
                }
            )

    def _ask(self, req: Request, hook: str, *args: Any) -> Any:
        answer = self.policies.ask(hook, req.view(), *args, self.engine_view())
        last = req.last_decisions.get(hook)
        current = (answer.policy, answer.value, answer.reason)
        if last != current:
            # Log a decision when it changes, not on every tick it is re-asked.
            req.last_decisions[hook] = current
            if hook == "admission" and answer.value == "defer":
                key = answer.policy
                self.stats.deferrals[key] = self.stats.deferrals.get(key, 0) + 1
            self._record(
                {
                    "kind": "decision",
                    "t": self.now,
                    "req": req.request_id,
                    "point": hook,
                    "policy": answer.policy,
                    "value": answer.value,
                    "reason": answer.reason,
                }
            )
        return answer.value

    def _hit_candidates(self, req: Request) -> tuple[int, ...]:
        # At least one prompt token is always computed, to produce the first output.
        limit = (req.prompt_tokens - 1) // self.config.block_tokens
        return req.hashes[:limit]

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

    def _submit_lookup(self, req: Request, reason: str) -> None:
        if req.state == "lookup_pending":
            # Idempotent: the pending lookup for this epoch will answer; never a second one.
            self.stats.duplicate_lookups += 1
            return
        self._sync_lookup_version.pop(req.request_id, None)
        self.stats.async_lookups += 1
        self._commands.append(SubmitLookup(req.request_id, req.epoch, self._hit_candidates(req)))
        self._move(req, "lookup_submitted", reason)

    def _finish(self, req: Request, trigger: str, reason: str, why: str) -> None:
        if req in self.running:
            self.running.remove(req)
        if req.state == "waiting" and req in self.waiting:
            self.waiting.remove(req)
        self._release_request_blocks(req)
        req.epoch += 1
        req.finish_reason = reason
        if req.finish_ms is None or trigger != "completed":
            req.finish_ms = self.now
        self._move(req, trigger, why)

    def _release_request_blocks(self, req: Request) -> None:
        if req.block_table:
            freed = self.pool.release(req.block_table)
            req.block_table = []
            if freed:
                self._free_blocks(freed)
        req.load_jobs = []

    def _free_blocks(self, freed: list[int]) -> None:
        self._record({"kind": "free", "t": self.now, "blocks": freed})
        self._commands.append(FreeBlocks(tuple(freed)))

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.config.block_tokens)

    def _new_job_id(self) -> int:
        job_id = self._next_job
        self._next_job += 1
        return job_id



def _seq(req: Request) -> int:
    return req.seq


def _moves_record(moves: Iterable[BlockMove]) -> list[list[int | str]]:
    return [[m.block_hash, m.device_block, m.tier] for m in moves]


def _count_tiers(tiers: Iterable[str]) -> dict[str, int]:
    """Blocks per tier, in order of first appearance (trace records keep that order)."""
    return dict(Counter(tiers))
