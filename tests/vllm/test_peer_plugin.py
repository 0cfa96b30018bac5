"""The peer suite's pytest plugin (scripts/vllm_peer/plugin.py) on vLLM 0.33's real factory and
Scheduler: what the factory builds is wrapped in RecordingConnector, or replaced by
KVLifeConnector."""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

import pytest

try:
    importlib.metadata.version("vllm")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("vLLM is not installed: `bash scripts/install-vllm.sh`, then "
                "`.venv-vllm/bin/python -m pytest tests/vllm`", allow_module_level=True)

from vllm_scenarios import OFFLOADING, records, run_a_tier_hit  # noqa: E402

from kvlife.lifecycle.drivers.vllm.harness import VllmDriver, build_config, build_scheduler  # noqa: E402
from kvlife.lifecycle.drivers.vllm.worker import OffloadingSimulatedWorker  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from vllm_peer.plugin import Connectors  # noqa: E402


def test_record_mode_wraps_what_the_factory_builds(model_dir: Path, tmp_path: Path) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

    from kvlife.vllm import RecordingConnectorHMA

    peer = Connectors("record", tmp_path)
    peer.install()
    try:
        scheduler = build_scheduler(model_dir, OFFLOADING)
    finally:
        peer.uninstall()
    connector = scheduler.connector
    assert isinstance(connector, RecordingConnectorHMA)  # OffloadingConnector supports HMA
    assert type(connector.inner) is OffloadingConnector
    assert peer.built == ["RecordingConnectorHMA(OffloadingConnector)"]
    run_a_tier_hit(VllmDriver(scheduler, [OffloadingSimulatedWorker(0, load_delay=2)]))
    connector.close()
    (trace,) = tmp_path.glob("*.trace.jsonl")
    recs = records(trace)
    assert recs[0]["source"] == "vllm:OffloadingConnector"
    assert {r["op"] for r in recs if r["kind"] == "job"} == {"load", "store"}  # the inner's jobs, recorded
    # A class-level hook of the wrapper answers as the inner connector's class does.
    config, _ = build_config(model_dir, OFFLOADING)
    wrapped = connector._vllm_config
    assert type(connector).get_required_kvcache_layout(wrapped) == \
        OffloadingConnector.get_required_kvcache_layout(config) is not None
    # Uninstalled, the factory builds the connector as configured again.
    assert type(build_scheduler(model_dir, OFFLOADING).connector) is OffloadingConnector


def test_kvlife_mode_puts_kvlife_connector_in_place(model_dir: Path, tmp_path: Path) -> None:
    from kvlife.vllm import KVLifeConnector

    peer = Connectors("kvlife", tmp_path)
    peer.install()
    try:
        scheduler = build_scheduler(model_dir, OFFLOADING)
    finally:
        peer.uninstall()
    assert type(scheduler.connector) is KVLifeConnector
    assert scheduler.vllm_config.kv_transfer_config.kv_connector == "OffloadingConnector"  # the test's own config
    scheduler.connector.shutdown()
    (trace,) = tmp_path.glob("*.trace.jsonl")
    assert records(trace)[0]["source"] == "vllm:KVLifeConnector"
