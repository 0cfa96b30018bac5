"""kvlife's scheduler: vLLM 0.33's v1 ``Scheduler``, for one full-attention KV cache group.

``schedule`` and ``update_from_output`` decide as vLLM's do (``v1/core/sched/scheduler.py``;
FCFS, chunked prefill, prefix caching, no speculative decoding), and this scheduler calls
the connector core (``connector.ConnectorCore``) only where vLLM calls its connector, with
the same calls. It owns its block pool (``blocks.DeviceBlockPool``), as nano-vllm's
scheduler owns its block manager and vLLM's its ``KVCacheManager``.

``schedule`` (one pass, one step; a pass that schedules nothing is a step too, whose output
comes like any other):

1. Running requests first, in order, each for all its known tokens not yet computed, within
   the token budget (chunked prefill; a decode is one token). Under async scheduling a
   request whose step in flight already samples its last token (``max_tokens``) is skipped.
   When blocks run out, the most recently admitted running request is preempted (its blocks
   freed, or, while a step in flight still writes them under async scheduling with a
   connector, not: then the request waits), until the request fits or preempted itself.
2. Then, unless something was preempted, waiting requests while the budget lasts and fewer
   than ``max_running`` run: first those that hold KV blocks (landed loads), then the
   waiting queue, in order. A request whose load has not landed, whose async lookup is
   pending, whose prefetch is waited for, or whom the admission policy defers is skipped in
   place (``get_num_new_matched_tokens`` answered ``None``). A new request takes its device
   prefix hit and the connector's external hit; it is admitted only if free blocks hold its
   whole known sequence (``scheduler_reserve_full_isl``), and a load must in addition leave
   the blocks the prefills in flight still need (``_inflight_prefill_reserved_blocks``).
   A request that does not fit stops admission (no overtaking).
3. ``build_connector_meta``; then the scheduled tokens count as computed, and under async
   scheduling each request that samples gets an output placeholder.

Blocks are cached when the step that computes them is scheduled (``allocate_slots``), a
load's when it lands. ``update_from_output`` takes the oldest step's output: sampled tokens,
stops (``request_finished``; a held request keeps its blocks), the workers' transfer results
(``finished_recving``: a landed load is promoted by the next pass; failed blocks cut the
request's computed tokens; ``finished_sending``: a held request's blocks are freed), then
``take_events``.

kvlife adds one liveness rule vLLM lacks (vllm#57841): a request whose known tokens can
never fit the device fails, at arrival, at admission or while it runs, instead of parking
the queue.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet

from kvlife.lifecycle.config import EngineConfig
from kvlife.lifecycle.engine import records
from kvlife.lifecycle.engine.blocks import DeviceBlockPool, extend_hashes
from kvlife.lifecycle.engine.connector import ConnectorMeta
from kvlife.lifecycle.engine.connector_api import ConnectorAPI
from kvlife.lifecycle.engine.events import FreeBlocks, Scheduled, StepPlan
from kvlife.lifecycle.engine.request import FINISHED_STATUS, SchedRequest, Status
from kvlife.lifecycle.engine.vllm_shapes import CachedRequestData, KVConnectorOutput, NewRequestData, SchedulerOutput

# One scheduled request of a step in flight: (request, tokens, samples a token).
Entry = tuple[SchedRequest, int, bool]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler:
    def __init__(self, config: EngineConfig, connector: ConnectorAPI) -> None:
        self.config = config
        self.connector = connector
        self.core = connector.core  # for its trace records and commands (the scheduler's frees)
        self.pool = DeviceBlockPool(config.device_blocks)
        self.block_tokens = config.block_tokens
        self.async_scheduling = config.async_scheduling
        # With async scheduling a step in flight may still write a freed request's blocks,
        # and a connector's load into a reused block is not ordered against that write:
        # blocks go back only once the steps that wrote them produced output (vLLM's
        # defer_block_free, for a KV-consumer connector). kvlife models vLLM with its
        # connector configured, tiers or none: the connector core keeps every request's
        # lifecycle, so it is always called.
        self.defer_block_free = self.async_scheduling
        self.requests: dict[str, SchedRequest] = {}
        self.waiting: deque[SchedRequest] = deque()
        self.kv_holding: deque[SchedRequest] = deque()  # waiting requests that hold KV blocks
        self.running: list[SchedRequest] = []
        self.finished_recving: set[str] = set()
        self.failed_recving: set[str] = set()
        self.preempted_ids: set[str] = set()  # since the last pass (the next SchedulerOutput's)
        self.finished_ids: set[str] = set()  # likewise
        self._resumed: set[str] = set()  # admitted this pass after a preemption
        self.inflight_prefills: dict[SchedRequest, None] = {}
        self.sched_step_seq = 0
        self.processed_step_seq = 0
        self.deferred_frees: deque[tuple[int, list[int]]] = deque()
        # step id -> (entries, tokens, the plan's entries: what each writes), until its output
        self.steps: dict[int, tuple[list[Entry], int, tuple[Scheduled, ...]]] = {}
        self.next_step_id = 0
        self.results = 0  # transfer results applied (finished_recving / finished_sending)

    # ---- requests in and out ---------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_tokens: int, block_hashes: Sequence[int],
                    max_tokens: int | None = None, resumable: bool = False) -> None:
        """vLLM's ``add_request``: queue it, and tell the connector (``on_new_request``)."""
        core = self.core
        if request_id in self.requests or request_id in core.state.requests or request_id in core.state.retired:
            core.lifecycle.warn("duplicate_arrival", req=request_id)
            return
        bt = self.block_tokens
        req = SchedRequest(request_id, prompt_tokens, max_tokens, tuple(block_hashes[: prompt_tokens // bt]), bt,
                           resumable)
        if _cdiv(prompt_tokens + 1, bt) > self.pool.capacity:
            # kvlife's liveness rule: a prompt that can never fit fails at its arrival.
            req.hash_cap = self.pool.capacity + 1
            self.connector.on_new_request(req, early=False)
            req.finish_note = f"prompt needs more than the {self.pool.capacity} device blocks"
            self._finish(req, "error", Status.FINISHED_IGNORED)
            return
        self.requests[request_id] = req
        self.waiting.append(req)
        self.connector.on_new_request(req)

    def finish_requests(self, request_id: str, reason: str = "aborted") -> bool:
        """vLLM's ``finish_requests`` (an abort): False if it is unknown or finished."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return False
        if req.status == Status.RUNNING:
            self.running.remove(req)
        else:
            self._unqueue(req)
        delay = req.status == Status.WAITING_FOR_REMOTE_KVS and request_id not in self.finished_recving
        self.finished_recving.discard(request_id)
        self.failed_recving.discard(request_id)
        self._free_request(req, reason, delay=delay)
        return True

    def _finish(self, req: SchedRequest, reason: str, status: Status | None = None) -> bool:
        """The request is finished (``reason``; ``status``: vLLM's, if not the reason's): the
        connector hears (``request_finished``) and says whether it holds the blocks. One
        that can never fit is ``FINISHED_IGNORED``: the scheduler's own doing, at its arrival
        or in a pass, not a step output's."""
        req.finished = True
        req.status = status or FINISHED_STATUS[reason]
        self.finished_ids.add(req.request_id)
        hold, _ = self.connector.request_finished(req, req.blocks)
        return hold

    def _unqueue(self, req: SchedRequest) -> None:
        if req in self.waiting:
            self.waiting.remove(req)
        elif req in self.kv_holding:
            self.kv_holding.remove(req)

    def _free_request(self, req: SchedRequest, reason: str, delay: bool = False, why: str | None = None,
                      status: Status | None = None) -> None:
        """vLLM's ``_free_request``: the connector learns of the finish (``request_finished``)
        and may hold the blocks; a loading request's are kept until its load reports."""
        self.inflight_prefills.pop(req, None)
        req.finish_note = why
        hold = self._finish(req, reason, status)
        if delay:
            req.free_on_recving = True
        elif hold:
            req.free_on_sending = True
        else:
            self._free_blocks(req)

    def _free_blocks(self, req: SchedRequest) -> None:
        self._free_request_blocks(req)
        self.requests.pop(req.request_id, None)

    def _can_free(self, req: SchedRequest) -> bool:
        return not self.defer_block_free or req.last_sched_seq <= self.processed_step_seq

    def _free_request_blocks(self, req: SchedRequest) -> None:
        """Give the request's blocks back, tail first, or, while a step in flight may still
        write them, once it has produced output."""
        blocks, req.blocks = req.blocks, []
        req.table = ()
        req.num_cached_blocks = 0
        if not blocks:
            return
        if self._can_free(req):
            self._release(reversed(blocks))
        else:
            self.deferred_frees.append((self.sched_step_seq, blocks))

    def release_held(self, blocks: Sequence[int]) -> None:
        """The connector core lets go of blocks it held (a quarantined job ended)."""
        self._release(blocks)

    def _release(self, blocks: Iterable[int]) -> None:
        freed = self.pool.release(blocks)
        if freed:
            core = self.core
            core.lifecycle.record(records.free(core.state.now, freed))
            core.state.commands.append(FreeBlocks(tuple(freed)))

    # ---- the pass --------------------------------------------------------------------------------
    def schedule(self) -> tuple[StepPlan, ConnectorMeta]:
        """One pass of vLLM's ``schedule()`` (see the module docstring)."""
        self.connector.begin_pass()
        pool = self.pool
        bt = self.block_tokens
        budget = self.config.max_batched_tokens
        running = self.running
        scheduled: list[Entry] = []
        new_blocks: dict[str, tuple[tuple[int, ...], bool]] = {}
        preempted = False
        index = 0
        capacity = pool.capacity
        while index < len(running) and budget > 0:
            req = running[index]
            computed = req.num_computed_tokens
            placeholders = req.num_output_placeholders
            if (placeholders > 0 and req.max_tokens is not None
                    and computed + 2 - placeholders >= req.prompt_tokens + req.max_tokens):
                index += 1  # async: a step in flight already samples its last token
                continue
            known = req.prompt_tokens + req.output_tokens  # (req.num_tokens, inlined: the hot loop)
            n = known + placeholders - computed
            if n > budget:
                n = budget
            if n <= 0:
                index += 1
                continue
            need = -(-(computed + n) // bt)
            if need > capacity:
                # It outgrew the whole device: preempting anything could never make room.
                running.pop(index)
                self._free_request(req, "error", status=Status.FINISHED_IGNORED,
                                   why=f"needs {need} blocks for {req.num_computed_tokens} computed tokens and the "
                                       f"chunk, the device has {pool.capacity}")
                continue
            fits = True
            while need - len(req.blocks) > pool.free:
                victim = running[-1]
                if not self._can_free(victim):
                    fits = False  # its blocks are still written by a step in flight
                    break
                running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if not fits or req.status != Status.RUNNING:
                break
            more = need - len(req.blocks)
            if more > 0:
                added = pool.allocate(more)
                req.blocks.extend(added)
                new_blocks[req.request_id] = (tuple(added), False)
            end = computed + n
            if (end if end < known else known) // bt > req.num_cached_blocks:
                self._cache_blocks(req, end if end < known else known)
            scheduled.append((req, n, end >= known))
            budget -= n
            index += 1
        if not preempted:
            budget = self._admit(budget, scheduled, new_blocks)
        return self._emit(scheduled, new_blocks)

    def _admit(self, budget: int, scheduled: list[Entry], new_blocks: dict[str, tuple[tuple[int, ...], bool]]) -> int:
        """The waiting half of the pass (vLLM's second loop); returns the budget left."""
        connector = self.connector
        pool = self.pool
        bt = self.block_tokens
        skipped_waiting: deque[SchedRequest] = deque()
        skipped_holding: deque[SchedRequest] = deque()

        def skip(queue: deque[SchedRequest]) -> None:
            req = queue.popleft()
            if req.num_computed_tokens > 0 or req.status == Status.WAITING_FOR_REMOTE_KVS:
                skipped_holding.appendleft(req)
            else:
                skipped_waiting.appendleft(req)

        max_running = self.config.max_running
        while budget > 0:
            queue = self.kv_holding if self.kv_holding else self.waiting
            if not queue or len(self.running) >= max_running:
                break
            req = queue[0]
            rid = req.request_id
            if req.status == Status.WAITING_FOR_REMOTE_KVS:
                if rid not in self.finished_recving:
                    skip(queue)
                    continue
                self._landed(req)
                req.status = Status.PREEMPTED if req.num_preemptions else Status.WAITING
            if req.num_stale_output_tokens:
                skip(queue)  # its in-flight output (preempted under async scheduling) comes first
                continue
            if _cdiv(req.num_tokens + 1, bt) > pool.capacity:
                queue.popleft()
                self._free_request(req, "error", status=Status.FINISHED_IGNORED,
                                   why=f"needs {_cdiv(req.num_tokens + 1, bt)} blocks for its {req.num_tokens} known "
                                       f"tokens and the next, the device has {pool.capacity}")
                continue
            local: list[int] = []
            external = 0
            load_async = False
            if req.num_computed_tokens == 0:
                limit = (req.num_tokens - 1) // bt
                local = pool.cached_prefix(req.block_hashes[:limit])
                answer, load_async = connector.get_num_new_matched_tokens(req, len(local) * bt)
                if answer is None:
                    skip(queue)
                    continue
                external = answer
                computed = len(local) * bt + external
            else:
                computed = req.num_computed_tokens
            n = 0 if load_async else min(req.num_tokens - computed, budget)
            reserved = self._reserved() if load_async else 0
            if not self._allocate(req, n, local, external, load_async, reserved):
                break
            connector.update_state_after_alloc(req, req.blocks, external)
            if load_async:
                req.status = Status.WAITING_FOR_REMOTE_KVS
                req.num_computed_tokens = computed
                self.inflight_prefills[req] = None
                skip(queue)
                continue
            queue.popleft()
            self.running.append(req)
            if req.status == Status.PREEMPTED:
                self._resumed.add(rid)
            req.status = Status.RUNNING
            req.num_computed_tokens = computed
            new_blocks[rid] = (tuple(req.blocks), True)
            scheduled.append((req, n, computed + n >= req.num_tokens))
            budget -= n
            if computed + n < req.num_tokens:
                self.inflight_prefills[req] = None
        if skipped_holding:
            self.kv_holding.extendleft(skipped_holding)
        if skipped_waiting:
            self.waiting.extendleft(skipped_waiting)
        return budget

    def _allocate(self, req: SchedRequest, n: int, local: list[int], external: int, delay_cache: bool,
                  reserved: int) -> bool:
        """``KVCacheManager.allocate_slots`` for a waiting request: False (nothing taken)
        unless free blocks hold its whole known sequence and, past ``reserved``, its first
        chunk; then its device hit is taken, blocks allocated, and what it computes cached."""
        pool = self.pool
        bt = self.block_tokens
        total = req.num_computed_tokens + len(local) * bt + external
        held = len(req.blocks)
        hits_taken = pool.evictable(local)
        if held:  # it holds blocks already (a landed load): no new hit
            full_need = max(_cdiv(req.num_tokens, bt) - held, 0)
            need = max(_cdiv(total + n, bt) - held, 0)
        else:
            full_need = max(_cdiv(req.num_tokens, bt) - len(local), 0) + hits_taken
            need = max(_cdiv(total + n, bt) - len(local), 0) + hits_taken
        if full_need > pool.free or need > pool.free - reserved:
            return False
        if local:
            pool.touch(local)
            req.blocks.extend(local)
            req.num_cached_blocks = len(req.blocks)
        if external:
            req.blocks.extend(pool.allocate(max(0, _cdiv(total, bt) - len(req.blocks))))
        more = _cdiv(total + n, bt) - len(req.blocks)
        if more > 0:
            req.blocks.extend(pool.allocate(more))
        if not delay_cache:
            self._cache_blocks(req, min(total + n, req.num_tokens))
        return True

    def _reserved(self) -> int:
        """Blocks the prefills in flight still need for their whole known sequence
        (vLLM's ``_inflight_prefill_reserved_blocks``): an async load must leave them free."""
        bt = self.block_tokens
        return sum(max(0, _cdiv(r.num_tokens, bt) - len(r.blocks)) for r in self.inflight_prefills)

    def _cache_blocks(self, req: SchedRequest, tokens: int) -> None:
        """Publish the request's full blocks of its first ``tokens`` tokens in the prefix cache."""
        full = tokens // self.block_tokens
        if full <= req.num_cached_blocks:
            return
        hashes = req.block_hashes
        cache = self.pool.cache
        blocks = req.blocks
        for i in range(req.num_cached_blocks, full):
            cache(blocks[i], hashes[i])
        req.num_cached_blocks = full

    def _landed(self, req: SchedRequest) -> None:
        """vLLM's ``_update_waiting_for_remote_kv``: a load reported; cache what is valid,
        or, if nothing is, give the blocks back (the request is matched again)."""
        rid = req.request_id
        if rid in self.failed_recving:
            self.failed_recving.discard(rid)
            if req.num_computed_tokens:
                self._cache_blocks(req, req.num_computed_tokens)
            else:
                self._free_request_blocks(req)
                # vLLM 0.33 keeps it in _inflight_prefills here: its own reservation then
                # counts against its next async admission (twice its blocks; on a small
                # device it never fits again: a livelock kvlife check found). Not kept here.
                self.inflight_prefills.pop(req, None)
        else:
            self._cache_blocks(req, req.num_computed_tokens)
        if req.num_computed_tokens == req.num_tokens:
            req.num_computed_tokens = req.num_tokens - 1  # the last token is computed again, to sample
        self.finished_recving.discard(rid)

    def _preempt(self, req: SchedRequest) -> None:
        """vLLM's ``_preempt_request``: blocks freed, back to the front of the queue; its
        output still in flight (async scheduling) will be delivered, as stale."""
        self._free_request_blocks(req)
        self.inflight_prefills.pop(req, None)
        req.status = Status.PREEMPTED
        req.num_computed_tokens = 0
        req.num_stale_output_tokens = req.num_in_flight_tokens
        req.num_output_placeholders = 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        self.preempted_ids.add(req.request_id)

    def _emit(self, scheduled: list[Entry], new_blocks: dict[str, tuple[tuple[int, ...], bool]]
              ) -> tuple[StepPlan, ConnectorMeta]:
        """The scheduler output, ``build_connector_meta``, then ``_update_after_schedule``."""
        step_id = self.next_step_id
        self.next_step_id += 1
        total = 0
        news: list[NewRequestData] = []
        cached = CachedRequestData([], [], [], set())
        cached_ids = cached.req_ids
        cached_computed = cached.num_computed_tokens
        cached_blocks = cached.new_block_ids
        tokens: dict[str, int] = {}
        resumed = self._resumed
        for req, n, _ in scheduled:
            rid = req.request_id
            tokens[rid] = n
            total += n
            added = new_blocks.get(rid)
            if added is None:
                cached_ids.append(rid)
                cached_computed.append(req.num_computed_tokens)
                cached_blocks.append(None)
            elif not added[1]:
                cached_ids.append(rid)
                cached_computed.append(req.num_computed_tokens)
                cached_blocks.append((list(added[0]),))
            elif rid in resumed:
                cached_ids.append(rid)
                cached_computed.append(req.num_computed_tokens)
                cached_blocks.append((list(added[0]),))
                cached.resumed_req_ids.add(rid)
            else:
                news.append(NewRequestData(rid, req.num_computed_tokens, (list(added[0]),)))
        output = SchedulerOutput(news, cached, tokens, self.preempted_ids, self.finished_ids)
        meta = self.connector.build_connector_meta(output)
        self.preempted_ids = set()
        self.finished_ids = set()
        self._resumed = set()
        defer = self.defer_block_free
        if defer and total > 0:
            self.sched_step_seq += 1
        seq = self.sched_step_seq
        entries = []
        placeholders = self.async_scheduling
        inflight = self.inflight_prefills
        bt = self.block_tokens
        for req, n, samples in scheduled:
            before = req.num_computed_tokens
            end = before + n
            req.num_computed_tokens = end
            req.num_in_flight_tokens += n
            if defer:
                req.last_sched_seq = seq
            known = req.prompt_tokens + req.output_tokens
            prefill = req.is_prefill_chunk = end < known + req.num_output_placeholders
            if not prefill:
                if inflight:
                    inflight.pop(req, None)
                if placeholders:
                    req.num_output_placeholders += 1
            table = req.table
            blocks = req.blocks
            if len(table) != len(blocks):
                table = req.table = tuple(blocks)
            hashes = req.hashes
            if len(hashes) < known // bt:
                hashes = req.block_hashes
            if len(hashes) < end // bt:
                # Blocks completed by output placeholders (async scheduling): named by their
                # derived hashes too, so a live worker writes their content.
                hashes = extend_hashes(hashes, req.request_id, end // bt)
            entries.append(Scheduled(req.request_id, n, before, samples, table, hashes))
        planned = tuple(entries)
        self.steps[step_id] = (scheduled, total, planned)
        return StepPlan(step_id, planned, len(meta.sync_lookup_keys), meta.sync_lookup_keys, meta.flush), meta

    # ---- the step's output -----------------------------------------------------------------------
    def update_from_output(self, step_id: int, stops: dict[str, str], output: KVConnectorOutput | None,
                           given_up: AbstractSet[str] = frozenset()) -> bool:
        """vLLM's ``update_from_output`` for the oldest step in flight (``stops``: requests
        whose sampled token was their last, and why; ``output``: the workers' connector
        output of the step, None if it carried none): sampled tokens appended, stopped
        requests finished (``request_finished``), failed loads cut (or failed), the
        connector told (``update_connector_output``), landed loads marked for the next pass
        and held blocks freed, then ``take_events``. ``given_up``: requests whose load the
        core gave up at a deadline (kvlife's drivers only), cut to 0 computed tokens as a
        load failed at its first block is. False if ``step_id`` is not in flight."""
        step = self.steps.pop(step_id, None)
        if step is None:
            return False
        self.connector.begin_output()
        scheduled, total, _ = step
        if self.defer_block_free and total > 0:
            self.processed_step_seq += 1
            while self.deferred_frees and self.deferred_frees[0][0] <= self.processed_step_seq:
                self._release(reversed(self.deferred_frees.popleft()[1]))
        failed_loads: list[str] = []
        if (output is not None and output.invalid_block_ids) or given_up:
            failed_loads = self._invalid_blocks(output.invalid_block_ids if output is not None else set(), given_up)
        for req, n, samples in scheduled:
            req.num_in_flight_tokens -= n
            stale = req.num_stale_output_tokens > 0
            if stale:
                req.num_stale_output_tokens -= n
            if req.finished:
                continue  # aborted while the step ran
            if not samples:
                continue
            req.output_tokens += 1
            if not stale and req.num_output_placeholders > 0:
                req.num_output_placeholders -= 1
                if req.status == Status.RUNNING:
                    self._cache_blocks(req, req.num_computed_tokens - req.num_in_flight_tokens)
            reason = stops.get(req.request_id)
            if reason is not None:
                if req.status == Status.RUNNING:
                    self.running.remove(req)
                else:
                    self._unqueue(req)  # preempted, its stale token was its last
                self._free_request(req, reason)
        for rid in failed_loads:
            failed = self.requests.get(rid)
            if failed is not None and not failed.finished:
                self.finish_requests(rid, "error")
        if output is not None:
            self._transfers_finished(output)
        self.connector.take_events()
        return True

    def _invalid_blocks(self, invalid: set[int], given_up: AbstractSet[str] = frozenset()) -> list[str]:
        """vLLM's ``_handle_invalid_blocks`` for async loads: a loading request's computed
        tokens are cut at its first invalid block. Returns the requests to fail (under
        kv_load_failure_policy "fail"), in queue order."""
        bt = self.block_tokens
        affected = []
        for req in self.kv_holding:
            if req.status != Status.WAITING_FOR_REMOTE_KVS:
                continue
            if req.request_id in given_up:  # (kvlife's drivers: a load given up at a deadline)
                req.num_computed_tokens = 0
                affected.append(req.request_id)
                continue
            blocks = _cdiv(req.num_computed_tokens, bt)
            for index, block in enumerate(req.blocks[:blocks]):
                if block in invalid:
                    req.num_computed_tokens = index * bt
                    affected.append(req.request_id)
                    break
        if self.config.kv_load_failure_policy == "fail":
            return affected
        self.failed_recving.update(affected)
        return []

    def _transfers_finished(self, output: KVConnectorOutput) -> None:
        """vLLM's ``_update_from_kv_xfer_finished``: the connector hears first, then a landed
        load is promoted by the next pass (or a finished request's blocks are freed), and a
        held request's blocks are freed."""
        self.connector.update_connector_output(output)
        recving = sorted(output.finished_recving or ())
        sending = sorted(output.finished_sending or ())
        self.results += len(recving) + len(sending)
        for rid in recving:
            req = self.requests.get(rid)
            if req is None:
                continue
            if req.status == Status.WAITING_FOR_REMOTE_KVS:
                self.finished_recving.add(rid)
            elif req.finished:
                self._free_blocks(req)
        for rid in sending:
            req = self.requests.get(rid)
            if req is not None and req.finished:
                self._free_blocks(req)

    # ---- what drivers and checks read -----------------------------------------------------------
    def waiting_for_remote_kvs(self) -> int:
        """Requests in vLLM's ``WAITING_FOR_REMOTE_KVS`` (their loads not yet taken back)."""
        return sum(1 for r in self.requests.values() if r.status == Status.WAITING_FOR_REMOTE_KVS)

    def output_tokens(self, request_id: str) -> int | None:
        """Tokens the request has output so far (None: it left the scheduler)."""
        req = self.requests.get(request_id)
        return None if req is None else req.output_tokens

    def check_accounting(self) -> None:
        """Invariant 8 on the device, and every block a live request holds is referenced."""
        self.pool.check_accounting()
        refs = self.pool.refs
        for req in self.requests.values():
            for block in req.blocks:
                if refs[block] <= 0:
                    raise AssertionError(f"request {req.request_id} holds device block {block} with no reference")
