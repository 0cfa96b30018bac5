"""Transfer jobs: loads into the device, stores out of it, prefetches between tiers.

``Transfers`` starts jobs for the scheduler (``start_load``, ``maybe_store``) and for
early prefetch (``start_prefetch``), and takes the ranks' reports (``on_report``).

A job is started with the blocks it moves pinned twice over: the device blocks by a
reference in the block pool, the tier slots in the tier index. It ends only when every
rank has reported it (``kvlife.lifecycle.engine.ranks``); then the pins go
(``release_job``), failed blocks are discarded from their tier, and the requests waiting
on it are told (``job_outcome``): a load's requests are ready for the next tick to take
into ``running``, or go back to ``waiting`` to recompute what failed; a finished request
in ``sending`` finishes once its last store is done and a scheduler step has run since it
finished (vLLM's ``finished_sending`` comes with a later step's worker output).

Deadlines, each acted on by the tick (``Scheduler.tick``) and each traced with its reason:

- a rank that stays silent past ``transfer_deadline_ms`` fails the job for its requests
  (``expire_jobs``: a ``rank_timeout`` warning; a load's requests move ``load_failed``
  with a "transfer deadline" reason, a store's request in ``sending`` finishes), but the
  job's blocks stay held (quarantined) until the late report comes (invariant 2);
- past ``reclaim_deadline_ms`` a job some rank never reported is given up if it was not
  already, and its device blocks and tier slots are reclaimed (``reclaim_jobs``: a
  ``reclaim`` record): an abort during loading or sending never leaks them to a silent
  rank (vLLM: VLLM_NIXL_ABORT_REQUEST_TIMEOUT). A report for it afterwards is a
  ``late_report`` warning and changes nothing;
- a prefetch whose request's patience ran out is abandoned (``prefetch_gate``: an
  ``abandon`` record); whatever it lands later is not published in the host tier.
"""

from __future__ import annotations

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
from kvlife.lifecycle.engine.lifecycle import Lifecycle
from kvlife.lifecycle.engine.ranks import ReportStatus
from kvlife.lifecycle.engine.request import Request
from kvlife.lifecycle.engine.state import EngineState, Job, PrefetchJob, count_tiers, moves_record
from kvlife.policies.base import PrefetchView


class Transfers:
    def __init__(self, state: EngineState, lifecycle: Lifecycle) -> None:
        self.state = state
        self.lifecycle = lifecycle

    # ---- device loads and stores: started by the scheduler -----------------------------------
    def start_load(self, req: Request, moves: list[BlockMove]) -> None:
        """Load ``moves`` (tier blocks into device blocks ``req`` already holds)."""
        state = self.state
        job_id = state.new_job_id()
        placed = []
        for move in moves:
            slot = state.tiers[move.tier].prepare_load([move.block_hash])[0]
            placed.append(attrs.evolve(move, slot=slot))
            bringing = state.in_flight_loads.setdefault(move.block_hash, [])
            if bringing:
                state.stats.redundant_block_loads += 1
            bringing.append((job_id, move.device_block, req.request_id))
        state.pool.retain(m.device_block for m in placed)
        job = Job(job_id, "load", req.request_id, tuple(placed), state.now, [(req.request_id, req.epoch)])
        state.jobs[job_id] = job
        state.ranks.open(job_id)
        req.load_jobs.append(job_id)
        state.stats.loads += 1
        state.stats.blocks_loaded += len(placed)
        self.lifecycle.record({"kind": "job", "t": state.now, "job": job_id, "op": "load", "req": req.request_id,
                               "blocks": len(placed), "tiers": count_tiers(m.tier for m in placed),
                               "moves": moves_record(placed)})
        state.commands.append(StartLoad(job_id, req.request_id, tuple(placed)))

    def maybe_store(self, req: Request) -> None:
        """Store the request's newly filled blocks (prompt and generated tokens alike) to
        every tier, up to what the store policy allows (``store_limit``); never a block no
        step has scheduled yet."""
        state = self.state
        bt = state.config.block_tokens
        if not state.tiers or req.computed // bt <= req.stored_blocks:
            return  # no new block boundary crossed: nothing to ask
        limit = self.lifecycle.ask(req, "store_limit")
        upto = min(min(limit, req.computed) // bt, len(req.block_table))
        if upto <= req.stored_blocks:
            return
        if upto > len(req.hashes):
            state.ensure_hashes(req, upto)
        hashes = req.hashes[req.stored_blocks : upto]
        blocks = req.block_table[req.stored_blocks : upto]
        req.stored_blocks = upto
        recorder = state.recorder  # (records are built only when there is one to take them)
        device_of: dict[int, int] | None = None
        for tier in state.tiers.values():
            plan = tier.prepare_store(hashes)
            if recorder is not None:
                if plan.evicted:
                    recorder({"kind": "evict", "t": state.now, "tier": tier.name, "blocks": list(plan.evicted)})
                if plan.rejected_full:
                    # The tier is full of copies still being written: these blocks are not stored.
                    recorder({"kind": "store_rejected", "t": state.now, "req": req.request_id, "tier": tier.name,
                              "blocks": plan.rejected_full})
            if not plan.accepted:
                continue
            if device_of is None:
                device_of = dict(zip(hashes, blocks, strict=True))
            moves = tuple([BlockMove(h, device_of[h], tier.name, slot) for h, slot in plan.accepted])
            job_id = state.new_job_id()
            state.pool.retain([m.device_block for m in moves])
            state.jobs[job_id] = Job(job_id, "store", req.request_id, moves, state.now, [(req.request_id, req.epoch)])
            state.ranks.open(job_id)
            req.store_jobs += 1
            stats = state.stats
            stats.stores += 1
            stats.blocks_stored += len(moves)
            if recorder is not None:
                recorder({"kind": "job", "t": state.now, "job": job_id, "op": "store", "req": req.request_id,
                          "blocks": len(moves), "tiers": {tier.name: len(moves)}, "moves": moves_record(moves)})
            state.commands.append(StartStore(job_id, req.request_id, moves))

    # ---- reports: a job ends when every rank has reported it ---------------------------------
    def on_report(self, event: TransferReport) -> None:
        """One rank's report on a job: a prefetch, or a device load or store."""
        self.state.transfer_version += 1
        if event.job_id in self.state.reclaimed:
            self.on_late_report(event)
        elif event.job_id in self.state.prefetches:
            self.on_prefetch_report(event)
        else:
            self.on_transfer_report(event)

    def on_transfer_report(self, event: TransferReport) -> None:
        state = self.state
        outcome = state.ranks.report(event.job_id, event.rank, event.failed)
        if outcome.status in (ReportStatus.PENDING,):
            return
        if outcome.status is not ReportStatus.DONE:
            self.lifecycle.warn(outcome.status.value + "_report", job=event.job_id, rank=event.rank)
            return
        job = state.jobs.pop(event.job_id)
        if state.recorder is not None:
            state.recorder({"kind": "job_done", "t": state.now, "job": job.job_id, "op": job.kind,
                            "failed": len(outcome.failed), "late": job.timed_out})
        self.release_job(job, outcome.failed)
        if not job.timed_out:
            self.job_outcome(job, outcome.failed)

    def on_late_report(self, event: TransferReport) -> None:
        """A report for a job reclaimed at its deadline: recorded as late, ignored."""
        state = self.state
        missing = state.reclaimed[event.job_id]
        if event.rank not in missing:
            status = "duplicate" if 0 <= event.rank < state.ranks.world_size else "bad_rank"
            self.lifecycle.warn(status + "_report", job=event.job_id, rank=event.rank)
            return
        missing.discard(event.rank)
        if not missing:
            del state.reclaimed[event.job_id]
        state.stats.late_reports += 1
        self.lifecycle.warn("late_report", job=event.job_id, rank=event.rank,
                            note="the job was reclaimed at its deadline: this report is ignored")

    def _stop_bringing(self, job: Job) -> None:
        """``job`` (a load) no longer brings its blocks: each hash's next load, if another is
        in flight, becomes the one to join and the one a further load duplicates."""
        in_flight = self.state.in_flight_loads
        for move in job.moves:
            bringing = in_flight.get(move.block_hash)
            if bringing is None:
                continue
            bringing[:] = [entry for entry in bringing if entry[0] != job.job_id]
            if not bringing:
                del in_flight[move.block_hash]

    def release_job(self, job: Job, failed: Sequence[int]) -> None:
        """Unpin what a finished job moved: tier slots, device block references; a failed
        block is discarded from its tier (a load) or not kept (a store)."""
        state = self.state
        tiers = state.tiers
        pool = state.pool
        bad = set(failed)
        hashes = [m.block_hash for m in job.moves]
        if job.kind == "load":
            for move in job.moves:
                tier = tiers[move.tier]
                tier.complete_load([move.block_hash])
                if move.block_hash in bad:
                    tier.discard([move.block_hash])
                    pool.forget(move.device_block)
                elif not job.timed_out:
                    pool.register(move.device_block, move.block_hash)
            self._stop_bringing(job)
        else:
            by_tier: dict[str, list[int]] = {}
            for move in job.moves:
                by_tier.setdefault(move.tier, []).append(move.block_hash)
            clean = not bad and not job.timed_out
            for name, blocks in by_tier.items():
                if clean:  # (the usual case: every block written)
                    tiers[name].complete_store(blocks, ok=True)
                    continue
                good = [h for h in blocks if h not in bad and not job.timed_out]
                failed_here = [h for h in blocks if h in bad or job.timed_out]
                tiers[name].complete_store(good, ok=True)
                tiers[name].complete_store(failed_here, ok=False)
        if bad:
            state.stats.failed_blocks += len(bad & set(hashes))
        freed = pool.release(m.device_block for m in reversed(job.moves))
        if freed:
            self.lifecycle.free_blocks(freed)

    def job_outcome(self, job: Job, failed: Sequence[int], cause: str | None = None) -> None:
        """Tell the requests a job was for how it went (``failed``: its failed blocks;
        ``cause``: why, when it was given up at a deadline rather than reported)."""
        state = self.state
        bad = set(failed)
        if job.kind == "store":
            owner = state.requests[job.request_id]
            owner.store_jobs -= 1
            if owner.state == "sending" and owner.store_jobs == 0:
                if state.sent_released(owner):
                    why = "every rank reported its stores" if cause is None else \
                        f"its last store, job {job.job_id}, was given up: {cause}"
                    self.lifecycle.finish(owner, "completed", owner.finish_reason or "stopped", why)
                else:
                    state.sent.append(owner)  # see EngineState.sent
            return
        for rid, epoch in job.waiters:
            req = state.requests[rid]
            if req.state != "loading" or req.epoch != epoch or job.job_id not in req.load_jobs:
                continue
            req.load_jobs.remove(job.job_id)
            req.load_failed.extend(m.block_hash for m in job.moves if m.block_hash in bad
                                   and m.block_hash in req.hashes)
            if not req.load_jobs:
                self.load_finished(req, None if cause is None else f"job {job.job_id} was given up: {cause}")

    def release_sent(self) -> None:
        """Finish the requests in ``sending`` whose stores are done, once released (see
        ``EngineState.sent``)."""
        state = self.state
        keep = []
        for req in state.sent:
            if req.state != "sending":
                continue  # aborted meanwhile
            if state.sent_released(req):
                self.lifecycle.finish(req, "completed", req.finish_reason or "stopped",
                                      "every rank reported its stores; finished_sending came with a step output")
            else:
                keep.append(req)
        state.sent = keep

    def load_finished(self, req: Request, cause: str | None = None) -> None:
        """Every load ``req`` waited for is done: run it, or recompute what failed
        (``cause``: the last one was given up at a deadline)."""
        state = self.state
        lifecycle = self.lifecycle
        if not req.load_failed:
            # Landed: the next tick takes it into running (Scheduler._take_landed), as
            # vLLM's next schedule() promotes a request whose finished_recving came.
            req.computed = req.confirmed = req.hit_tokens_pending
            req.registered_blocks = req.hit_tokens_pending // state.config.block_tokens
            return
        failed = len(req.load_failed)
        action = lifecycle.ask(req, "on_load_failure", failed)
        what = f"{failed} blocks failed to load" if cause is None else f"{failed} blocks not loaded ({cause})"
        if action == "fail":
            lifecycle.finish(req, "failed", "error", what)
            return
        position = {h: i for i, h in enumerate(req.hashes)}
        first_bad = min((position[h] for h in req.load_failed if h in position), default=0)
        req.external_hit_limit = min(req.external_hit_limit, first_bad)
        lifecycle.release_request_blocks(req)
        req.epoch += 1
        req.lookup = None
        req.lookup_async = False
        req.lookup_uses = 0
        req.computed = req.confirmed = 0
        req.admitted_tokens = 0
        state.holding.remove(req)
        lifecycle.move(req, "load_failed", f"{what}: recompute them")
        state.waiting.insert(0, req)  # it held KV blocks: first in line, as in vLLM

    def expire_jobs(self, deadline: float) -> None:
        """Give up on jobs some rank has not reported within ``deadline`` ms: their requests
        see them failed; their blocks stay held (quarantined) until the reports come."""
        state = self.state
        for job in list(state.jobs.values()):
            if job.timed_out or state.now - job.started_ms < deadline:
                continue
            self.give_up(job, "job failed on those ranks; its blocks stay held until they report",
                         f"transfer deadline: ranks {list(state.ranks.missing_ranks(job.job_id))} silent "
                         f"{state.now - job.started_ms:g} ms after it started (deadline {deadline:g} ms)")

    def give_up(self, job: Job, note: str, cause: str) -> None:
        """Stop waiting for ``job``'s result: its requests see every block failed (``cause``
        says why in their transitions); its blocks stay held until reported or reclaimed."""
        state = self.state
        job.timed_out = True
        state.stats.rank_timeouts += 1
        missing = state.ranks.missing_ranks(job.job_id)
        self.lifecycle.warn("rank_timeout", job=job.job_id, ranks=list(missing), note=note)
        if job.kind == "load":
            self._stop_bringing(job)  # nobody may join a load that has already been given up on
        self.job_outcome(job, [m.block_hash for m in job.moves], cause)

    def reclaim_jobs(self, deadline: float) -> None:
        """Jobs (and prefetches) some rank has not reported ``deadline`` ms after they
        started: given up if they were not already, then their device blocks and tier slots
        are reclaimed (a ``reclaim`` record first, then the ``free``). Reports that come
        later are ``late_report`` warnings (``on_late_report``)."""
        state = self.state
        now = state.now
        # Jobs are kept in start order: stop at the first one not yet due.
        for job in list(state.jobs.values()):
            if now < job.started_ms + deadline:
                break
            missing = list(state.ranks.missing_ranks(job.job_id))
            silent = f"ranks {missing} silent {now - job.started_ms:g} ms after it started"
            if not job.timed_out:
                self.give_up(job, f"reclaim deadline ({deadline:g} ms): job failed on those ranks",
                             f"reclaim deadline: {silent} (deadline {deadline:g} ms)")
            self._reclaim(job.job_id, job.kind, job.request_id, missing, len(job.moves), silent, deadline)
            del state.jobs[job.job_id]
            self.release_job(job, ())
        for pull in list(state.prefetches.values()):
            if now < pull.started_ms + deadline:
                break
            missing = list(state.ranks.missing_ranks(pull.job_id))
            self._reclaim(pull.job_id, "prefetch", pull.request_id, missing, len(pull.moves),
                          f"ranks {missing} silent {now - pull.started_ms:g} ms after it started", deadline)
            del state.prefetches[pull.job_id]
            if state.prefetch_waits.get(pull.request_id) is pull:
                del state.prefetch_waits[pull.request_id]
            host = state.tiers[pull.moves[0].dst_tier]
            for move in pull.moves:
                state.tiers[move.src_tier].complete_load([move.block_hash])
            host.complete_store([m.block_hash for m in pull.moves], ok=False)

    def _reclaim(self, job_id: int, op: str, rid: str, missing: list[int], blocks: int, silent: str,
                 deadline: float) -> None:
        state = self.state
        state.ranks.close(job_id)
        state.reclaimed[job_id] = set(missing)
        state.stats.reclaimed_jobs += 1
        self.lifecycle.record({"kind": "reclaim", "t": state.now, "job": job_id, "op": op, "req": rid,
                               "ranks": missing, "blocks": blocks,
                               "reason": f"reclaim deadline: {silent} (deadline {deadline:g} ms); its blocks "
                                         f"are given back and a later report is ignored"})

    # ---- prefetch: lower tiers into the host tier, started at arrival ------------------------
    def start_prefetch(self, req: Request) -> None:
        """Pull the request's lookup hits below the host tier up into it, before admission."""
        state = self.state
        tiers = state.tiers
        host = tiers.get("host")
        if host is None or not req.lookup:
            return
        candidates = state.hit_candidates(req)
        lower = [
            (candidates[i], tier)
            for i, tier in enumerate(req.lookup[: len(candidates)])
            if tier != "host" and state.pool.block_of(candidates[i]) is None
            and tiers[tier].contains(candidates[i])
        ]
        if not lower:
            return
        plan = host.prepare_store([h for h, _ in lower])
        if plan.evicted:
            self.lifecycle.record({"kind": "evict", "t": state.now, "tier": host.name, "blocks": list(plan.evicted)})
        if not plan.accepted:
            return
        source = dict(lower)
        moves = tuple(
            TierMove(h, source[h], tiers[source[h]].prepare_load([h])[0], host.name, slot)
            for h, slot in plan.accepted
        )
        job_id = state.new_job_id()
        view = PrefetchView(
            blocks=len(moves),
            tokens=len(moves) * state.config.block_tokens,
            source_tiers=tuple(m.src_tier for m in moves),
            started_ms=state.now,
        )
        patience = float(self.lifecycle.ask(req, "prefetch_patience", view))
        policy = req.last_decisions["prefetch_patience"][0]
        job = PrefetchJob(job_id, req.request_id, req.epoch, moves, state.now, state.now + patience, policy)
        state.prefetches[job_id] = job
        state.prefetch_waits[req.request_id] = job
        state.ranks.open(job_id)
        state.stats.prefetches += 1
        state.stats.blocks_prefetched += len(moves)
        self.lifecycle.record({"kind": "job", "t": state.now, "job": job_id, "op": "prefetch", "req": req.request_id,
                               "blocks": len(moves), "tiers": count_tiers(m.src_tier for m in moves),
                               "moves": [[m.block_hash, m.src_tier, m.dst_tier] for m in moves]})
        state.commands.append(StartPrefetch(job_id, req.request_id, moves))

    def on_prefetch_report(self, event: TransferReport) -> None:
        state = self.state
        outcome = state.ranks.report(event.job_id, event.rank, event.failed)
        if outcome.status is ReportStatus.PENDING:
            return
        if outcome.status is not ReportStatus.DONE:
            self.lifecycle.warn(outcome.status.value + "_report", job=event.job_id, rank=event.rank)
            return
        job = state.prefetches.pop(event.job_id)
        bad = set(outcome.failed)
        host = state.tiers[job.moves[0].dst_tier]
        landed: list[int] = []
        lost: list[int] = []
        for move in job.moves:
            source = state.tiers[move.src_tier]
            source.complete_load([move.block_hash])
            if move.block_hash in bad:
                source.discard([move.block_hash])
                lost.append(move.block_hash)
            else:
                landed.append(move.block_hash)
        if job.abandoned:
            # Its request went on without it: nothing it brought is published.
            host.complete_store(landed + lost, ok=False)
        else:
            host.complete_store(landed, ok=True)
            host.complete_store(lost, ok=False)
        state.stats.failed_blocks += len(lost)
        done = {"kind": "job_done", "t": state.now, "job": job.job_id, "op": "prefetch",
                "failed": len(lost), "late": False}
        if job.abandoned:
            done["abandoned"] = True
        self.lifecycle.record(done)
        if state.prefetch_waits.get(job.request_id) is job:
            del state.prefetch_waits[job.request_id]
        req = state.requests.get(job.request_id)
        if job.abandoned or req is None or req.epoch != job.epoch or req.lookup is None:
            return
        # The owner now reads the landed blocks from the host tier, and computes from the
        # first block that failed to land.
        landed_set = set(landed)
        lost_set = set(lost)
        candidates = state.hit_candidates(req)
        tiers: list[str] = []
        for i, tier in enumerate(req.lookup[: len(candidates)]):
            if candidates[i] in lost_set:
                break
            tiers.append(host.name if candidates[i] in landed_set else tier)
        req.lookup = tuple(tiers)

    def prefetch_gate(self, req: Request) -> str:
        """"deferred" while the request's prefetch is in flight and its patience lasts;
        "go" once it landed or patience ran out (what is still in flight is computed)."""
        state = self.state
        job = state.prefetch_waits[req.request_id]
        if req.epoch != job.epoch or job.job_id not in state.prefetches:
            del state.prefetch_waits[req.request_id]
            return "go"
        if state.now < job.deadline_ms:
            if not job.deferred:
                job.deferred = True
                state.stats.prefetch_waits += 1
                deferrals = state.stats.deferrals
                deferrals[job.patience_policy] = deferrals.get(job.patience_policy, 0) + 1
            return "deferred"
        del state.prefetch_waits[req.request_id]
        in_flight = {m.block_hash for m in job.moves}
        lookup = req.lookup or ()
        candidates = state.hit_candidates(req)
        keep = 0
        while keep < min(len(lookup), len(candidates)) and candidates[keep] not in in_flight:
            keep += 1
        state.stats.prefetch_gave_up += 1
        job.abandoned = True
        reason = (f"patience ran out after {state.now - job.started_ms:.1f} ms: "
                  f"{len(lookup) - keep} hit blocks still in flight are computed")
        self.lifecycle.record({"kind": "decision", "t": state.now, "req": req.request_id,
                               "point": "prefetch_patience", "policy": job.patience_policy, "value": "compute",
                               "reason": reason})
        self.lifecycle.record({"kind": "abandon", "t": state.now, "job": job.job_id, "op": "prefetch",
                               "req": req.request_id,
                               "reason": f"prefetch deadline: {reason}; what it lands later is not published"})
        req.lookup = lookup[:keep]
        return "go"
