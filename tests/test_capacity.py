"""``kvlife capacity``: SLO specs, the search, and a threshold known by hand."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvlife.lifecycle.cli.main import main
from kvlife.lifecycle.config import RunConfig
from kvlife.lifecycle.drivers.physics import resolve
from kvlife.lifecycle.sweeps.capacity import (
    AT_LEAST,
    BELOW,
    EXACT,
    Capacity,
    Objective,
    Probe,
    Search,
    parse_slo,
    relative,
)

PERIOD_MS = 1000.0
PROMPT = 8192  # = engine.max_batched_tokens: one prompt fills one step's token budget
REQUESTS = 200


def test_parse_slo() -> None:
    assert parse_slo("ttft_p90=2000ms,tpot_p90=100ms") == (Objective("ttft", 90.0, 2000.0),
                                                           Objective("tpot", 90.0, 100.0))
    assert parse_slo(" ttft_p99.9 = 1.5s ") == (Objective("ttft", 99.9, 1500.0),)


@pytest.mark.parametrize(("text", "message"), [
    ("ttft_p90=2000", "'ttft_p90=2000': expected a duration with its unit, e.g. 2000ms or 2s"),
    ("e2e_p90=2s", "'e2e_p90=2s': unknown metric 'e2e'; expected one of ttft, tpot"),
    ("ttft_p0=2s", "'ttft_p0=2s': percentile must be in (0, 100], got 0"),
    ("ttft_p101=2s", "'ttft_p101=2s': percentile must be in (0, 100], got 101"),
    ("ttft_p90=0ms", "'ttft_p90=0ms': the limit must be a positive finite duration"),
    ("ttft_p90=2s,ttft_p90=3s", "ttft_p90 given twice"),
    ("ttft=2s", "'ttft=2s': expected METRIC_pQ=VALUE with METRIC one of ttft, tpot (e.g. ttft_p90=2000ms)"),
    ("ttft_p90=2s,", "expected METRIC_pQ=VALUE[ms|s],..."),
])
def test_a_bad_slo_is_one_line_exit_2(capsys: pytest.CaptureFixture[str], text: str, message: str) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["capacity", "--limit", "5", "--stack", "baseline", "--slo", text])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvlife capacity: error: argument --slo: {message}"), err
    assert err.count("\n") == 1


def _probe(scale: float, meets: bool) -> Probe:
    return Probe(scale, {}, 1.0, 1.0, 0, () if meets else ("too slow",), "")


@pytest.mark.parametrize("threshold", [0.02, 0.05, 0.2621, 1.0, 3.7, 17.0, 63.0])
@pytest.mark.parametrize("precision", [0.05, 0.01])
def test_the_search_brackets_any_threshold_within_its_precision(threshold: float, precision: float) -> None:
    search = Search(precision=precision)
    while (scale := search.next_scale()) is not None:
        search.record(_probe(scale, scale <= threshold))
    assert search.kind == EXACT
    assert search.low is not None and search.high is not None
    assert search.low <= threshold < search.high <= search.low * (1 + precision)
    assert len(search.probes) <= 6 + math.ceil(math.log2(math.log(2) / math.log1p(precision))) + 1


def test_the_search_reports_bounds_at_its_ends() -> None:
    search = Search(max_scale=8.0)
    while (scale := search.next_scale()) is not None:
        search.record(_probe(scale, True))
    assert (search.kind, search.low, search.high) == (AT_LEAST, 8.0, None)
    assert [p.scale for p in search.probes] == [1.0, 2.0, 4.0, 8.0]
    search = Search(min_scale=0.25)
    while (scale := search.next_scale()) is not None:
        search.record(_probe(scale, False))
    assert (search.kind, search.low, search.high) == (BELOW, None, 0.25)


def _capacity(kind: str, scale: float | None, high: float | None = None) -> Capacity:
    return Capacity("s", kind, scale, scale, high, 0.05, None, ())


def test_relative_capacity_keeps_bounds() -> None:
    ref = _capacity(EXACT, 2.0, 2.1)
    assert relative(_capacity(EXACT, 3.0, 3.1), ref) == (1.5, EXACT)
    assert relative(_capacity(AT_LEAST, 8.0), ref) == (4.0, AT_LEAST)
    assert relative(_capacity(BELOW, None, 0.5), ref) == (0.25, BELOW)
    assert relative(_capacity(EXACT, 1.0, 1.05), _capacity(AT_LEAST, 4.0)) == (0.25, "at_most")
    assert relative(_capacity(AT_LEAST, 8.0), _capacity(AT_LEAST, 4.0)) == (None, None)


def _fixed_workload(path: Path) -> Path:
    """Requests of PROMPT tokens each (no shared prefix, one output token) every PERIOD_MS: one
    request is one prefill step of the whole token budget, so the engine serves one request per
    step time T and the queue grows as soon as arrivals come faster than one per T."""
    with path.open("w") as f:
        for i in range(REQUESTS):
            hashes = list(range(i * PROMPT // 512, (i + 1) * PROMPT // 512))
            f.write(json.dumps({"timestamp": i * PERIOD_MS, "input_length": PROMPT, "output_length": 1,
                                "hash_ids": hashes}) + "\n")
    return path


def test_capacity_finds_the_threshold_of_a_saturating_workload(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    workload = _fixed_workload(tmp_path / "fixed.jsonl")
    # By hand: T is the step cost of one 8,192-token prefill on the default hardware and model;
    # arrivals PERIOD_MS / scale apart outrun it from scale PERIOD_MS / T on (3.74 here).
    step_ms = resolve(RunConfig())[1].cost.step_ms([(PROMPT, 0)])
    threshold = PERIOD_MS / step_ms
    assert 1 < threshold < 16
    precision = 0.02
    argv = ["capacity", "--workload", str(workload), "--tier", "host=0", "--stack", "baseline",
            "--slo", f"ttft_p90={10 * step_ms:.3f}ms", "--precision", str(precision), "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert list(report)[:2] == ["kind", "schema"] and report["kind"] == "capacity"
    assert report["workload"]["requests_per_s"] == pytest.approx(1000.0 / PERIOD_MS)
    (result,) = report["results"]
    assert result["kind"] == EXACT and result["relative"] == {"value": 1.0, "kind": EXACT}
    found = result["time_scale"]
    # The stability rule allows a queue that grows by up to 100 ms over the run: with 200
    # requests that is 0.2 % past the true threshold.
    assert threshold * (1 - precision) <= found <= threshold * 1.003
    assert found <= result["high"] <= found * (1 + precision)
    assert abs(found - threshold) / threshold <= precision
    assert result["requests_per_s"] == pytest.approx(found * 1000.0 / PERIOD_MS)
    # Below the threshold there is no queue: every TTFT is T.
    below = [p for p in result["probes"] if p["time_scale"] <= threshold]
    assert below and all(p["meets"] and p["ttft_p90"] == pytest.approx(step_ms) for p in below)
    assert all(not p["meets"] for p in result["probes"] if p["time_scale"] > found)
    # The same search again: the same answer (runs are deterministic).
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out) == report


def test_capacity_table_bounds_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    workload = _fixed_workload(tmp_path / "fixed.jsonl")
    base = ["capacity", "--workload", str(workload), "--limit", "60", "--tier", "host=0", "--slo", "ttft_p90=10s"]
    # Meets the SLO at every scale up to --max-scale: a lower bound, not a number.
    assert main([*base, "--stack", "baseline", "--stack", "async-lookup", "--max-scale", "2", "--markdown"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("| stack | capacity (x recorded rate) | requests/s | vs first |")
    assert table[2].startswith("| `baseline` | >= 2 | >= 2 | 1.00x |")
    # Fails even at --min-scale: an upper bound.
    pytest.importorskip("matplotlib", reason="the plot extra is not installed")
    image = tmp_path / "capacity.png"
    assert main([*base, "--stack", "baseline", "--min-scale", "8", "--start", "8", "--plot", str(image)]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("baseline"))
    assert line.split()[1:3] == ["<", "8"], out
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_capacity_refuses_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["capacity", "--limit", "5", "--stack", "baseline", "--slo", "ttft_p90=1s", "--min-scale", "4",
                 "--max-scale", "2"]) == 2
    assert capsys.readouterr().err == "kvlife capacity: error: --min-scale 4 must be below --max-scale 2\n"
    assert main(["capacity", "--limit", "5", "--stack", "nope", "--slo", "ttft_p90=1s"]) == 2
    assert capsys.readouterr().err.startswith("kvlife: error: unknown policy 'nope'")
    # --precision is a relative precision in [0.0001, 1]: outside, one line and exit 2, no search.
    for precision, why in (("0", "must be a positive number, got 0"),
                           ("0.00001", "must be a relative precision from 0.0001 to 1, got 0.00001"),
                           ("1.5", "must be a relative precision from 0.0001 to 1, got 1.5")):
        with pytest.raises(SystemExit) as exc:
            main(["capacity", "--limit", "5", "--stack", "baseline", "--slo", "ttft_p90=1s", "--precision", precision])
        assert exc.value.code == 2
        captured = capsys.readouterr()
        assert captured.err == f"kvlife capacity: error: argument --precision: {why}\n" and not captured.out
    # Its ends are taken: 1 (the threshold within a factor of 2) searches, and says so.
    assert main(["capacity", "--limit", "5", "--stack", "baseline", "--slo", "ttft_p90=1s", "--precision", "1",
                 "--min-scale", "1", "--max-scale", "1.5", "--start", "1"]) == 0
    assert "precision 1: the threshold lies in [capacity, capacity x 2)" in capsys.readouterr().out
