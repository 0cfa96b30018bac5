"""Perfetto/Chrome trace export and plots."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from kvlife.lifecycle.cli.main import main
from kvlife.lifecycle.config import EngineConfig, RunConfig
from kvlife.lifecycle.drivers.runner import run_workload
from kvlife.lifecycle.traces.export import chrome_trace, read_timeline
from kvlife.lifecycle.workloads.synthetic import synthetic_workload


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("export") / "run.jsonl"
    config = RunConfig(engine=EngineConfig(ranks=2))
    run_workload(config, synthetic_workload(seed=2, num_requests=30, block_tokens=512), trace_path=path)
    return path


def test_chrome_trace_has_a_track_per_request_and_a_slice_per_state(trace: Path) -> None:
    timeline = read_timeline(trace)
    data = chrome_trace(timeline)
    events = data["traceEvents"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {f"req-{i}" for i in range(30)} <= names or len(names & set(timeline.segments)) == 30
    assert {"ticks", "steps"} <= names
    slices = [e for e in events if e["ph"] == "X" and e["pid"] == 3]
    transitions = sum(1 for raw in trace.read_bytes().splitlines() if b'"kind":"transition"' in raw)
    finished = sum(1 for segs in timeline.segments.values() if segs[-1].state == "finished")
    assert len(slices) == transitions + len(timeline.segments) - finished  # one per non-final state
    for e in events:
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] >= 0
    jobs = [e for e in events if e["ph"] == "X" and e["pid"] == 2]
    assert jobs and all(e["name"].split()[0] in ("load", "store") for e in jobs)
    # overlapping jobs never share a lane
    by_lane: dict[int, list[tuple[float, float]]] = {}
    for e in jobs:
        by_lane.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
    for spans in by_lane.values():
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))


def test_cli_export_writes_json(trace: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    assert main(["export", str(trace), "--perfetto", str(out)]) == 0
    data = orjson.loads(out.read_bytes())
    assert data["displayTimeUnit"] == "ms" and data["traceEvents"]


def test_cli_plot_writes_png(trace: Path, tmp_path: Path) -> None:
    out = tmp_path / "out.png"
    assert main(["plot", str(trace), str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_trace_is_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"kind":"input","type":"tick","t":0}\n')
    assert main(["export", str(bad), "--perfetto", str(tmp_path / "o.json")]) == 2
    assert "missing header" in capsys.readouterr().err
