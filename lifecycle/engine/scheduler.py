"""The scheduler tick: token budget, running requests first, FIFO admission, preemption.

``Scheduler.tick`` first extends the running requests (chunked prefill, then one token
per decode step), preempting the most recently admitted request when device blocks run
out; then admits waiting requests in arrival order: look them up in the tiers (sync on
this path, or async through ``lookup_pending``), ask the admission policy, and either
start a load (``loading``, through ``Transfers.start_load``) or schedule compute
(``running``). The result is one ``StepPlan`` command for the driver to run; stores of
the blocks the step computes start with it (``Transfers.maybe_store``).

Like nano-vllm's scheduler owns its block manager, this one works on the state's block
pool directly; it receives the state, the shared ``Lifecycle`` primitives and the
``Transfers`` part it starts loads and stores with.
"""

from __future__ import annotations

import bisect

from kvlife.lifecycle.engine.events import (
    BlockMove,
    Scheduled,
    StepPlan,
)
from kvlife.lifecycle.engine.lifecycle import Lifecycle
from kvlife.lifecycle.engine.request import Request
from kvlife.lifecycle.engine.state import EngineState, seq_key
from kvlife.lifecycle.engine.transfers import Transfers
from kvlife.policies.base import LoadView

# One request's share of the step being built: (request, tokens, samples a token).
Entry = tuple[Request, int, bool]


def _schedule(req: Request, n: int) -> Entry:
    """Schedule ``n`` more tokens of ``req`` in this step; the last one samples."""
    samples = req.computed + n >= req.known_tokens
    req.computed += n
    if samples:
        req.placeholders += 1
    return (req, n, samples)


class Scheduler:
    def __init__(self, state: EngineState, lifecycle: Lifecycle, transfers: Transfers) -> None:
        self.state = state
        self.lifecycle = lifecycle
        self.transfers = transfers

    def tick(self) -> None:
        """Build one step: extend the running requests, then admit waiting ones."""
        state = self.state
        config = state.config
        state.stats.ticks += 1
        if config.transfer_deadline_ms is not None:
            self.transfers.expire_jobs(config.transfer_deadline_ms)
        budget = config.max_batched_tokens
        bt = config.block_tokens
        running = state.running
        pool = state.pool
        entries: list[Entry] = []
        preempted = False
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            want = req.known_tokens - req.computed
            if want <= 0:
                i += 1
                continue
            n = min(want, budget)
            need = -(-(req.computed + n) // bt) - len(req.block_table)  # state.blocks_for, inlined
            while need > 0 and need > pool.free:
                victim = running[-1]
                if victim is req and len(running) == 1 and not state.jobs:
                    self.lifecycle.finish(req, "failed", "error",
                                          f"needs {need} more blocks and nothing else holds any")
                    break
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req.state != "running":
                break
            if need > 0:
                req.block_table.extend(pool.allocate(need))
            entries.append(_schedule(req, n))
            budget -= n
            i += 1
        sync_lookups = 0
        if not preempted:
            budget, sync_lookups = self._admit(budget, entries)
        self._emit_plan(entries, sync_lookups)

    def _emit_plan(self, entries: list[Entry], sync_lookups: int) -> None:
        state = self.state
        state.stats.sync_lookups += sync_lookups
        if not entries and not sync_lookups:
            return
        step_id = state.next_step_id
        state.next_step_id += 1
        state.stats.steps += 1
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
        state.steps[step_id] = [(req, req.epoch, n, samples) for req, n, samples in entries]
        self.lifecycle.record(
            {
                "kind": "step",
                "t": state.now,
                "step": step_id,
                "requests": len(entries),
                "prefill_tokens": prefill,
                "sync_lookups": sync_lookups,
                "prompt": prompt_chunks,
            }
        )
        state.commands.append(StepPlan(step_id, tuple(scheduled), sync_lookups))
        maybe_store = self.transfers.maybe_store
        for req, _, _ in entries:
            if req.stored_blocks < len(req.hashes):
                maybe_store(req)

    def _admit(self, budget: int, entries: list[Entry]) -> tuple[int, int]:
        """Admit waiting requests in FIFO order while budget and ``max_running`` allow."""
        state = self.state
        lifecycle = self.lifecycle
        waiting = state.waiting
        versions = state.sync_lookup_version
        sync_lookups = 0
        active = len(state.running) + state.state_counts["loading"]
        index = 0
        while index < len(waiting) and budget > 0 and active < state.config.max_running:
            req = waiting[index]
            if req.request_id in state.prefetch_waits and self.transfers.prefetch_gate(req) == "deferred":
                index += 1
                continue
            stale = versions.get(req.request_id, state.transfer_version)
            if req.lookup is None or stale != state.transfer_version:
                if not state.tiers:
                    req.lookup = ()
                elif lifecycle.ask(req, "lookup_mode") == "async":
                    del waiting[index]
                    lifecycle.submit_lookup(req, "async lookup submitted")
                    continue
                else:
                    req.lookup = state.sync_lookup(state.hit_candidates(req))
                    versions[req.request_id] = state.transfer_version
                    sync_lookups += 1
            outcome = self._try_admit(req, budget, entries)
            if outcome == "blocked":
                break  # FIFO: no overtaking when memory or budget is short
            if outcome == "deferred":
                index += 1
                continue
            del waiting[index]
            versions.pop(req.request_id, None)
            active += 1
            if outcome == "running":
                budget -= entries[-1][1]
        return budget, sync_lookups

    def _try_admit(self, req: Request, budget: int, entries: list[Entry]) -> str:
        """Admit ``req`` into ``loading`` or ``running``; or "deferred" (policy), or
        "blocked" (not enough free device blocks: admission stops here)."""
        state = self.state
        pool = state.pool
        in_flight_loads = state.in_flight_loads
        bt = state.config.block_tokens
        candidates = state.hit_candidates(req)
        device = pool.cached_prefix(candidates)
        assert req.lookup is not None
        # Re-validate the lookup: a block may have been evicted since the answer.
        plan: list[tuple[int, str]] = []  # (hash, "device" | tier) for blocks past the device hit
        # After a failed load, external hits stop before the first block that failed, so
        # a bad or unreachable copy is never retried forever.
        external_end = min(len(req.lookup), len(candidates), req.external_hit_limit)
        for i in range(device, external_end):
            block = candidates[i]
            if pool.block_of(block) is not None:
                plan.append((block, "device"))
            elif state.tiers[req.lookup[i]].contains(block):
                plan.append((block, req.lookup[i]))
            else:
                break
        to_load = [(h, t) for h, t in plan if t != "device"]
        in_flight = tuple(
            (h, in_flight_loads[h][2]) for h, _ in to_load if h in in_flight_loads
        )
        join = False
        if to_load:
            load_view = LoadView(
                device_hit_blocks=device,
                external_hit_blocks=len(plan),
                tiers=tuple(t for _, t in plan),
                in_flight=in_flight,
            )
            choice = self.lifecycle.ask(req, "admission", load_view)
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
            new_blocks = state.blocks_for(hit_blocks * bt + compute_tokens) - hit_blocks
        reclaim = sum(
            1
            for h in hit_hashes
            if (b := pool.block_of(h)) is not None and pool.refs[b] == 0
        )
        if new_blocks + reclaim > pool.free:
            return "blocked"
        # Commit: build the block table in prefix order.
        # Take the cached hits first: allocating could otherwise recycle one of them.
        table: list[int] = []
        own_moves: list[BlockMove] = []
        join_jobs: list[int] = []
        tier_of = dict(to_load)
        for h in hit_hashes:
            if h in joined:
                job_id, block, _ = in_flight_loads[h]
                pool.retain([block])
                table.append(block)
                if job_id not in join_jobs:
                    join_jobs.append(job_id)
                state.stats.joined_blocks += 1
            elif h not in tier_of:
                table.append(pool.acquire_cached(h))
            else:
                table.append(-1)
        fresh = iter(pool.allocate(len(own_loads)))
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
                state.jobs[job_id].waiters.append((req.request_id, req.epoch))
            reason = f"loading {len(own_moves)} blocks"
            if join_jobs:
                reason += f", joined {len(joined)} in-flight blocks of jobs {join_jobs}"
            if own_moves:
                self.transfers.start_load(req, own_moves)
            self.lifecycle.move(req, "load_started", reason)
            return "loading"
        req.computed = req.confirmed = hit_blocks * bt
        req.registered_blocks = hit_blocks
        if new_blocks:
            req.block_table.extend(pool.allocate(new_blocks))
        self.lifecycle.move(req, "admitted", f"admitted with {hit_blocks} hit blocks on device")
        state.running.append(req)
        entries.append(_schedule(req, compute_tokens))
        return "running"

    def _preempt(self, req: Request) -> None:
        """Send ``req`` back to ``waiting`` (its place by arrival kept), blocks released:
        it recomputes, or reloads what the tiers still hold."""
        state = self.state
        state.running.remove(req)
        self.lifecycle.release_request_blocks(req)
        req.computed = req.confirmed = 0
        req.placeholders = 0
        req.registered_blocks = 0
        req.epoch += 1
        req.lookup = None
        req.preemptions += 1
        state.stats.preemptions += 1
        self.lifecycle.move(req, "preempted", f"out of device blocks ({state.pool.free} free)")
        bisect.insort(state.waiting, req, key=seq_key)
