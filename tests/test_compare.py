"""``kvlife compare``: one workload under several stacks, side by side."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvlife.lifecycle.cli.compare import compare_stacks, format_comparison, parse_stack
from kvlife.lifecycle.cli.main import main
from kvlife.lifecycle.config import EngineConfig, RunConfig, SimConfig, TierConfig
from kvlife.lifecycle.workloads.synthetic import synthetic_workload
from kvlife.policies.base import PolicyError

CONFIG = RunConfig(
    engine=EngineConfig(block_tokens=256, device_blocks=400, max_batched_tokens=4096, max_running=64,
                        lookup_latency_ms=4.0, tiers=(TierConfig("host", capacity_blocks=2000),)),
    sim=SimConfig(seed=2),
)


def test_parse_stack() -> None:
    assert parse_stack("baseline") == ()
    assert parse_stack(" async-lookup , shared-loads ") == ("async-lookup", "shared-loads")
    with pytest.raises(PolicyError):
        parse_stack("async-lookup,,shared-loads")


def test_rows_compare_the_same_workload_under_each_stack() -> None:
    workload = synthetic_workload(seed=2, num_requests=120, arrival_rate_per_s=10.0, block_tokens=256)
    rows = compare_stacks(CONFIG, workload, [(), ("async-lookup", "shared-loads")])
    assert [r["stack"] for r in rows] == ["baseline", "async-lookup,shared-loads"]
    base, tuned = rows
    assert base["requests"] == tuned["requests"] == 120
    assert base["critical_path_lookup_ms"] > 0 and tuned["critical_path_lookup_ms"] == 0
    assert base["bytes_moved"] == base["bytes_loaded"] + base["bytes_stored"] + base["bytes_prefetched"]
    # deterministic: the same stack twice gives the same figures
    again = compare_stacks(CONFIG, workload, [()])[0]
    assert again["ttft_p99_ms"] == base["ttft_p99_ms"] and again["bytes_moved"] == base["bytes_moved"]
    text = format_comparison(rows)
    for label in ("TTFT p50 (ms)", "TTFT p99 (ms)", "throughput", "redundant block loads", "bytes moved",
                  "critical-path lookup (ms)", "deferrals by reason", "async-lookup,shared-loads"):
        assert label in text
    table = format_comparison(rows, markdown=True).splitlines()
    assert table[0].startswith("| metric | `baseline` |") and table[1].startswith("|---|")


def test_cli_compare_text_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["compare", "--limit", "60", "--time-scale", "3", "--seed", "1",
            "--stack", "baseline", "--stack", "async-lookup,defer-while-loading"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "60 requests" in out and "async-lookup,defer-while-loading" in out
    assert main([*args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["kind"] == "compare" and result["schema"] == 1
    assert result["workload"] == {"name": "synthetic", "requests": 60} and result["time_scale"] == 3
    rows = result["rows"]
    assert [r["stack"] for r in rows] == result["stacks"] == ["baseline", "async-lookup,defer-while-loading"]
    assert rows[1]["critical_path_lookup_ms"] == 0
    assert set(rows[0]) >= {"ttft_p50_ms", "ttft_p99_ms", "throughput_tokens_per_s", "redundant_block_loads",
                            "bytes_moved", "critical_path_lookup_ms", "deferrals"}


def test_cli_compare_reads_a_mooncake_trace_and_a_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    lines = [json.dumps({"timestamp": i * 50, "input_length": 1200, "output_length": 5, "hash_ids": [0, 1, i + 2]})
             for i in range(30)]
    trace.write_text("\n".join(lines) + "\n")
    config = tmp_path / "c.toml"
    config.write_text("[engine]\nblock_tokens = 512\n[policies]\nstack = [\"async-lookup\"]\n")
    assert main(["compare", "--workload", str(trace), "--config", str(config), "--json",
                 "--stack", "baseline", "--stack", "shared-loads"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["requests"] for r in rows] == [30, 30]


def test_cli_compare_bad_policy_is_exit_2_before_any_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", "--limit", "10", "--stack", "baseline", "--stack", "no-such-policy"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvlife: error: unknown policy 'no-such-policy'")
