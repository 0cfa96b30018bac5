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


# ---- OpenTelemetry (OTLP/JSON) ---------------------------------------------------------------
def _as_proto_json(data: object) -> object:
    """OTLP/JSON writes ids in hex; protobuf's own JSON mapping takes bytes in base64."""
    import base64

    if isinstance(data, dict):
        return {k: base64.b64encode(bytes.fromhex(v)).decode() if k in ("traceId", "spanId", "parentSpanId")
                else _as_proto_json(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_as_proto_json(v) for v in data]
    return data


def test_otlp_export_is_a_valid_export_request_with_a_span_per_request(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    json_format = pytest.importorskip("google.protobuf.json_format")
    service = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")
    trace, out = tmp_path / "t.jsonl", tmp_path / "spans.json"
    assert main(["run", "--limit", "100", "--device-blocks", "200", "--tier", "host=200", "--tier", "disk=4000",
                 "--stack", "async-lookup,shared-loads", "--trace", str(trace)]) == 0
    assert main(["export", str(trace), "--otlp", str(out)]) == 0
    assert "spans" in capsys.readouterr().out
    data = orjson.loads(out.read_bytes())
    # Strict: an unknown field, a wrong type or a bad enum fails the parse.
    request = json_format.Parse(orjson.dumps(_as_proto_json(data)).decode(), service.ExportTraceServiceRequest())
    spans = list(request.resource_spans[0].scope_spans[0].spans)
    roots = [s for s in spans if not s.parent_span_id]
    timeline = read_timeline(trace)
    assert sorted(s.name for s in roots) == sorted(f"request {rid}" for rid in timeline.segments)
    assert len({s.trace_id for s in roots}) == len(roots) and all(len(s.trace_id) == 16 for s in spans)
    by_id = {s.span_id: s for s in roots}
    states = [s for s in spans if s.parent_span_id]
    non_final = sum(1 for segs in timeline.segments.values() for seg in segs if seg.state != "finished")
    assert len(states) == non_final
    for span in states:
        parent = by_id[span.parent_span_id]
        assert span.trace_id == parent.trace_id
        assert parent.start_time_unix_nano <= span.start_time_unix_nano <= span.end_time_unix_nano \
            <= parent.end_time_unix_nano
    decisions = sum(1 for raw in trace.read_bytes().splitlines() if b'"kind":"decision"' in raw)
    assert sum(len(s.events) for s in states) == decisions > 0
    # Tier attribution and latencies as attributes, equal to the run's own rows.
    from kvlife.lifecycle.traces.explain import trace_rows

    rows = {r.request: r for r in trace_rows(trace)}
    for root in roots:
        attributes = {a.key: a.value for a in root.attributes}
        row = rows[attributes["kvlife.request.id"].string_value]
        assert attributes["kvlife.latency.ttft_ms"].double_value == row.ttft_ms
        assert attributes["kvlife.prompt_tokens_by_source.disk"].int_value == row.source("disk")
        assert attributes["kvlife.prompt_tokens_by_source.local_compute"].int_value == row.source("local_compute")
    assert any(r.source("disk") for r in rows.values())
