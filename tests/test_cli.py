"""The command line: the main job, JSON output, and one-line errors for bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from kvlife.lifecycle.cli.main import main


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvlife.lifecycle.cli.main", *args], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1])


def test_default_run_prints_the_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--limit", "60"]) == 0
    out = capsys.readouterr().out
    for label in ("TTFT p50 / p90 / p99", "TPOT", "throughput", "prefix hit rate", "host",
                  "deferrals by reason", "scheduler ticks", "wall time"):
        assert label in out


def test_json_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--limit", "50", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert list(result)[:2] == ["kind", "schema"] and result["kind"] == "run" and result["schema"] == 1
    assert result["driver"] == "sim" and result["workload"] == {"name": "synthetic", "requests": 50}
    summary = result["summary"]
    assert summary["requests"] == 50
    assert summary["finished"] == {"stopped": 50}
    assert set(summary["prefix_hit_rate"]) == {"device", "host"}
    assert summary["ttft_ms"]["p50"] > 0


def test_config_file_and_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "kvlife.toml"
    config.write_text('[engine]\ndevice_blocks = 300\nranks = 2\n\n[[tiers]]\nname = "host"\n'
                      'capacity_blocks = 500\neviction = "arc"\n\n[sim]\nseed = 4\n')
    trace = tmp_path / "run.jsonl"
    assert main(["run", "--limit", "40", "--config", str(config), "--trace", str(trace)]) == 0
    header = orjson.loads(trace.read_bytes().splitlines()[0])
    assert header["config"]["engine"]["device_blocks"] == 300
    assert header["config"]["engine"]["tiers"][0]["eviction"] == "arc"
    assert header["seed"] == 4


def test_malformed_workload_line_names_file_line_and_field(tmp_path: Path) -> None:
    workload = tmp_path / "w.jsonl"
    workload.write_text(
        '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}\n'
        '{"timestamp": 5, "input_length": "x", "output_length": 5, "hash_ids": [1]}\n'
    )
    proc = run_cli("run", "--workload", str(workload))
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0
    assert f"{workload}:2" in proc.stderr and "input_length" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_config_value_names_file_line_and_field(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("[engine]\nblock_tokens = 512\ndevice_blocks = -4\n")
    proc = run_cli("run", "--config", str(config))
    assert proc.returncode == 2
    assert f"{config}:3: field 'engine.device_blocks'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_unknown_config_key_and_bad_tier(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text('[engine]\nranks = 1\n\n[[tiers]]\nname = "host"\ncapacity_blocks = 0\n')
    proc = run_cli("run", "--config", str(config))
    assert proc.returncode == 2 and "tiers[0].capacity_blocks" in proc.stderr and ":6:" in proc.stderr
    config.write_text("[engine]\nturbo = true\n")
    proc = run_cli("run", "--config", str(config))
    assert proc.returncode == 2 and "engine.turbo" in proc.stderr and ":2:" in proc.stderr


def test_unknown_policy_is_a_one_line_error() -> None:
    proc = run_cli("run", "--limit", "5", "--stack", "no-such-policy")
    assert proc.returncode == 2
    assert "no-such-policy" in proc.stderr and "Traceback" not in proc.stderr


def test_policy_failing_mid_run_keeps_the_partial_trace_valid(tmp_path: Path) -> None:
    policy = tmp_path / "flaky.py"
    policy.write_text(
        "from kvlife.policies.base import Decision\n"
        "class Flaky:\n"
        "    name = 'flaky'\n"
        "    calls = 0\n"
        "    def lookup_mode(self, req, engine):\n"
        "        Flaky.calls += 1\n"
        "        return Decision('sync', 'ok') if Flaky.calls < 20 else 'sync'\n"
    )
    trace = tmp_path / "partial.jsonl"
    proc = run_cli("run", "--limit", "100", "--stack", f"{policy}:Flaky", "--trace", str(trace))
    assert proc.returncode == 2
    assert "flaky" in proc.stderr and "lookup_mode" in proc.stderr and "Traceback" not in proc.stderr
    lines = trace.read_bytes().splitlines()
    assert len(lines) > 20
    assert all(isinstance(orjson.loads(line), dict) for line in lines)


def test_policies_lists_builtins(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["policies"]) == 0
    assert "baseline" in capsys.readouterr().out


def test_choice_fields_name_the_field_and_the_options(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text('[[tiers]]\nname = "host"\ncapacity_blocks = 10\neviction = "fifo"\n')
    proc = run_cli("run", "--config", str(config))
    assert proc.returncode == 2
    assert f"{config}:4: field 'tiers[0].eviction'" in proc.stderr and "'lru', 'arc'" in proc.stderr
    config.write_text('[live]\ndtype = "int8"\n')
    proc = run_cli("run", "--live", "--config", str(config))
    assert proc.returncode == 2 and f"{config}:2: field 'live.dtype'" in proc.stderr
    assert "Attribute(" not in proc.stderr


def test_size_flags_shape_the_tiers(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--limit", "150", "--device-blocks", "120", "--tier", "host=60", "--tier", "disk=900",
                 "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)["summary"]
    assert set(summary["prefix_hit_rate"]) == {"device", "host", "disk"}
    assert summary["prefix_hit_rate"]["disk"] > 0  # a 120-block device and 60-block host spill to disk
    assert main(["run", "--limit", "20", "--tier", "host=0", "--json"]) == 0
    assert set(json.loads(capsys.readouterr().out)["summary"]["prefix_hit_rate"]) == {"device"}


def test_bad_size_flags_are_one_line_errors() -> None:
    proc = run_cli("run", "--tier", "ssd=4")
    assert (proc.returncode, proc.stderr) == (2, "kvlife run: error: argument --tier: expected host=N, disk=N or "
                                                 "remote=N (N blocks, 0 drops it), got 'ssd=4'\n")
    proc = run_cli("run", "--device-blocks", "0")
    assert proc.returncode == 2
    assert proc.stderr == "kvlife run: error: argument --device-blocks: must be a positive integer, got 0\n"


def test_unknown_policy_in_a_config_file_names_file_line_and_field(tmp_path: Path) -> None:
    config = tmp_path / "stack.toml"
    config.write_text('[engine]\nranks = 1\n\n[policies]\nstack = ["shared-loads", "no-such"]\n')
    proc = run_cli("run", "--config", str(config))
    assert proc.returncode == 2
    assert f"{config}:5: field 'policies.stack'" in proc.stderr and "no-such" in proc.stderr


def test_version_and_spec_table(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.startswith("kvlife ")
    assert main(["spec", "--format", "table"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "loading         --load_failed--> waiting" in lines and len(lines) == 22
    assert "lookup_pending  --lookup_expired--> waiting" in lines
    assert "running         --turn_ended--> waiting" in lines


def test_live_run_from_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["run", "--live", "--limit", "40", "--ranks", "1", "--disk-path", str(tmp_path / "disk"),
            "--tier", "host=16", "--json"]
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out)["summary"]
    assert summary["live"]["ranks"] == 1 and summary["live"]["mismatches"] == 0
    assert sum(summary["finished"].values()) == 40
    assert summary["live"]["blocks_verified"] == summary["blocks_loaded"]
    assert (tmp_path / "disk" / "rank0.kvblocks").stat().st_size > 0  # --disk-path holds the tier's file
    assert main([*args, "--no-verify"]) == 0
    assert json.loads(capsys.readouterr().out)["summary"]["live"]["blocks_verified"] == 0


def test_bench_engine_runs_small(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "engine", "--requests", "300", "--repeats", "1", "--reference-requests", "20",
                 "--skip-trace"]) == 0
    out = capsys.readouterr().out
    assert "compiled core" in out and "x the bare loop" in out


def test_vllm_diff_without_vllm_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.metadata

    try:  # the installed distribution (tests/vllm would pass as a namespace package "vllm")
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        pass
    else:
        pytest.skip("vLLM is installed here: tests/vllm/test_vllm_diff_cli.py runs the command")
    assert main(["vllm-diff", "--limit", "5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("kvlife vllm-diff: error: needs vLLM 0.33") and "scripts/install-vllm.sh" in err
    # flags are checked first, vLLM or not
    assert main(["vllm-diff", "--family", "conversation-sync", "--seeds", "0,x"]) == 2
    assert "argument --seeds: expected non-negative integers" in capsys.readouterr().err
