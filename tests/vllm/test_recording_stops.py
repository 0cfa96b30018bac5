"""RecordingConnector never breaks the connector it wraps: an error while recording ends the
recording (a ``recording_stopped`` warning closes the trace), and vLLM and the inner connector
run on as if nothing were recorded."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

try:
    importlib.metadata.version("vllm")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("vLLM is not installed: `bash scripts/install-vllm.sh`, then "
                "`.venv-vllm/bin/python -m pytest tests/vllm`", allow_module_level=True)

from vllm_scenarios import BS, OFFLOADING, records, run_a_tier_hit  # noqa: E402

from kvlife.lifecycle.drivers.vllm.harness import SchedulerSpec, VllmDriver, build_scheduler  # noqa: E402
from kvlife.lifecycle.drivers.vllm.worker import OffloadingSimulatedWorker  # noqa: E402


def test_a_recording_error_stops_the_recording_not_the_connector(model_dir: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    trace = tmp_path / "stopped.jsonl"
    extra = {**OFFLOADING.extra, "record": {"inner": "OffloadingConnector", "trace": str(trace)}}
    spec = SchedulerSpec(block_size=BS, num_blocks=10, connector="RecordingConnectorHMA", extra=extra)
    scheduler = build_scheduler(model_dir, spec)
    connector = scheduler.connector
    api = connector.api

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a sequence the core does not model")

    monkeypatch.setattr(api, "update_state_after_alloc", broken)
    driver = VllmDriver(scheduler, [OffloadingSimulatedWorker(0, load_delay=2)])
    run_a_tier_hit(driver)  # vLLM never sees the error: every request runs and finishes
    assert connector.api is None and connector.writer is None  # recording over, trace closed
    last = records(trace)[-1]
    assert (last["kind"], last["what"], last["call"]) == ("warning", "recording_stopped", "update_state_after_alloc")
    assert "a sequence the core does not model" in last["error"]
    # The inner connector still served every call: r1 loaded what r0 stored.
    assert any(obs.external_hits.get("r1") for obs in driver.observations)
