"""The connector core: everything a KV connector owns, behind vLLM's connector calls.

One implementation for every driver. kvlife's own scheduler (``scheduler.Scheduler``, the
simulator and the live runtime run it) and vLLM's scheduler (through
``kvlife.lifecycle.drivers.vllm.connector.KVLifeConnector``) make the same calls, in the
same order, named as vLLM names them:

- ``on_new_request``: arrival (the ``on_arrival`` policy: an early lookup or prefetch);
- ``get_num_new_matched_tokens``: the external hit beyond the device's prefix hit, or
  ``None`` while an async lookup is pending, a prefetch is being waited for, or the
  admission policy defers (``lookup_mode``, ``lookup_reuse``, ``admission``);
- ``update_state_after_alloc``: the scheduler admitted the request on these blocks: a load
  job (``loading``), or ``running``; after a landed load, its promotion (``load_done``); a
  resumable request it has ``running`` ended its turn and its next input chunk is admitted
  (``turn_ended``, then ``admitted``);
- ``build_connector_meta``: the step's preemptions (their stores flushed; one vLLM made
  outside ``schedule()`` is taken earlier, when ``get_num_new_matched_tokens`` asks about
  the request while the core has it ``running``), the step's
  scheduled chunks (the tokens each later output confirms), and what the workers must do:
  loads, stores, prefetches, flushes, abandoned jobs, holds;
- ``update_connector_output``: the workers' per-rank job reports (``ranks``, invariant 3)
  and ``finished_sending`` (a held request's blocks are given back);
- ``request_finished``: the request stopped, failed or was aborted: its last blocks'
  stores start, and it is held (its blocks kept until ``finished_sending``) while any store
  reads them (``hold_at_finish`` says whether it waits in ``sending``);
- ``take_events``: the end of a step output: the tokens of the oldest step in flight are
  confirmed, and the blocks they fill are stored (``store_limit``).

Two more inputs are kvlife's: ``on_lookup_answer`` (an async lookup answered; vLLM's
connector answers its own) and ``tick`` (the driver's clock at the start of a scheduler
pass, for the deadlines). The calls come through ``connector_api.ConnectorAPI``, which reads
them off vLLM's objects (or kvlife's scheduler's, of the same shapes).

Every state change goes through ``Lifecycle.move`` (the spec table), every policy question
through ``Lifecycle.ask``, and every trace record through ``records``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

from kvlife.lifecycle.config import EngineConfig
from kvlife.lifecycle.engine import records
from kvlife.lifecycle.engine.events import (
    BlockMove,
    Command,
    DiscardLookup,
    LookupAnswer,
    SubmitLookup,
    TransferReport,
    input_to_record,
)
from kvlife.lifecycle.engine.jobs import Transfers
from kvlife.lifecycle.engine.lifecycle import DeviceInfo, Lifecycle
from kvlife.lifecycle.engine.request import Request
from kvlife.lifecycle.engine.state import CoreState, Job, PrefetchJob, Recorder, Retire, StepEntry
from kvlife.policies.base import Hook, LoadView
from kvlife.policies.stack import PolicyStack
from kvlife.specs.names import RequestState, Trigger
from kvlife.specs.table import ReferenceRequest
from kvlife.transfer.index import TierIndex

WAITING = RequestState.WAITING
LOOKUP_PENDING = RequestState.LOOKUP_PENDING
LOADING = RequestState.LOADING
RUNNING = RequestState.RUNNING
SENDING = RequestState.SENDING
FINISHED = RequestState.FINISHED

# Why vLLM finished a request (``request_finished``): a stop, the length limit, an abort, an error.
FINISH_REASONS = ("stopped", "length", "aborted", "error")


@attrs.frozen
class StepInfo:
    """What ``build_connector_meta`` reads of vLLM's ``SchedulerOutput``."""

    step_id: int
    # (request, tokens computed before, tokens) per scheduled request, in scheduler order.
    scheduled: tuple[tuple[str, int, int], ...]
    # request -> (its new block ids, True if they replace its table: a new or resumed request).
    new_blocks: Mapping[str, tuple[tuple[int, ...], bool]]
    preempted: tuple[str, ...] = ()


@attrs.frozen
class NextChunk:
    """A resumable request's next input chunk (vLLM's streaming input session), read off
    the scheduler's request when it is admitted again: its prompt now (the last turn's kept
    outputs and the new input), their full blocks' hashes, its output limit, and the tokens
    whose KV it kept (vLLM's ``num_computed_tokens``, where the chunk resumes)."""

    prompt_tokens: int
    hashes: tuple[int, ...]
    max_tokens: int | None
    computed_tokens: int


@attrs.frozen
class ConnectorMeta:
    """What the workers do for one step (the connector metadata's payload)."""

    step_id: int
    loads: tuple[Job, ...]
    stores: tuple[Job, ...]
    prefetches: tuple[PrefetchJob, ...]
    flush: tuple[int, ...]  # store jobs to finish before this step writes anything (preempted owners)
    abandon: tuple[int, ...]  # jobs given up: workers still owing them report them failed
    hold_finished: tuple[str, ...]  # requests to report in finished_sending once their stores end
    sync_lookup_keys: tuple[int, ...]  # blocks each sync lookup of this pass asked about


class ConnectorCore:
    """The connector's half of kvlife's lifecycle (see the module docstring)."""

    def __init__(
        self,
        config: EngineConfig,
        policies: PolicyStack,
        tiers: Sequence[TierIndex] | None = None,
        recorder: Recorder | None = None,
        reference: bool = False,
        retire: Retire | None = None,
        device: DeviceInfo | None = None,
        deadline_kinds: tuple[str, ...] = ("load", "store"),
        observing: bool = False,
    ) -> None:
        self.state = CoreState(config, tiers, recorder, reference, retire)
        self.state.observing = observing
        self.lifecycle = Lifecycle(self.state, policies, device)
        self.transfers = Transfers(self.state, self.lifecycle)
        # The jobs ``engine.transfer_deadline_ms`` gives up on (inside vLLM: stores only, a
        # late load would land in blocks vLLM may have handed on).
        self.deadline_kinds = deadline_kinds
        # Requests preempted outside ``schedule()`` whose preemption was taken in this pass,
        # before the pass's ``build_connector_meta`` names them (``_preempted_outside``).
        self.preempted_early: set[str] = set()

    @property
    def config(self) -> EngineConfig:
        return self.state.config

    @property
    def requests(self) -> dict[str, Request]:
        return self.state.requests

    def take_commands(self) -> list[Command]:
        commands, self.state.commands = self.state.commands, []
        return commands

    # ---- the clock ---------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        """A scheduler pass starts at the driver's time ``now``: deadlines that have passed
        are acted on first (lookups expire, transfers are given up or reclaimed), so what
        they release is seen by this very pass."""
        state = self.state
        state.now = now
        state.stats.ticks += 1
        if state.lookup_timers and state.lookup_timers[0][0] <= now:
            self._expire_lookups()
        config = state.config
        if config.transfer_deadline_ms is not None:
            self.transfers.expire_jobs(config.transfer_deadline_ms, self.deadline_kinds)
        if state.jobs or state.prefetches:
            self.transfers.reclaim_jobs(config.reclaim_deadline_ms)

    # ---- vLLM: on_new_request --------------------------------------------------------------------
    def on_new_request(self, request_id: str, prompt_tokens: int, block_hashes: Sequence[int],
                       max_tokens: int | None = None, resumable: bool = False, early: bool = True) -> Request | None:
        """A request arrived (vLLM's ``on_new_request``). The ``on_arrival`` decision may
        start an early lookup, or a lookup and a prefetch of its lower-tier hits into the
        host tier (``early=False``: not asked, the scheduler fails the request at once).
        None: a duplicate id, ignored."""
        state = self.state
        lifecycle = self.lifecycle
        if request_id in state.requests or request_id in state.retired:
            lifecycle.warn("duplicate_arrival", req=request_id)
            return None
        block_tokens = state.config.block_tokens
        req = Request(
            request_id=request_id,
            seq=state.next_seq,
            arrival_ms=state.now,
            prompt_tokens=prompt_tokens,
            hashes=tuple(block_hashes[: prompt_tokens // block_tokens]),
            resumable=resumable,
            block_tokens=block_tokens,
            max_tokens=max_tokens,
        )
        state.next_seq += 1
        state.requests[request_id] = req
        state.state_counts[WAITING] += 1
        if state.reference is not None:
            state.reference[request_id] = ReferenceRequest(request_id)
        # No full block to hit: nothing to look up early (or ever, for this prompt).
        if early and state.tiers and state.hit_candidates(req):
            action = lifecycle.ask(req, Hook.ON_ARRIVAL)
            if action in ("lookup", "prefetch"):
                if action == "prefetch":
                    state.wants_prefetch[request_id] = req.epoch
                self._submit_lookup(req, f"early {action} at arrival")
        return req

    # ---- vLLM: get_num_new_matched_tokens --------------------------------------------------------
    def get_num_new_matched_tokens(self, request_id: str, num_computed_tokens: int) -> tuple[int | None, bool]:
        """The tokens a load can bring beyond the ``num_computed_tokens`` the device's prefix
        cache holds, and whether the load is async (always, in kvlife); ``(None, False)``
        while the request cannot be answered yet (vLLM skips it, in place)."""
        state = self.state
        lifecycle = self.lifecycle
        req = state.requests[request_id]
        if req.state == RUNNING:
            self._preempted_outside(req)
        req.local_tokens = num_computed_tokens
        req.plan = ()
        req.joins = {}
        req.landed = False  # (a failed load's request that kept no block comes back through here)
        if req.state == LOOKUP_PENDING:
            return None, False
        if request_id in state.prefetch_waits and self.transfers.prefetch_gate(req):
            return None, False
        candidates = state.hit_candidates(req)
        if not state.tiers or not candidates:
            # Nothing to look up (no full block): answered at once, at no cost (vLLM's
            # Mooncake connector returns (0, False) without a lookup).
            return 0, False
        lookup = req.lookup
        if lookup is not None and not req.lookup_async \
                and state.sync_lookup_version.get(request_id) != state.transfer_version:
            lookup = None  # a sync answer is re-done once the tiers may have changed
        elif lookup is not None and req.lookup_async and req.lookup_uses and req.last_decisions.get(
                "lookup_reuse", ("", "consume", ""))[1] == "consume":
            # Handed out once already and vLLM did not admit it: consumed, a new lookup.
            if req.async_lookups < state.config.max_async_lookups:
                lookup = None
            elif req.async_lookups == state.config.max_async_lookups:
                # Liveness: a request deferred on every answer would look up for ever
                # (vllm#49829: 1.27M lookup() calls for one request). Past the bound its
                # last answer is kept, as keep-lookup-answers would.
                req.async_lookups += 1
                lifecycle.warn("lookup_limit", req=request_id, lookups=state.config.max_async_lookups)
        if lookup is None:
            if lifecycle.ask(req, Hook.LOOKUP_MODE) == "async":
                reason = "async lookup submitted"
                if req.lookup_uses:
                    reason = (f"async lookup submitted again: the answer of t={req.lookup_answered_ms:g} "
                              f"was consumed by the admission it was used for")
                self._submit_lookup(req, reason)
                return None, False
            req.lookup = state.sync_lookup(candidates)
            req.lookup_async = False
            req.lookup_uses = 0
            state.sync_lookup_version[request_id] = state.transfer_version
            state.stats.sync_lookups += 1
            state.sync_keys.append(len(candidates))
        elif req.lookup_async:
            lifecycle.ask(req, Hook.LOOKUP_REUSE)
            if req.lookup_uses:
                self._record_reuse(req, candidates)
            req.lookup_uses += 1
        plan = self._plan(req, candidates, num_computed_tokens // state.config.block_tokens)
        if not plan:
            return 0, False
        in_flight = state.in_flight_loads
        joinable = tuple((h, in_flight[h][0][2]) for h, _ in plan if h in in_flight)
        view = LoadView(device_hit_blocks=num_computed_tokens // state.config.block_tokens,
                        external_hit_blocks=len(plan), tiers=tuple(t for _, t in plan), in_flight=joinable)
        choice = lifecycle.ask(req, Hook.ADMISSION, view)
        if choice == "defer":
            return None, False
        if choice == "join":
            req.joins = {h: in_flight[h][0][0] for h, _ in joinable}
        req.plan = plan
        return len(plan) * state.config.block_tokens, True

    def _plan(self, req: Request, candidates: tuple[int, ...], start: int) -> tuple[tuple[int, str], ...]:
        """The blocks past the device hit that the tiers hold, in order, per the lookup
        answer and re-validated (a block may have left its tier since); after a failed
        load, never from its first failed block on."""
        tiers = self.state.tiers
        lookup = req.lookup or ()
        end = min(len(lookup), len(candidates), req.external_hit_limit)
        plan = []
        for i in range(start, end):
            block = candidates[i]
            tier = tiers.get(lookup[i])
            if tier is None or not tier.contains(block):
                break
            plan.append((block, lookup[i]))
        return tuple(plan)

    def _record_reuse(self, req: Request, candidates: tuple[int, ...]) -> None:
        """A kept async answer is used again: trace its age and what left the tiers since."""
        state = self.state
        lookup = req.lookup or ()
        gone = sum(1 for h, tier in zip(candidates, lookup, strict=False)
                   if tier in state.tiers and not state.tiers[tier].contains(h))
        self.lifecycle.record(records.lookup_reuse(state.now, req.request_id, req.lookup_answered_ms,
                                                   req.lookup_uses + 1, len(lookup), gone))

    # ---- vLLM: update_state_after_alloc ----------------------------------------------------------
    def update_state_after_alloc(self, request_id: str, block_ids: Sequence[int], num_external_tokens: int,
                                 chunk: NextChunk | None = None) -> None:
        """The scheduler admitted ``request_id`` on ``block_ids`` (its whole table): start the
        load of its external hit, or run it; after its loads landed, it is promoted. A
        resumable request the core has ``running`` admitted again (``chunk``, its next input
        chunk) ended its turn. (A request preempted outside ``schedule()`` comes back through
        ``get_num_new_matched_tokens`` first: vLLM asks about every request with no computed
        tokens.)"""
        state = self.state
        lifecycle = self.lifecycle
        req = state.requests[request_id]
        if chunk is not None and req.state == RUNNING:
            self._next_chunk(req, block_ids, chunk)
            return
        req.block_table = list(block_ids)
        bt = state.config.block_tokens
        if req.state == LOADING:
            # vLLM's second call, at the pass that takes a landed load back.
            req.landed = False
            lifecycle.move(req, Trigger.LOAD_DONE, "every rank reported the load; taken back by the scheduler")
            return
        if req.landed:
            # Re-admitted after a failed load, on the blocks it kept (vLLM recomputes from
            # the first failed block).
            req.landed = False
            lifecycle.move(req, Trigger.ADMITTED, f"recomputes from token {req.confirmed} after its failed load")
            return
        first = req.local_tokens // bt
        count = num_external_tokens // bt
        if state.observing and count > 0:
            # Another connector's load: its job comes with the step's metadata (``observe_jobs``).
            req.load_jobs, req.load_failed, req.landed = [], [], False
            req.computed = req.confirmed = req.local_tokens
            req.pending_hit_tokens = (first + count) * bt
            lifecycle.move(req, Trigger.LOAD_STARTED, f"loading {num_external_tokens} tokens")
            return
        if req.preemptions == 0 and not req.tier_hit_blocks and not req.device_hit_blocks:
            # Hit rates describe what the request found when it first came in.
            req.device_hit_blocks = first
            for _, tier in req.plan[:count]:
                req.tier_hit_blocks[tier] = req.tier_hit_blocks.get(tier, 0) + 1
        if count <= 0:
            req.computed = req.confirmed = req.local_tokens
            req.plan = ()
            req.joins = {}
            lifecycle.move(req, Trigger.ADMITTED, f"admitted with {first} hit blocks on device")
            return
        own: list[BlockMove] = []
        joined: dict[int, list[BlockMove]] = {}  # owner job -> copies of its device blocks
        jobs = state.jobs
        for i, (block_hash, tier) in enumerate(req.plan[:count]):
            device = block_ids[first + i]
            owner = req.joins.get(block_hash)
            owner_job = jobs.get(owner) if owner is not None else None
            if owner_job is not None and not owner_job.timed_out:
                source = next(m.device_block for m in owner_job.moves if m.block_hash == block_hash)
                joined.setdefault(owner_job.job_id, []).append(BlockMove(block_hash, device, "device", source))
                state.stats.joined_blocks += 1
            else:
                own.append(BlockMove(block_hash, device, tier, -1))
        req.load_jobs = []
        req.load_failed = []
        req.landed = False
        req.computed = req.confirmed = req.local_tokens  # the rest is valid once the loads land
        req.pending_hit_tokens = (first + count) * bt
        req.plan = ()
        req.joins = {}
        reason = f"loading {len(own)} blocks"
        if joined:
            reason += f", copying {sum(len(m) for m in joined.values())} blocks of in-flight jobs {sorted(joined)}"
        if own:
            self.transfers.start_load(req, own)
        for owner, moves in joined.items():
            self.transfers.start_load(req, moves, after=owner)
        lifecycle.move(req, Trigger.LOAD_STARTED, reason)

    # ---- vLLM: build_connector_meta --------------------------------------------------------------
    def build_connector_meta(self, step: StepInfo) -> ConnectorMeta:
        """The step vLLM scheduled: take its preemptions and its chunks, and hand the
        workers what they must do with it."""
        state = self.state
        requests = state.requests
        early = self.preempted_early
        for rid in step.preempted:
            req = requests.get(rid)
            if req is not None and req.state == RUNNING and rid not in early:
                self._preempt(req)
        early.clear()
        for rid, (ids, replace) in step.new_blocks.items():
            req = requests.get(rid)
            if req is not None:
                if replace:
                    req.block_table = list(ids)
                else:
                    req.block_table.extend(ids)
        entries: list[StepEntry] = []
        bt = state.config.block_tokens
        prompt_chunks: list[list[object]] = []
        fills: list[list[object]] = []
        prefill = 0
        recording = state.recorder is not None
        for rid, before, n in step.scheduled:
            req = requests.get(rid)
            if req is None:
                continue
            end = before + n
            samples = end >= req.prompt_tokens + req.generated
            req.computed = end
            if samples:
                req.placeholders += 1
            entries.append((req, req.epoch, before, n, samples))
            if n > 1:
                prefill += n
            if recording:
                if before < req.prompt_tokens:
                    prompt_chunks.append([rid, before, n])
                elif end % bt < n:
                    fills.append([rid, before, n])
        state.steps.append((step.step_id, entries))
        if entries:
            state.stats.steps += 1
        meta = ConnectorMeta(step.step_id, tuple(state.out_loads), tuple(state.out_stores),
                             tuple(state.out_prefetches), tuple(state.out_flush), tuple(state.out_abandon),
                             tuple(state.out_holds), tuple(state.sync_keys))
        if recording:
            self.lifecycle.record(records.step(state.now, step.step_id, len(entries), prefill, len(state.sync_keys),
                                               prompt_chunks, fills, meta.flush))
        state.out_loads, state.out_stores, state.out_prefetches = [], [], []
        state.out_flush, state.out_abandon, state.out_holds, state.sync_keys = [], [], [], []
        return meta

    def _preempt(self, req: Request, why: str = "out of device blocks: the scheduler preempted it") -> None:
        """vLLM preempted ``req`` and freed its blocks: back to ``waiting``, to recompute or
        reload what the tiers hold; its stores in flight are flushed before the next step."""
        self.transfers.flush_stores(req)
        req.computed = req.confirmed = 0
        req.placeholders = 0
        req.block_table = []
        req.epoch += 1
        req.lookup = None
        req.lookup_uses = 0
        req.preemptions += 1
        self.state.stats.preemptions += 1
        self.lifecycle.move(req, Trigger.PREEMPTED, why)

    def _preempted_outside(self, req: Request) -> None:
        """vLLM asks about ``req`` again while the core has it ``running``: its
        scheduler preempted it outside ``schedule()`` (``reset_prefix_cache(
        reset_running_requests=True)`` frees every running request's blocks), and the
        pass's ``preempted_req_ids`` name it only at ``build_connector_meta``, after this
        call. The preemption is taken now (a new epoch, its stores flushed, its state
        reset), and that later entry is not taken again."""
        self._preempt(req, "preempted outside a scheduler pass (vLLM's reset_prefix_cache): asked about again "
                           "before the pass's build_connector_meta named the preemption")
        self.preempted_early.add(req.request_id)

    def _next_chunk(self, req: Request, block_ids: Sequence[int], chunk: NextChunk) -> None:
        """A resumable request stopped its turn without ``request_finished`` (vLLM keeps its
        blocks and waits for its next input chunk, which says nothing to the connector) and
        is admitted again for the chunk: its turn ends (``turn_ended``: a new epoch, the
        turn's output still in flight is dropped as vLLM drops it), then the chunk is a new
        admission of the same request, resuming on its blocks from the tokens it kept (no
        lookup: vLLM asks the connector nothing for it). Its hits stay what it found when it
        first came in; its prompt is the last turn's kept outputs and the new input."""
        bt = self.state.config.block_tokens
        kept = chunk.computed_tokens
        if req.stored_blocks > kept // bt:
            # A dropped output confirmed tokens past what vLLM kept: their blocks are written
            # again, so the stores reading them finish first and they are stored anew.
            self.transfers.flush_stores(req)
            req.stored_blocks = kept // bt
        req.epoch += 1
        req.placeholders = 0
        self.lifecycle.move(req, Trigger.TURN_ENDED,
                            f"its turn stopped (a resumable request: a streaming input session); its next input "
                            f"chunk came, and the scheduler kept its {len(block_ids)} blocks and {kept} tokens")
        req.prompt_tokens = chunk.prompt_tokens
        req.hashes = chunk.hashes[: chunk.prompt_tokens // bt]
        req.max_tokens = chunk.max_tokens
        req.generated = 0
        req.block_table = list(block_ids)
        req.local_tokens = req.computed = req.confirmed = kept
        req.lookup = None
        req.lookup_uses = 0
        req.plan = ()
        req.joins = {}
        req.landed = False
        self.lifecycle.move(req, Trigger.ADMITTED, f"its next input chunk: {chunk.prompt_tokens - kept} tokens to "
                                                   f"compute from token {kept}, on the blocks it kept")

    # ---- vLLM: update_connector_output -----------------------------------------------------------
    def update_connector_output(self, reports: Sequence[TransferReport] = (),
                                finished_sending: Sequence[str] = ()) -> None:
        """The workers' output: one report per rank per job (failed blocks named), and the
        held requests whose blocks the scheduler gives back now."""
        for report in reports:
            self.transfers.on_report(report)
        for rid in finished_sending:
            req = self.state.held.pop(rid, None)
            if req is None:
                continue
            req.hold = False
            if req.state == SENDING:
                self._finish(req, Trigger.COMPLETED, req.finish_reason or "stopped",
                             "every rank reported its stores; finished_sending came with a step output")

    # ---- vLLM: request_finished ------------------------------------------------------------------
    def request_finished(self, request_id: str, reason: str, why: str | None = None,
                         held: bool | None = None) -> bool:
        """vLLM finished the request (``reason``: stopped, length, aborted, error). True: the
        scheduler must keep its blocks until ``finished_sending`` (a store still reads them).
        ``held``: what another connector answered (recording it): nothing is decided."""
        state = self.state
        req = state.requests.get(request_id)
        if req is None or req.state == FINISHED:
            return False
        lifecycle = self.lifecycle
        if req.state == LOOKUP_PENDING:
            state.commands.append(DiscardLookup(request_id, req.epoch))
        state.sync_lookup_version.pop(request_id, None)
        state.wants_prefetch.pop(request_id, None)
        state.prefetch_waits.pop(request_id, None)
        if reason in ("stopped", "length"):
            self._confirm_finishing_step(req)
            if held is None:
                self.transfers.maybe_store(req)  # its last blocks too, before it lets them go
        hold = req.store_jobs > 0 if held is None else held
        if reason == "aborted":
            self._finish(req, Trigger.ABORTED, "aborted", why or "client aborted", hold)
        elif reason == "error":
            self._finish(req, Trigger.FAILED, "error", why or "vLLM finished it with an error", hold)
        elif hold and req.state == RUNNING and (held is not None
                                                or lifecycle.ask(req, Hook.HOLD_AT_FINISH, req.store_jobs)):
            # (Only a running request goes to sending: one preempted while its last step ran,
            # whose token stops it, finishes from waiting with its stores' blocks held below.)
            req.finish_reason = reason
            req.finish_ms = state.now
            self._hold(req)
            req.epoch += 1
            lifecycle.move(req, Trigger.SEND_STARTED,
                           f"finished ({reason}); {req.store_jobs} stores still read its blocks" if held is None
                           else f"finished ({reason}); the connector holds its blocks")
        else:
            # (A store still in flight keeps the blocks held all the same: block safety is
            # the engine's, whatever the policy says.)
            self._finish(req, Trigger.COMPLETED, reason, f"finished ({reason})", hold)
        return hold

    def _hold(self, req: Request) -> None:
        """The scheduler keeps ``req``'s blocks until finished_sending; the workers hear of
        it with the next step."""
        req.hold = True
        self.state.held[req.request_id] = req
        self.state.out_holds.append(req.request_id)

    def _confirm_finishing_step(self, req: Request) -> None:
        """The step output that finishes ``req`` is the oldest in flight: its tokens are
        confirmed (``take_events`` comes after ``request_finished`` in vLLM's order)."""
        steps = self.state.steps
        if not steps:
            return
        for entry in steps[0][1]:
            if entry[0] is req and entry[1] == req.epoch:
                self._confirm(req, entry[2], entry[3], entry[4])

    def _finish(self, req: Request, trigger: Trigger, reason: str, why: str, hold: bool = False) -> None:
        state = self.state
        req.epoch += 1
        req.finish_reason = reason
        if req.finish_ms is None or trigger != Trigger.COMPLETED:
            req.finish_ms = state.now
        if hold and not req.hold:
            self._hold(req)
        self.lifecycle.move(req, trigger, why)
        if state.retire is not None:
            state.retiring[req.request_id] = req

    # ---- vLLM: take_events (the end of a step output) -------------------------------------------
    def take_events(self) -> None:
        """The oldest step in flight produced its output: confirm its tokens, and store
        the blocks they fill."""
        state = self.state
        if not state.steps:
            return
        _, entries = state.steps.popleft()
        maybe_store = self.transfers.maybe_store
        bt = state.config.block_tokens
        for req, epoch, before, n, samples in entries:
            if req.epoch != epoch:
                if samples and req.state == WAITING and req.preemptions:
                    # vLLM delivers a preempted request's in-flight token all the same.
                    req.generated += 1
                continue
            if req.state != RUNNING:
                continue
            self._confirm(req, before, n, samples)
            # Every full block a step has scheduled is offered to the store policy (under
            # async scheduling, one the step in flight completes too: vllm#27644's hazard is
            # the policy's to avoid, and invariant 5's to catch).
            if min(req.computed // bt, len(req.block_table)) > req.stored_blocks and not state.observing:
                maybe_store(req)

    def _confirm(self, req: Request, before: int, n: int, samples: bool) -> None:
        if before + n > req.confirmed:
            req.confirmed = before + n
        if samples:
            req.placeholders -= 1
            req.generated += 1
            if req.first_token_ms is None:
                req.first_token_ms = self.state.now
        # The entry is taken: a second look (take_events after request_finished) skips it.
        full = req.confirmed // self.state.config.block_tokens
        if full > len(req.hashes):
            self.state.ensure_hashes(req, full)

    # ---- kvlife: lookups -------------------------------------------------------------------------
    def _submit_lookup(self, req: Request, reason: str) -> None:
        """Ask the driver for an async tier lookup; the request waits in ``lookup_pending``
        in its place in the queue (vLLM skips it until the answer comes)."""
        state = self.state
        if req.state == LOOKUP_PENDING:
            state.stats.duplicate_lookups += 1
            return
        state.sync_lookup_version.pop(req.request_id, None)
        state.stats.async_lookups += 1
        req.async_lookups += 1
        req.lookup = None
        req.lookup_submitted_ms = state.now
        state.lookup_timers.append((state.now + state.config.lookup_deadline_ms, req.request_id, req.async_lookups))
        state.commands.append(SubmitLookup(req.request_id, req.epoch, state.hit_candidates(req)))
        self.lifecycle.move(req, Trigger.LOOKUP_SUBMITTED, reason)

    def on_lookup_answer(self, request_id: str, epoch: int, tiers: Sequence[str] | None) -> None:
        """An async lookup answered: the tier of each leading hit block (None: it failed,
        a miss). Applied only to the epoch that asked (invariant 4)."""
        state = self.state
        req = state.requests.get(request_id)
        if req is None or req.state != LOOKUP_PENDING or req.epoch != epoch:
            state.stats.stale_lookup_answers += 1
            retired = state.retired.get(request_id) if req is None else None
            self.lifecycle.record(records.stale_lookup(
                state.now, request_id, epoch, retired if req is None else req.epoch,
                (None if retired is None else FINISHED) if req is None else req.state))
            return
        if tiers is None:
            state.stats.failed_lookups += 1
            req.lookup = ()
            reason = "lookup failed: treated as a miss"
        else:
            req.lookup = tuple(t for t in tiers if t in state.tiers)
            reason = f"lookup answered: {len(req.lookup)} blocks in tiers"
        req.lookup_async = True
        req.lookup_answered_ms = state.now
        req.lookup_uses = 0
        self.lifecycle.move(req, Trigger.LOOKUP_ANSWERED, reason)
        if state.wants_prefetch.pop(request_id, None) == req.epoch:
            self.transfers.start_prefetch(req)

    def _expire_lookups(self) -> None:
        """Every async lookup still unanswered at its deadline is given up: the driver is
        told to discard it, the request goes back to ``waiting`` (``lookup_expired``) in a
        new epoch, as a miss (its answer, if it ever comes, is stale)."""
        state = self.state
        timers = state.lookup_timers
        now = state.now
        while timers and timers[0][0] <= now:
            _, rid, count = timers.popleft()
            req = state.requests.get(rid)
            if req is None or req.state != LOOKUP_PENDING or req.async_lookups != count:
                continue  # answered, discarded or submitted again since
            state.stats.expired_lookups += 1
            state.commands.append(DiscardLookup(rid, req.epoch))
            state.wants_prefetch.pop(rid, None)  # an early prefetch needed that answer
            req.epoch += 1
            req.lookup = ()
            req.lookup_async = True
            req.lookup_answered_ms = now
            req.lookup_uses = 0
            self.lifecycle.move(req, Trigger.LOOKUP_EXPIRED,
                                f"lookup deadline: no answer {now - req.lookup_submitted_ms:g} ms after it was "
                                f"submitted at t={req.lookup_submitted_ms:g} (deadline "
                                f"{state.config.lookup_deadline_ms:g} ms): treated as a miss; its answer is stale now")

    def pending_reason(self, request_id: str) -> str | None:
        """Why the last match answered None: "lookup", "prefetch" or "defer"; None if the
        request is unknown (``RecordingConnector`` records a deferral as no lookup)."""
        req = self.state.requests.get(request_id)
        if req is None:
            return None
        if req.state == LOOKUP_PENDING:
            return "lookup"
        return "prefetch" if request_id in self.state.prefetch_waits else "defer"

    # ---- recording another connector --------------------------------------------------------------
    def observe_answer(self, request_id: str, num_computed_tokens: int, answer: int | None, load_async: bool,
                       tier: str, deferred: bool = False) -> None:
        """Another connector answered ``get_num_new_matched_tokens``: ``None`` (it cannot
        answer yet: a lookup goes out, unless it says it defers), or its external hit, which
        answers a pending lookup."""
        state = self.state
        req = state.requests[request_id]
        if req.state == RUNNING:
            self._preempted_outside(req)
        req.local_tokens = num_computed_tokens
        req.landed = False  # (as in get_num_new_matched_tokens: a failed load's request that kept no block)
        if answer is None:
            if req.state == WAITING and not deferred:
                self._submit_lookup(req, "the connector cannot answer yet")
            return
        bt = state.config.block_tokens
        blocks = answer // bt
        if req.state == LOOKUP_PENDING:
            if state.recorder is not None:
                state.recorder(input_to_record(LookupAnswer(state.now, request_id, req.epoch, (tier,) * blocks)))
            self.on_lookup_answer(request_id, req.epoch, (tier,) * blocks)
        if load_async and blocks:
            candidates = state.hit_candidates(req)
            first = num_computed_tokens // bt
            req.plan = tuple((h, tier) for h in candidates[first:first + blocks])

    def observe_jobs(self, jobs: Sequence[tuple[int, str, str, tuple[BlockMove, ...]]]) -> None:
        """Another connector's jobs of a step: (job id, kind, request, moves), each done once
        every rank reported it (their reports come to ``update_connector_output``)."""
        for job_id, kind, rid, moves in jobs:
            req = self.state.requests.get(rid)
            if req is not None:
                self.transfers.observe_job(req, job_id, kind, moves)

    # ---- retention ---------------------------------------------------------------------------
    def retire_finished(self) -> None:
        """Let go of the finished requests nothing refers to any more (retention on): no
        hold, no store or load job, no prefetch."""
        state = self.state
        if not state.retiring or state.retire is None:
            return
        for rid, req in list(state.retiring.items()):
            if req.hold or req.store_jobs or req.load_jobs or rid in state.prefetch_waits \
                    or rid in state.wants_prefetch:
                continue
            del state.retiring[rid]
            del state.requests[rid]
            state.retired[rid] = req.epoch
            state.sync_lookup_version.pop(rid, None)
            if state.reference is not None:
                state.reference.pop(rid, None)
            state.retire(req)
