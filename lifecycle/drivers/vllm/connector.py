"""KVLifeConnector: a vLLM ``KVConnectorBase_V1`` whose scheduler side is kvlife's lifecycle and policies.

Enable it in ``vllm serve`` (see docs/vllm.md)::

    --kv-transfer-config '{"kv_connector": "KVLifeConnector", "kv_connector_module_path": "kvlife.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"stack": "async-lookup,shared-loads",
                                                         "host_blocks": 4096}}'

Extra config keys: ``stack`` (one comma-separated policy stack, the CLI's names and
``pkg.mod:Class`` / ``file.py:Class`` specs), ``host_blocks`` (host tier capacity in vLLM
blocks), ``lookup_delay_steps`` (steps before an async lookup answers, default 1),
``ranks`` (workers that report each job; default: tensor-parallel size),
``store_timeout_steps`` (give up on a store some rank has not reported after this many
steps; default: never).

Hook mapping (scheduler side, ``lifecycle.ConnectorLifecycle``):
``on_new_request`` -> arrival (early lookup if a policy asks); ``get_num_new_matched_tokens``
-> sync lookup, or ``(None, False)`` while ``lookup_pending`` (async) or while the
admission policy defers or joins an in-flight load; ``update_state_after_alloc`` -> a load
job on the blocks vLLM allocated (``loading``) or ``running``; ``build_connector_meta`` ->
the step's load and store jobs (stores cover confirmed tokens only) plus stores to flush
for preempted requests; ``update_connector_output`` -> step output, then one
``TransferReport`` per rank per job (a job whose reports name failed blocks is a failed
load or store: see below); ``request_finished`` -> hold the blocks while stores run
(``hold_at_finish``) and report them in ``finished_sending``; ``take_events`` -> none, but
it closes the step's output: vLLM calls it at the end of every ``update_from_output``,
while ``update_connector_output`` is skipped when a step has no connector output.

Failures. A worker reports a load's failed blocks twice: as vLLM device blocks through
``get_block_ids_with_load_errors`` (vLLM's ``invalid_block_ids``: with
``kv_load_failure_policy`` "recompute" vLLM cuts the request's computed tokens at the
first failed block and recomputes from there, with "fail" it finishes the request with an
error), and as block hashes in its per-rank report, which the scheduler side turns into
kvlife's failed-load input (the blocks are discarded from the tier, nothing is published
from them, the request leaves ``loading`` for ``waiting`` and is admitted again). A store's
failed blocks are never made readable in the tier; the request finishes and its held blocks
are released as usual.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput

from kvlife.lifecycle.drivers.vllm.lifecycle import ConnectorJob, ConnectorLifecycle
from kvlife.lifecycle.drivers.vllm.metadata import KVLifeJob, KVLifeMetadata, KVLifeWorkerMetadata
from kvlife.lifecycle.drivers.vllm.worker import HostPoolWorker
from kvlife.policies.loading import load_stack

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


def block_hash_int(block_hash: bytes) -> int:
    """vLLM block hashes are bytes; kvlife's are integers (the first 8 bytes, big-endian,
    kept below 2**63 so every JSON reader takes them)."""
    return int.from_bytes(bytes(block_hash)[:8], "big") >> 1


def parse_stack(value: Any) -> list[str]:
    if value is None or value == "":
        return []
    if isinstance(value, str):
        names = [part.strip() for part in value.split(",")]
    elif isinstance(value, list) and all(isinstance(v, str) for v in value):
        names = [v.strip() for v in value]
    else:
        raise ValueError(f"kv_connector_extra_config 'stack': expected a comma-separated string, got {value!r}")
    if any(not n for n in names):
        raise ValueError(f"kv_connector_extra_config 'stack': empty policy name in {value!r}")
    return names


def _job_spec(job: ConnectorJob, tier: str) -> KVLifeJob:
    return KVLifeJob(job.request_id, job.kind, tier, [m[0] for m in job.moves], [m[1] for m in job.moves],
                     [m[2] for m in job.moves])


class KVLifeConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.block_size = vllm_config.cache_config.block_size
        self.stack_names = parse_stack(extra.get("stack"))
        self.host_blocks = int(extra.get("host_blocks", 4096))
        self.ranks = int(extra.get("ranks", vllm_config.parallel_config.world_size))
        timeout = extra.get("store_timeout_steps")
        self.store_timeout_steps = None if timeout is None else int(timeout)
        self.lifecycle: ConnectorLifecycle | None = None
        self.worker: HostPoolWorker | None = None
        self._in_step = False
        self._output_seen = False  # update_connector_output came for the step output in progress
        self._worker_meta: KVLifeWorkerMetadata | None = None
        self._vllm_requests: dict[str, Request] = {}  # whose block_hashes grow as tokens come
        if role == KVConnectorRole.SCHEDULER:
            self.lifecycle = ConnectorLifecycle(
                self.block_size, load_stack(self.stack_names), self.host_blocks, ranks=self.ranks,
                lookup_delay_steps=int(extra.get("lookup_delay_steps", 1)),
                store_timeout_steps=self.store_timeout_steps,
            )
        else:
            num_blocks = kv_cache_config.num_blocks if kv_cache_config is not None else 0
            self.worker = HostPoolWorker(vllm_config.parallel_config.rank, self.host_blocks, self.block_size,
                                         num_blocks)

    # ---- scheduler side ------------------------------------------------------------------
    @property
    def sched(self) -> ConnectorLifecycle:
        assert self.lifecycle is not None, "scheduler-side call on a worker-side connector"
        return self.lifecycle

    def _step(self) -> None:
        if not self._in_step:
            self._in_step = True
            self.sched.begin_step()

    def on_new_request(self, request: Request) -> None:
        self._vllm_requests[request.request_id] = request
        self.sched.arrival(request.request_id, request.num_prompt_tokens,
                           [block_hash_int(h) for h in request.block_hashes])

    def _refresh_hashes(self, request_id: str) -> None:
        request = self._vllm_requests.get(request_id)
        known = self.sched.requests.get(request_id)
        if request is not None and known is not None and len(request.block_hashes) > len(known.hashes):
            self.sched.update_hashes(request_id, [block_hash_int(h) for h in request.block_hashes])

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        self._step()
        if request.request_id not in self.sched.requests:
            self.on_new_request(request)
        self._refresh_hashes(request.request_id)
        return self.sched.matched(request.request_id, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._step()
        block_ids = blocks.get_block_ids()[0]
        self.sched.allocated(request.request_id, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        self._step()
        self._in_step = False
        scheduled: list[tuple[str, int, int]] = []
        new_blocks: dict[str, tuple[list[int], bool]] = {}
        for new in scheduler_output.scheduled_new_reqs:
            scheduled.append((new.req_id, new.num_computed_tokens, scheduler_output.num_scheduled_tokens[new.req_id]))
            new_blocks[new.req_id] = (list(new.block_ids[0]), True)
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            scheduled.append((rid, cached.num_computed_tokens[i], scheduler_output.num_scheduled_tokens[rid]))
            ids = cached.new_block_ids[i]
            new_blocks[rid] = (list(ids[0]) if ids is not None else [], rid in cached.resumed_req_ids)
        for rid in scheduler_output.num_scheduled_tokens:
            self._refresh_hashes(rid)
        jobs = self.sched.build(scheduled, new_blocks, scheduler_output.preempted_req_ids or ())
        tier = self.sched.tier.name
        return KVLifeMetadata(
            load_jobs={j.job_id: _job_spec(j, tier) for j in jobs.loads},
            store_jobs={j.job_id: _job_spec(j, tier) for j in jobs.stores},
            jobs_to_flush=set(jobs.flush),
            hold_finished=list(jobs.hold_finished),
            jobs_to_abandon=set(jobs.abandon),
        )

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        sched = self.sched
        self._output_seen = True
        sched.step_output()
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, KVLifeWorkerMetadata):
            for job_id, rank, failed in meta.reports:
                sched.report(job_id, rank, failed)
        for rid in sorted(connector_output.finished_sending or ()):
            sched.sent(rid)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        aborted = request.status.name == "FINISHED_ABORTED"
        self._refresh_hashes(request.request_id)
        self._vllm_requests.pop(request.request_id, None)
        hold = self.sched.finished(request.request_id, aborted)
        return hold, None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids[0])

    def take_events(self) -> Iterable[Any]:
        # The last connector call of every update_from_output. A step whose model runner
        # output carries no connector output (vLLM's runner sends none for a step with
        # nothing to report) never reached update_connector_output: its output still
        # confirms the step's tokens.
        if self.lifecycle is not None:
            if not self._output_seen:
                self.lifecycle.step_output()
            self._output_seen = False
        return ()

    # For RecordingConnector: why a None answer, and the decisions / stale answers to trace.
    def kvlife_pending_reason(self, request_id: str) -> str | None:
        return self.sched.pending_reason(request_id)

    def kvlife_take_records(self) -> list[dict[str, Any]]:
        return self.sched.take_records()

    # ---- worker side ----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.register(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # Called before the forward pass (start_load_kv may come after it): stores of
        # preempted requests end before this step's compute reuses their blocks.
        if self.worker is not None and isinstance(kv_connector_metadata, KVLifeMetadata):
            self.worker.flush(kv_connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if self.worker is not None and isinstance(meta, KVLifeMetadata):
            self.worker.start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv orders the loads before the forward pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # stores run after the forward pass, in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if self.worker is not None and isinstance(meta, KVLifeMetadata):
            self.worker.save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.worker is None:
            return None, None
        sending, recving, self._worker_meta = self.worker.take_output()
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        # Asked after get_finished in the same pass: a failed load's device blocks come
        # no later than its finished_recving, as vLLM requires.
        return self.worker.take_invalid_blocks() if self.worker is not None else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        meta, self._worker_meta = self._worker_meta, None
        return meta
