"""The scheduler tick: token budget, running requests first, then admission, preemption.

``Scheduler.tick`` decides as vLLM's v1 ``Scheduler.schedule`` does (vLLM 0.33,
``v1/core/sched/scheduler.py``; ``kvlife.lifecycle.drivers.vllm.differential`` checks it
step by step). First it extends the running requests (chunked prefill, then one token per
decode step), preempting the most recently admitted request when device blocks run out.
Then, unless it preempted, it admits, while the budget lasts and fewer than
``max_running`` requests run (requests in ``loading`` do not count, as vLLM's
``max_num_seqs`` does not count ``WAITING_FOR_REMOTE_KVS``):

1. requests whose loads all landed, in the order their loads started (vLLM drains its
   queue of waiting requests that hold KV blocks first);
2. waiting requests in queue order. Each is looked up in the tiers (sync on this path, or
   async through ``lookup_pending``; a request with no full block to hit skips the
   lookup), the admission policy is asked, and it either starts a load (``loading``,
   through ``Transfers.start_load``) or is scheduled for compute (``running``). A
   request whose async lookup is pending is skipped in place. An async answer is consumed
   by the admission it is used for: if the request is not admitted, the next time it is
   considered a new lookup goes out (vLLM asks ``get_num_new_matched_tokens`` again each
   pass), unless the ``lookup_reuse`` policy keeps answers.

An admission needs free device blocks for its whole known sequence, not just its first
chunk (vLLM's ``scheduler_reserve_full_isl``); a load must also leave free the blocks the
prefills in flight still need (vLLM's ``_inflight_prefill_reserved_blocks``). A request
that does not fit stops admission (FIFO: no overtaking).

The result is one ``StepPlan`` command for the driver to run; stores of the blocks the
step computes start with it (``Transfers.maybe_store``). Like nano-vllm's scheduler owns
its block manager, this one works on the state's block pool directly; it receives the
state, the shared ``Lifecycle`` primitives and the ``Transfers`` part it starts loads and
stores with.
"""

from __future__ import annotations

import math

from kvlife.lifecycle.engine.events import (
    BlockMove,
    Scheduled,
    StepPlan,
)
from kvlife.lifecycle.engine.lifecycle import Lifecycle
from kvlife.lifecycle.engine.request import Request
from kvlife.lifecycle.engine.state import DecodeCohort, EngineState
from kvlife.lifecycle.engine.transfers import Transfers
from kvlife.policies.base import LoadView
from kvlife.policies.registry import BUILTIN

# One request's share of the step being built: (request, tokens, samples a token).
Entry = tuple[Request, int, bool]


def _schedule(req: Request, n: int) -> Entry:
    """Schedule ``n`` more tokens of ``req`` in this step; the last one samples."""
    samples = req.computed + n >= req.known_tokens
    req.computed += n
    if samples:
        req.placeholders += 1
    return (req, n, samples)


def _nothing_to_schedule(req: Request, want: int) -> bool:
    """``req`` (running) gets no tokens this step: it wants none (``want``: its known tokens
    not yet computed), or, with async scheduling, a step in flight already samples its
    last token (vLLM schedules no step past max_tokens)."""
    return want <= 0 or bool(req.placeholders and req.max_tokens is not None
                             and req.computed + 2 - req.placeholders >= req.prompt_tokens + req.max_tokens)


def _outgrown(req: Request, need: int, capacity: int) -> str:
    return (f"needs {len(req.block_table) + need} blocks for {req.computed} computed tokens and the chunk, "
            f"the device has {capacity}")


class Scheduler:
    def __init__(self, state: EngineState, lifecycle: Lifecycle, transfers: Transfers) -> None:
        self.state = state
        self.lifecycle = lifecycle
        self.transfers = transfers
        # Every policy of the stack is a built-in one, whose admission hook answers from the
        # request and load it is given alone (not the time, not the queue lengths).
        builtin = tuple(BUILTIN.values())
        self._pure_admission = all(type(p) in builtin for p in lifecycle.policies.policies)
        self._blocked_head: Request | None = None  # _admit's last pass stopped at a blocked head
        self._blocked_loads: tuple[tuple[int, str], ...] = ()  # (hash, tier) it would have loaded
        self.fast_steps = 0  # steps planned for a decode cohort

    def tick(self) -> None:
        """Build one step: extend the running requests, then admit (see the module docstring)."""
        state = self.state
        config = state.config
        state.stats.ticks += 1
        # Deadlines first, so what they release is admitted in this very tick.
        if state.lookup_timers and state.lookup_timers[0][0] <= state.now:
            self.lifecycle.expire_lookups()
        if config.transfer_deadline_ms is not None:
            self.transfers.expire_jobs(config.transfer_deadline_ms)
        if state.jobs or state.prefetches:
            self.transfers.reclaim_jobs(config.reclaim_deadline_ms)
        budget = config.max_batched_tokens
        running = state.running
        if state.fast_limits is not None and running and not state.steps:
            cohort = state.cohort
            if cohort is None:
                cohort = state.cohort = DecodeCohort(outsiders=list(running))
            if self._cohort_tick(cohort, budget):
                return
        state.drop_cohort()
        bt = config.block_tokens
        pool = state.pool
        entries: list[Entry] = []
        preempted = False
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            known = req.prompt_tokens + req.generated + req.placeholders  # req.known_tokens, inlined
            want = known - req.computed
            if _nothing_to_schedule(req, want):
                i += 1
                continue
            n = min(want, budget)
            need = -(-(req.computed + n) // bt) - len(req.block_table)  # state.blocks_for, inlined
            if need > 0:
                if need > pool.free:
                    if len(req.block_table) + need > pool.capacity:
                        # It outgrew the whole device: preempting anything (itself included,
                        # while its own stores or step are in flight) could never make room.
                        self.lifecycle.finish(req, "failed", "error", _outgrown(req, need, pool.capacity))
                        break
                    stuck = False
                    while need > pool.free:
                        victim = running[-1]
                        if state.defer_frees and state.last_step_with(victim) is not None:
                            stuck = True  # its blocks cannot be given back yet: wait for the step
                            break
                        self._preempt(victim)
                        preempted = True
                        if victim is req:
                            break
                    if stuck or req.state != "running":
                        break
                req.block_table.extend(pool.allocate(need))
            # _schedule(req, n), inlined (the hot loop: every running request, every step)
            computed = req.computed + n
            req.computed = computed
            samples = computed >= known
            if samples:
                req.placeholders += 1
            entries.append((req, n, samples))
            budget -= n
            i += 1
        sync_keys: list[int] = []
        if not preempted and (state.waiting or state.holding):
            budget = self._admit(budget, entries, sync_keys)
        self._emit_plan(entries, sync_keys)
        if state.sent:
            self.transfers.release_sent()

    # ---- the decode fast path --------------------------------------------------------------
    def _cohort_tick(self, cohort: DecodeCohort, budget: int) -> bool:
        """``tick`` with the decode cohort (``state.DecodeCohort``): the same step, records
        and commands, but the members' share of the step is one token each, added up
        without looking at them; the specials (the other running requests) are planned as
        the ordinary loop plans them, in ``running`` order. False, with no request touched,
        when the step would not schedule every special's whole chunk or would need more
        free device blocks than there are (budget and preemption then depend on ``running``
        order: the ordinary tick plans it)."""
        state = self.state
        members = cohort.members
        step = cohort.step
        outsiders = [req for req in cohort.outsiders if req.state == "running"]
        expiring = cohort.expiry.pop(step, None)
        if expiring is not None:
            for req in expiring:
                cohort.settle(req)
                del members[req]
                cohort.before -= req.computed
                outsiders.append(req)
        specials: list[Request] = []
        room = self._decode_room
        for req in outsiders:
            k = room(req)
            if k > 0:  # it decodes for k steps from this one: a member till then
                members[req] = (step, req.computed, req.generated)
                cohort.expiry.setdefault(step + k, []).append(req)
                cohort.before += req.computed
            else:
                specials.append(req)
        running = state.running
        if len(specials) > 1:
            specials.sort(key=running.index)
        cohort.outsiders = specials
        left = budget - len(members)
        bt = state.config.block_tokens
        pool = state.pool
        free = pool.free
        chunks: list[tuple[Request, int, int]] = []
        for req in specials:
            want = req.prompt_tokens + req.generated + req.placeholders - req.computed
            if _nothing_to_schedule(req, want):
                continue
            need = -(-(req.computed + want) // bt) - len(req.block_table)
            if need > 0:
                free -= need
            chunks.append((req, want, need))
            left -= want
        if left < 0 or free < 0:
            return False
        entries: list[Entry] = []
        for req, n, need in chunks:
            if need > 0:
                req.block_table.extend(pool.allocate(need))
            entries.append(_schedule(req, n))
        sync_keys: list[int] = []
        if state.waiting or state.holding:
            admitted = len(running)
            self._cohort_admit(cohort, left, entries, sync_keys)
            specials.extend(running[admitted:])  # outsiders from the next step on
        if self._emit_plan(entries, sync_keys, cohort):
            cohort.step = step + 1
            self.fast_steps += 1
        if state.sent:
            self.transfers.release_sent()
        return True

    def _cohort_admit(self, cohort: DecodeCohort, budget: int, entries: list[Entry], sync_keys: list[int]) -> None:
        """``_admit`` for a cohort's step, skipped while its last pass would repeat."""
        state = self.state
        if self.admission_quiet(cohort):
            return
        cohort.quiet_head = None
        pool = state.pool
        pool.watch = None
        commands = len(state.commands)
        admitted = len(entries)
        self._blocked_head = None
        self._admit(budget, entries, sync_keys)
        head = self._blocked_head
        if (self._pure_admission and head is not None and len(entries) == admitted
                and not sync_keys and len(state.commands) == commands and not state.holding
                and not state.prefetch_waits and not state.prefetches and not state.sent):
            # The head was blocked (short of device blocks) and nothing else happened: the
            # same pass gives the same answer, and the same decisions (the built-in
            # policies' admission hooks answer from the request and the load they are given
            # only), until something it read changes (``admission_quiet``): skip it till then.
            wake = state.next_wakeup()
            cohort.quiet_head = head
            cohort.quiet_until = math.inf if wake is None else wake
            cohort.quiet_mark = (head.epoch, head.lookup, state.transfer_version, pool.freed_total)
            cohort.quiet_loads = self._blocked_loads
            cohort.quiet_removals = tuple((tier, tier.removals) for tier in state.tiers.values())
            pool.watch = frozenset(state.hit_candidates(head))
            pool.watch_hit = False

    def admission_quiet(self, cohort: DecodeCohort) -> bool:
        """Would an admission pass now find ``cohort.quiet_head`` at the head of the queue,
        blocked as before, and do nothing else? Yes while none of what that pass read has
        changed: the head (its epoch, its lookup answer, still current for the tiers'
        version), no device block freed (``free`` only went down; the blocks the prefills
        in flight reserve went down with it), none of the head's blocks in or out of the
        device cache, each block it would load still in its tier (blocks join the tiers
        only when a transfer reports, which changes the version), no load landed or
        prefetch running, no deadline reached."""
        head = cohort.quiet_head
        if head is None:
            return False
        state = self.state
        waiting = state.waiting
        pool = state.pool
        if (not waiting or waiting[0] is not head or state.holding or state.sent or state.prefetch_waits
                or state.prefetches or state.now >= cohort.quiet_until or pool.watch_hit):
            return False
        epoch, lookup, version, freed = cohort.quiet_mark
        if (head.state != "waiting" or head.epoch != epoch or head.lookup is not lookup
                or state.transfer_version != version or pool.freed_total != freed
                or state.sync_lookup_version.get(head.request_id) != version):
            return False
        tiers = state.tiers
        if all(tier.removals == count for tier, count in cohort.quiet_removals):
            return True  # nothing left any tier since
        if not all(tiers[tier].contains(block) for block, tier in cohort.quiet_loads):
            return False
        cohort.quiet_removals = tuple((tier, tier.removals) for tier, _ in cohort.quiet_removals)
        return True

    def _decode_room(self, req: Request) -> int:
        """How many more steps ``req`` (running) would just decode, this tick's included
        (0 if it would not, or has no stop rule): ``_cohort_tick``'s test of a member."""
        state = self.state
        limits = state.fast_limits
        c = req.computed
        stop = limits.get(req.request_id) if limits is not None else None
        if (stop is None or req.placeholders or req.confirmed != c or c < req.prompt_tokens
                or req.prompt_tokens + req.generated != c + 1 or req.first_token_ms is None):
            return 0
        bt = state.config.block_tokens
        # Steps j = 0, 1, ... end at c + j + 1 tokens: it stops at the output where
        # generated + 1 reaches its stop; it fills a block when c + j + 1 is a multiple
        # of bt (and allocates one past its table); it registers or stores a block
        # when c + j + 1 reaches the block after the last registered or stored one.
        k = min(stop[0] - req.generated - 1, (c // bt + 1) * bt - c - 1, len(req.block_table) * bt - c,
                (req.registered_blocks + 1) * bt - c - 1)
        if state.tiers:
            k = min(k, (req.stored_blocks + 1) * bt - c - 1)
        return k

    def _emit_plan(self, entries: list[Entry], sync_keys: list[int], cohort: DecodeCohort | None = None) -> bool:
        """Plan the step of ``entries`` and of ``cohort``'s members (one token each, counted
        in the totals and the record only; ``state.steps`` holds the entries), record it and
        start the stores it calls for. False if there is nothing to plan."""
        state = self.state
        sync_lookups = len(sync_keys)
        state.stats.sync_lookups += sync_lookups
        members = 0 if cohort is None else len(cohort.members)
        if not entries and not sync_lookups and not members:
            return False
        step_id = state.next_step_id
        state.next_step_id += 1
        state.stats.steps += 1
        bt = state.config.block_tokens
        scheduled = []
        light = state.fast_limits is not None  # the simulator: totals and samplers, not entries
        samplers = []
        tokens = cached = twice_pairs = 0
        prefill = 0
        prompt_chunks = []  # (request, computed before, tokens) of steps that compute prompt tokens
        fills = []  # the same for the other steps that fill a block (generated tokens)
        to_store = []
        recorder = state.recorder
        recording = recorder is not None  # (the record's lists are built only for it)
        for req, n, samples in entries:
            end = req.computed
            before = end - n
            if before < req.prompt_tokens:
                if recording:
                    prompt_chunks.append([req.request_id, before, n])
                if end >= (len(req.hashes) + 1) * bt:
                    state.ensure_hashes(req, end // bt)  # a recompute past the prompt's blocks
            elif end % bt < n:  # the chunk reaches a block boundary: it fills a block
                if recording:
                    fills.append([req.request_id, before, n])
                if end >= (len(req.hashes) + 1) * bt:
                    state.ensure_hashes(req, end // bt)  # the block it fills gets its hash
            if light:
                tokens += n
                cached += before
                twice_pairs += n * (before + before + n + 1)
                if samples:
                    samplers.append(req.request_id)
            else:
                scheduled.append(Scheduled(req.request_id, n, before, samples, tuple(req.block_table), req.hashes))
            if n > 1:
                prefill += n
            if end >= (req.stored_blocks + 1) * bt:
                to_store.append(req)
        step_entries = [(req, req.epoch, n, samples) for req, n, samples in entries]
        if cohort is not None:
            # The members' share: one token each on top of their computed tokens
            # (``cohort.before`` in all); none of them samples its last token here.
            before = cohort.before
            tokens += members
            cached += before
            twice_pairs += 2 * before + 2 * members
            cohort.planned = step_entries
            cohort.before = before + members
        state.steps[step_id] = step_entries
        if recorder is not None:
            record = {
                "kind": "step",
                "t": state.now,
                "step": step_id,
                "requests": len(step_entries) + members,
                "prefill_tokens": prefill,
                "sync_lookups": sync_lookups,
                "prompt": prompt_chunks,
            }
            if fills:
                record["fills"] = fills
            recorder(record)
        if light:
            state.commands.append(StepPlan(step_id, (), sync_lookups, tuple(sync_keys),
                                           (tokens, len(step_entries) + members, twice_pairs, cached), tuple(samplers)))
        else:
            state.commands.append(StepPlan(step_id, tuple(scheduled), sync_lookups, tuple(sync_keys)))
        maybe_store = self.transfers.maybe_store
        for req in to_store:
            maybe_store(req)
        return True

    # ---- admission ------------------------------------------------------------------------
    def _admit(self, budget: int, entries: list[Entry], sync_keys: list[int]) -> int:
        """Take landed loads into ``running``, then admit waiting requests in queue order,
        while budget and ``max_running`` allow. Returns the budget left; each sync lookup
        paid appends its number of blocks to ``sync_keys``."""
        state = self.state
        lifecycle = self.lifecycle
        max_running = state.config.max_running
        max_lookups = state.config.max_async_lookups
        running = state.running
        if state.holding:
            budget, blocked = self._take_landed(budget, entries)
            if blocked:
                return budget
        waiting = state.waiting
        versions = state.sync_lookup_version
        index = 0
        while index < len(waiting) and budget > 0 and len(running) < max_running:
            req = waiting[index]
            if req.state == "lookup_pending":
                index += 1  # vLLM: (None, False) from the connector: skipped in place
                continue
            if req.request_id in state.prefetch_waits and self.transfers.prefetch_gate(req) == "deferred":
                index += 1
                continue
            if self._never_fits(req):
                continue  # failed: a head that can never fit must not park the queue (vllm#57841)
            candidates = state.hit_candidates(req)
            lookup = req.lookup
            if lookup is not None and not req.lookup_async \
                    and versions.get(req.request_id) != state.transfer_version:
                lookup = None  # a sync answer is re-done once the tiers may have changed
            reuse = "consume"
            if lookup is None:
                if not state.tiers or not candidates:
                    # Nothing to look up (no full block): answered at once, at no cost
                    # (vLLM's Mooncake connector returns (0, False) without a lookup).
                    req.lookup = ()
                    req.lookup_async = False
                    versions[req.request_id] = state.transfer_version
                elif lifecycle.ask(req, "lookup_mode") == "async":
                    reason = "async lookup submitted"
                    if req.lookup_uses:
                        reason = (f"async lookup submitted again: the answer of t={req.lookup_answered_ms:g} "
                                  f"was consumed by the admission it was used for")
                    lifecycle.submit_lookup(req, reason)
                    index += 1
                    continue
                else:
                    req.lookup = state.sync_lookup(candidates)
                    req.lookup_async = False
                    versions[req.request_id] = state.transfer_version
                    sync_keys.append(len(candidates))
            elif req.lookup_async:
                reuse = lifecycle.ask(req, "lookup_reuse")
                if req.lookup_uses:
                    self._record_reuse(req, candidates)
                req.lookup_uses += 1
            outcome = self._try_admit(req, budget, entries, candidates)
            if outcome == "running" or outcome == "loading":
                del waiting[index]
                versions.pop(req.request_id, None)
                if outcome == "running":
                    budget -= entries[-1][1]
                continue
            if req.lookup_async and reuse == "consume":
                if req.async_lookups < max_lookups:
                    req.lookup = None  # consumed: the next consideration looks up again
                elif req.async_lookups == max_lookups:
                    # Liveness: a request deferred on every answer would look up for ever
                    # (vllm#49829: 1.27M lookup() calls for one request). Past the bound its
                    # last answer is kept, as keep-lookup-answers would.
                    req.async_lookups += 1
                    self.lifecycle.warn("lookup_limit", req=req.request_id, lookups=max_lookups)
            if outcome == "blocked":
                if index == 0 and not req.lookup_async:
                    self._blocked_head = req  # (for _cohort_admit: the pass changed nothing)
                break  # FIFO: no overtaking when memory is short
            index += 1  # deferred by the admission policy
        return budget

    def _never_fits(self, req: Request) -> bool:
        """Fail ``req`` if its known tokens and the next need more blocks than the whole
        device (its generated tokens grew it past the device before a preemption)."""
        state = self.state
        need = state.blocks_for(req.known_tokens + 1)
        if need <= state.pool.capacity:
            return False
        self.lifecycle.finish(req, "failed", "error", f"needs {need} blocks for its {req.known_tokens} known "
                              f"tokens and the next, the device has {state.pool.capacity}")
        return True

    def _record_reuse(self, req: Request, candidates: tuple[int, ...]) -> None:
        """A kept async answer is used again: trace its age and what left the tiers since."""
        state = self.state
        lookup = req.lookup or ()
        gone = sum(1 for h, tier in zip(candidates, lookup, strict=False)
                   if tier in state.tiers and not state.tiers[tier].contains(h))
        self.lifecycle.record({"kind": "lookup_reuse", "t": state.now, "req": req.request_id,
                               "answered": req.lookup_answered_ms, "age_ms": state.now - req.lookup_answered_ms,
                               "uses": req.lookup_uses + 1, "blocks": len(lookup), "evicted": gone})

    def _take_landed(self, budget: int, entries: list[Entry]) -> tuple[int, bool]:
        """Requests whose loads all landed go to ``running`` with their first chunk, in the
        order their loads started; still-loading ones are skipped. True when admission
        must stop (budget, ``max_running`` or the device is short)."""
        state = self.state
        pool = state.pool
        holding = state.holding
        running = state.running
        max_running = state.config.max_running
        bt = state.config.block_tokens
        i = 0
        while i < len(holding):
            if budget <= 0 or len(running) >= max_running:
                return budget, True
            req = holding[i]
            if req.load_jobs:
                i += 1
                continue
            known = req.known_tokens
            if -(-known // bt) - len(req.block_table) > pool.free:
                req.landed_seen = True
                return budget, True  # its whole sequence must fit (scheduler_reserve_full_isl)
            n = min(known - req.computed, budget)
            need = -(-(req.computed + n) // bt) - len(req.block_table)
            if need > 0:
                req.block_table.extend(pool.allocate(need))
            del holding[i]
            self.lifecycle.move(req, "load_done", "every rank reported the load; taken back by the scheduler")
            running.append(req)
            entries.append(_schedule(req, n))
            budget -= n
        return budget, False

    def _reserved(self) -> int:
        """Blocks the prefills in flight still need to reach their whole known sequence
        (vLLM's ``_inflight_prefill_reserved_blocks``): an async load must leave them free."""
        bt = self.state.config.block_tokens
        reserved = 0
        for req in self.state.running:
            if req.computed < req.admitted_tokens:
                reserved += max(0, -(-req.admitted_tokens // bt) - len(req.block_table))
        for req in self.state.holding:
            reserved += max(0, -(-req.admitted_tokens // bt) - len(req.block_table))
        return reserved

    def _try_admit(self, req: Request, budget: int, entries: list[Entry], candidates: tuple[int, ...]) -> str:
        """Admit ``req`` into ``loading`` or ``running``; or "deferred" (policy), or
        "blocked" (not enough free device blocks: admission stops here)."""
        state = self.state
        pool = state.pool
        in_flight_loads = state.in_flight_loads
        bt = state.config.block_tokens
        device = pool.cached_prefix(candidates)
        assert req.lookup is not None
        # Re-validate the lookup: a block may have been evicted since the answer.
        plan: list[tuple[int, str]] = []  # (hash, "device" | tier) for blocks past the device hit
        # After a failed load, external hits stop before the first block that failed, so
        # a bad or unreachable copy is never retried forever.
        external_end = min(len(req.lookup), len(candidates), req.external_hit_limit)
        on_device = pool.cached  # (pool.block_of, inlined: every block of the head, every pass)
        tiers = state.tiers
        lookup = req.lookup
        for i in range(device, external_end):
            block = candidates[i]
            if block in on_device:
                plan.append((block, "device"))
            elif tiers[lookup[i]].contains(block):
                plan.append((block, lookup[i]))
            else:
                break
        to_load = [(h, t) for h, t in plan if t != "device"]
        in_flight = tuple(
            (h, in_flight_loads[h][0][2]) for h, _ in to_load if h in in_flight_loads
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
        known = req.known_tokens
        # Cached hits that sit in the free queue: taking them uses up free blocks too.
        refs = pool.refs
        reclaim = 0
        for h in hit_hashes:
            b = on_device.get(h)
            if b is not None and refs[b] == 0:
                reclaim += 1
        # The whole known sequence must fit, not just the first chunk (vLLM's
        # scheduler_reserve_full_isl): new blocks past the hit, the blocks to load, and
        # the cached hits it takes out of the free queue.
        if -(-known // bt) - hit_blocks + len(own_loads) + reclaim > pool.free:
            self._blocked_loads = tuple(to_load)
            return "blocked"
        loads = bool(own_loads or joined)
        if loads:
            compute_tokens = 0
            if len(own_loads) + reclaim > pool.free - self._reserved():
                self._blocked_loads = tuple(to_load)
                return "blocked"  # would take blocks the prefills in flight still need
        else:
            compute_tokens = min(known - hit_blocks * bt, budget)
        new_blocks = len(own_loads) if loads else state.blocks_for(hit_blocks * bt + compute_tokens) - hit_blocks
        # Commit: build the block table in prefix order.
        # Take the cached hits first: allocating could otherwise recycle one of them.
        table: list[int] = []
        own_moves: list[BlockMove] = []
        join_jobs: list[int] = []
        tier_of = dict(to_load)
        for h in hit_hashes:
            if h in joined:
                job_id, block, _ = in_flight_loads[h][0]
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
        req.admitted_tokens = known
        if req.preemptions == 0 and not req.tier_hit_blocks and not req.device_hit_blocks:
            # Hit rates describe what the request found when it first came in.
            req.device_hit_blocks = device
            for _, t in plan:
                req.tier_hit_blocks[t] = req.tier_hit_blocks.get(t, 0) + 1
        if loads:
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
            state.holding.append(req)
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
        """Send ``req`` back to the front of the waiting queue (vLLM prepends it), blocks
        released: it recomputes, or reloads what the tiers still hold."""
        state = self.state
        state.running.remove(req)
        state.drop_cohort()
        self.lifecycle.release_request_blocks(req)
        req.computed = req.confirmed = 0
        req.placeholders = 0
        req.registered_blocks = 0
        req.admitted_tokens = 0
        req.epoch += 1
        req.lookup = None
        req.lookup_async = False
        req.lookup_uses = 0
        req.preemptions += 1
        state.stats.preemptions += 1
        self.lifecycle.move(req, "preempted", f"out of device blocks ({state.pool.free} free)")
        state.waiting.insert(0, req)
