"""Transfer jobs: loads into the device, stores out of it, prefetches between tiers.

``Transfers`` starts jobs for the connector core (``start_load``, ``maybe_store``,
``start_prefetch``) and takes the ranks' reports (``on_report``). A job goes to the workers
with the next step's metadata (``CoreState.out_*``), as a vLLM connector's jobs do.

A job pins its tier slots in the tier index. It holds no device block: the blocks under a
transfer are kept safe by the lifecycle (see ``blocks``). It ends only when every rank has
reported it (``kvlife.lifecycle.engine.ranks``); then the pins go (``release_job``), failed
blocks are discarded from their tier, and the request it was for is told (``job_outcome``):
a load's request has landed, or failed (vLLM cuts its computed tokens at the first failed
block and recomputes from there, or fails it, by its ``kv_load_failure_policy``); a store's
request, if held, may be reported in ``finished_sending`` with the next step output.

Deadlines, each acted on by the core's ``tick`` and each traced with its reason:

- a rank that stays silent past ``transfer_deadline_ms`` fails the job for its request
  (``expire_jobs``: a ``rank_timeout`` warning; a load's request moves ``load_failed``),
  but the job's device blocks stay held by the core (quarantined: ``CoreState.held_blocks``)
  until the late report comes (invariant 2);
- past ``reclaim_deadline_ms`` a job some rank never reported is given up if it was not
  already and reclaimed (``reclaim_jobs``: a ``reclaim`` record): its tier slots and the
  core's hold go, and the workers still owing it report it failed (``abandon``), so the
  blocks of an aborted or finished request are released. A report for it afterwards is a
  ``late_report`` warning and changes nothing;
- a prefetch whose request's patience ran out is abandoned (``prefetch_gate``: an
  ``abandon`` record); whatever it lands later is not published in the host tier.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

from kvlife.lifecycle.engine import records
from kvlife.lifecycle.engine.blocks import derived_block_hash
from kvlife.lifecycle.engine.events import BlockMove, TierMove, TransferReport
from kvlife.lifecycle.engine.lifecycle import Lifecycle
from kvlife.lifecycle.engine.ranks import ReportStatus
from kvlife.lifecycle.engine.request import Request
from kvlife.lifecycle.engine.state import CoreState, Job, PrefetchJob, count_tiers, moves_record
from kvlife.policies.base import Hook, PrefetchView
from kvlife.specs.names import RequestState, Trigger

# Hold or release device blocks the core keeps out of the free queue (quarantine).
BlockHold = Callable[[Sequence[int]], None]


class Transfers:
    def __init__(self, state: CoreState, lifecycle: Lifecycle) -> None:
        self.state = state
        self.lifecycle = lifecycle
        # The scheduler's block pool, for the quarantine of jobs given up at a deadline
        # (None: no quarantine; KVLifeConnector gives up on no load).
        self.hold_blocks: BlockHold | None = None
        self.unhold_blocks: BlockHold | None = None

    # ---- device loads and stores ----------------------------------------------------------
    def start_load(self, req: Request, moves: Sequence[BlockMove], after: int | None = None) -> Job:
        """Load ``moves`` into device blocks ``req`` holds: tier blocks, or (``after``) the
        device blocks an in-flight load fills, copied once it has landed (a join)."""
        state = self.state
        job_id = state.new_job_id()
        placed = []
        for move in moves:
            if after is None:
                slot = state.tiers[move.tier].prepare_load([move.block_hash])[0]
                move = attrs.evolve(move, slot=slot)
                bringing = state.in_flight_loads.setdefault(move.block_hash, [])
                if bringing:
                    state.stats.redundant_block_loads += 1
                bringing.append((job_id, move.device_block, req.request_id))
            placed.append(move)
        job = Job(job_id, "load", req.request_id, req.epoch, tuple(placed), state.now, after=after)
        state.jobs[job_id] = job
        state.ranks.open(job_id)
        req.load_jobs.append(job_id)
        state.stats.loads += 1
        if after is None:
            # Blocks read from a tier. A join's device copies are counted as joined_blocks:
            # they cross no tier link, and they are what shared loads saves.
            state.stats.blocks_loaded += len(placed)
        if after is not None and self.hold_blocks is not None:
            # A join copies its owner's device blocks once the owner landed: they stay held
            # until it ends, though the owner be aborted meanwhile.
            sources = tuple(m.slot for m in placed)
            self.hold_blocks(sources)
            state.held_blocks[job_id] = sources
        extra = {} if after is None else {"after": after}
        self.lifecycle.record(records.job(state.now, job_id, "load", req.request_id,
                                          count_tiers(m.tier for m in placed), moves_record(placed), **extra))
        state.out_loads.append(job)
        return job

    def maybe_store(self, req: Request) -> None:
        """Store the request's new full blocks (prompt and generated tokens alike) to every
        tier, up to what the store policy allows (``store_limit``: the built-in ones, only
        blocks a step output confirmed); never a block no step has scheduled yet."""
        state = self.state
        bt = state.config.block_tokens
        if not state.tiers or min(req.computed // bt, len(req.block_table)) <= req.stored_blocks:
            return  # no new block scheduled: nothing to ask
        limit = self.lifecycle.ask(req, Hook.STORE_LIMIT)
        # Clamped to the scheduled tokens, not the confirmed ones: which scheduled tokens
        # are safe to store is the policy's call (invariant 5), so that
        # ``naive-stores-unsafe`` can show the placeholder bug (vLLM #27644).
        upto = min(min(limit, req.computed) // bt, len(req.block_table))
        if upto <= req.stored_blocks:
            return
        if upto > len(req.hashes):
            state.ensure_hashes(req, upto)
        hashes = req.hashes[req.stored_blocks:upto]
        blocks = req.block_table[req.stored_blocks:upto]
        first = req.stored_blocks
        req.stored_blocks = upto
        recorder = state.recorder  # (records are built only when there is one to take them)
        device_of: dict[int, int] | None = None
        named = _underivable(req, range(first, upto)) if recorder is not None else None
        for tier in state.tiers.values():
            plan = tier.prepare_store(hashes)
            if recorder is not None:
                if plan.evicted:
                    recorder(records.evict(state.now, tier.name, plan.evicted))
                if plan.rejected_full:
                    # The tier is full of copies still being written: these blocks are not stored.
                    recorder(records.store_rejected(state.now, req.request_id, tier.name, plan.rejected_full))
            if not plan.accepted:
                continue
            if device_of is None:
                device_of = dict(zip(hashes, blocks, strict=True))
            moves = tuple([BlockMove(h, device_of[h], tier.name, slot) for h, slot in plan.accepted])
            job_id = state.new_job_id()
            job = Job(job_id, "store", req.request_id, req.epoch, moves, state.now)
            state.jobs[job_id] = job
            state.ranks.open(job_id)
            req.store_jobs += 1
            stats = state.stats
            stats.stores += 1
            stats.blocks_stored += len(moves)
            if recorder is not None:
                recorder(records.job(state.now, job_id, "store", req.request_id, {tier.name: len(moves)},
                                     moves_record(moves, named)))
            state.out_stores.append(job)

    def observe_job(self, req: Request, job_id: int, kind: str, moves: Sequence[BlockMove]) -> None:
        """Another connector started ``job_id`` for ``req`` (recording it): its ranks' reports
        are aggregated as any job's; no tier index mirrors its storage."""
        state = self.state
        job = Job(job_id, kind, req.request_id, req.epoch, tuple(moves), state.now)
        state.jobs[job_id] = job
        state.ranks.open(job_id)
        if kind == "load":
            req.load_jobs.append(job_id)
            state.stats.loads += 1
            state.stats.blocks_loaded += len(moves)
        else:
            req.store_jobs += 1
            state.stats.stores += 1
            state.stats.blocks_stored += len(moves)
        named = None
        if kind == "store" and state.recorder is not None:
            named = _underivable(req, range(len(req.hashes)), {m.block_hash for m in moves})
        self.lifecycle.record(records.job(state.now, job_id, kind, req.request_id,
                                          count_tiers(m.tier for m in moves), moves_record(moves, named)))

    def flush_stores(self, req: Request) -> None:
        """``req`` was preempted and the scheduler freed its blocks: its stores in flight
        are flushed (the workers finish them before the next step writes anything)."""
        state = self.state
        for job in state.jobs.values():
            if job.kind == "store" and job.request_id == req.request_id and not job.flushed and not job.timed_out:
                job.flushed = True
                state.stats.flushed_stores += 1
                state.out_flush.append(job.job_id)

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

    def _report(self, event: TransferReport) -> tuple[int, ...] | None:
        """Count one rank's report: the job's failed blocks (the union over ranks) once every
        rank reported it, else None (a duplicate or bad rank is warned)."""
        outcome = self.state.ranks.report(event.job_id, event.rank, event.failed)
        if outcome.status is ReportStatus.PENDING:
            return None
        if outcome.status is not ReportStatus.DONE:
            self.lifecycle.warn(outcome.status.value + "_report", job=event.job_id, rank=event.rank)
            return None
        return outcome.failed

    def on_transfer_report(self, event: TransferReport) -> None:
        failed = self._report(event)
        if failed is None:
            return
        state = self.state
        job = state.jobs.pop(event.job_id)
        self.lifecycle.record(records.job_done(state.now, job.job_id, job.kind, len(failed), job.timed_out))
        if failed:
            self._failed(job, failed)
        self.release_job(job, failed)
        if not job.timed_out:
            self.job_outcome(job, failed)

    def _failed(self, job: Job, failed: Sequence[int]) -> None:
        """A job some block of which failed: counted, and a warning naming the blocks."""
        state = self.state
        bad = set(failed)
        blocks = [m.block_hash for m in job.moves if m.block_hash in bad]
        if job.kind == "load":
            state.stats.failed_loads += 1
            policy = state.config.kv_load_failure_policy
            note = (f"kv_load_failure_policy {policy!r}: "
                    + ("the request recomputes from its first failed block" if policy == "recompute"
                       else "the request fails"))
        else:
            state.stats.failed_stores += 1
            note = "the failed blocks are not kept in the tier; the request's blocks are released as usual"
        self.lifecycle.warn(f"{job.kind}_failed", job=job.job_id, req=job.request_id, blocks=blocks, note=note)

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
        in flight, becomes the one a join copies from."""
        in_flight = self.state.in_flight_loads
        for move in job.moves:
            bringing = in_flight.get(move.block_hash)
            if bringing is None:
                continue
            bringing[:] = [entry for entry in bringing if entry[0] != job.job_id]
            if not bringing:
                del in_flight[move.block_hash]

    def release_job(self, job: Job, failed: Sequence[int]) -> None:
        """Unpin what a finished job moved: its tier slots; a failed block is discarded from
        its tier (a load) or not kept (a store); the core's quarantine hold, if any."""
        state = self.state
        tiers = state.tiers
        bad = set(failed)
        if state.observing:
            pass  # another connector's storage: no index mirrors it
        elif job.kind == "load":
            if job.after is None:
                for move in job.moves:
                    tier = tiers[move.tier]
                    tier.complete_load([move.block_hash])
                    if move.block_hash in bad:
                        tier.discard([move.block_hash])
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
            state.stats.failed_blocks += len(bad & {m.block_hash for m in job.moves})
        held = state.held_blocks.pop(job.job_id, None)
        if held is not None and self.unhold_blocks is not None:
            self.unhold_blocks(held)

    def job_outcome(self, job: Job, failed: Sequence[int], cause: str | None = None) -> None:
        """Tell the request a job was for how it went (``failed``: its failed blocks;
        ``cause``: why, when it was given up at a deadline rather than reported)."""
        state = self.state
        req = state.requests.get(job.request_id)
        if req is None:
            return
        if job.kind == "store":
            req.store_jobs -= 1
            return
        if job.job_id not in req.load_jobs:
            return
        req.load_jobs.remove(job.job_id)
        bad = set(failed)
        if cause is not None:
            # Given up, not reported: its copy may still land anywhere it was to write, so
            # none of the request's blocks is trusted: the scheduler cuts this request to 0
            # (its blocks freed; the core holds the job's). Only this request: a prefix-cache
            # hit it shares with others is theirs as well, and stays valid for them.
            state.given_up_loads.add(req.request_id)
        req.load_failed.extend(m.block_hash for m in job.moves if m.block_hash in bad)
        if req.load_jobs:
            return
        if req.state == RequestState.LOADING and req.epoch == job.epoch:
            self.load_finished(req, None if cause is None else f"job {job.job_id} was given up: {cause}")

    def load_finished(self, req: Request, cause: str | None = None) -> None:
        """Every load ``req`` waited for is done. Landed: the scheduler promotes it at its
        next pass (``update_state_after_alloc`` with no external tokens: ``load_done``).
        Failed: vLLM cuts its computed tokens at the first failed block (at 0 for a load
        given up at a deadline), and recomputes from there or fails it, by
        ``engine.kv_load_failure_policy``; the ``on_load_failure`` policy is asked, and an
        answer the deployment cannot carry out is refused."""
        state = self.state
        lifecycle = self.lifecycle
        bt = state.config.block_tokens
        req.landed = True
        if not req.load_failed:
            req.computed = req.confirmed = req.pending_hit_tokens
            return
        failed = len(req.load_failed)
        what = f"{failed} blocks failed to load" if cause is None else f"{failed} blocks not loaded ({cause})"
        configured = state.config.kv_load_failure_policy
        action = configured if state.observing else lifecycle.ask(req, Hook.ON_LOAD_FAILURE, failed)
        if action != configured:
            lifecycle.warn("decision_refused", req=req.request_id, point="on_load_failure", value=action,
                           carried_out=configured,
                           note=f"vLLM's kv_load_failure_policy is {configured!r}: a connector cannot "
                                f"{'fail' if action == 'fail' else 'recompute'} one request against it")
        position = {h: i for i, h in enumerate(req.hashes)}
        first_bad = min((position[h] for h in req.load_failed if h in position), default=0)
        req.external_hit_limit = min(req.external_hit_limit, first_bad)
        cut = 0 if cause is not None else min(req.confirmed, first_bad * bt)
        req.computed = req.confirmed = cut
        req.epoch += 1
        req.lookup = None
        req.lookup_uses = 0
        if configured == "fail":
            return  # the scheduler fails it with the step output that reports the load
        lifecycle.move(req, Trigger.LOAD_FAILED, f"{what}: recompute from token {cut}")

    def give_up(self, job: Job, note: str, cause: str) -> None:
        """Stop waiting for ``job``'s result: its request sees every block failed
        (``cause`` says why in its transitions); the core holds its device blocks
        (quarantine) until it is reported or reclaimed."""
        state = self.state
        job.timed_out = True
        job.abandoned = True
        state.out_abandon.append(job.job_id)  # the workers still owing it report it failed
        state.stats.rank_timeouts += 1
        missing = state.ranks.missing_ranks(job.job_id)
        self.lifecycle.warn("rank_timeout", job=job.job_id, ranks=list(missing), note=note)
        if job.kind == "load":
            self._stop_bringing(job)  # nobody may join a load that has already been given up on
            # ... and the joins copying from it copy blocks nobody vouches for: given up too.
            for join in [j for j in state.jobs.values() if j.after == job.job_id and not j.timed_out]:
                self.give_up(join, f"the load it copies from (job {job.job_id}) was given up",
                             f"its source, load job {job.job_id}, was given up ({cause})")
        if self.hold_blocks is not None and not job.flushed:
            # (A flushed store's blocks went back at the preemption that flushed it: the
            # workers finish it before the next step writes anything.)
            blocks = tuple(m.device_block for m in job.moves)
            self.hold_blocks(blocks)
            state.held_blocks[job.job_id] = state.held_blocks.get(job.job_id, ()) + blocks
        self.job_outcome(job, [m.block_hash for m in job.moves], cause)

    def expire_jobs(self, deadline: float, kinds: tuple[str, ...] = ("load", "store")) -> None:
        """Give up on jobs (of ``kinds``) some rank has not reported within ``deadline`` ms:
        their requests see them failed; their blocks stay held (quarantined) until the
        reports come."""
        state = self.state
        for job in list(state.jobs.values()):
            if job.timed_out or job.kind not in kinds or state.now - job.started_ms < deadline:
                continue
            self.give_up(job, "job failed on those ranks; its blocks stay held until they report",
                         f"transfer deadline: ranks {list(state.ranks.missing_ranks(job.job_id))} silent "
                         f"{state.now - job.started_ms:g} ms after it started (deadline {deadline:g} ms)")

    def reclaim_jobs(self, deadline: float) -> None:
        """Jobs (and prefetches) some rank has not reported ``deadline`` ms after they
        started: given up if they were not already, then reclaimed (a ``reclaim`` record):
        their tier slots and holds go, the workers still owing them report them failed."""
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
        self.lifecycle.record(records.reclaim(state.now, job_id, op, rid, missing, blocks,
                                              f"reclaim deadline: {silent} (deadline {deadline:g} ms); its blocks "
                                              f"are given back and a later report is ignored"))

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
            if tier != "host" and tiers[tier].contains(candidates[i])
        ]
        if not lower:
            return
        plan = host.prepare_store([h for h, _ in lower])
        if plan.evicted:
            self.lifecycle.record(records.evict(state.now, host.name, plan.evicted))
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
        patience = float(self.lifecycle.ask(req, Hook.PREFETCH_PATIENCE, view))
        policy = req.last_decisions["prefetch_patience"][0]
        job = PrefetchJob(job_id, req.request_id, req.epoch, moves, state.now, state.now + patience, policy)
        state.prefetches[job_id] = job
        state.prefetch_waits[req.request_id] = job
        state.ranks.open(job_id)
        state.stats.prefetches += 1
        state.stats.blocks_prefetched += len(moves)
        self.lifecycle.record(records.job(state.now, job_id, "prefetch", req.request_id,
                                          count_tiers(m.src_tier for m in moves),
                                          [[m.block_hash, m.src_tier, m.dst_tier] for m in moves]))
        state.out_prefetches.append(job)

    def on_prefetch_report(self, event: TransferReport) -> None:
        failed = self._report(event)
        if failed is None:
            return
        state = self.state
        job = state.prefetches.pop(event.job_id)
        bad = set(failed)
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
        self.lifecycle.record(records.job_done(state.now, job.job_id, "prefetch", len(lost), False,
                                               abandoned=job.abandoned))
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

    def prefetch_gate(self, req: Request) -> bool:
        """True (defer) while the request's prefetch is in flight and its patience lasts;
        False once it landed or patience ran out (what is still in flight is computed)."""
        state = self.state
        job = state.prefetch_waits[req.request_id]
        if req.epoch != job.epoch or job.job_id not in state.prefetches:
            del state.prefetch_waits[req.request_id]
            return False
        if state.now < job.deadline_ms:
            if not job.deferred:
                job.deferred = True
                state.stats.prefetch_waits += 1
                deferrals = state.stats.deferrals
                deferrals[job.patience_policy] = deferrals.get(job.patience_policy, 0) + 1
            return True
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
        self.lifecycle.record(records.decision(state.now, req.request_id, "prefetch_patience", job.patience_policy,
                                               "compute", reason))
        self.lifecycle.record(records.abandon(state.now, job.job_id, "prefetch", req.request_id,
                                              f"prefetch deadline: {reason}; what it lands later is not published"))
        req.lookup = lookup[:keep]
        return False


def _underivable(req: Request, positions: range, among: set[int] | None = None) -> dict[int, int]:
    """Blocks of ``req`` at ``positions`` past its prompt (of hashes ``among``, if given)
    whose names are not ``blocks.derived_block_hash`` (inside vLLM: vLLM's block hashes):
    hash -> position, for the trace, whose reader could not place them otherwise."""
    hashes, rid = req.hashes, req.request_id
    named = {}
    for i in range(max(positions.start, req.prompt_tokens // req.block_tokens), min(positions.stop, len(hashes))):
        if among is not None and hashes[i] not in among:
            continue
        if hashes[i] != derived_block_hash(hashes[i - 1] if i else None, rid, i):
            named[hashes[i]] = i
    return named
