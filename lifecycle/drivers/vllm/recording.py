"""RecordingConnector: wraps any vLLM KV connector and writes the lifecycle it observes as a kvlife trace.

Enable it around vLLM's OffloadingConnector (or any connector, by registered name or
``pkg.mod:Class``)::

    --kv-transfer-config '{"kv_connector": "RecordingConnector", "kv_connector_module_path": "kvlife.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"record": {"inner": "OffloadingConnector",
                                                                    "trace": "run.trace.jsonl"},
                                                         "cpu_bytes_to_use": 1000000000}}'

Every call is forwarded unchanged; the scheduler side also feeds a ``TraceRecorder``,
which turns what vLLM and the connector say into kvlife records that ``kvlife validate``,
``explain``, ``export`` and ``plot`` read:

- ``on_new_request`` -> an ``arrival`` input; the first scheduler hook of a step -> ``tick``;
- ``get_num_new_matched_tokens`` answering ``None`` -> ``lookup_pending`` (a connector
  that says why, like KVLifeConnector, can mark it a deferral instead); the next numeric
  answer -> a ``lookup_answer`` input and ``lookup_answered``;
- ``update_state_after_alloc`` -> ``load_started`` (async external hit) or ``admitted``;
- ``build_connector_meta`` -> preemptions, a ``step`` record (prompt chunks), load jobs
  (they start before the forward pass); store jobs are recorded at the step's output (the
  worker starts them after the forward pass, in ``wait_for_save``);
- ``update_connector_output`` -> a ``step_output`` input (steps end in order), finishes,
  one ``transfer_report`` input per rank per job (job reports come from the connector's
  worker metadata: kvlife's per-rank reports, or OffloadingConnector's per-step counts),
  ``job_done`` once every rank reported, ``load_done``, ``completed`` after
  ``finished_sending``. A step whose model runner output carries no connector output never
  reaches ``update_connector_output``; ``take_events``, which vLLM calls at the end of every
  ``update_from_output``, records its ``step_output`` then;
- a job whose reports name failed blocks -> ``job_done`` with the count and a
  ``load_failed`` / ``store_failed`` warning naming them; a failed load moves its request
  ``load_failed`` (vLLM recomputes it; if nothing before the failed block is left, vLLM
  frees its blocks), or ``failed`` when vLLM's ``kv_load_failure_policy`` is "fail";
- ``request_finished`` -> ``abort`` input and ``aborted``, or a finish in the next step output
  (``failed`` for vLLM's ``FINISHED_ERROR``).

Block names: a prompt block is named by vLLM's block hash (``block_hash_int``); a block that
generated tokens filled is named as kvlife's engine names it
(``kvlife.lifecycle.engine.blocks.derived_block_hash``: chained on the previous block, the
request id and the index), so ``kvlife validate`` places its stores, and a later prompt that
contains those tokens (the next turn of a conversation) is recorded with the same names.
Step records list, besides prompt chunks, the chunks that fill a block of generated tokens
(``fills``).

Blocks: the recorder counts, per device block, the requests whose block tables hold it
(vLLM's reference count) and writes ``free`` when vLLM lets the last one go: at once,
after ``finished_recving`` for a request aborted while loading (vLLM delays it), or after
``finished_sending`` for a held request. A connector that fences stores instead of holding
blocks (OffloadingConnector flushes a store before its blocks are reused) has that free
recorded when the store ends: the block is not reusable before. A load gets no such
grace: a block freed under a load is an invariant-2 finding.
"""

from __future__ import annotations

import importlib
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput

from kvlife.lifecycle.config import EngineConfig, RunConfig, TierConfig
from kvlife.lifecycle.drivers.vllm.connector import block_hash_int
from kvlife.lifecycle.engine.blocks import derived_block_hash
from kvlife.lifecycle.traces.trace import TraceWriter

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

_EPOCH_BUMPS = frozenset({"preempted", "load_failed", "completed", "aborted", "failed"})


@attrs.define(slots=True, eq=False)
class _Req:
    hashes: tuple[int, ...]
    prompt_tokens: int
    vllm: Any = None  # vLLM's Request: its block_hashes grow as tokens are generated
    names: list[int] = attrs.Factory(list)  # kvlife's name of each block, as far as named
    state: str = "waiting"
    epoch: int = 0
    blocks: list[int] = attrs.Factory(list)
    load_async: bool = False
    load_jobs: set[int] = attrs.Factory(set)
    free_on: str | None = None  # "recving" / "sending": vLLM frees its blocks on that report
    error: bool = False  # vLLM finished it with an error while it was loading


@attrs.define(slots=True, eq=False)
class _Job:
    kind: str
    request_id: str
    moves: list[tuple[int, int, str]]
    reported: set[int] = attrs.Factory(set)
    failed: set[int] = attrs.Factory(set)


def _job_blocks(job: Any) -> list[int] | None:
    """Device blocks of a job in a connector's metadata (kvlife's or OffloadingConnector's)."""
    blocks = getattr(job, "device_blocks", None)
    if blocks is not None:
        return [int(b) for b in blocks]
    kind = getattr(job, "dst_spec", None), getattr(job, "src_spec", None)
    for spec in kind:
        if spec is not None and type(spec).__name__ == "GPULoadStoreSpec":
            return [int(b) for b in spec.block_ids]
    return None


class TraceRecorder:
    """Observes vLLM's connector hooks; writes kvlife trace records (see the module docstring)."""

    def __init__(self, path: str | Path, block_tokens: int, ranks: int = 1, tier: str = "host",
                 tier_blocks: int = 1, device_blocks: int = 1, max_batched_tokens: int = 1, max_running: int = 1,
                 async_scheduling: bool = False, policies: Iterable[str] = (), fenced_stores: bool = True,
                 source: str = "vllm", load_failure_policy: str = "fail") -> None:
        self.block_tokens = block_tokens
        self.load_failure_policy = load_failure_policy
        self.ranks = ranks
        self.tier = tier
        self.fenced_stores = fenced_stores
        self.writer = TraceWriter(path)
        config = RunConfig(
            engine=EngineConfig(block_tokens=block_tokens, device_blocks=max(1, device_blocks),
                                max_batched_tokens=max(1, max_batched_tokens), max_running=max(1, max_running),
                                ranks=ranks, async_scheduling=async_scheduling,
                                tiers=(TierConfig(tier, capacity_blocks=max(1, tier_blocks)),)),
            policies=tuple(policies),
        )
        self.writer.write_header(config.to_dict(), list(policies), 0, source=source)
        self.t = 0.0
        self.in_step = False
        self.requests: dict[str, _Req] = {}
        self.jobs: dict[int, _Job] = {}
        self.refs: dict[int, int] = {}
        self.store_blocks: dict[int, set[int]] = {}  # device block -> store jobs in flight
        self.fenced: set[int] = set()  # freed by vLLM, free recorded when its stores end
        self.steps: deque[tuple[int, list[int]]] = deque()  # (step id, store jobs to start at its output)
        self.pending_stores: dict[int, tuple[str, list[tuple[int, int, str]]]] = {}
        self.finishes: list[tuple[str, str, bool]] = []  # (request, reason, held) since the last output
        self.outputs = 0  # step outputs recorded
        self.next_step = 0
        self.lines_written = 0
        self.renamed: dict[int, int] = {}  # vLLM hash of a generated block -> kvlife's name of it

    # ---- writing -----------------------------------------------------------------------
    def _write(self, record: dict[str, Any]) -> None:
        self.writer.record(record)

    def _input(self, kind: str, **fields: Any) -> None:
        self._write({"kind": "input", "type": kind, "t": self.t, **fields})

    def _move(self, rid: str, trigger: str, target: str, reason: str) -> None:
        req = self.requests[rid]
        self._write({"kind": "transition", "t": self.t, "req": rid, "from": req.state, "to": target,
                     "trigger": trigger, "reason": reason})
        req.state = target
        if trigger in _EPOCH_BUMPS:
            req.epoch += 1

    def extra(self, records: Iterable[dict[str, Any]]) -> None:
        """Records the wrapped connector offers (kvlife: decisions, stale lookup answers)."""
        for record in records:
            self._write({**record, "t": self.t})

    def close(self) -> None:
        self.writer.close()

    # ---- blocks ------------------------------------------------------------------------
    def _hold(self, req: _Req, ids: Iterable[int]) -> None:
        for b in ids:
            if b not in req.blocks:
                req.blocks.append(b)
                self.refs[b] = self.refs.get(b, 0) + 1

    def _release(self, req: _Req) -> None:
        freed = []
        for b in req.blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                del self.refs[b]
                if self.fenced_stores and self.store_blocks.get(b):
                    self.fenced.add(b)
                else:
                    freed.append(b)
        req.blocks = []
        if freed:
            self._write({"kind": "free", "t": self.t, "blocks": freed})

    # ---- scheduler hooks ---------------------------------------------------------------
    def tick(self) -> None:
        if not self.in_step:
            self.in_step = True
            self.t += 1.0
            self._input("tick")

    def arrival(self, request: Request) -> None:
        if request.request_id in self.requests:
            return
        renamed = self.renamed
        hashes = tuple(renamed.get(h, h) for h in (block_hash_int(h) for h in request.block_hashes))
        full = request.num_prompt_tokens // self.block_tokens
        self.requests[request.request_id] = _Req(hashes[:full], request.num_prompt_tokens, request,
                                                 list(hashes[:full]))
        self._input("arrival", request_id=request.request_id, prompt_tokens=request.num_prompt_tokens,
                    block_hashes=list(hashes), resumable=False)

    def matched(self, request: Request, result: tuple[int | None, bool], reason: str | None) -> None:
        rid = request.request_id
        req = self.requests[rid]
        tokens, load_async = result
        if tokens is None:
            if req.state == "waiting" and reason != "defer":
                self._move(rid, "lookup_submitted", "lookup_pending", "the connector cannot answer yet")
            return
        if req.state == "lookup_pending":
            blocks = tokens // self.block_tokens
            self._input("lookup_answer", request_id=rid, epoch=req.epoch, tiers=[self.tier] * blocks)
            self._move(rid, "lookup_answered", "waiting", f"lookup answered: {blocks} blocks")
        req.load_async = bool(tokens) and load_async

    def allocated(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        rid = request.request_id
        req = self.requests[rid]
        self._hold(req, blocks.get_block_ids()[0])
        if req.state != "waiting":
            return
        if num_external_tokens > 0 and req.load_async:
            self._move(rid, "load_started", "loading", f"loading {num_external_tokens} tokens")
        else:
            self._move(rid, "admitted", "running",
                       f"admitted with {num_external_tokens} external tokens" if num_external_tokens else "admitted")

    def _name(self, rid: str, req: _Req, index: int) -> int:
        """kvlife's name of block ``index`` of ``rid`` (derived past the prompt's blocks)."""
        names = req.names
        vllm_hashes = getattr(req.vllm, "block_hashes", ())
        while len(names) <= index:
            j = len(names)
            names.append(derived_block_hash(names[-1] if names else None, rid, j))
            if j < len(vllm_hashes):
                self.renamed[block_hash_int(vllm_hashes[j])] = names[-1]
        return names[index]

    def build(self, out: SchedulerOutput, meta: Any) -> None:
        self.tick()
        self.in_step = False
        for rid in sorted(out.preempted_req_ids or ()):
            req = self.requests.get(rid)
            if req is not None and req.state == "running":
                self._move(rid, "preempted", "waiting", "vLLM preempted it (out of blocks)")
                self._release(req)
        chunks: list[list[Any]] = []
        fills: list[list[Any]] = []  # chunks past the prompt that fill a block
        entries = 0
        prefill = 0
        bt = self.block_tokens

        def chunk(rid: str, req: _Req, before: int, n: int) -> None:
            if before < req.prompt_tokens:
                chunks.append([rid, before, n])
            elif (before + n) % bt < n:
                fills.append([rid, before, n])

        for new in out.scheduled_new_reqs:
            req = self.requests[new.req_id]
            self._hold(req, new.block_ids[0])
            n = out.num_scheduled_tokens[new.req_id]
            entries += 1
            prefill += n if n > 1 else 0
            chunk(new.req_id, req, new.num_computed_tokens, n)
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            req = self.requests[rid]
            ids = cached.new_block_ids[i]
            if ids is not None:
                self._hold(req, ids[0])
            n = out.num_scheduled_tokens[rid]
            entries += 1
            prefill += n if n > 1 else 0
            chunk(rid, req, cached.num_computed_tokens[i], n)
        step = self.next_step
        self.next_step += 1
        if entries:
            record: dict[str, Any] = {"kind": "step", "t": self.t, "step": step, "requests": entries,
                                      "prefill_tokens": prefill, "sync_lookups": 0, "prompt": chunks}
            if fills:
                record["fills"] = fills
            self._write(record)
        flush = sorted(getattr(meta, "jobs_to_flush", None) or ())
        if flush:
            self._write({"kind": "warning", "t": self.t, "what": "flush", "jobs": flush,
                         "note": "stores finished before their blocks are reused"})
        for job_id, job in sorted((getattr(meta, "load_jobs", None) or {}).items()):
            self._start_job(int(job_id), "load", job)
        stores = []
        for job_id, job in sorted((getattr(meta, "store_jobs", None) or {}).items()):
            moves = self._moves(job)
            if moves is not None:
                self.pending_stores[int(job_id)] = (job.req_id, moves)
                stores.append(int(job_id))
        self.steps.append((step, stores))

    def _moves(self, job: Any) -> list[tuple[int, int, str]] | None:
        req = self.requests.get(job.req_id)
        blocks = _job_blocks(job)
        if req is None or blocks is None:
            return None
        given = getattr(job, "block_hashes", None)
        position = {b: i for i, b in enumerate(req.blocks)}
        hashes = []
        for k, b in enumerate(blocks):
            i = position.get(b)
            if i is not None and i < len(req.hashes):
                hashes.append(req.hashes[i])
            elif i is not None:
                hashes.append(self._name(job.req_id, req, i))  # a block generated tokens filled
            elif given is not None:
                h = int(given[k])
                hashes.append(self.renamed.get(h, h))
            else:
                hashes.append(-1)
        return [(int(h), b, self.tier) for h, b in zip(hashes, blocks, strict=True)]

    def _start_job(self, job_id: int, kind: str, job: Any, moves: list[tuple[int, int, str]] | None = None) -> None:
        moves = moves if moves is not None else self._moves(job)
        rid = job.req_id
        if moves is None:
            return
        self.jobs[job_id] = _Job(kind, rid, moves)
        if kind == "load" and rid in self.requests:
            self.requests[rid].load_jobs.add(job_id)
        if kind == "store":
            for _, b, _ in moves:
                self.store_blocks.setdefault(b, set()).add(job_id)
        self._write({"kind": "job", "t": self.t, "job": job_id, "op": kind, "req": rid, "blocks": len(moves),
                     "tiers": {self.tier: len(moves)}, "moves": [list(m) for m in moves]})

    def finished(self, request: Request, held: bool) -> None:
        rid = request.request_id
        req = self.requests.get(rid)
        if req is None or req.state == "finished":
            return
        status = request.status.name
        if status == "FINISHED_ABORTED":
            self._input("abort", request_id=rid)
            was = req.state
            self._move(rid, "aborted", "finished", "client aborted")
            if was == "loading":
                req.free_on = "recving"  # vLLM keeps a loading request's blocks until its load reports
            elif held:
                req.free_on = "sending"
            else:
                self._release(req)
            return
        why = {"FINISHED_LENGTH_CAPPED": "length", "FINISHED_ERROR": "error"}.get(status, "stopped")
        self.finishes.append((rid, why, held))

    def output(self, output: KVConnectorOutput | None) -> None:
        """One step output (the oldest step in flight). ``None``: the step's model runner
        output carried no connector output (vLLM then skips update_connector_output; the
        connector learns of the output from take_events)."""
        output = output if output is not None else KVConnectorOutput()
        self.outputs += 1
        step, stores = self.steps.popleft() if self.steps else (-1, [])
        finishes, self.finishes = self.finishes, []
        self._input("step_output", step_id=step, finished=[[rid, why] for rid, why, _ in finishes])
        # The worker started this step's stores after its forward pass, before the scheduler
        # saw the output: a request finishing now had its last blocks stored by then.
        for job_id in stores:
            rid, moves = self.pending_stores.pop(job_id)
            self._start_job(job_id, "store", attrs.make_class("J", ["req_id"])(rid), moves)
        errored = []
        for rid, why, held in finishes:
            req = self.requests[rid]
            if req.state == "loading" and why == "error":
                # vLLM failed it (kv_load_failure_policy "fail") on the report that comes
                # below: moved once that report is recorded.
                req.error = True
                errored.append(rid)
                continue
            if req.state != "running":
                continue
            if why == "error":
                if held:
                    req.free_on = "sending"
                self._move(rid, "failed", "finished", "vLLM finished it with an error")
                if not held:
                    self._release(req)
            elif held:
                req.free_on = "sending"
                self._move(rid, "send_started", "sending", f"finished ({why}); the connector holds its blocks")
            else:
                self._move(rid, "completed", "finished", f"finished ({why})")
                self._release(req)
        for job_id, rank, failed in self._reports(output):
            self._report(job_id, rank, failed)
        for rid in errored:
            req = self.requests[rid]
            if req.state == "loading":
                # vLLM keeps a loading request's blocks until its finished_recving.
                req.free_on = "recving"
                self._move(rid, "failed", "finished",
                           "its load failed and vLLM's kv_load_failure_policy is 'fail'")
        for rid in sorted(output.finished_recving or ()):
            got = self.requests.get(rid)
            if got is None:
                continue
            req = got
            if req is None:
                continue
            if req.state == "loading" and not req.load_jobs:
                self._move(rid, "load_done", "running", "every worker reported the load")
            elif req.free_on == "recving":
                self._release(req)
        for rid in sorted(output.finished_sending or ()):
            got = self.requests.get(rid)
            if got is None:
                continue
            req = got
            if req.state == "sending":
                self._move(rid, "completed", "finished", "every worker reported its stores")
            self._release(req)

    def _reports(self, output: KVConnectorOutput) -> list[tuple[int, int, tuple[int, ...]]]:
        meta = output.kv_connector_worker_meta
        reports = getattr(meta, "reports", None)
        if reports is not None:
            return [(int(j), int(r), tuple(f)) for j, r, f in reports]
        out: list[tuple[int, int, tuple[int, ...]]] = []
        for job_id, count in sorted((getattr(meta, "completed_jobs", None) or {}).items()):
            job = self.jobs.get(int(job_id))
            ranks = [r for r in range(self.ranks) if job is None or r not in job.reported]
            out += [(int(job_id), rank, ()) for rank in ranks[:count]]
        return out

    def _report(self, job_id: int, rank: int, failed: tuple[int, ...]) -> None:
        self._input("transfer_report", job_id=job_id, rank=rank, failed=list(failed))
        job = self.jobs.get(job_id)
        if job is None or rank in job.reported:
            return
        job.reported.add(rank)
        job.failed.update(failed)
        if len(job.reported) < self.ranks:
            return
        del self.jobs[job_id]
        self._write({"kind": "job_done", "t": self.t, "job": job_id, "op": job.kind, "failed": len(job.failed),
                     "late": False})
        if job.failed:
            self._failure_warning(job_id, job)
        req = self.requests.get(job.request_id)
        if job.kind == "store":
            freed = []
            for _, b, _ in job.moves:
                jobs = self.store_blocks.get(b)
                if jobs is not None:
                    jobs.discard(job_id)
                    if not jobs:
                        del self.store_blocks[b]
                        if b in self.fenced and b not in self.refs:
                            self.fenced.discard(b)
                            freed.append(b)
            if freed:
                self._write({"kind": "free", "t": self.t, "blocks": freed})
            return
        if req is None:
            return
        req.load_jobs.discard(job_id)
        if req.state == "loading" and not req.load_jobs and job.failed and not req.error:
            self._move(job.request_id, "load_failed", "waiting",
                       f"{len(job.failed)} blocks failed to load: vLLM recomputes from the first")
            if getattr(req.vllm, "num_computed_tokens", 1) == 0:
                # Nothing before the first failed block: vLLM frees the request's blocks
                # (at its next schedule, before any reuse) and looks it up again.
                self._release(req)

    def _failure_warning(self, job_id: int, job: _Job) -> None:
        blocks = [h for h, _, _ in job.moves if h in job.failed]
        if job.kind == "load":
            note = (f"vLLM's kv_load_failure_policy {self.load_failure_policy!r}: "
                    + ("the request recomputes from its first failed block"
                       if self.load_failure_policy == "recompute" else "the request fails"))
        else:
            note = "the failed blocks are not kept in the tier; the request's blocks are released as usual"
        self._write({"kind": "warning", "t": self.t, "what": f"{job.kind}_failed", "job": job_id,
                     "req": job.request_id, "blocks": blocks, "note": note})


def _connector_class(spec: str) -> type[KVConnectorBase_V1]:
    if ":" in spec:
        module, _, name = spec.rpartition(":")
        cls = getattr(importlib.import_module(module), name)
    else:
        cls = KVConnectorFactory.get_connector_class_by_name(spec)
    if not (isinstance(cls, type) and issubclass(cls, KVConnectorBase_V1)):
        raise ValueError(f"record.inner {spec!r} is not a KVConnectorBase_V1 subclass")
    return cls


class RecordingConnector(KVConnectorBase_V1, SupportsHMA):
    """Forwards every call to ``inner``; the scheduler side records the lifecycle it observes."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        record = dict(extra.get("record") or {})
        inner = record.get("inner")
        if not isinstance(inner, str):
            raise ValueError("RecordingConnector: kv_connector_extra_config.record.inner must name the wrapped "
                             "connector (a registered name like 'OffloadingConnector', or 'pkg.mod:Class')")
        self.inner: KVConnectorBase_V1 = _connector_class(inner)(vllm_config, role, kv_cache_config)  # type: ignore[arg-type,unused-ignore]
        self.recorder: TraceRecorder | None = None
        trace = record.get("trace")
        if role == KVConnectorRole.SCHEDULER and trace:
            sched = vllm_config.scheduler_config
            num_blocks = kv_cache_config.num_blocks if kv_cache_config is not None else 1
            inner_cls = type(self.inner).__name__
            self.recorder = TraceRecorder(
                trace, vllm_config.cache_config.block_size,
                ranks=int(record.get("ranks", vllm_config.parallel_config.world_size)),
                tier=str(record.get("tier", "host")), tier_blocks=int(record.get("tier_blocks", num_blocks)),
                device_blocks=num_blocks - 1, max_batched_tokens=sched.max_num_batched_tokens,
                max_running=sched.max_num_seqs, async_scheduling=bool(sched.async_scheduling),
                policies=list(getattr(self.inner, "stack_names", [])) or [inner_cls],
                source=f"vllm:{inner_cls}",
                load_failure_policy=str(getattr(self._kv_transfer_config, "kv_load_failure_policy", "fail")),
            )
        self._output_seen = False  # update_connector_output came for the step output in progress

    def _extra(self) -> None:
        take = getattr(self.inner, "kvlife_take_records", None)
        if self.recorder is not None and take is not None:
            self.recorder.extra(take())

    # ---- observed scheduler hooks ------------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        if self.recorder is not None:
            self.recorder.arrival(request)
        self.inner.on_new_request(request)
        self._extra()

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        rec = self.recorder
        if rec is not None:
            rec.tick()
            rec.arrival(request)
        result = self.inner.get_num_new_matched_tokens(request, num_computed_tokens)
        if rec is not None:
            self._extra()
            why = getattr(self.inner, "kvlife_pending_reason", None)
            rec.matched(request, result, why(request.request_id) if why is not None else None)
        return result

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if self.recorder is not None:
            self.recorder.tick()
        self.inner.update_state_after_alloc(request, blocks, num_external_tokens)
        if self.recorder is not None:
            self._extra()
            self.recorder.allocated(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self.recorder is not None:
            self.recorder.tick()
        meta = self.inner.build_connector_meta(scheduler_output)
        if self.recorder is not None:
            self._extra()
            self.recorder.build(scheduler_output, meta)
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._output_seen = True
        self.inner.update_connector_output(connector_output)
        if self.recorder is not None:
            self._extra()
            self.recorder.output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        if isinstance(self.inner, SupportsHMA):
            held, params = self.inner.request_finished_all_groups(request, block_ids)
        else:
            held, params = self.inner.request_finished(request, block_ids[0])
        if self.recorder is not None:
            self._extra()
            self.recorder.finished(request, held)
        return held, params

    def take_events(self) -> Iterable[Any]:
        # vLLM calls this at the end of every update_from_output, and update_connector_output
        # only when the step's model runner output carries a connector output: a step
        # without one is recorded here, as an output with nothing to report.
        events = self.inner.take_events()
        if self.recorder is not None and not self._output_seen:
            self._extra()
            self.recorder.output(None)
        self._output_seen = False
        return events

    # ---- worker side: forwarded unchanged -------------------------------------------------
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.inner.start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.inner.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        self.inner.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        self.inner.wait_for_save()


# Every other KVConnectorBase_V1 method and property forwards to the wrapped connector.
_FORWARDED = (
    "bind_connector_metadata", "clear_connector_metadata", "has_connector_metadata", "register_kv_caches",
    "unregister_kv_caches", "restore_kv_caches", "set_host_xfer_buffer_ops", "finish_forward",
    "reset_capture_state", "handle_preemptions", "get_finished", "get_transfer_results",
    "get_block_ids_with_load_errors", "shutdown", "get_kv_connector_stats", "get_kv_connector_kv_cache_events",
    "get_handshake_metadata", "build_connector_worker_meta", "bind_kv_cache_manager", "bind_gpu_block_pool",
    "get_loaded_kv_cache_group_ids", "get_external_cache_hit_sources", "register_finished_partial_tail",
    "has_pending_block_frees", "has_pending_push_work", "get_finished_count", "set_xfer_handshake_metadata",
    "set_xfer_handshake_metadata_pp_aware", "reset_cache", "get_mem_pool_context",
)


def _forward(name: str) -> Any:
    def method(self: RecordingConnector, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.inner, name)(*args, **kwargs)

    method.__name__ = name
    return method


for _name in _FORWARDED:
    setattr(RecordingConnector, _name, _forward(_name))
def _forward_property(name: str) -> property:
    def getter(self: RecordingConnector) -> Any:
        return getattr(self.inner, name)

    return property(getter)


for _prop in ("requires_kv_delivery", "supports_divergent_local_hybrid_hits"):
    setattr(RecordingConnector, _prop, _forward_property(_prop))
