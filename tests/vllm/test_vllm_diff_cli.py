"""``kvlife vllm-diff`` on vLLM 0.33: a workload agrees step by step (exit 0), and a
difference is reported with both sides' state (exit 1)."""

from __future__ import annotations

import importlib.metadata
import json
from typing import Any

import attrs
import pytest

try:
    importlib.metadata.version("vllm")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("vLLM is not installed: `bash scripts/install-vllm.sh`, then "
                "`.venv-vllm/bin/python -m pytest tests/vllm`", allow_module_level=True)

from kvlife.lifecycle.cli.main import main  # noqa: E402
from kvlife.lifecycle.drivers.vllm import differential  # noqa: E402

ARGS = ["vllm-diff", "--limit", "40", "--offset", "500", "--async-scheduling", "--workers", "2",
        "--device-blocks", "60", "--max-prompt", "800", "--abort-rate", "0.2", "--stack", "shared-loads"]


def test_a_workload_agrees_step_by_step(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*ARGS, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kind"] == "vllm-diff" and out["steps"] == out["identical"] > 40
    (run,) = out["runs"]
    assert run["first"] is None


def test_a_difference_is_exit_1_with_both_sides_state(capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    real = differential.run_kvlife

    def one_step_off(*args: Any, **kwargs: Any) -> Any:
        observations = real(*args, **kwargs)
        step = observations[5]
        observations[5] = attrs.evolve(step, loads_started=step.loads_started + 1)
        return observations

    monkeypatch.setattr(differential, "run_kvlife", one_step_off)
    assert main(ARGS) == 1
    out = capsys.readouterr().out
    assert "steps identical" in out and "first difference at step 6" in out
