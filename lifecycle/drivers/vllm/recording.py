"""RecordingConnector: wraps any vLLM KV connector and writes the lifecycle it observes as a kvlife trace.

Enable it around vLLM's OffloadingConnector (or any connector, by registered name or
``pkg.mod:Class``)::

    --kv-transfer-config '{"kv_connector": "RecordingConnector", "kv_connector_module_path": "kvlife.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"record": {"inner": "OffloadingConnector",
                                                                    "trace": "run.trace.jsonl"},
                                                         "cpu_bytes_to_use": 1000000000}}'

Every call is forwarded unchanged, and so is every class-level hook (the KV cache layout the
inner connector requires, its stats and Prometheus metrics, piecewise CUDA graphs, sleep
mode). ``RecordingConnector`` claims no HMA support (vLLM then turns the hybrid KV cache
manager off); ``RecordingConnectorHMA`` claims it, and refuses an inner connector that has
none.

The scheduler side hands every call and the inner connector's answer to
``kvlife.lifecycle.engine.recorder.ConnectorRecorder``, which drives kvlife's connector core
(``ConnectorCore(observing=True)``) through the same ``ConnectorAPI`` that kvlife's engine and
``KVLifeConnector`` use, with the inner connector's answers in place of kvlife's decisions:
the same state machine, the same transitions at the same calls, the same records (``kvlife
validate``, ``explain``, ``export`` and ``plot`` read them); ``kvlife check`` runs the same
recorder beside kvlife's own engine. This module adapts vLLM to it: the inner connector's
jobs read off its metadata (kvlife's, or OffloadingConnector's), the trace's header from
vLLM's config, the stats and class-level hooks. The recorder adds what the core cannot see
of vLLM: the inner connector's per-rank reports (kvlife's, or OffloadingConnector's per-step
counts), the device blocks vLLM frees (a ``free`` record when no request holds a block any
more), and request ids vLLM reuses after a finish (the trace names the new request ``id#2``). Block
hashes are vLLM's (``block_hash_int``), so a later turn holding an earlier one's answer is
recorded under the same names. The trace is for validate, explain, export and plot: inside a
pass its inputs are ordered as vLLM calls the connector, so it is not replayed by ``kvlife
replay`` (a trace of kvlife's own driver is).

Recording never breaks the connector it wraps: an error while recording a call (a sequence
of vLLM's calls the core does not model) ends the recording, with a ``recording_stopped``
warning naming the call and the error as the trace's last record and in vLLM's log; the inner
connector goes on serving every call.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
    supports_hma,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput

from kvlife.lifecycle.config import EngineConfig, RunConfig, TierConfig
from kvlife.lifecycle.drivers.vllm.connector import block_hash_int
from kvlife.lifecycle.engine import records
from kvlife.lifecycle.engine.connector_api import ConnectorAPI
from kvlife.lifecycle.engine.recorder import ConnectorRecorder, ObservedJob
from kvlife.lifecycle.traces.trace import TraceWriter

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

# The key under which a recorded connector's stats carry the inner connector's spec, so the
# class-level stats hook (which vLLM calls with the data alone) builds the inner's stats class.
_INNER_KEY = "__kvlife_inner__"


def _connector_class(spec: str) -> type[KVConnectorBase_V1]:
    if ":" in spec:
        module, _, name = spec.rpartition(":")
        cls = getattr(importlib.import_module(module), name)
    else:
        cls = KVConnectorFactory.get_connector_class_by_name(spec)
    if not (isinstance(cls, type) and issubclass(cls, KVConnectorBase_V1)):
        raise ValueError(f"record.inner {spec!r} is not a KVConnectorBase_V1 subclass")
    return cls


def _inner_spec(extra: dict[str, Any] | None) -> str:
    record = dict((extra or {}).get("record") or {})
    inner = record.get("inner")
    if not isinstance(inner, str):
        raise ValueError("RecordingConnector: kv_connector_extra_config.record.inner must name the wrapped "
                         "connector (a registered name like 'OffloadingConnector', or 'pkg.mod:Class')")
    return inner


def _inner_class(kv_transfer_config: KVTransferConfig) -> type[KVConnectorBase_V1]:
    return _connector_class(_inner_spec(kv_transfer_config.kv_connector_extra_config))


def _job_blocks(job: Any) -> list[int] | None:
    """Device blocks of a job in a connector's metadata (kvlife's or OffloadingConnector's)."""
    blocks = getattr(job, "device_blocks", None)
    if blocks is not None:
        return [int(b) for b in blocks]
    for spec in (getattr(job, "dst_spec", None), getattr(job, "src_spec", None)):
        if spec is not None and type(spec).__name__ == "GPULoadStoreSpec":
            return [int(b) for b in spec.block_ids]
    return None


def _jobs(meta: Any) -> list[ObservedJob]:
    """The load and store jobs of a connector's step metadata (kvlife's or OffloadingConnector's)."""
    out = []
    for kind, jobs in (("load", getattr(meta, "load_jobs", None)), ("store", getattr(meta, "store_jobs", None))):
        for job_id, job in sorted((jobs or {}).items()):
            blocks = _job_blocks(job)
            if blocks is None:
                continue
            given = getattr(job, "block_hashes", None)
            out.append(ObservedJob(int(job_id), kind, job.req_id, tuple(blocks),
                                   None if given is None else tuple(int(h) for h in given)))
    return out


class RecordingConnector(KVConnectorBase_V1):
    """Forwards every call to ``inner``; the scheduler side records the lifecycle it observes."""

    hma: ClassVar[bool] = False

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        record = dict(extra.get("record") or {})
        self.inner_spec = _inner_spec(extra)
        inner_cls = _connector_class(self.inner_spec)
        if self.hma and not supports_hma(inner_cls):
            raise ValueError(f"RecordingConnectorHMA: the wrapped connector {inner_cls.__name__} does not support "
                             "HMA; use RecordingConnector")
        self.inner: KVConnectorBase_V1 = inner_cls(vllm_config, role, kv_cache_config)  # type: ignore[arg-type,unused-ignore]
        self.writer: TraceWriter | None = None
        self.recorder: ConnectorRecorder | None = None
        trace = record.get("trace")
        if role == KVConnectorRole.SCHEDULER and trace:
            self._start_recording(vllm_config, kv_cache_config, record, str(trace), inner_cls.__name__)

    def _start_recording(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None,
                         record: dict[str, Any], trace: str, inner_name: str) -> None:
        sched = vllm_config.scheduler_config
        num_blocks = kv_cache_config.num_blocks if kv_cache_config is not None else 2
        self.tier = str(record.get("tier", "host"))
        config = EngineConfig(
            block_tokens=vllm_config.cache_config.block_size, device_blocks=max(1, num_blocks - 1),
            max_batched_tokens=sched.max_num_batched_tokens, max_running=sched.max_num_seqs,
            ranks=int(record.get("ranks", vllm_config.parallel_config.world_size)),
            async_scheduling=bool(sched.async_scheduling),
            kv_load_failure_policy=str(getattr(self._kv_transfer_config, "kv_load_failure_policy", "fail")),
            tiers=(TierConfig(self.tier, capacity_blocks=max(1, int(record.get("tier_blocks", num_blocks)))),))
        policies = list(getattr(self.inner, "stack_names", [])) or [inner_name]
        self.writer = TraceWriter(trace)
        self.writer.write_header(RunConfig(engine=config, policies=tuple(policies)).to_dict(), policies, 0,
                                 source=f"vllm:{inner_name}")
        self.recorder = ConnectorRecorder(config, self.writer.record, self.tier, hash_of=block_hash_int,
                                          inner_name=inner_name)

    @property
    def api(self) -> ConnectorAPI | None:
        """The recording's connector API (None: not recording, or the recording stopped)."""
        return self.recorder.api if self.recorder is not None else None

    @contextlib.contextmanager
    def _observing(self, call: str) -> Iterator[ConnectorRecorder | None]:
        """Record what ``call`` showed, if recording: an error there ends the recording (a
        ``recording_stopped`` warning is the trace's last record) and never reaches vLLM,
        which the inner connector serves as before."""
        recorder = self.recorder
        try:
            yield recorder
        except Exception as exc:  # the recorder must not break the connector it wraps
            self.recorder = None
            error = f"{type(exc).__name__}: {exc}"
            logger.warning("RecordingConnector: recording stopped at %s (%s); %s keeps running unrecorded", call,
                           error, type(self.inner).__name__)
            if self.writer is not None and recorder is not None:
                self.writer.record(records.warning(recorder.now, "recording_stopped", call=call, error=error))
            self.close()

    # ---- observed scheduler hooks ------------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        with self._observing("on_new_request") as recorder:
            if recorder is not None:
                recorder.on_new_request(request)
        self.inner.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        result = self.inner.get_num_new_matched_tokens(request, num_computed_tokens)
        with self._observing("get_num_new_matched_tokens") as recorder:
            if recorder is not None:
                why = getattr(self.inner, "kvlife_pending_reason", None)
                deferred = why is not None and why(request.request_id) == "defer"
                recorder.get_num_new_matched_tokens(request, num_computed_tokens, result, deferred)
        return result

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self.inner.update_state_after_alloc(request, blocks, num_external_tokens)
        with self._observing("update_state_after_alloc") as recorder:
            if recorder is not None:
                recorder.update_state_after_alloc(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = self.inner.build_connector_meta(scheduler_output)
        with self._observing("build_connector_meta") as recorder:
            if recorder is not None:
                recorder.build_connector_meta(scheduler_output, _jobs(meta),
                                              getattr(meta, "jobs_to_abandon", None) or (),
                                              getattr(meta, "jobs_to_flush", None) or ())
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.inner.update_connector_output(connector_output)
        with self._observing("update_connector_output") as recorder:
            if recorder is not None:
                recorder.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        if isinstance(self.inner, SupportsHMA):
            held, params = self.inner.request_finished_all_groups(request, block_ids)
        else:
            held, params = self.inner.request_finished(request, block_ids[0])
        with self._observing("request_finished") as recorder:
            if recorder is not None:
                recorder.request_finished(request, block_ids[0], held)
        return held, params

    def take_events(self) -> Iterable[Any]:
        events = self.inner.take_events()
        with self._observing("take_events") as recorder:
            if recorder is not None:
                recorder.take_events()
        return events

    def shutdown(self) -> None:
        self.inner.shutdown()
        self.close()

    def close(self) -> None:
        """Close the trace (the scheduler side keeps forwarding)."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    # ---- worker side: forwarded unchanged -------------------------------------------------
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.inner.start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.inner.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        self.inner.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        self.inner.wait_for_save()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        stats = self.inner.get_kv_connector_stats()
        if stats is None:
            return None
        return _TaggedStats(data={**stats.data, _INNER_KEY: self.inner_spec}, inner=stats)

    # ---- class-level hooks: forwarded to the inner connector's class ---------------------------
    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        if vllm_config.kv_transfer_config is None:
            return None
        return _inner_class(vllm_config.kv_transfer_config).get_required_kvcache_layout(vllm_config)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return bool(_connector_class(_inner_spec(extra_config)).requires_piecewise_for_cudagraph(extra_config))

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        return bool(_inner_class(kv_transfer_config).supports_sleep_mode(kv_transfer_config))

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        if data is None or _INNER_KEY not in data:
            return None
        inner = _connector_class(str(data[_INNER_KEY]))
        return inner.build_kv_connector_stats({k: v for k, v in data.items() if k != _INNER_KEY})

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[Any, Any], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics | None:
        if vllm_config.kv_transfer_config is None:
            return None
        inner = _inner_class(vllm_config.kv_transfer_config).build_prom_metrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues)
        return None if inner is None else _TaggedProm(vllm_config, metric_types, labelnames, per_engine_labelvalues,
                                                      inner)


class RecordingConnectorHMA(RecordingConnector, SupportsHMA):
    """``RecordingConnector`` for an inner connector that supports HMA (vLLM's hybrid KV
    cache manager stays on)."""

    hma = True


@dataclass
class _TaggedStats(KVConnectorStats):
    """The inner connector's stats, its data tagged with the inner's spec."""

    data: dict[str, Any] = field(default_factory=dict)
    inner: Any = None

    def reset(self) -> None:
        if self.inner is not None:
            self.inner.reset()
        self.data = {k: v for k, v in self.data.items() if k == _INNER_KEY}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        assert self.inner is not None
        merged = self.inner.aggregate(getattr(other, "inner", other))
        return _TaggedStats(data={**merged.data, _INNER_KEY: self.data[_INNER_KEY]}, inner=merged)

    def reduce(self) -> dict[str, int | float]:
        return dict(self.inner.reduce()) if self.inner is not None else {}

    def is_empty(self) -> bool:
        return self.inner is None or bool(self.inner.is_empty())


class _TaggedProm(KVConnectorPromMetrics):
    """The inner connector's Prometheus metrics, fed the data without the tag."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[Any, Any], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]], inner: KVConnectorPromMetrics) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.inner = inner

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        self.inner.observe({k: v for k, v in transfer_stats_data.items() if k != _INNER_KEY}, engine_idx)


# Every other KVConnectorBase_V1 method and property forwards to the wrapped connector.
_FORWARDED = (
    "bind_connector_metadata", "clear_connector_metadata", "has_connector_metadata", "register_kv_caches",
    "unregister_kv_caches", "restore_kv_caches", "set_host_xfer_buffer_ops", "finish_forward",
    "reset_capture_state", "handle_preemptions", "get_finished", "get_transfer_results",
    "get_block_ids_with_load_errors", "get_kv_connector_kv_cache_events",
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
