"""kvlife explain: one request's life, each state, how long, and why."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvlife.lifecycle.cli.main import main
from kvlife.lifecycle.config import RunConfig
from kvlife.lifecycle.drivers.runner import run_workload
from kvlife.lifecycle.traces.explain import explain
from kvlife.lifecycle.workloads.synthetic import synthetic_workload


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("explain") / "run.jsonl"
    run_workload(RunConfig(), synthetic_workload(seed=4, num_requests=20, block_tokens=512), trace_path=path)
    return path


def test_every_state_with_duration_and_reason(trace: Path) -> None:
    lines = explain(trace, "req-3")
    text = "\n".join(lines)
    assert lines[0].startswith("req-3: arrived at t=")
    assert "waiting" in text and "running" in text and "finished" in text
    assert "-> admitted:" in text
    assert "decision lookup_mode: 'sync' by baseline" in text
    assert lines[-1].startswith("time by state:") and "total" in lines[-1]


def test_durations_add_up(trace: Path) -> None:
    last = explain(trace, "req-0")[-1]
    parts = last.removeprefix("time by state: ").split("; total ")
    total = float(parts[1].removesuffix(" ms").replace(",", ""))
    summed = sum(float(p.split()[1].replace(",", "")) for p in parts[0].split(", "))
    assert abs(total - summed) < 0.2


def test_unknown_request_is_one_line_error(trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", str(trace), "req-999"]) == 2
    err = capsys.readouterr().err
    assert "req-999" in err and err.count("\n") == 1
    assert main(["explain", str(trace), "req-1"]) == 0
    assert "req-1: arrived" in capsys.readouterr().out
