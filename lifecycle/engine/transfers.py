"""Transfer jobs: loads into the device, stores out of it, prefetches between tiers.

A job is started with the blocks it moves pinned twice over: the device blocks by a
reference in the block pool, the tier slots in the tier index. It ends only when every
rank has reported it (``kvlife.lifecycle.engine.ranks``); then the pins go, failed blocks are
discarded from their tier, and the requests waiting on it are told (``_job_outcome``).
A rank that stays silent past the deadline fails the job for its requests, but the
job's blocks stay held until the late report comes (invariant 2).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import attrs

from kvlife.lifecycle.engine.events import (
    BlockMove,
    StartLoad,
    StartPrefetch,
    StartStore,
    TierMove,
    TransferReport,
)
from kvlife.lifecycle.engine.ranks import ReportStatus
from kvlife.lifecycle.engine.request import Request
from kvlife.lifecycle.engine.state import EngineState, Job, PrefetchJob, _count_tiers, _moves_record, _seq
from kvlife.policies.base import PrefetchView


class Transfers(EngineState):
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
        self._record({"kind": "job", "t": self.now, "job": job_id, "op": "prefetch", "req": req.request_id,
                      "blocks": len(moves), "tiers": _count_tiers(m.src_tier for m in moves),
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
                      "blocks": len(placed), "tiers": _count_tiers(m.tier for m in placed),
                      "moves": _moves_record(placed)})
        self._commands.append(StartLoad(job_id, req.request_id, tuple(placed)))

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
