"""KVLife's scheduler side in connector mode: kvlife's lifecycle and policy stack, with vLLM as the scheduler.

Inside vLLM the scheduler owns admission, the token budget, the device blocks and
preemption; a connector only answers what it is asked. So this is not ``Engine.handle``
(whose ``Tick`` is a scheduler of its own): it is the part of kvlife's lifecycle that a
connector owns, built from kvlife's parts: the policy stack (``lookup_mode``,
``admission``, ``store_limit``, ``hold_at_finish``, ``on_arrival``), the host tier's
``TierIndex`` (pins, LRU eviction), the per-rank ``RankAggregator`` (invariant 3) and
the request states and epochs of the spec (invariant 4). It imports no vLLM: the
connector (``connector.py``) translates vLLM's hooks into the calls below, so the logic
is testable without vLLM.

Per vLLM step: ``begin_step`` (answers of async lookups that are due), then for each
waiting request vLLM considers ``matched`` (sync answer, or ``None`` while the lookup is
pending or the admission policy defers), ``allocated`` (vLLM admitted it: a load job
starts on its blocks), then ``build`` (the step's load and store jobs for the workers).
After the step: ``step_output`` (tokens confirmed: only confirmed tokens are stored,
never async placeholders), ``report`` (one per rank per job) and ``finished``.

An async answer is consumed by the ``matched`` call that returns it, as Mooncake's
connector hands each answer out once: if vLLM then cannot admit the request, its next
``matched`` submits a new lookup (unless the ``lookup_reuse`` policy keeps answers). A
request with no full block to hit is answered ``(0, False)`` without a lookup. Block
hashes follow vLLM's request (``update_hashes``): blocks of generated tokens are stored
once confirmed, like prompt blocks, and a preempted request can hit them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs

from kvlife.lifecycle.engine.ranks import RankAggregator, ReportStatus
from kvlife.policies.base import EngineView, LoadView, RequestView
from kvlife.policies.stack import PolicyStack
from kvlife.transfer.index import TierIndex

Record = dict[str, Any]


@attrs.define(slots=True, eq=False)
class ConnectorRequest:
    request_id: str
    prompt_tokens: int
    hashes: tuple[int, ...]  # full blocks of the known tokens (vLLM's request.block_hashes)
    seq: int
    state: str = "waiting"  # waiting, lookup_pending, loading, running, sending, finished
    epoch: int = 0
    hit_blocks: int | None = None  # leading blocks the tier holds (this epoch's lookup)
    answered_step: int = 0  # when that async answer came
    answer_uses: int = 0  # matched() calls that returned it
    computed: int = 0  # tokens computed or scheduled (in-flight steps included)
    confirmed: int = 0  # tokens whose step output arrived
    generated: int = 0
    placeholders: int = 0
    stored_blocks: int = 0
    store_jobs: set[int] = attrs.Factory(set)
    load_jobs: set[int] = attrs.Factory(set)
    block_ids: list[int] = attrs.Factory(list)
    preemptions: int = 0
    pending_reason: str | None = None  # why ``matched`` last answered None: "lookup" or "defer"
    local_tokens: int = 0  # device prefix hit vLLM reported at the last matched()
    fresh: bool = False  # admitted; its first scheduled chunk starts where the hit ends
    hold: bool = False  # finished, blocks held until its stores report (finished_sending)
    last_decisions: dict[str, tuple[str, Any, str]] = attrs.Factory(dict)

    def view(self, block_tokens: int) -> RequestView:
        return RequestView(
            request_id=self.request_id, state=self.state, arrival_ms=float(self.seq),
            prompt_tokens=self.prompt_tokens, generated_tokens=self.generated,
            computed_tokens=self.computed, confirmed_tokens=self.confirmed,
            placeholder_tokens=self.placeholders, block_tokens=block_tokens,
            block_hashes=self.hashes, stored_blocks=self.stored_blocks, resumable=False,
            preemptions=self.preemptions,
        )


@attrs.define(slots=True, eq=False)
class ConnectorJob:
    job_id: int
    kind: str  # "load" | "store"
    request_id: str
    moves: tuple[tuple[int, int, int], ...]  # (block hash, device block, tier slot)
    failed: set[int] = attrs.Factory(set)
    started_step: int = 0
    abandoned: bool = False  # a store given up on after ``store_timeout_steps``


@attrs.frozen
class StepJobs:
    """What the workers must do this step (the connector metadata's payload)."""

    loads: tuple[ConnectorJob, ...]
    stores: tuple[ConnectorJob, ...]
    flush: tuple[int, ...]  # store jobs to finish before this step's compute (preempted owners)
    hold_finished: tuple[str, ...]  # requests to report in finished_sending once their stores end
    abandon: tuple[int, ...] = ()  # store jobs given up on: workers still owing them report them failed


class ConnectorLifecycle:
    """The connector's half of kvlife's lifecycle (see the module docstring)."""

    def __init__(
        self,
        block_tokens: int,
        stack: PolicyStack,
        host_blocks: int,
        ranks: int = 1,
        lookup_delay_steps: int = 1,
        tier: str = "host",
        lookup_answer: Callable[[str, int, int], int | None] | None = None,
        store_timeout_steps: int | None = None,
    ) -> None:
        if store_timeout_steps is not None and store_timeout_steps < 1:
            raise ValueError(f"store_timeout_steps must be >= 1, got {store_timeout_steps}")
        self.block_tokens = block_tokens
        self.stack = stack
        self.tier = TierIndex(tier, host_blocks)
        self.ranks = RankAggregator(ranks)
        self.lookup_delay_steps = lookup_delay_steps
        # Optional override of an async lookup's answer: (request, epoch, step) -> hit blocks
        # or None (a failed lookup: a miss). Default: what the tier holds when it answers.
        self.lookup_answer = lookup_answer
        # A store that some rank has not reported this many steps after it started is
        # given up on (``StepJobs.abandon``); None: wait for it forever (vLLM keeps a held
        # request's blocks until finished_sending, so a store that never ends leaks them).
        self.store_timeout_steps = store_timeout_steps
        self.requests: dict[str, ConnectorRequest] = {}
        self.jobs: dict[int, ConnectorJob] = {}
        self.in_flight_loads: dict[int, tuple[int, str]] = {}  # hash -> (job, request)
        self.step = 0
        self._seq = 0
        self._next_job = 0
        self._pending_lookups: dict[tuple[str, int], int] = {}  # (request, epoch) -> due step
        self._steps: deque[list[tuple[str, int, int, bool]]] = deque()  # (rid, epoch, end, samples)
        self._loads: list[ConnectorJob] = []
        self._flush: list[int] = []
        self._hold_finished: list[str] = []
        self._records: list[Record] = []
        self.stats: dict[str, int] = {"stale_lookup_answers": 0, "async_lookups": 0, "loads": 0, "stores": 0,
                                      "deferrals": 0, "blocks_loaded": 0, "blocks_stored": 0,
                                      "failed_loads": 0, "failed_stores": 0, "abandoned_stores": 0}

    # ---- trace records the recorder picks up (decisions, stale answers) ---------------
    def take_records(self) -> list[Record]:
        records, self._records = self._records, []
        return records

    def _ask(self, req: ConnectorRequest, hook: str, *args: Any) -> Any:
        answer = self.stack.ask(hook, req.view(self.block_tokens), *args, self._engine_view())
        current = (answer.policy, answer.value, answer.reason)
        if req.last_decisions.get(hook) != current:
            req.last_decisions[hook] = current
            self._records.append({"kind": "decision", "t": float(self.step), "req": req.request_id, "point": hook,
                                  "policy": answer.policy, "value": answer.value, "reason": answer.reason})
        return answer.value

    def _engine_view(self) -> EngineView:
        states = [r.state for r in self.requests.values()]
        return EngineView(now_ms=float(self.step), running=states.count("running"),
                          waiting=states.count("waiting"), loading=states.count("loading"),
                          free_device_blocks=0, device_blocks=0)

    # ---- arrival and lookups -------------------------------------------------------------
    def arrival(self, request_id: str, prompt_tokens: int, hashes: Sequence[int]) -> None:
        full = prompt_tokens // self.block_tokens
        req = ConnectorRequest(request_id, prompt_tokens, tuple(hashes[:full]), self._seq)
        self._seq += 1
        self.requests[request_id] = req
        if self._candidates(req) and self._ask(req, "on_arrival") != "none":
            self._submit_lookup(req)

    def update_hashes(self, request_id: str, hashes: Sequence[int]) -> None:
        """vLLM's request.block_hashes grew (generated tokens filled blocks)."""
        req = self.requests.get(request_id)
        if req is not None and len(hashes) > len(req.hashes):
            req.hashes = tuple(hashes)

    def _candidates(self, req: ConnectorRequest) -> tuple[int, ...]:
        # At least one known token is always computed, to sample the next output token.
        return req.hashes[: (req.prompt_tokens + req.generated - 1) // self.block_tokens]

    def _submit_lookup(self, req: ConnectorRequest) -> None:
        if req.state == "lookup_pending":
            return
        req.state = "lookup_pending"
        req.hit_blocks = None
        self.stats["async_lookups"] += 1
        self._pending_lookups[(req.request_id, req.epoch)] = self.step + self.lookup_delay_steps

    def begin_step(self) -> None:
        """A new vLLM step: deliver the async lookup answers that are due."""
        self.step += 1
        due = sorted((k for k, s in self._pending_lookups.items() if s <= self.step),
                     key=lambda k: self._pending_lookups[k])
        for key in due:
            del self._pending_lookups[key]
            rid, epoch = key
            req = self.requests.get(rid)
            if req is None or req.state != "lookup_pending" or req.epoch != epoch:
                self.stats["stale_lookup_answers"] += 1
                t = float(self.step)
                self._records.append({"kind": "input", "type": "lookup_answer", "t": t, "request_id": rid,
                                      "epoch": epoch, "tiers": []})
                self._records.append({"kind": "stale_lookup", "t": t, "req": rid, "epoch": epoch,
                                      "current_epoch": None if req is None else req.epoch,
                                      "state": None if req is None else req.state})
                continue
            if self.lookup_answer is not None:
                hit = self.lookup_answer(rid, epoch, self.step)
            else:
                hit = self.tier.lookup(self._candidates(req))
            req.hit_blocks = hit or 0
            req.answered_step = self.step
            req.answer_uses = 0
            req.state = "waiting"  # the answer is consumed when vLLM next asks (matched)

    def pending_reason(self, request_id: str) -> str | None:
        req = self.requests.get(request_id)
        return None if req is None else req.pending_reason

    def matched(self, request_id: str, num_computed_tokens: int) -> tuple[int | None, bool]:
        """vLLM's get_num_new_matched_tokens: external tokens beyond the device hit."""
        req = self.requests[request_id]
        bt = self.block_tokens
        req.pending_reason = None
        req.local_tokens = num_computed_tokens
        if req.state == "lookup_pending":
            req.pending_reason = "lookup"
            return None, False
        candidates = self._candidates(req)
        if not candidates:
            return 0, False  # nothing to look up (Mooncake's connector answers at once)
        if req.hit_blocks is None:
            if self._ask(req, "lookup_mode") == "async":
                self._submit_lookup(req)
                req.pending_reason = "lookup"
                return None, False
            # A sync lookup is re-done each time vLLM asks (as vLLM's is).
            hit_blocks = self.tier.lookup(candidates)
        else:
            hit_blocks = req.hit_blocks
            if self._ask(req, "lookup_reuse") == "consume":
                req.hit_blocks = None  # handed out once: a new lookup if vLLM does not admit it
            elif req.answer_uses:
                gone = sum(1 for h in candidates[:hit_blocks] if not self.tier.contains(h))
                self._records.append({"kind": "lookup_reuse", "t": float(self.step), "req": request_id,
                                      "answered": float(req.answered_step),
                                      "age_ms": float(self.step - req.answered_step),
                                      "uses": req.answer_uses + 1, "blocks": hit_blocks, "evicted": gone})
            req.answer_uses += 1
        start = num_computed_tokens // bt
        end = min(hit_blocks, len(candidates))
        # Re-validate: a block may have been evicted since the answer.
        blocks = []
        for i in range(start, end):
            if not self.tier.contains(candidates[i]):
                break
            blocks.append(candidates[i])
        if not blocks:
            return 0, False
        in_flight = tuple((h, self.in_flight_loads[h][1]) for h in blocks if h in self.in_flight_loads)
        if in_flight:
            view = LoadView(device_hit_blocks=start, external_hit_blocks=len(blocks),
                            tiers=(self.tier.name,) * len(blocks), in_flight=in_flight)
            choice = self._ask(req, "admission", view)
            if choice in ("defer", "join"):
                # vLLM gives each request its own blocks and caches loaded blocks only when
                # their load lands: joining an in-flight load is waiting for it to land, then
                # taking those blocks from the device prefix cache (invariant 6 holds).
                self.stats["deferrals"] += 1
                req.pending_reason = "defer"
                return None, False
        return len(blocks) * bt, True

    def allocated(self, request_id: str, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """vLLM's update_state_after_alloc: the request is admitted with these blocks."""
        req = self.requests[request_id]
        req.block_ids = list(block_ids)
        if req.state == "running":
            return  # the second call after an async load: nothing to load
        bt = self.block_tokens
        req.fresh = True
        if num_external_tokens <= 0:
            req.state = "running"
            req.hit_blocks = None
            req.computed = req.confirmed = req.local_tokens
            return
        num_computed_tokens = req.local_tokens + num_external_tokens
        first = req.local_tokens // bt
        count = num_external_tokens // bt
        hashes = self._candidates(req)[first:first + count]
        devices = req.block_ids[first:first + count]
        slots = self.tier.prepare_load(hashes)
        job = ConnectorJob(self._new_job(), "load", request_id, tuple(zip(hashes, devices, slots, strict=True)),
                           started_step=self.step)
        self.jobs[job.job_id] = job
        self.ranks.open(job.job_id)
        for h in hashes:
            self.in_flight_loads.setdefault(h, (job.job_id, request_id))
        req.load_jobs.add(job.job_id)
        req.state = "loading"
        req.hit_blocks = None
        req.computed = req.confirmed = num_computed_tokens
        self._loads.append(job)
        self.stats["loads"] += 1
        self.stats["blocks_loaded"] += len(hashes)

    def _new_job(self) -> int:
        self._next_job += 1
        return self._next_job

    # ---- the step ---------------------------------------------------------------------
    def build(
        self,
        scheduled: Iterable[tuple[str, int, int]],
        new_blocks: dict[str, tuple[list[int], bool]],
        preempted: Iterable[str],
    ) -> StepJobs:
        """vLLM's build_connector_meta: ``scheduled`` is (request, computed before, tokens),
        ``new_blocks`` request -> (block ids, replace), ``preempted`` this step's victims."""
        for rid in sorted(preempted):
            self._preempt(rid)
        for rid, (ids, replace) in new_blocks.items():
            req = self.requests.get(rid)
            if req is not None:
                req.block_ids = list(ids) if replace else req.block_ids + list(ids)
        entries = []
        for rid, before, n in scheduled:
            req = self.requests.get(rid)
            if req is None:
                continue
            samples = before + n >= req.prompt_tokens
            if req.fresh:
                req.fresh = False
                req.confirmed = before  # the hit (device prefix or a completed load) is valid KV
            req.computed = before + n
            if samples:
                req.placeholders += 1
            entries.append((rid, req.epoch, before + n, samples))
        self._steps.append(entries)
        stores = []
        for req in sorted(self.requests.values(), key=lambda r: r.seq):
            if req.state in ("running", "sending") and req.stored_blocks < len(req.hashes):
                job = self._maybe_store(req)
                if job is not None:
                    stores.append(job)
        out = StepJobs(tuple(self._loads), tuple(stores), tuple(self._flush), tuple(self._hold_finished),
                       self._expire_stores())
        self._loads, self._flush, self._hold_finished = [], [], []
        return out

    def _expire_stores(self) -> tuple[int, ...]:
        """Store jobs open for ``store_timeout_steps``: the workers that still owe them
        report them failed (their blocks never enter the tier) and release the held
        request. Loads are never given up on: a late copy would land in device blocks
        vLLM may have handed to a recompute."""
        timeout = self.store_timeout_steps
        if timeout is None:
            return ()
        out = []
        for job in sorted(self.jobs.values(), key=lambda j: j.job_id):
            if job.kind != "store" or job.abandoned or self.step - job.started_step < timeout:
                continue
            job.abandoned = True
            out.append(job.job_id)
            self.stats["abandoned_stores"] += 1
            self._records.append({"kind": "warning", "t": float(self.step), "what": "store_abandoned",
                                  "job": job.job_id, "req": job.request_id,
                                  "ranks": list(self.ranks.missing_ranks(job.job_id)),
                                  "note": f"store open for {self.step - job.started_step} steps "
                                          f"(store_timeout_steps {timeout}): the ranks that owe it report it "
                                          "failed"})
        return tuple(out)

    def _maybe_store(self, req: ConnectorRequest) -> ConnectorJob | None:
        bt = self.block_tokens
        if min(req.confirmed // bt, len(req.hashes)) <= req.stored_blocks:
            return None
        limit = self._ask(req, "store_limit")
        upto = min(limit // bt, len(req.hashes), len(req.block_ids))
        if upto <= req.stored_blocks:
            return None
        hashes = req.hashes[req.stored_blocks:upto]
        devices = req.block_ids[req.stored_blocks:upto]
        req.stored_blocks = upto
        plan = self.tier.prepare_store(hashes)
        if not plan.accepted:
            return None
        device_of = dict(zip(hashes, devices, strict=True))
        job = ConnectorJob(self._new_job(), "store", req.request_id,
                           tuple((h, device_of[h], slot) for h, slot in plan.accepted), started_step=self.step)
        self.jobs[job.job_id] = job
        self.ranks.open(job.job_id)
        req.store_jobs.add(job.job_id)
        self.stats["stores"] += 1
        self.stats["blocks_stored"] += len(job.moves)
        return job

    def _preempt(self, rid: str) -> None:
        req = self.requests.get(rid)
        if req is None or req.state != "running":
            return
        # vLLM frees a preempted request's blocks at once: its stores must finish before
        # those blocks are reused, so the worker runs them before this step (flush).
        self._flush.extend(sorted(req.store_jobs))
        req.state = "waiting"
        req.epoch += 1
        req.computed = req.confirmed = 0
        req.placeholders = 0
        req.hit_blocks = None
        req.block_ids = []
        req.preemptions += 1

    def step_output(self) -> None:
        """The oldest step still in flight produced its output (steps finish in order)."""
        if not self._steps:
            return
        for rid, epoch, end, samples in self._steps.popleft():
            req = self.requests.get(rid)
            if req is None or req.epoch != epoch or req.state not in ("running", "sending"):
                continue
            req.confirmed = max(req.confirmed, end)
            if samples:
                req.placeholders = max(0, req.placeholders - 1)
                req.generated += 1

    def finished(self, request_id: str, aborted: bool) -> bool:
        """vLLM's request_finished: True to hold the blocks until finished_sending."""
        req = self.requests.get(request_id)
        if req is None or req.state == "finished":
            return False
        was = req.state
        # A pending lookup's answer now comes back stale and is dropped (invariant 4).
        req.epoch += 1
        if was == "loading" or aborted:
            # vLLM itself keeps a loading request's blocks until finished_recving.
            req.state = "finished"
            return False
        # The finish comes with the output of the oldest step in flight: its tokens are
        # confirmed (and stored from the next build); a later step still in flight (async
        # scheduling) only holds placeholders, which are never stored.
        for rid, epoch, end, _ in self._steps[0] if self._steps else ():
            if rid == request_id and epoch == req.epoch - 1:
                req.confirmed = max(req.confirmed, end)
        pending = min(req.confirmed // self.block_tokens, len(req.hashes)) > req.stored_blocks
        if (req.store_jobs or pending) and self._ask(req, "hold_at_finish", len(req.store_jobs) + int(pending)):
            req.state = "sending"
            req.hold = True
            self._hold_finished.append(request_id)
            return True
        req.state = "finished"
        return False

    # ---- worker reports -------------------------------------------------------------------
    def report(self, job_id: int, rank: int, failed: Sequence[int]) -> ConnectorJob | None:
        """One rank's report for one job; the job when this was the last rank owed."""
        outcome = self.ranks.report(job_id, rank, tuple(failed))
        if outcome.status is not ReportStatus.DONE:
            return None
        job = self.jobs.pop(job_id)
        job.failed = set(outcome.failed)
        hashes = [m[0] for m in job.moves]
        req = self.requests.get(job.request_id)
        if job.failed:
            self._record_failure(job)
        if job.kind == "load":
            self.tier.complete_load(hashes)
            # A block that failed to load is bad in the tier: it is never handed out
            # again until a store rewrites it (invariant 4's stale-hit check).
            self.tier.discard([h for h in hashes if h in job.failed])
            for h in hashes:
                if self.in_flight_loads.get(h, (None,))[0] == job_id:
                    del self.in_flight_loads[h]
            if req is not None:
                req.load_jobs.discard(job_id)
                if req.state == "loading" and not req.load_jobs:
                    req.state = "running" if not job.failed else "waiting"
                    if job.failed:
                        # vLLM (kv_load_failure_policy "recompute") cut the request's
                        # computed tokens at the first failed block: it is admitted again
                        # (update_state_after_alloc with no external tokens, or a new
                        # lookup when nothing before the failed block is left) and
                        # recomputes from there.
                        req.epoch += 1
                        req.computed = req.confirmed = 0
                        req.hit_blocks = None
        else:
            # A failed store publishes nothing: its blocks never become readable.
            self.tier.complete_store([h for h in hashes if h not in job.failed], ok=True)
            self.tier.complete_store([h for h in hashes if h in job.failed], ok=False)
            if req is not None:
                req.store_jobs.discard(job_id)  # not retried, as kvlife's engine does not
        return job

    def _record_failure(self, job: ConnectorJob) -> None:
        # The trace's failure records come from the recorder, which sees every rank's report.
        self.stats["failed_loads" if job.kind == "load" else "failed_stores"] += 1

    def sent(self, request_id: str) -> None:
        """vLLM freed a held request's blocks (finished_sending): it is finished."""
        req = self.requests.get(request_id)
        if req is not None and req.state == "sending":
            req.state = "finished"
            req.hold = False

    def request_holds(self, request_id: str) -> bool:
        """Still owes stores (the worker reports finished_sending when this turns False)."""
        req = self.requests.get(request_id)
        return req is not None and bool(req.store_jobs)
