"""Class-level connector hooks: KVLifeConnector's counters on vLLM's Prometheus metrics, and
RecordingConnector forwarding every class hook (KV layout, stats, metrics, piecewise CUDA
graphs, sleep mode) and its HMA claim to the wrapped connector's class."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Any

import pytest

try:
    importlib.metadata.version("vllm")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("vLLM is not installed: `bash scripts/install-vllm.sh`, then "
                "`.venv-vllm/bin/python -m pytest tests/vllm`", allow_module_level=True)

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging, KVConnectorProm  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector  # noqa: E402
from vllm_scenarios import BS, PREFIX, run_until, warm_tier  # noqa: E402

from kvlife.lifecycle.drivers.vllm.harness import SchedulerSpec, VllmDriver, build_config, build_scheduler  # noqa: E402
from kvlife.lifecycle.drivers.vllm.recording import RecordingConnector, RecordingConnectorHMA  # noqa: E402
from kvlife.lifecycle.drivers.vllm.worker import SimulatedWorker  # noqa: E402
from kvlife.vllm import KVLifeConnector  # noqa: E402

LABELS = ["model_name", "engine"]


def _prom(registry: CollectorRegistry) -> type[KVConnectorProm]:
    """vLLM's own ``KVConnectorProm``, its metrics in ``registry`` (not the process-wide one)."""

    def bound(cls: type[Any]) -> type[Any]:
        class Bound(cls):  # type: ignore[misc,valid-type]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, registry=registry, **kwargs)

        return Bound

    class Prom(KVConnectorProm):
        _gauge_cls = bound(Gauge)
        _counter_cls = bound(Counter)
        _histogram_cls = bound(Histogram)

    return Prom


def test_kvlife_counters_reach_vllms_prometheus_metrics(model_dir: Path) -> None:
    spec = SchedulerSpec(block_size=BS, num_blocks=10, connector="KVLifeConnector", module_path="kvlife.vllm",
                         extra={"stack": "", "host_blocks": 64, "clock": "steps"})
    driver = VllmDriver(build_scheduler(model_dir, spec), [SimulatedWorker(0, load_delay=2)])
    connector = driver.scheduler.connector
    reported: list[Any] = []  # what vLLM's scheduler took from the connector, step by step
    own = connector.get_kv_connector_stats

    def taken() -> Any:
        stats = own()
        reported.append(stats)
        return stats

    connector.get_kv_connector_stats = taken
    warm_tier(driver)  # r0 computes the prefix and stores it; a filler evicts it from the device
    driver.add("r1", PREFIX + [200, 201], 2)  # a tier hit: one load
    run_until(driver, lambda: driver.status("r1") is None)
    assert len(reported) >= len(driver.observations)  # once per step output, by vLLM's scheduler
    total = reported[0]
    for stats in reported[1:]:
        total = total.aggregate(stats)  # as vLLM aggregates a step's scheduler and worker stats
    data = total.to_dict()  # what vLLM's scheduler puts in SchedulerStats.kv_connector_stats
    core = connector.core.state.stats
    assert data["loads"] == core.loads == 1 and data["blocks_loaded"] == core.blocks_loaded == len(PREFIX) // BS
    assert data["stores"] == core.stores > 0 and data["sync_lookups"] == core.sync_lookups > 0
    # each report says what changed since the last: a later call, with nothing new, is empty
    assert own().is_empty()

    vllm_config, _ = build_config(model_dir, spec)
    registry = CollectorRegistry()
    prom = _prom(registry)(vllm_config, LABELS, {0: ["m", "0"]})
    prom.observe(data, 0)
    prom.observe(data, 0)  # counters add up over reports
    labels = {"model_name": "m", "engine": "0"}
    assert registry.get_sample_value("kvlife:loads_total", labels) == 2.0
    assert registry.get_sample_value("kvlife:blocks_stored_total", labels) == 2.0 * data["blocks_stored"]
    assert registry.get_sample_value("kvlife:preemptions_total", labels) == 0.0
    # vLLM's log line reads the same stats through the class hook
    logging = KVConnectorLogging(vllm_config.kv_transfer_config)
    logging.observe(data)
    assert logging.transfer_stats_accumulator is not None
    assert logging.transfer_stats_accumulator.reduce()["loads"] == 1


def _recording_config(model_dir: Path, inner: str, record_cls: str = "RecordingConnector") -> Any:
    spec = SchedulerSpec(block_size=BS, num_blocks=10, connector=record_cls, module_path="kvlife.vllm",
                         extra={"record": {"inner": inner}, "cpu_bytes_to_use": 1 << 24})
    config, _ = build_config(model_dir, spec)
    return config


def test_recording_connector_forwards_every_class_hook(model_dir: Path) -> None:
    config = _recording_config(model_dir, "OffloadingConnector")
    transfer = config.kv_transfer_config
    extra = transfer.kv_connector_extra_config
    assert RecordingConnector.get_required_kvcache_layout(config) == \
        OffloadingConnector.get_required_kvcache_layout(config) == "LBHNC"
    assert RecordingConnector.requires_piecewise_for_cudagraph(extra) == \
        OffloadingConnector.requires_piecewise_for_cudagraph(extra)
    assert RecordingConnector.supports_sleep_mode(transfer) == OffloadingConnector.supports_sleep_mode(transfer)
    # stats: vLLM rebuilds them in its logger process from the data alone, so the data says
    # which class built them; the inner connector's class builds them there
    stats = RecordingConnector.build_kv_connector_stats({"__kvlife_inner__": "OffloadingConnector"})
    inner = OffloadingConnector.build_kv_connector_stats({})
    assert stats is not None and inner is not None and type(stats) is type(inner)
    registry = CollectorRegistry()
    prom = _prom(registry)(config, LABELS, {0: ["m", "0"]})
    assert prom.prom_metrics is not None
    own = {name for metric in registry.collect() for name in [metric.name]}
    # OffloadingConnector's own metrics are registered (not kvlife's)
    assert own and not any(name.startswith("kvlife") for name in own)


def test_recording_connector_claims_hma_only_through_its_hma_class(model_dir: Path) -> None:
    assert not supports_hma(RecordingConnector) and supports_hma(RecordingConnectorHMA)
    assert supports_hma(OffloadingConnector) and supports_hma(KVLifeConnector)
    config = _recording_config(model_dir, "OffloadingConnector", "RecordingConnectorHMA")
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    RecordingConnectorHMA(config, KVConnectorRole.SCHEDULER, build_config(
        model_dir, SchedulerSpec(block_size=BS, num_blocks=10))[1])
    # an inner connector without HMA is refused by the HMA class
    no_hma = _recording_config(model_dir, "ExampleConnector", "RecordingConnectorHMA")
    with pytest.raises(ValueError, match="does not support HMA"):
        RecordingConnectorHMA(no_hma, KVConnectorRole.SCHEDULER, None)
