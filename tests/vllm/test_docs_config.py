"""Every ``--kv-transfer-config`` in docs/vllm.md builds vLLM's real Scheduler with its connector.

So the documented way to enable KVLifeConnector (and RecordingConnector) in ``vllm serve``
cannot drift from what vLLM 0.33 accepts.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
from pathlib import Path

import pytest

try:
    importlib.metadata.version("vllm")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("vLLM is not installed: `bash scripts/install-vllm.sh`, then "
                "`.venv-vllm/bin/python -m pytest tests/vllm`", allow_module_level=True)

from kvlife.lifecycle.drivers.vllm.harness import SchedulerSpec, build_scheduler  # noqa: E402

DOC = Path(__file__).resolve().parents[2] / "docs" / "vllm.md"
CONFIGS = [json.loads(m) for m in re.findall(r"--kv-transfer-config '(\{.*?\})'", DOC.read_text(), re.DOTALL)]


def test_the_docs_show_both_connectors() -> None:
    assert {c["kv_connector"] for c in CONFIGS} == {"KVLifeConnector", "RecordingConnector"}


@pytest.mark.parametrize("config", CONFIGS, ids=[f"{c['kv_connector']}-{i}" for i, c in enumerate(CONFIGS)])
def test_documented_kv_transfer_config_builds_the_scheduler(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, config: dict[str, object]
) -> None:
    monkeypatch.chdir(tmp_path)  # a recording writes its trace where vllm serve runs
    known = {"kv_connector", "kv_connector_module_path", "kv_role", "kv_connector_extra_config",
             "kv_load_failure_policy"}
    assert set(config) <= known and config["kv_role"] == "kv_both"
    extra = config["kv_connector_extra_config"]
    assert isinstance(extra, dict)
    failure = config.get("kv_load_failure_policy")
    spec = SchedulerSpec(connector=str(config["kv_connector"]), module_path=str(config["kv_connector_module_path"]),
                         extra=extra, kv_load_failure_policy=None if failure is None else str(failure))
    scheduler = build_scheduler(model_dir, spec)
    connector = scheduler.connector
    assert type(connector).__name__ == config["kv_connector"]
    if config["kv_connector"] == "KVLifeConnector":
        assert connector.stack_names == [s.strip() for s in str(extra["stack"]).split(",")]
        assert connector.core.state.tiers["host"].capacity == extra["host_blocks"]
        timeout = extra.get("store_timeout_ms")
        assert connector.core.config.transfer_deadline_ms == (None if timeout is None else float(timeout))
    else:
        assert type(connector.inner).__name__ == extra["record"]["inner"]  # type: ignore[index]
        connector.close()
        assert (tmp_path / extra["record"]["trace"]).exists()  # type: ignore[index]
    if failure is not None:
        assert scheduler.recompute_kv_load_failures == (failure == "recompute")
