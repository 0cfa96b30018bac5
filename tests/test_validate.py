"""kvlife validate: legal traces pass; each kind of breakage is found, located and counted."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from lifecycle.cli import main
from lifecycle.config import EngineConfig, RunConfig, TierConfig
from lifecycle.runner import run_workload
from lifecycle.synthetic import synthetic_workload
from lifecycle.trace import TraceError
from lifecycle.validate import validate


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("validate") / "run.jsonl"
    # Two ranks and a small device: reports per rank, loads, stores and preemptions.
    config = RunConfig(engine=EngineConfig(ranks=2, device_blocks=300,
                                           tiers=(TierConfig("host", capacity_blocks=400),)))
    workload = synthetic_workload(seed=5, num_requests=80, block_tokens=512, arrival_rate_per_s=20.0)
    run_workload(config, workload, trace_path=path)
    return path


def _lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines()


def _write(path: Path, lines: list[bytes], newline: bool = True) -> Path:
    path.write_bytes(b"\n".join(lines) + (b"\n" if newline else b""))
    return path


def test_simulated_trace_is_valid(trace: Path) -> None:
    report = validate(trace)
    assert report.ok, report.format()
    assert b'"type":"transfer_report"' in trace.read_bytes()


def test_illegal_transition_named_and_rest_counted(trace: Path, tmp_path: Path) -> None:
    lines = _lines(trace)
    hits = [i for i, raw in enumerate(lines) if b'"trigger":"completed"' in raw]
    for i in hits[:3]:
        record = orjson.loads(lines[i])
        record["trigger"] = "load_done"  # running -> finished by load_done: not in the spec
        lines[i] = orjson.dumps(record)
    report = validate(_write(tmp_path / "bad.jsonl", lines))
    ones = [f for f in report.findings if f.invariant == 1]
    assert len(ones) >= 3
    assert report.findings[0].line == hits[0] + 1
    assert "first offending line: line" in report.format()


def test_job_done_before_every_rank_reported(trace: Path, tmp_path: Path) -> None:
    lines = _lines(trace)
    # Drop the first report of the first job that has two: the job is then counted done
    # after one rank only.
    for i, raw in enumerate(lines):
        if b'"type":"transfer_report"' in raw:
            del lines[i]
            break
    report = validate(_write(tmp_path / "bad.jsonl", lines))
    assert any(f.invariant == 3 and "still to report" in f.message for f in report.findings), report.format()


def test_stale_lookup_answer_applied(tmp_path: Path) -> None:
    header = {"kind": "header", "schema": 1, "config": RunConfig().to_dict(), "policies": ["baseline"], "seed": 0}
    records = [
        header,
        {"kind": "input", "type": "arrival", "t": 0.0, "request_id": "a", "prompt_tokens": 10,
         "block_hashes": [], "resumable": False},
        {"kind": "input", "type": "tick", "t": 1.0},
        {"kind": "transition", "t": 1.0, "req": "a", "from": "waiting", "to": "lookup_pending",
         "trigger": "lookup_submitted", "reason": "r"},
        {"kind": "input", "type": "lookup_answer", "t": 2.0, "request_id": "a", "epoch": 7, "tiers": []},
        {"kind": "transition", "t": 2.0, "req": "a", "from": "lookup_pending", "to": "waiting",
         "trigger": "lookup_answered", "reason": "r"},
        {"kind": "input", "type": "abort", "t": 3.0, "request_id": "a"},
        {"kind": "transition", "t": 3.0, "req": "a", "from": "waiting", "to": "finished",
         "trigger": "aborted", "reason": "r"},
    ]
    path = _write(tmp_path / "t.jsonl", [orjson.dumps(r) for r in records])
    report = validate(path)
    assert [(f.invariant, f.line) for f in report.findings] == [(4, 6)]


def test_stranded_request_and_unreported_job_at_end(tmp_path: Path) -> None:
    config = RunConfig(engine=EngineConfig(ranks=2))
    header = {"kind": "header", "schema": 1, "config": config.to_dict(), "policies": ["baseline"], "seed": 0}
    records = [
        header,
        {"kind": "input", "type": "arrival", "t": 0.0, "request_id": "a", "prompt_tokens": 10,
         "block_hashes": [], "resumable": False},
        {"kind": "input", "type": "tick", "t": 1.0},
        {"kind": "transition", "t": 1.0, "req": "a", "from": "waiting", "to": "lookup_pending",
         "trigger": "lookup_submitted", "reason": "r"},
        {"kind": "job", "t": 1.0, "job": 0, "op": "store", "req": "a", "blocks": 1, "tiers": {"host": 1}},
        {"kind": "input", "type": "transfer_report", "t": 2.0, "job_id": 0, "rank": 1, "failed": []},
    ]
    report = validate(_write(tmp_path / "s.jsonl", [orjson.dumps(r) for r in records]))
    messages = [f.message for f in report.findings if f.invariant == 7]
    assert any("ranks [0] never reported" in m for m in messages)
    assert any("a stranded in lookup_pending" in m for m in messages)


def test_format_findings_are_counted_not_fatal(trace: Path, tmp_path: Path) -> None:
    lines = _lines(trace)
    lines[3:3] = [b"{oops", b'{"kind":"mystery","t":0}', b'{"kind":"input","type":"warp","t":0}']
    report = validate(_write(tmp_path / "f.jsonl", lines))
    zeros = [f for f in report.findings if f.invariant == 0]
    assert [f.line for f in zeros] == [4, 5, 6]


def test_truncated_last_line_is_reported_and_rest_used(trace: Path, tmp_path: Path) -> None:
    data = trace.read_bytes()
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes(data[: len(data) - 25])
    report = validate(cut)
    assert report.truncated_line == len(_lines(trace))
    assert report.ok, report.format()  # no end-of-run checks on a run that did not end
    assert "truncated last line" in report.format()


def test_missing_header_is_a_finding(trace: Path, tmp_path: Path) -> None:
    report = validate(_write(tmp_path / "h.jsonl", _lines(trace)[1:]))
    assert report.findings[0].invariant == 0 and report.findings[0].line == 1
    assert "missing header" in report.findings[0].message


def test_newer_schema_is_an_error(trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = _lines(trace)
    lines[0] = lines[0].replace(b'"schema":1', b'"schema":42')
    path = _write(tmp_path / "n.jsonl", lines)
    with pytest.raises(TraceError, match="newer"):
        validate(path)
    assert main(["validate", str(path)]) == 2
    assert "kvlife: error:" in capsys.readouterr().err


def test_cli_exit_codes(trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(trace)]) == 0
    assert "0 findings" in capsys.readouterr().out
    lines = _lines(trace)
    lines.insert(2, b"garbage")
    assert main(["validate", str(_write(tmp_path / "g.jsonl", lines))]) == 1
    assert "line 3" in capsys.readouterr().out
