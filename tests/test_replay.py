"""Exact replay, divergence reporting, what-if, and bad input."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from kvlife.lifecycle.cli.main import main
from kvlife.lifecycle.config import RunConfig
from kvlife.lifecycle.drivers.runner import run_workload
from kvlife.lifecycle.traces.replay import config_from_header, replay, workload_from_trace
from kvlife.lifecycle.traces.trace import SCHEMA_VERSION, TraceError
from kvlife.lifecycle.workloads.synthetic import synthetic_workload


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("replay") / "run.jsonl"
    config = RunConfig()
    workload = synthetic_workload(seed=3, num_requests=60, block_tokens=config.engine.block_tokens,
                                  arrival_rate_per_s=8.0)
    run_workload(config, workload, trace_path=path)
    return path


def _lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines()


def _write(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_config_round_trips_through_the_header(trace: Path) -> None:
    header = orjson.loads(_lines(trace)[0])
    assert orjson.loads(orjson.dumps(config_from_header(header).to_dict())) == header["config"]


def test_exact_replay_is_identical(trace: Path) -> None:
    result = replay(trace)
    assert result.identical, result.divergence
    assert result.lines == len(_lines(trace))
    assert result.inputs > 60


def test_first_divergence_names_line_expected_and_got(trace: Path, tmp_path: Path) -> None:
    lines = _lines(trace)
    index = next(i for i, raw in enumerate(lines) if b'"kind":"transition"' in raw and i > 50)
    record = orjson.loads(lines[index])
    record["reason"] = "tampered"
    lines[index] = orjson.dumps(record)
    result = replay(_write(tmp_path / "t.jsonl", lines))
    assert result.divergence is not None
    assert result.divergence.line == index + 1
    assert "tampered" in result.divergence.expected
    assert "tampered" not in result.divergence.got


def test_missing_records_at_the_end_diverge(trace: Path, tmp_path: Path) -> None:
    lines = _lines(trace)
    last_input = max(i for i, raw in enumerate(lines) if b'"kind":"input"' in raw)
    cut = _write(tmp_path / "cut.jsonl", lines[: last_input + 1])
    result = replay(cut)
    if len(lines) > last_input + 1:
        assert result.divergence is not None and result.divergence.expected == "<end of trace>"


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda ls: ls[1:], "missing header"),
        (lambda ls: [ls[0].replace(f'"schema":{SCHEMA_VERSION}'.encode(), b'"schema":99')] + ls[1:], "newer"),
        (lambda ls: ls[:3] + [b"{not json"] + ls[3:], "not JSON"),
        (lambda ls: ls[:3] + [b'{"kind":"mystery","t":1}'] + ls[3:], "unknown record kind"),
        (lambda ls: ls[:1] + [b'{"kind":"input","type":"teleport","t":0}'] + ls[1:], "unknown input event"),
    ],
)
def test_bad_input_is_one_clear_error_with_line(trace: Path, tmp_path: Path, mutate: object,
                                                 message: str, capsys: pytest.CaptureFixture[str]) -> None:
    bad = _write(tmp_path / "bad.jsonl", mutate(_lines(trace)))  # type: ignore[operator]
    with pytest.raises(TraceError, match=message):
        replay(bad)
    assert main(["replay", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvlife: error:") and err.count("\n") == 1
    if message != "newer" and message != "missing header":
        assert f"{bad}:4" in err or f"{bad}:2" in err


def test_cli_replay_reports_identical_and_divergence(trace: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(trace)]) == 0
    assert capsys.readouterr().out.startswith("identical")
    lines = _lines(trace)
    lines[5] = lines[5].replace(b'"kind":"decision"', b'"kind":"decision","extra":1') \
        if b'"kind":"decision"' in lines[5] else lines[5] + b" "
    lines[5] = orjson.dumps({**orjson.loads(lines[5]), "zz": 1})
    assert main(["replay", str(_write(tmp_path / "d.jsonl", lines))]) == 1
    out = capsys.readouterr().out
    assert "diverged at line 6" in out and "expected:" in out and "got:" in out


def test_workload_is_recovered_from_the_trace(trace: Path) -> None:
    config, workload = workload_from_trace(trace)
    assert len(workload) == 60
    original = synthetic_workload(seed=3, num_requests=60, block_tokens=config.engine.block_tokens,
                                  arrival_rate_per_s=8.0)
    by_id = {w.request_id: w for w in original}
    for w in workload:
        assert w.input_length == by_id[w.request_id].input_length
        assert w.output_length == by_id[w.request_id].output_length
        assert w.hash_ids == by_id[w.request_id].hash_ids


def test_what_if_prints_both_runs(trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(trace), "--stack", "kvlife.specs.model_check:AsyncLookups"]) == 0
    out = capsys.readouterr().out
    assert "recorded: baseline" in out and "what-if: kvlife.specs.model_check:AsyncLookups" in out
    lookups = next(line for line in out.splitlines() if line.startswith("lookups async"))
    assert lookups.split()[2] == "0" and lookups.split()[3] != "0"


@pytest.mark.parametrize(("broken", "message"), [
    (b"this is not json", "not JSON"),
    (b'{"kind":"weird"}', "unknown record kind 'weird'"),
    (b'{"kind":"transition","t":0.0,"req"', "not JSON"),
])
def test_broken_line_mid_trace_is_an_error_not_a_divergence(trace: Path, tmp_path: Path, broken: bytes,
                                                             message: str) -> None:
    from kvlife.lifecycle.traces.trace import TraceError

    lines = _lines(trace)
    index = next(i for i, raw in enumerate(lines) if b'"kind":"transition"' in raw and i > 20)
    path = _write(tmp_path / "broken.jsonl", lines[:index] + [broken] + lines[index + 1:])
    with pytest.raises(TraceError) as info:
        replay(path)
    assert info.value.line == index + 1 and message in str(info.value)


def test_what_if_takes_a_comma_stack(trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(trace), "--stack", "kvlife.specs.model_check:AsyncLookups,shared-loads"]) == 0
    assert "what-if: kvlife.specs.model_check:AsyncLookups, shared-loads" in capsys.readouterr().out
    assert main(["replay", str(trace), "--stack", "baseline"]) == 0
    assert "what-if: baseline" in capsys.readouterr().out
