"""KVLifeConnector: a vLLM ``KVConnectorBase_V1`` whose scheduler side is kvlife's connector core.

Enable it in ``vllm serve`` (see docs/vllm.md)::

    --kv-transfer-config '{"kv_connector": "KVLifeConnector", "kv_connector_module_path": "kvlife.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"stack": "async-lookup,shared-loads",
                                                         "host_blocks": 4096}}'

The scheduler side is an adapter and nothing more: every call vLLM's scheduler makes goes to
``kvlife.lifecycle.engine.connector_api.ConnectorAPI`` over a
``kvlife.lifecycle.engine.connector.ConnectorCore``, the very objects kvlife's own scheduler
drives in the simulator, so a policy is asked at the same points, with the same views, as
there. What is vLLM's stays here: the base class, vLLM's block hashes (bytes, read as
integers), the metadata and worker-output classes, vLLM's block pool (for the policies'
engine view) and its connector stats (on vLLM's Prometheus ``/metrics``).

Extra config keys (``kv_connector_extra_config``):

- ``stack``: one comma-separated policy stack (the CLI's names, ``pkg.mod:Class``,
  ``file.py:Class``);
- ``host_blocks``: the host tier's capacity, in vLLM blocks (default 4096); ``tiers``: a
  cascade instead, ``{"host": N, "disk": M, ...}`` in lookup order (the simulated worker
  serves every tier, ``HostPoolWorker`` the host tier only);
- ``lookup_delay_steps``: scheduler passes before an async lookup answers (default 1);
- ``ranks``: workers that report each job (default: the tensor-parallel world size);
- ``clock``: ``"wall"`` (default: ms since the connector started) or ``"steps"`` (one ms per
  scheduler pass: deterministic, for tests and the differential comparison);
- ``store_timeout_ms``: give up on a store some worker has not reported this long after it
  started, on the connector's clock (default: never); loads are never given up inside vLLM
  (a late copy would land in blocks vLLM may have handed on);
- ``trace``: write the connector core's records as a kvlife trace to this file.

vLLM's own ``kv_load_failure_policy`` decides what a failed load does (recompute from the
first failed block, or fail the request); the ``on_load_failure`` policy is asked, and an
answer vLLM cannot carry out is refused (a ``decision_refused`` warning), as in the simulator.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput

from kvlife.lifecycle.config import EngineConfig, TierConfig
from kvlife.lifecycle.drivers.vllm.metadata import KVLifeJob, KVLifeMetadata, KVLifeWorkerMetadata
from kvlife.lifecycle.drivers.vllm.worker import HostPoolWorker
from kvlife.lifecycle.drivers.vllm_order import DelayedLookups
from kvlife.lifecycle.engine.connector import ConnectorCore, ConnectorMeta
from kvlife.lifecycle.engine.connector_api import ConnectorAPI
from kvlife.lifecycle.engine.state import Job, PrefetchJob, Stats
from kvlife.policies.loading import load_stack

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.core.block_pool import BlockPool
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


def _tiers(extra: dict[str, Any]) -> tuple[TierConfig, ...]:
    tiers = extra.get("tiers")
    if tiers is None:
        return (TierConfig("host", capacity_blocks=int(extra.get("host_blocks", 4096))),)
    if not isinstance(tiers, dict) or not tiers:
        raise ValueError(f"kv_connector_extra_config 'tiers': expected {{name: blocks, ...}}, got {tiers!r}")
    return tuple(TierConfig(str(name), capacity_blocks=int(blocks)) for name, blocks in tiers.items())


def _job_spec(job: Job) -> KVLifeJob:
    tier = job.moves[0].tier if job.moves else "host"
    return KVLifeJob(job.request_id, job.kind, tier, [m.block_hash for m in job.moves],
                     [m.device_block for m in job.moves], [m.slot for m in job.moves], job.after)


def _prefetch_spec(job: PrefetchJob) -> KVLifeJob:
    tier = job.moves[0].src_tier if job.moves else "disk"
    return KVLifeJob(job.request_id, "prefetch", tier, [m.block_hash for m in job.moves],
                     [m.dst_slot for m in job.moves], [m.src_slot for m in job.moves])


def worker_metadata(meta: ConnectorMeta) -> KVLifeMetadata:
    """The core's step metadata in vLLM's metadata class."""
    return KVLifeMetadata(
        load_jobs={j.job_id: _job_spec(j) for j in meta.loads},
        store_jobs={j.job_id: _job_spec(j) for j in meta.stores},
        prefetch_jobs={j.job_id: _prefetch_spec(j) for j in meta.prefetches},
        jobs_to_flush=set(meta.flush),
        hold_finished=list(meta.hold_finished),
        jobs_to_abandon=set(meta.abandon),
    )


# The counters KVLifeConnector reports through vLLM's connector stats (``Stats`` fields).
STAT_COUNTERS: tuple[str, ...] = (
    "sync_lookups", "async_lookups", "stale_lookup_answers", "failed_lookups", "expired_lookups", "loads",
    "blocks_loaded", "redundant_block_loads", "joined_blocks", "stores", "blocks_stored", "failed_blocks",
    "flushed_stores", "preemptions", "prefetches", "blocks_prefetched", "prefetch_waits", "rank_timeouts",
    "reclaimed_jobs",
)


def stat_counts(stats: Stats) -> dict[str, int]:
    counts = {name: int(getattr(stats, name)) for name in STAT_COUNTERS}
    counts["deferrals"] = sum(stats.deferrals.values())
    counts["warnings"] = sum(stats.warnings.values())
    return counts


@dataclass
class KVLifeConnectorStats(KVConnectorStats):
    """KVLifeConnector's counters since the last report (``data``: counter -> increment)."""

    data: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merged = dict(self.data)
        for key, value in other.data.items():
            merged[key] = merged.get(key, 0) + value
        return KVLifeConnectorStats(data=merged)

    def reduce(self) -> dict[str, int | float]:
        return {key: value for key, value in self.data.items() if isinstance(value, int | float)}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KVLifePromMetrics(KVConnectorPromMetrics):
    """Each counter as ``kvlife:<name>_total`` on vLLM's Prometheus ``/metrics``."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[Any, Any], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters: dict[tuple[int, str], Any] = {}
        for name in (*STAT_COUNTERS, "deferrals", "warnings"):
            counter = self._counter_cls(name=f"kvlife:{name}", labelnames=labelnames,
                                        documentation=f"KVLifeConnector: {name.replace('_', ' ')}")
            for engine, values in per_engine_labelvalues.items():
                self.counters[(engine, name)] = counter.labels(*values)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            counter = self.counters.get((engine_idx, name))
            if counter is not None and value:
                counter.inc(value)


class _VllmPool:
    """vLLM's block pool as the policies' engine view reads it (``DeviceInfo``)."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool

    @property
    def free(self) -> int:
        return int(self.pool.get_num_free_blocks())

    @property
    def capacity(self) -> int:
        return int(self.pool.num_gpu_blocks) - 1  # block 0 is vLLM's null block


class KVLifeConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.block_size = vllm_config.cache_config.block_size
        self.stack_names = parse_stack(extra.get("stack"))
        self.tiers = _tiers(extra)
        self.host_blocks = self.tiers[0].capacity_blocks
        self.ranks = int(extra.get("ranks", vllm_config.parallel_config.world_size))
        self.api: ConnectorAPI | None = None
        self.worker: HostPoolWorker | None = None
        self.writer: Any = None
        self._worker_meta: KVLifeWorkerMetadata | None = None
        self._reported: dict[str, int] = {}
        if role == KVConnectorRole.SCHEDULER:
            self.api = self._scheduler_side(vllm_config, kv_cache_config, extra)
        else:
            num_blocks = kv_cache_config.num_blocks if kv_cache_config is not None else 0
            self.worker = HostPoolWorker(vllm_config.parallel_config.rank, self.host_blocks, self.block_size,
                                         num_blocks)

    def _scheduler_side(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None,
                        extra: dict[str, Any]) -> ConnectorAPI:
        clock = str(extra.get("clock", "wall"))
        if clock not in ("wall", "steps"):
            raise ValueError(f"kv_connector_extra_config 'clock': expected 'wall' or 'steps', got {clock!r}")
        timeout = extra.get("store_timeout_ms")
        num_blocks = kv_cache_config.num_blocks if kv_cache_config is not None else 2
        config = EngineConfig(
            block_tokens=self.block_size, device_blocks=max(1, num_blocks - 1),
            max_batched_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
            max_running=vllm_config.scheduler_config.max_num_seqs, ranks=self.ranks,
            async_scheduling=bool(vllm_config.scheduler_config.async_scheduling),
            transfer_deadline_ms=None if timeout is None else float(timeout),
            kv_load_failure_policy=str(getattr(self._kv_transfer_config, "kv_load_failure_policy", "fail")),
            tiers=self.tiers,
        )
        recorder = None
        trace = extra.get("trace")
        if trace:
            from kvlife.lifecycle.config import RunConfig
            from kvlife.lifecycle.traces.trace import TraceWriter

            self.writer = TraceWriter(str(trace))
            self.writer.write_header(RunConfig(engine=config, policies=tuple(self.stack_names)).to_dict(),
                                     list(self.stack_names), 0, source="vllm:KVLifeConnector")
            recorder = self.writer.record
        core = ConnectorCore(config, load_stack(self.stack_names), recorder=recorder, deadline_kinds=("store",))
        started = time.monotonic()
        if clock == "steps":
            def now() -> float:
                return float(api.pass_index)
        else:
            def now() -> float:
                return (time.monotonic() - started) * 1000.0  # the driver's clock: read here, never in the core
        lookups = DelayedLookups(int(extra.get("lookup_delay_steps", 1)), core.state.sync_lookup)
        api = ConnectorAPI(core, now, hash_of=block_hash_int, lookups=lookups, record_inputs=True)
        return api

    # ---- scheduler side: every call to the API ----------------------------------------------------
    @property
    def sched(self) -> ConnectorAPI:
        assert self.api is not None, "scheduler-side call on a worker-side connector"
        return self.api

    @property
    def core(self) -> ConnectorCore:
        return self.sched.core

    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        super().bind_gpu_block_pool(gpu_block_pool)
        if self.api is not None:
            self.api.core.lifecycle.device = _VllmPool(gpu_block_pool)

    def on_new_request(self, request: Request) -> None:
        self.sched.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self.sched.update_state_after_alloc(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return worker_metadata(self.sched.build_connector_meta(scheduler_output))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.sched.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.sched.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.sched.request_finished(request, block_ids[0])

    def take_events(self) -> Iterable[Any]:
        if self.api is not None:
            self.api.take_events()
        return ()

    def kvlife_pending_reason(self, request_id: str) -> str | None:
        """Why the last match answered None (``RecordingConnector`` records a deferral as no
        lookup): "lookup", "prefetch" or "defer"; None if it did not."""
        return self.core.pending_reason(request_id)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """The scheduler side's counters since the last call (vLLM adds them to the step's
        connector stats, which reach its Prometheus logger)."""
        if self.api is None:
            return None
        counts = stat_counts(self.api.core.state.stats)
        delta = {k: v - self._reported.get(k, 0) for k, v in counts.items()}
        self._reported = counts
        return KVLifeConnectorStats(data={k: v for k, v in delta.items() if v})

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVLifeConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[Any, Any], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics | None:
        return KVLifePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    # ---- worker side ----------------------------------------------------------------------
    worker_class: ClassVar[type[HostPoolWorker]] = HostPoolWorker

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
