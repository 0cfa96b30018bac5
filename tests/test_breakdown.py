"""Per-request rows (``kvlife.lifecycle.breakdown``), the standard metrics of the summary, the
overload warning, policy answers per hook, and ``--requests-out``, ``explain --brief/--slowest``.

Every figure a row has is checked against the summary and against what the engine's own
request records say, computed here independently."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import attrs
import pytest
from test_policy_effects import BT, shared_prefix_bursts

from kvlife.lifecycle.breakdown import COLUMNS, PHASES, SOURCES
from kvlife.lifecycle.cli.main import main
from kvlife.lifecycle.config import EngineConfig, RunConfig, TierConfig
from kvlife.lifecycle.drivers.runner import run_workload
from kvlife.lifecycle.workloads.synthetic import synthetic_burst_workload

# A small device and a host tier under a burst of shared prefixes: requests wait, load from
# the host, get preempted and join each other's loads (with shared-loads).
PRESSURE = RunConfig(engine=EngineConfig(block_tokens=64, device_blocks=120, max_batched_tokens=1024,
                                         tiers=(TierConfig("host", capacity_blocks=400),)))


def _workload() -> list[Any]:
    return synthetic_burst_workload(seed=2, num_requests=80, block_tokens=64, arrival_rate_per_s=20.0)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


# Shared prefixes warmed into the host tier, then bursts that load them: host hits, joins.
BURSTS = RunConfig(engine=EngineConfig(block_tokens=BT, device_blocks=250, max_batched_tokens=4096, max_running=64,
                                       lookup_latency_ms=1.0, tiers=(TierConfig("host", capacity_blocks=6000),)),
                   policies=("shared-loads",))


def _bursts() -> list[Any]:
    return shared_prefix_bursts(n_prefixes=2, prefix_blocks=24, burst=8, own=6, fillers=20)


@pytest.fixture(scope="module")
def pressured() -> Any:
    config = attrs.evolve(PRESSURE, policies=("shared-loads",))
    return run_workload(config, _workload(), breakdown=True, keep_requests=True,
                        goodput={"ttft": 400.0, "tpot": 60.0})


@pytest.fixture(scope="module")
def bursts() -> Any:
    return run_workload(BURSTS, _bursts(), breakdown=True, keep_requests=True)


@pytest.fixture(params=["pressured", "bursts"])
def outcome(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue(request.param)


def test_the_runs_exercise_what_rows_must_get_right(pressured: Any, bursts: Any) -> None:
    assert pressured.summary["preemptions"] > 0
    assert all(pressured.summary["latency_breakdown_ms"][p]["total"] > 0 for p in ("queue", "prefill", "decode"))
    assert bursts.summary["prompt_tokens_by_source"]["host"] > 0 and bursts.summary["joined_blocks"] > 0
    assert bursts.summary["latency_breakdown_ms"]["load"]["total"] > 0


def test_rows_sum_to_the_summary(outcome: Any) -> None:
    pressured = outcome
    summary, rows = pressured.summary, pressured.rows
    requests = pressured.result.engine.requests
    assert len(rows) == summary["requests"] == len(requests)
    assert [r.request for r in rows] == sorted(requests, key=lambda rid: requests[rid].seq)
    assert sum(r.output_tokens for r in rows) == summary["output_tokens"]
    assert Counter(r.finish_reason for r in rows) == Counter(summary["finished"])
    for i, source in enumerate(SOURCES):
        assert sum(r.sources[i] for r in rows) == summary["prompt_tokens_by_source"].get(source, 0)
    assert sum(r.prompt_tokens for r in rows) == summary["prompt_tokens"]
    ttft = [r.ttft_ms for r in rows if r.ttft_ms is not None]
    assert summary["ttft_ms"]["p99"] == pytest.approx(_percentile(ttft, 99))
    for i, phase in enumerate(PHASES):
        assert summary["latency_breakdown_ms"][phase]["total"] == pytest.approx(math.fsum(r.phases[i] for r in rows))
    assert sum(r.preemptions for r in rows) == summary["preemptions"]


def test_each_rows_phases_add_up_to_its_life(outcome: Any) -> None:
    requests = outcome.result.engine.requests
    for row in outcome.rows:
        req = requests[row.request]
        assert req.finish_ms is not None and req.first_token_ms is not None
        # Everything from arrival to the end of sending: E2E plus the hold.
        assert math.fsum(row.phases) == pytest.approx(row.e2e_ms + row.phase("hold"), abs=1e-6)
        assert row.e2e_ms == pytest.approx(req.finish_ms - req.arrival_ms)
        # The first token splits running; a request never preempted waited, looked up and
        # loaded only before it (one preempted after it waits again: queue after the TTFT).
        before = row.phase("queue") + row.phase("lookup") + row.phase("load") + row.phase("prefill")
        if row.preemptions == 0:
            assert before == pytest.approx(row.ttft_ms, abs=1e-6)
        else:
            assert before >= row.ttft_ms - 1e-6
        assert sum(row.sources) == req.prompt_tokens
        assert row.source("local_cache_hit") == req.device_hit_blocks * req.block_tokens


def test_standard_metrics_match_the_requests(pressured: Any) -> None:
    summary = pressured.summary
    reqs = list(pressured.result.engine.requests.values())
    e2e = [r.finish_ms - r.arrival_ms for r in reqs]
    mean = sum(e2e) / len(e2e)
    assert summary["e2e_ms"]["mean"] == pytest.approx(mean)
    assert summary["e2e_ms"]["std"] == pytest.approx(math.sqrt(sum((v - mean) ** 2 for v in e2e) / len(e2e)))
    assert summary["e2e_ms"]["p90"] == pytest.approx(_percentile(e2e, 90))
    decoding = [r for r in reqs if r.generated > 1]
    itl = sum(r.finish_ms - r.first_token_ms for r in decoding) / sum(r.generated - 1 for r in decoding)
    assert summary["itl_ms"]["mean"] == pytest.approx(itl)
    good = sum(1 for r in reqs if r.first_token_ms - r.arrival_ms <= 400.0
               and (r.generated < 2 or (r.finish_ms - r.first_token_ms) / (r.generated - 1) <= 60.0))
    assert summary["goodput"]["requests"] == good and 0 < good < len(reqs)
    assert summary["goodput"]["requests_per_s"] == pytest.approx(good / summary["simulated_s"])


def test_policy_answers_count_the_joins(bursts: Any) -> None:
    # Each request's last admission answer, read from its decision records independently.
    records: list[dict[str, Any]] = []
    from kvlife.lifecycle.drivers.simulator import Simulator
    from kvlife.policies.loading import load_stack

    Simulator(BURSTS, _bursts(), load_stack(BURSTS.policies), records.append).run()
    last: dict[str, tuple[str, str]] = {}
    for record in records:
        if record["kind"] == "decision" and record["point"] == "admission":
            last[record["req"]] = (record["policy"], record["value"])
    expected = Counter(last.values())
    answers = bursts.summary["decisions"]["admission"]
    assert answers["shared-loads"]["join"] == expected[("shared-loads", "join")] > 0
    assert answers["baseline"]["go"] == expected[("baseline", "go")] > 0
    assert sum(r.answers[4] == "shared-loads:join" for r in bursts.rows) == answers["shared-loads"]["join"]


def test_kept_or_dropped_requests_give_the_same_rows() -> None:
    config = attrs.evolve(PRESSURE, policies=("shared-loads",))
    kept = run_workload(config, _workload(), breakdown=True, keep_requests=True)
    dropped = run_workload(config, _workload(), breakdown=True)
    assert dropped.rows == kept.rows
    for summary in (kept.summary, dropped.summary):
        summary.pop("wall_s")
    assert dropped.summary == kept.summary


def test_requests_out_csv_has_a_row_per_request_summing_to_the_summary(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "requests.csv"
    assert main(["run", "--limit", "60", "--device-blocks", "150", "--tier", "host=400", "--requests-out", str(out),
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    summary = report["summary"]
    with out.open() as f:
        table = list(csv.DictReader(f))
    assert list(table[0]) == list(COLUMNS)
    assert len(table) == summary["requests"] == report["requests_out"]["rows"] == 60
    assert len({r["request"] for r in table}) == 60
    assert sum(int(r["output_tokens"]) for r in table) == summary["output_tokens"]
    for source in SOURCES:
        assert sum(int(r[f"tokens_{source}"]) for r in table) == summary["prompt_tokens_by_source"].get(source, 0)
    for phase in PHASES:
        total = math.fsum(float(r[f"{phase}_ms"]) for r in table)
        assert total == pytest.approx(summary["latency_breakdown_ms"][phase]["total"], rel=1e-9, abs=1e-3)
    ttft = [float(r["ttft_ms"]) for r in table if r["ttft_ms"]]
    assert _percentile(ttft, 50) == pytest.approx(summary["ttft_ms"]["p50"], rel=1e-9)


def test_requests_out_refuses_parquet(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--limit", "5", "--requests-out", "r.parquet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "kvlife writes CSV" in err


def test_explain_brief_and_slowest_agree_with_the_runs_rows(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    trace, out = tmp_path / "t.jsonl", tmp_path / "r.csv"
    flags = ["--limit", "60", "--device-blocks", "150", "--tier", "host=400", "--stack", "async-lookup"]
    assert main(["run", *flags, "--trace", str(trace), "--requests-out", str(out)]) == 0
    capsys.readouterr()
    from kvlife.lifecycle.traces.explain import trace_rows

    rows = trace_rows(trace)
    with out.open() as f:
        written = list(csv.DictReader(f))
    # The trace gives back exactly the rows the run wrote.
    for row, line in zip(rows, written, strict=True):
        for column, value in row.as_dict().items():
            cell = line[column]
            if isinstance(value, float):
                assert float(cell) == value
            else:
                assert cell == ("" if value is None else str(value))
    assert main(["explain", str(trace), "--slowest", "3", "--json"]) == 0
    slow = json.loads(capsys.readouterr().out)["slowest"]
    e2e = sorted((r.e2e_ms for r in rows), reverse=True)[:3]
    assert [s["e2e_ms"] for s in slow] == pytest.approx(e2e)
    worst = slow[0]["request"]
    assert main(["explain", str(trace), worst, "--brief"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.count("\n") == 0 and line.startswith(f"{worst}: e2e {slow[0]['e2e_ms']:,.1f} ms")
    assert main(["explain", str(trace), worst, "--slowest", "2"]) == 2


# ---- overload --------------------------------------------------------------------------------
def _kvlife(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvlife", *args], capture_output=True, text=True, timeout=300)


def test_overload_warning_on_the_bundled_trace_at_1x_and_not_at_its_stable_point() -> None:
    at_1x = _kvlife("run", "--workload", "mooncake-conversation", "--json")
    assert at_1x.returncode == 0, at_1x.stderr
    warnings = [line for line in at_1x.stderr.splitlines() if "overloaded" in line]
    assert len(warnings) == 1 and warnings[0].startswith("kvlife run: overloaded: TTFT of the last arrival decile is")
    assert "try --time-scale 0." in warnings[0]
    report = json.loads(at_1x.stdout)
    assert report["overloaded"] is True and report["summary"]["stability"]["ratio"] > 1.5
    # The README's conversation example: the stable point (docs/benchmarks.md).
    stable = _kvlife("run", "--workload", "mooncake-conversation", "--limit", "1000", "--time-scale", "0.26",
                     "--arrivals", "spread", "--json")
    assert stable.returncode == 0 and "overloaded" not in stable.stderr
    assert json.loads(stable.stdout)["overloaded"] is False


def test_compare_marks_an_overloaded_stack(capsys: pytest.CaptureFixture[str]) -> None:
    # Out of device blocks for a burst at 8x: the queue grows under either stack.
    argv = ["compare", "--workload", "synthetic:burst", "--limit", "150", "--time-scale", "8", "--device-blocks", "60",
            "--stack", "baseline", "--stack", "shared-loads"]
    assert main([*argv, "--json"]) == 0
    captured = capsys.readouterr()
    rows = json.loads(captured.out)["rows"]
    assert [r["overloaded"] for r in rows] == [True, True]
    assert captured.err.count("kvlife compare: overloaded: ") == 2
    assert main(argv) == 0
    header = capsys.readouterr().out.splitlines()[3]
    assert "baseline (overloaded)" in header and "shared-loads (overloaded)" in header
    assert main(["compare", "--limit", "40", "--stack", "baseline"]) == 0
    assert "overloaded" not in capsys.readouterr().err


def test_overload_suggestion_is_a_stable_scale() -> None:
    from kvlife.lifecycle.metrics import overload_line

    summary: dict[str, Any] = {"overloaded": True, "simulated_s": 400.0,
                               "stability": {"ratio": 9.0, "growth_ms": 5000.0, "arrivals_s": 100.0}}
    # Arrivals took 100 s, serving them 400 s: a quarter of the rate, less a margin.
    assert overload_line(summary, 1.0).endswith("try --time-scale 0.2")
    assert overload_line(summary, 1.0, request_rate=8.0).endswith("try --request-rate 1.6")
    assert overload_line({**summary, "overloaded": False}, 1.0) is None
