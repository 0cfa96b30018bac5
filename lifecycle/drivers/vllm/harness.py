"""vLLM's real v1 scheduler, built offline on a CPU-only machine and stepped by hand.

The way vLLM's own connector unit tests drive it: a local OPT-style ``config.json``,
``skip_tokenizer_init``, ``HF_HUB_OFFLINE=1``, a private ``VLLM_CACHE_ROOT``; then
``schedule()``, the workers' connector outputs (simulated workers, combined by vLLM's
``KVOutputAggregator`` as the executor does) and ``update_from_output`` with scripted
model outputs (one sampled token per request that reaches the end of its known tokens).
Written for kvlife's tests and the differential comparison; vLLM's test helpers are not
in its wheel.
"""

from __future__ import annotations

import json
import os
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from kvlife.lifecycle.drivers.vllm.recording import _job_blocks
from kvlife.lifecycle.drivers.vllm.worker import OffloadingSimulatedWorker, SimulatedWorker
from kvlife.lifecycle.drivers.vllm_order import StepObs

# OPT-125m's shape (facebook/opt-125m config.json), positions raised to 16,384 so scaled
# trace slices fit: only the scheduler reads it.
OPT_CONFIG = {
    "architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 768, "num_hidden_layers": 12,
    "num_attention_heads": 12, "ffn_dim": 3072, "vocab_size": 50272, "max_position_embeddings": 16384,
    "word_embed_proj_dim": 768, "do_layer_norm_before": True, "torch_dtype": "float16",
}


def offline_model_dir(root: str | Path) -> Path:
    """Write the model config and point vLLM at it and at a private cache, offline."""
    root = Path(root)
    model = root / "opt-config"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(OPT_CONFIG))
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ.setdefault("VLLM_CACHE_ROOT", str(root / "vllm-cache"))
    return model


@attrs.frozen
class SchedulerSpec:
    block_size: int = 16
    num_blocks: int = 64  # vLLM's pool; block 0 is its null block
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 128
    async_scheduling: bool = False
    connector: str = "KVLifeConnector"
    module_path: str | None = "kvlife.vllm"
    extra: dict[str, Any] = attrs.Factory(dict)
    world_size: int = 1
    # vLLM's kv_load_failure_policy ("recompute" or "fail"); None: vLLM's default ("fail").
    kv_load_failure_policy: str | None = None
    # The KV cache's per-block shape for a worker-side connector (HostPoolWorker):
    # one layer, FlashAttention's layout (2, num_blocks, block_size, heads, head_size).
    num_kv_heads: int = 1
    head_size: int = 1
    max_model_len: int = 2048


def build_config(model_dir: Path, spec: SchedulerSpec) -> tuple[Any, Any]:
    """vLLM's (VllmConfig, KVCacheConfig) for ``spec``, offline."""
    import torch
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    model = ModelConfig(model=str(model_dir), tokenizer=str(model_dir), skip_tokenizer_init=True,
                        max_model_len=spec.max_model_len, dtype="float16", seed=0)
    sched = SchedulerConfig(max_num_seqs=spec.max_num_seqs, max_num_batched_tokens=spec.max_num_batched_tokens,
                            max_model_len=spec.max_model_len, enable_chunked_prefill=True, is_encoder_decoder=False,
                            async_scheduling=spec.async_scheduling)
    cache = CacheConfig(block_size=spec.block_size, enable_prefix_caching=True)
    failure: Any = spec.kv_load_failure_policy or "fail"  # vLLM's default
    transfer = KVTransferConfig(kv_connector=spec.connector, kv_connector_module_path=spec.module_path,
                                kv_role="kv_both", kv_connector_extra_config=dict(spec.extra),
                                kv_load_failure_policy=failure)
    config = VllmConfig(model_config=model, scheduler_config=sched, cache_config=cache,
                        kv_transfer_config=transfer, device_config=DeviceConfig("cpu"))
    kv_cache = KVCacheConfig(num_blocks=spec.num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=spec.block_size, num_kv_heads=spec.num_kv_heads,
                                                      head_size=spec.head_size, dtype=torch.float32))])
    config.cache_config.num_gpu_blocks = spec.num_blocks
    return config, kv_cache


def build_scheduler(model_dir: Path, spec: SchedulerSpec) -> Any:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    config, kv_cache = build_config(model_dir, spec)
    cls = AsyncScheduler if spec.async_scheduling else Scheduler
    return cls(config, kv_cache, log_stats=True, structured_output_manager=StructuredOutputManager(config),
               block_size=spec.block_size)


_HASH_READY = False


def make_request(request_id: str, prompt: Sequence[int], max_tokens: int, block_size: int) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    global _HASH_READY
    if not _HASH_READY:
        init_none_hash(sha256)
        _HASH_READY = True
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(request_id=request_id, prompt_token_ids=list(prompt), sampling_params=params,
                   pooling_params=None, block_hasher=get_request_block_hasher(block_size, sha256))


ForwardFn = Callable[[Any], None]  # (scheduler output) -> None: the step's compute writes its KV


class ConnectorWorker:
    """A worker-side connector (``KVConnectorRole.WORKER``) driven as vLLM's model runner
    drives it (``v1/worker/kv_connector_model_runner_mixin.py`` and
    ``gpu_model_runner.execute_model``): bind the metadata, ``handle_preemptions``,
    ``start_load_kv`` before the forward pass when the step has sync loads and after it
    otherwise, ``wait_for_save``, then the transfer results, the load errors and the worker
    metadata as the step's ``KVConnectorOutput``. ``forward`` stands for the model: it
    writes the KV of the tokens the step computes into the registered tensors."""

    def __init__(self, connector: Any, forward: ForwardFn | None = None) -> None:
        self.connector = connector
        self.forward = forward

    @classmethod
    def build(cls, model_dir: Path, spec: SchedulerSpec, kv_caches: dict[str, Any], rank: int = 0,
              forward: ForwardFn | None = None) -> ConnectorWorker:
        """The worker-side connector of ``spec`` with ``kv_caches`` registered."""
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        config, kv_cache = build_config(model_dir, spec)
        config.parallel_config.rank = rank
        connector_cls = KVConnectorFactory.get_connector_class(config.kv_transfer_config)
        connector = connector_cls(config, KVConnectorRole.WORKER, kv_cache)
        connector.register_kv_caches(kv_caches)
        return cls(connector, forward)

    def run_step(self, meta: Any, out: Any = None) -> Any:
        from vllm.v1.outputs import KVConnectorOutput

        c = self.connector
        c.bind_connector_metadata(meta)
        c.handle_preemptions(meta)
        sync_loads = bool(getattr(out, "has_sync_kv_loads", False))
        if sync_loads:
            c.start_load_kv(None)
        if self.forward is not None and out is not None:
            self.forward(out)
        if not sync_loads:
            c.start_load_kv(None)
        c.wait_for_save()
        results = c.get_transfer_results(set(getattr(out, "finished_req_ids", ()) or ()))
        output = KVConnectorOutput(
            finished_sending=results.finished_sending, finished_recving=results.finished_recving,
            failed_recving=results.failed_recving, invalid_block_ids=c.get_block_ids_with_load_errors(),
            kv_connector_stats=c.get_kv_connector_stats(), kv_cache_events=c.get_kv_connector_kv_cache_events(),
            kv_connector_worker_meta=c.build_connector_worker_meta())
        c.clear_connector_metadata()
        return output

    @property
    def busy(self) -> bool:
        return bool(getattr(getattr(self.connector, "worker", None), "busy", False))


def scheduled_chunks(out: Any) -> dict[str, tuple[int, int]]:
    """A scheduler output's request -> (computed before, tokens this step)."""
    chunks = {}
    for new in out.scheduled_new_reqs:
        chunks[new.req_id] = (new.num_computed_tokens, out.num_scheduled_tokens[new.req_id])
    cached = out.scheduled_cached_reqs
    for i, rid in enumerate(cached.req_ids):
        chunks[rid] = (cached.num_computed_tokens[i], out.num_scheduled_tokens[rid])
    return chunks


class VllmDriver:
    """Steps a vLLM scheduler with simulated workers (one per rank) and scripted outputs.

    ``empty_outputs_as_none``: a step whose workers have nothing to report reaches the
    scheduler with ``kv_connector_output=None``, as vLLM's single-worker runner sends it
    (``ModelRunnerOutput.with_kv_conn_output_only``); vLLM then skips
    ``update_connector_output`` for that step. Off: every step carries one (as vLLM's
    ``KVOutputAggregator`` builds it for several workers)."""

    def __init__(self, scheduler: Any,
                 workers: Sequence[SimulatedWorker | OffloadingSimulatedWorker | ConnectorWorker] | None = None,
                 empty_outputs_as_none: bool = False) -> None:
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

        self.scheduler = scheduler
        self.workers = list(workers) if workers is not None else [SimulatedWorker(0)]
        self.aggregator = KVOutputAggregator(len(self.workers))
        self.empty_outputs_as_none = empty_outputs_as_none
        self.none_outputs = 0  # steps whose model runner output carried no connector output
        self.async_scheduling = type(scheduler).__name__ == "AsyncScheduler"
        self.pending: deque[tuple[Any, list[Any], list[str]]] = deque()
        self.observations: list[StepObs] = []
        self.step_index = 0
        self.before_update: Callable[[Any], None] | None = None

    @property
    def block_size(self) -> int:
        return int(self.scheduler.block_size)

    def add(self, request_id: str, prompt: Sequence[int], max_tokens: int) -> Any:
        request = make_request(request_id, prompt, max_tokens, self.block_size)
        self.scheduler.add_request(request)
        return request

    def abort(self, request_id: str) -> None:
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)

    def status(self, request_id: str) -> str | None:
        request = self.scheduler.requests.get(request_id)
        return None if request is None else request.status.name

    def step(self) -> StepObs:
        """One schedule(); the workers run its metadata; its output is applied now (sync) or
        after the next schedule() (async scheduling, one step in flight)."""
        from vllm.v1.request import RequestStatus

        sched = self.scheduler
        out = sched.schedule()
        meta = out.kv_connector_metadata
        outputs = [w.run_step(meta, out) for w in self.workers]
        samplers = []
        for rid in out.num_scheduled_tokens:
            req = sched.requests[rid]
            if req.num_computed_tokens >= req.num_tokens:
                samplers.append(rid)
        self.step_index += 1
        obs = self._observe(out, meta)
        obs.waiting_remote = sum(1 for r in sched.requests.values()
                                 if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS)
        self.observations.append(obs)
        self.pending.append((out, outputs, samplers))
        if len(self.pending) > (1 if self.async_scheduling else 0):
            self._update(*self.pending.popleft())
        return obs

    def drain(self) -> None:
        while self.pending:
            self._update(*self.pending.popleft())

    def _observe(self, out: Any, meta: Any) -> StepObs:
        scheduled = scheduled_chunks(out)
        hits: dict[str, int] = {}
        loads = getattr(meta, "load_jobs", None) or {}
        for job in loads.values():
            blocks = _job_blocks(job) or []
            hits[job.req_id] = hits.get(job.req_id, 0) + len(blocks) * self.block_size
        return StepObs(self.step_index, scheduled, hits, len(loads), 0, tuple(sorted(out.preempted_req_ids or ())))

    def _update(self, out: Any, outputs: list[Any], samplers: list[str]) -> None:
        from vllm.v1.outputs import ModelRunnerOutput

        req_ids = list(out.num_scheduled_tokens)
        runner_outputs: list[ModelRunnerOutput | None] = []
        for kv_output in outputs:
            runner_outputs.append(ModelRunnerOutput(
                req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                sampled_token_ids=[[7] if r in samplers else [] for r in req_ids],
                kv_connector_output=kv_output))
        merged = self.aggregator.aggregate(runner_outputs, 0)
        assert merged is not None
        kv_output = merged.kv_connector_output
        if self.empty_outputs_as_none and (kv_output is None or kv_output.is_empty()):
            merged.kv_connector_output = None
            self.none_outputs += 1
        elif kv_output is None:
            from vllm.v1.outputs import KVConnectorOutput

            merged.kv_connector_output = KVConnectorOutput()
        if self.before_update is not None:
            self.before_update(merged)
        self.scheduler.update_from_output(out, merged)

    def idle(self) -> bool:
        return not self.scheduler.requests and not any(w.busy for w in self.workers)
