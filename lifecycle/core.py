"""The sans-IO engine: input events in, commands out.

Like h11 for HTTP, the ``Engine`` never reads a clock, starts a thread, touches torch or
opens a socket. Drivers (the simulator, the live runtime) feed it ``lifecycle.events``
inputs and carry out the commands it returns. Every state change goes through the
compiled spec table (``specs.table``) and is recorded with its trigger and reason.

Follow one request: ``Arrival`` puts it in ``waiting``; a ``Tick`` runs the scheduler
(``_schedule``): running requests first, then FIFO admission, which looks the request
up in the tiers (sync, or async through ``lookup_pending``), asks the admission policy,
and either starts a load (``loading``) or schedules compute (``running``). ``StepOutput``
confirms computed tokens, triggers stores and finishes requests; a finished request
whose blocks a store still reads waits in ``sending``. ``TransferReport``s from every
rank complete jobs (``_job_done``).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs

from lifecycle.blocks import DeviceBlockPool
from lifecycle.config import EngineConfig
from lifecycle.events import (
    Abort,
    Arrival,
    BlockMove,
    Command,
    DiscardLookup,
    FreeBlocks,
    InputEvent,
    LookupAnswer,
    Scheduled,
    StartLoad,
    StartPrefetch,
    StartStore,
    StepOutput,
    StepPlan,
    SubmitLookup,
    Tick,
    TierMove,
    TransferReport,
    input_to_record,
)
from lifecycle.ranks import RankAggregator, ReportStatus
from lifecycle.request import Request
from policies.base import EngineView, LoadView, PolicyStack, PrefetchView
from specs.table import TABLE, ReferenceRequest
from transfer.index import TierIndex

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


class Engine:
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

    # ---- public API -------------------------------------------------------------------
    def handle(self, event: InputEvent) -> list[Command]:
        """Apply one input event; return the commands the driver must carry out."""
        if event.t < self.now:
            raise ValueError(f"time went backwards: {event.t} < {self.now}")
        self.now = event.t
        if self.recorder is not None:
            self.recorder(input_to_record(event))
        self._commands = []
        if isinstance(event, Tick):
            self._on_tick()
        elif isinstance(event, StepOutput):
            self._on_step_output(event)
        elif isinstance(event, TransferReport):
            self._transfer_version += 1
            if event.job_id in self.prefetches:
                self._on_prefetch_report(event)
            else:
                self._on_transfer_report(event)
        elif isinstance(event, LookupAnswer):
            self._on_lookup_answer(event)
        elif isinstance(event, Arrival):
            self._on_arrival(event)
        elif isinstance(event, Abort):
            self._on_abort(event)
        else:  # pragma: no cover - the union is closed
            raise TypeError(f"not an input event: {event!r}")
        return self._commands

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

    # ---- recording --------------------------------------------------------------------
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

    # ---- arrivals, aborts, lookups -------------------------------------------------------
    def _on_arrival(self, event: Arrival) -> None:
        if event.request_id in self.requests:
            self._warn("duplicate_arrival", req=event.request_id)
            return
        full_blocks = event.prompt_tokens // self.config.block_tokens
        req = Request(
            request_id=event.request_id,
            seq=self._next_seq,
            arrival_ms=event.t,
            prompt_tokens=event.prompt_tokens,
            hashes=tuple(event.block_hashes[:full_blocks]),
            resumable=event.resumable,
            block_tokens=self.config.block_tokens,
        )
        self._next_seq += 1
        self.requests[req.request_id] = req
        self.state_counts["waiting"] += 1
        if self.reference is not None:
            self.reference[req.request_id] = ReferenceRequest(req.request_id)
        if self._blocks_for(req.prompt_tokens + 1) > self.pool.capacity:
            self._finish(req, "failed", "error", f"prompt needs more than the {self.pool.capacity} device blocks")
            return
        bisect.insort(self.waiting, req, key=_seq)
        action = self._ask(req, "on_arrival") if self.tiers else "none"
        if action in ("lookup", "prefetch"):
            if action == "prefetch":
                self._wants_prefetch[req.request_id] = req.epoch
            self.waiting.remove(req)
            self._submit_lookup(req, f"early {action} at arrival")

    def _submit_lookup(self, req: Request, reason: str) -> None:
        if req.state == "lookup_pending":
            # Idempotent: the pending lookup for this epoch will answer; never a second one.
            self.stats.duplicate_lookups += 1
            return
        self._sync_lookup_version.pop(req.request_id, None)
        self.stats.async_lookups += 1
        self._commands.append(SubmitLookup(req.request_id, req.epoch, self._hit_candidates(req)))
        self._move(req, "lookup_submitted", reason)

    def _on_lookup_answer(self, event: LookupAnswer) -> None:
        req = self.requests.get(event.request_id)
        if req is None or req.state != "lookup_pending" or req.epoch != event.epoch:
            self.stats.stale_lookup_answers += 1
            self._record(
                {
                    "kind": "stale_lookup",
                    "t": self.now,
                    "req": event.request_id,
                    "epoch": event.epoch,
                    "current_epoch": None if req is None else req.epoch,
                    "state": None if req is None else req.state,
                }
            )
            return
        if event.tiers is None:
            self.stats.failed_lookups += 1
            req.lookup = ()
            reason = "lookup failed: treated as a miss"
        else:
            req.lookup = tuple(t for t in event.tiers if t in self.tiers)
            reason = f"lookup answered: {len(req.lookup)} blocks in tiers"
        self._move(req, "lookup_answered", reason)
        bisect.insort(self.waiting, req, key=_seq)
        if self._wants_prefetch.pop(req.request_id, None) == req.epoch:
            self._start_prefetch(req)

    def _on_abort(self, event: Abort) -> None:
        req = self.requests.get(event.request_id)
        if req is None or req.state == "finished":
            self._warn("abort_ignored", req=event.request_id, state=None if req is None else req.state)
            return
        if req.state == "lookup_pending":
            self._commands.append(DiscardLookup(req.request_id, req.epoch))
        self._sync_lookup_version.pop(req.request_id, None)
        self._wants_prefetch.pop(req.request_id, None)
        self.prefetch_waits.pop(req.request_id, None)
        self._finish(req, "aborted", "aborted", "client aborted")

    def _hit_candidates(self, req: Request) -> tuple[int, ...]:
        # At least one prompt token is always computed, to produce the first output.
        limit = (req.prompt_tokens - 1) // self.config.block_tokens
        return req.hashes[:limit]

    # ---- early prefetch: lower tier -> host tier, and the patience to wait for it --------
    def _start_prefetch(self, req: Request) -> None:
        host = self.tiers.get("host")
        if host is None or not req.lookup:
            return
        candidates = self._hit_candidates(req)
        lower = [
            (candidates[i], tier)
            for i, tier in enumerate(req.lookup[: len(candidates)])
            if tier != "host" and self.pool.block_of(candidates[i]) is None
            and self.tiers[tier].contains(candidates[i])
        ]
        if not lower:
            return
        plan = host.prepare_store([h for h, _ in lower])
        if plan.evicted:
            self._record({"kind": "evict", "t": self.now, "tier": host.name, "blocks": list(plan.evicted)})
        if not plan.accepted:
            return
        source = dict(lower)
        moves = tuple(
            TierMove(h, source[h], self.tiers[source[h]].prepare_load([h])[0], host.name, slot)
            for h, slot in plan.accepted
        )
        job_id = self._new_job_id()
        view = PrefetchView(
            blocks=len(moves),
            tokens=len(moves) * self.config.block_tokens,
            source_tiers=tuple(m.src_tier for m in moves),
            started_ms=self.now,
        )
        patience = float(self._ask(req, "prefetch_patience", view))
        policy = req.last_decisions["prefetch_patience"][0]
        job = PrefetchJob(job_id, req.request_id, req.epoch, moves, self.now, self.now + patience, policy)
        self.prefetches[job_id] = job
        self.prefetch_waits[req.request_id] = job
        self.ranks.open(job_id)
        self.stats.prefetches += 1
        self.stats.blocks_prefetched += len(moves)
        tiers: dict[str, int] = {}
        for move in moves:
            tiers[move.src_tier] = tiers.get(move.src_tier, 0) + 1
        self._record({"kind": "job", "t": self.now, "job": job_id, "op": "prefetch", "req": req.request_id,
                      "blocks": len(moves), "tiers": tiers,
                      "moves": [[m.block_hash, m.src_tier, m.dst_tier] for m in moves]})
        self._commands.append(StartPrefetch(job_id, req.request_id, moves))

    def _on_prefetch_report(self, event: TransferReport) -> None:
        outcome = self.ranks.report(event.job_id, event.rank, event.failed)
        if outcome.status is ReportStatus.PENDING:
            return
        if outcome.status is not ReportStatus.DONE:
            self._warn(outcome.status.value + "_report", job=event.job_id, rank=event.rank)
            return
        job = self.prefetches.pop(event.job_id)
        bad = set(outcome.failed)
        host = self.tiers[job.moves[0].dst_tier]
        landed: list[int] = []
        lost: list[int] = []
        for move in job.moves:
            source = self.tiers[move.src_tier]
            source.complete_load([move.block_hash])
            if move.block_hash in bad:
                source.discard([move.block_hash])
                lost.append(move.block_hash)
            else:
                landed.append(move.block_hash)
        host.complete_store(landed, ok=True)
        host.complete_store(lost, ok=False)
        self.stats.failed_blocks += len(lost)
        self._record({"kind": "job_done", "t": self.now, "job": job.job_id, "op": "prefetch",
                      "failed": len(lost), "late": False})
        if self.prefetch_waits.get(job.request_id) is job:
            del self.prefetch_waits[job.request_id]
        req = self.requests.get(job.request_id)
        if req is None or req.epoch != job.epoch or req.lookup is None:
            return
        # The owner now reads the landed blocks from the host tier, and computes from the
        # first block that failed to land.
        landed_set = set(landed)
        lost_set = set(lost)
        candidates = self._hit_candidates(req)
        tiers: list[str] = []
        for i, tier in enumerate(req.lookup[: len(candidates)]):
            if candidates[i] in lost_set:
                break
            tiers.append(host.name if candidates[i] in landed_set else tier)
        req.lookup = tuple(tiers)

    def _prefetch_gate(self, req: Request) -> str:
        """"deferred" while the request's prefetch is in flight and its patience lasts."""
        job = self.prefetch_waits[req.request_id]
        if req.epoch != job.epoch or job.job_id not in self.prefetches:
            del self.prefetch_waits[req.request_id]
            return "go"
        if self.now < job.deadline_ms:
            if not job.deferred:
                job.deferred = True
                self.stats.prefetch_waits += 1
                self.stats.deferrals[job.patience_policy] = self.stats.deferrals.get(job.patience_policy, 0) + 1
            return "deferred"
        del self.prefetch_waits[req.request_id]
        in_flight = {m.block_hash for m in job.moves}
        lookup = req.lookup or ()
        candidates = self._hit_candidates(req)
        keep = 0
        while keep < min(len(lookup), len(candidates)) and candidates[keep] not in in_flight:
            keep += 1
        self.stats.prefetch_gave_up += 1
        self._record({"kind": "decision", "t": self.now, "req": req.request_id, "point": "prefetch_patience",
                      "policy": job.patience_policy, "value": "compute",
                      "reason": f"patience ran out after {self.now - job.started_ms:.1f} ms: "
                                f"{len(lookup) - keep} hit blocks still in flight are computed"})
        req.lookup = lookup[:keep]
        return "go"

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

    # ---- the scheduler tick --------------------------------------------------------------
    def _on_tick(self) -> None:
        self.stats.ticks += 1
        if self.config.transfer_deadline_ms is not None:
            self._expire_jobs(self.config.transfer_deadline_ms)
        budget = self.config.max_batched_tokens
        entries: list[tuple[Request, int, bool]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            want = req.known_tokens - req.computed
            if want <= 0:
                i += 1
                continue
            n = min(want, budget)
            need = self._blocks_for(req.computed + n) - len(req.block_table)
            while need > self.pool.free:
                victim = self.running[-1]
                if victim is req and len(self.running) == 1 and not self.jobs:
                    self._finish(req, "failed", "error",
                                 f"needs {need} more blocks and nothing else holds any")
                    break
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req.state != "running":
                break
            if need > 0:
                req.block_table.extend(self.pool.allocate(need))
            entries.append(self._schedule(req, n))
            budget -= n
            i += 1
        sync_lookups = 0
        if not preempted:
            budget, sync_lookups = self._admit(budget, entries)
        self._emit_plan(entries, sync_lookups)

    def _schedule(self, req: Request, n: int) -> tuple[Request, int, bool]:
        samples = req.computed + n >= req.known_tokens
        req.computed += n
        if samples:
            req.placeholders += 1
        return (req, n, samples)

    def _emit_plan(self, entries: list[tuple[Request, int, bool]], sync_lookups: int) -> None:
        self.stats.sync_lookups += sync_lookups
        if not entries and not sync_lookups:
            return
        step_id = self._next_step
        self._next_step += 1
        self.stats.steps += 1
        scheduled = []
        prefill = 0
        prompt_chunks = []  # (request, computed before, tokens) of steps that compute prompt tokens
        for req, n, samples in entries:
            before = req.computed - n
            scheduled.append(Scheduled(req.request_id, n, before, samples, tuple(req.block_table), req.hashes))
            if n > 1:
                prefill += n
            if before < req.prompt_tokens:
                prompt_chunks.append([req.request_id, before, n])
        self.steps[step_id] = [(req, req.epoch, n, samples) for req, n, samples in entries]
        self._record(
            {
                "kind": "step",
                "t": self.now,
                "step": step_id,
                "requests": len(entries),
                "prefill_tokens": prefill,
                "sync_lookups": sync_lookups,
                "prompt": prompt_chunks,
            }
        )
        self._commands.append(StepPlan(step_id, tuple(scheduled), sync_lookups))
        for req, _, _ in entries:
            if req.stored_blocks < len(req.hashes):
                self._maybe_store(req)

    def _admit(self, budget: int, entries: list[tuple[Request, int, bool]]) -> tuple[int, int]:
        sync_lookups = 0
        active = len(self.running) + self.state_counts["loading"]
        index = 0
        while index < len(self.waiting) and budget > 0 and active < self.config.max_running:
            req = self.waiting[index]
            if req.request_id in self.prefetch_waits and self._prefetch_gate(req) == "deferred":
                index += 1
                continue
            stale = self._sync_lookup_version.get(req.request_id, self._transfer_version)
            if req.lookup is None or stale != self._transfer_version:
                if not self.tiers:
                    req.lookup = ()
                elif self._ask(req, "lookup_mode") == "async":
                    del self.waiting[index]
                    self._submit_lookup(req, "async lookup submitted")
                    continue
                else:
                    req.lookup = self.sync_lookup(self._hit_candidates(req))
                    self._sync_lookup_version[req.request_id] = self._transfer_version
                    sync_lookups += 1
            outcome = self._try_admit(req, budget, entries)
            if outcome == "blocked":
                break  # FIFO: no overtaking when memory or budget is short
            if outcome == "deferred":
                index += 1
                continue
            del self.waiting[index]
            self._sync_lookup_version.pop(req.request_id, None)
            active += 1
            if outcome == "running":
                budget -= entries[-1][1]
        return budget, sync_lookups

    def _try_admit(self, req: Request, budget: int, entries: list[tuple[Request, int, bool]]) -> str:
        bt = self.config.block_tokens
        candidates = self._hit_candidates(req)
        device = self.pool.cached_prefix(candidates)
        assert req.lookup is not None
        # Re-validate the lookup: a block may have been evicted since the answer.
        plan: list[tuple[int, str]] = []  # (hash, "device" | tier) for blocks past the device hit
        # After a failed load, external hits stop before the first block that failed, so
        # a bad or unreachable copy is never retried forever.
        external_end = min(len(req.lookup), len(candidates), req.external_hit_limit)
        for i in range(device, external_end):
            block = candidates[i]
            if self.pool.block_of(block) is not None:
                plan.append((block, "device"))
            elif self.tiers[req.lookup[i]].contains(block):
                plan.append((block, req.lookup[i]))
            else:
                break
        to_load = [(h, t) for h, t in plan if t != "device"]
        in_flight = tuple(
            (h, self.in_flight_loads[h][2]) for h, _ in to_load if h in self.in_flight_loads
        )
        join = False
        if to_load:
            load_view = LoadView(
                device_hit_blocks=device,
                external_hit_blocks=len(plan),
                tiers=tuple(t for _, t in plan),
                in_flight=in_flight,
            )
            choice = self._ask(req, "admission", load_view)
            if choice == "defer":
                return "deferred"
            join = choice == "join"
        hit_blocks = device + len(plan)
        hit_hashes = candidates[:hit_blocks]
        joined = {h for h, _ in in_flight} if join else set()
        own_loads = [(h, t) for h, t in to_load if h not in joined]
        if own_loads or joined:
            compute_tokens = 0
            new_blocks = len(own_loads)
        else:
            compute_tokens = min(req.known_tokens - hit_blocks * bt, budget)
            new_blocks = self._blocks_for(hit_blocks * bt + compute_tokens) - hit_blocks
        reclaim = sum(
            1
            for h in hit_hashes
            if (b := self.pool.block_of(h)) is not None and self.pool.refs[b] == 0
        )
        if new_blocks + reclaim > self.pool.free:
            return "blocked"
        # Commit: build the block table in prefix order.
        # Take the cached hits first: allocating could otherwise recycle one of them.
        table: list[int] = []
        own_moves: list[BlockMove] = []
        join_jobs: list[int] = []
        tier_of = dict(to_load)
        for h in hit_hashes:
            if h in joined:
                job_id, block, _ = self.in_flight_loads[h]
                self.pool.retain([block])
                table.append(block)
                if job_id not in join_jobs:
                    join_jobs.append(job_id)
                self.stats.joined_blocks += 1
            elif h not in tier_of:
                table.append(self.pool.acquire_cached(h))
            else:
                table.append(-1)
        fresh = iter(self.pool.allocate(len(own_loads)))
        for i, h in enumerate(hit_hashes):
            if table[i] == -1:
                table[i] = next(fresh)
                own_moves.append(BlockMove(h, table[i], tier_of[h], -1))
        req.block_table = table
        if req.preemptions == 0 and not req.tier_hit_blocks and not req.device_hit_blocks:
            # Hit rates describe what the request found when it first came in.
            req.device_hit_blocks = device
            for _, t in plan:
                req.tier_hit_blocks[t] = req.tier_hit_blocks.get(t, 0) + 1
        if own_moves or join_jobs:
            req.load_jobs = list(join_jobs)
            req.load_failed = []
            req.hit_tokens_pending = hit_blocks * bt
            for job_id in join_jobs:
                self.jobs[job_id].waiters.append((req.request_id, req.epoch))
            reason = f"loading {len(own_moves)} blocks"
            if join_jobs:
                reason += f", joined {len(joined)} in-flight blocks of jobs {join_jobs}"
            if own_moves:
                self._start_load(req, own_moves)
            self._move(req, "load_started", reason)
            return "loading"
        req.computed = req.confirmed = hit_blocks * bt
        req.registered_blocks = hit_blocks
        if new_blocks:
            req.block_table.extend(self.pool.allocate(new_blocks))
        self._move(req, "admitted", f"admitted with {hit_blocks} hit blocks on device")
        self.running.append(req)
        entries.append(self._schedule(req, compute_tokens))
        return "running"

    def _start_load(self, req: Request, moves: list[BlockMove]) -> None:
        job_id = self._new_job_id()
        placed = []
        for move in moves:
            slot = self.tiers[move.tier].prepare_load([move.block_hash])[0]
            placed.append(attrs.evolve(move, slot=slot))
            if move.block_hash in self.in_flight_loads:
                self.stats.redundant_block_loads += 1
            else:
                self.in_flight_loads[move.block_hash] = (job_id, move.device_block, req.request_id)
        self.pool.retain(m.device_block for m in placed)
        job = Job(job_id, "load", req.request_id, tuple(placed), self.now, [(req.request_id, req.epoch)])
        self.jobs[job_id] = job
        self.ranks.open(job_id)
        req.load_jobs.append(job_id)
        self.stats.loads += 1
        self.stats.blocks_loaded += len(placed)
        self._record({"kind": "job", "t": self.now, "job": job_id, "op": "load", "req": req.request_id,
                      "blocks": len(placed), "tiers": _count_tiers(placed), "moves": _moves_record(placed)})
        self._commands.append(StartLoad(job_id, req.request_id, tuple(placed)))

    def _new_job_id(self) -> int:
        job_id = self._next_job
        self._next_job += 1
        return job_id

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release_request_blocks(req)
        req.computed = req.confirmed = 0
        req.placeholders = 0
        req.registered_blocks = 0
        req.epoch += 1
        req.lookup = None
        req.preemptions += 1
        self.stats.preemptions += 1
        self._move(req, "preempted", f"out of device blocks ({self.pool.free} free)")
        bisect.insort(self.waiting, req, key=_seq)

    # ---- step outputs, stores, finishing ------------------------------------------------
    def _on_step_output(self, event: StepOutput) -> None:
        entries = self.steps.pop(event.step_id, None)
        if entries is None:
            self._warn("unknown_step", step=event.step_id)
            return
        finished = dict(event.finished)
        for req, epoch, n, samples in entries:
            if req.state != "running" or req.epoch != epoch:
                continue  # preempted or aborted while the step ran: its output is void
            req.confirmed += n
            if samples:
                req.placeholders -= 1
                req.generated += 1
                if req.first_token_ms is None:
                    req.first_token_ms = self.now
            if req.registered_blocks < len(req.hashes):
                self._register_computed(req)
            if req.stored_blocks < len(req.hashes):
                self._maybe_store(req)  # before finishing: the last step's blocks are stored too
            reason = finished.pop(req.request_id, None)
            if reason is not None:
                self._finish_generation(req, reason)
        for rid in finished:
            self._warn("finish_for_unscheduled_request", req=rid, step=event.step_id)

    def _register_computed(self, req: Request) -> None:
        full = min(req.confirmed // self.config.block_tokens, len(req.hashes))
        while req.registered_blocks < full:
            i = req.registered_blocks
            self.pool.register(req.block_table[i], req.hashes[i])
            req.registered_blocks += 1

    def _maybe_store(self, req: Request) -> None:
        bt = self.config.block_tokens
        if not self.tiers or req.stored_blocks >= len(req.hashes):
            return
        if min(req.computed // bt, len(req.hashes)) <= req.stored_blocks:
            return  # no new block boundary crossed: nothing to ask
        limit = self._ask(req, "store_limit")
        upto = min(limit // bt, len(req.hashes), len(req.block_table))
        if upto <= req.stored_blocks:
            return
        hashes = req.hashes[req.stored_blocks : upto]
        blocks = req.block_table[req.stored_blocks : upto]
        req.stored_blocks = upto
        for tier in self.tiers.values():
            plan = tier.prepare_store(hashes)
            if plan.evicted:
                self._record({"kind": "evict", "t": self.now, "tier": tier.name, "blocks": list(plan.evicted)})
            if not plan.accepted:
                continue
            device_of = dict(zip(hashes, blocks, strict=True))
            moves = tuple(BlockMove(h, device_of[h], tier.name, slot) for h, slot in plan.accepted)
            job_id = self._new_job_id()
            self.pool.retain(m.device_block for m in moves)
            self.jobs[job_id] = Job(job_id, "store", req.request_id, moves, self.now, [(req.request_id, req.epoch)])
            self.ranks.open(job_id)
            req.store_jobs += 1
            self.stats.stores += 1
            self.stats.blocks_stored += len(moves)
            self._record({"kind": "job", "t": self.now, "job": job_id, "op": "store", "req": req.request_id,
                          "blocks": len(moves), "tiers": {tier.name: len(moves)}, "moves": _moves_record(moves)})
            self._commands.append(StartStore(job_id, req.request_id, moves))

    def _finish_generation(self, req: Request, reason: str) -> None:
        self.running.remove(req)
        if req.store_jobs and self._ask(req, "hold_at_finish", req.store_jobs):
            req.finish_reason = reason
            req.finish_ms = self.now
            self._move(req, "send_started", f"finished ({reason}); {req.store_jobs} stores still read its blocks")
            return
        self._finish(req, "completed", reason, f"finished ({reason})")

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

    # ---- transfer reports ------------------------------------------------------------
    def _on_transfer_report(self, event: TransferReport) -> None:
        outcome = self.ranks.report(event.job_id, event.rank, event.failed)
        if outcome.status in (ReportStatus.PENDING,):
            return
        if outcome.status is not ReportStatus.DONE:
            self._warn(outcome.status.value + "_report", job=event.job_id, rank=event.rank)
            return
        job = self.jobs.pop(event.job_id)
        self._record({"kind": "job_done", "t": self.now, "job": job.job_id, "op": job.kind,
                      "failed": len(outcome.failed), "late": job.timed_out})
        self._release_job(job, outcome.failed)
        if not job.timed_out:
            self._job_outcome(job, outcome.failed)

    def _release_job(self, job: Job, failed: Sequence[int]) -> None:
        bad = set(failed)
        hashes = [m.block_hash for m in job.moves]
        if job.kind == "load":
            for move in job.moves:
                tier = self.tiers[move.tier]
                tier.complete_load([move.block_hash])
                if move.block_hash in bad:
                    tier.discard([move.block_hash])
                    self.pool.forget(move.device_block)
                elif not job.timed_out:
                    self.pool.register(move.device_block, move.block_hash)
                owner = self.in_flight_loads.get(move.block_hash)
                if owner is not None and owner[0] == job.job_id:
                    del self.in_flight_loads[move.block_hash]
        else:
            by_tier: dict[str, list[int]] = {}
            for move in job.moves:
                by_tier.setdefault(move.tier, []).append(move.block_hash)
            for name, blocks in by_tier.items():
                good = [h for h in blocks if h not in bad and not job.timed_out]
                failed_here = [h for h in blocks if h in bad or job.timed_out]
                self.tiers[name].complete_store(good, ok=True)
                self.tiers[name].complete_store(failed_here, ok=False)
        if bad:
            self.stats.failed_blocks += len(bad & set(hashes))
        freed = self.pool.release(m.device_block for m in job.moves)
        if freed:
            self._free_blocks(freed)

    def _job_outcome(self, job: Job, failed: Sequence[int]) -> None:
        bad = set(failed)
        if job.kind == "store":
            owner = self.requests[job.request_id]
            owner.store_jobs -= 1
            if owner.state == "sending" and owner.store_jobs == 0:
                self._finish(owner, "completed", owner.finish_reason or "stopped",
                             "every rank reported its stores")
            return
        for rid, epoch in job.waiters:
            req = self.requests[rid]
            if req.state != "loading" or req.epoch != epoch or job.job_id not in req.load_jobs:
                continue
            req.load_jobs.remove(job.job_id)
            req.load_failed.extend(m.block_hash for m in job.moves if m.block_hash in bad
                                   and m.block_hash in req.hashes)
            if not req.load_jobs:
                self._load_finished(req)

    def _load_finished(self, req: Request) -> None:
        if not req.load_failed:
            req.computed = req.confirmed = req.hit_tokens_pending
            req.registered_blocks = req.hit_tokens_pending // self.config.block_tokens
            self.running.append(req)
            self._move(req, "load_done", "every rank reported the load")
            return
        failed = len(req.load_failed)
        action = self._ask(req, "on_load_failure", failed)
        if action == "fail":
            self._finish(req, "failed", "error", f"{failed} blocks failed to load")
            return
        position = {h: i for i, h in enumerate(req.hashes)}
        first_bad = min((position[h] for h in req.load_failed if h in position), default=0)
        req.external_hit_limit = min(req.external_hit_limit, first_bad)
        self._release_request_blocks(req)
        req.epoch += 1
        req.lookup = None
        req.computed = req.confirmed = 0
        self._move(req, "load_failed", f"{failed} blocks failed to load: recompute them")
        bisect.insort(self.waiting, req, key=_seq)

    def _expire_jobs(self, deadline: float) -> None:
        for job in list(self.jobs.values()):
            if job.timed_out or self.now - job.started_ms < deadline:
                continue
            job.timed_out = True
            self.stats.rank_timeouts += 1
            missing = self.ranks.missing_ranks(job.job_id)
            self._warn("rank_timeout", job=job.job_id, ranks=list(missing),
                       note="job failed on those ranks; its blocks stay held until they report")
            if job.kind == "load":
                # Nobody may join a load that has already been given up on.
                for move in job.moves:
                    owner = self.in_flight_loads.get(move.block_hash)
                    if owner is not None and owner[0] == job.job_id:
                        del self.in_flight_loads[move.block_hash]
            self._job_outcome(job, [m.block_hash for m in job.moves])


def _seq(req: Request) -> int:
    return req.seq


def _moves_record(moves: Iterable[BlockMove]) -> list[list[int | str]]:
    return [[m.block_hash, m.device_block, m.tier] for m in moves]


def _count_tiers(moves: Iterable[BlockMove]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for move in moves:
        counts[move.tier] = counts.get(move.tier, 0) + 1
    return counts
