"""The command-line grammar (docs/cli.md): one stack per --stack, --json everywhere, one-line
errors, nested bench subcommands, help for every flag, extras, progress, interrupts."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from kvlife.lifecycle.cli import output
from kvlife.lifecycle.cli.main import build_parser, main
from kvlife.lifecycle.cli.parsing import iter_parsers
from tests.conftest import written_so_far

ROOT = Path(__file__).resolve().parents[1]
HAS_LIVE = all(importlib.util.find_spec(m) is not None for m in ("torch", "redis"))
HAS_PLOT = importlib.util.find_spec("matplotlib") is not None


def kvlife(*args: str, cwd: Path = ROOT, prelude: str = "", **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``python -m kvlife ARGS`` in a fresh interpreter; ``prelude`` runs first (to hide a module)."""
    code = f"{prelude}\nimport sys\nfrom kvlife.lifecycle.cli.main import main\nsys.exit(main(sys.argv[1:]))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300, stdin=subprocess.DEVNULL, **kwargs)


def _strict_json(text: str) -> dict[str, Any]:
    """Parse one JSON object, refusing NaN/Infinity (which Python's json would accept)."""
    def refuse(name: str) -> Any:
        raise AssertionError(f"{name} in JSON output")

    value = json.loads(text, parse_constant=refuse)
    assert isinstance(value, dict)
    return value


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("grammar") / "run.jsonl"
    assert main(["run", "--limit", "40", "--trace", str(path)]) == 0
    return path


# ---- one stack per --stack -----------------------------------------------------------------
@pytest.mark.parametrize("command", [["run"], ["check"], ["replay", "t.jsonl"]])
def test_a_second_stack_is_one_line_and_exit_2(command: list[str]) -> None:
    proc = kvlife(*command, "--stack", "async-lookup", "--stack", "shared-loads")
    name = command[0]
    assert proc.returncode == 2
    line = f"kvlife {name}: error: --stack given 2 times; {name} takes one stack (compare takes several)"
    assert proc.stderr == line + "\n"
    assert proc.stdout == ""


def test_policy_flag_is_gone() -> None:
    proc = kvlife("run", "--policy", "shared-loads")
    assert proc.returncode == 2
    assert proc.stderr == ("kvlife run: error: unrecognized arguments: --policy shared-loads; "
                           '--policy is gone: one --stack "a,b" names the whole stack\n')


def test_a_comma_stack_is_one_stack(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--limit", "20", "--stack", "async-lookup, shared-loads", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["stack"] == "async-lookup,shared-loads" and result["summary"]["async_lookups"] > 0


# ---- --json ----------------------------------------------------------------------------------
def _json_commands(trace: Path, tmp: Path) -> list[tuple[list[str], str, int]]:
    mooncake = tmp / "w.jsonl"
    mooncake.write_text("".join(json.dumps({"timestamp": i * 40, "input_length": 1100, "output_length": 4,
                                            "hash_ids": [0, 1, i + 2]}) + "\n" for i in range(12)))
    commands = [
        (["run", "--limit", "20", "--json"], "run", 0),
        (["compare", "--limit", "20", "--stack", "baseline", "--stack", "shared-loads", "--json"], "compare", 0),
        (["replay", str(trace), "--json"], "replay", 0),
        (["replay", str(trace), "--stack", "async-lookup", "--json"], "replay", 0),
        (["validate", str(trace), "--json"], "validate", 0),
        (["check", "--examples", "3", "--steps", "10", "--json"], "check", 0),
        (["check", "--stack", "naive-stores-unsafe", "--json"], "check", 1),
        (["explain", str(trace), "req-3", "--json"], "explain", 0),
        (["export", str(trace), "--perfetto", str(tmp / "p.json"), "--json"], "export", 0),
        (["policies", "--json"], "policies", 0),
        (["spec", "--json"], "spec", 0),
        (["bench", "engine", "--requests", "200", "--repeats", "1", "--reference-requests", "10",
          "--workload", str(mooncake), "--json"], "bench-engine", 0),
        (["capacity", "--limit", "20", "--stack", "baseline", "--slo", "ttft_p90=5s", "--precision", "0.5",
          "--max-scale", "2", "--json"], "capacity", 0),
        (["sweep", "run", "--limit", "10", "--vary", "sim.time_scale=1,2", "-o", str(tmp / "sweep.jsonl"), "--json"],
         "sweep", 0),
    ]
    if HAS_PLOT:
        commands.append((["plot", str(trace), str(tmp / "p.png"), "--json"], "plot", 0))
    if HAS_LIVE:
        commands.append((["run", "--live", "--limit", "5", "--ranks", "1", "--json"], "run", 0))
        commands.append((["bench", "transfer", "--block-sizes", "16K", "--batches", "2", "--repeats", "1",
                          "--pool-mb", "1", "--tiers", "host", "--json"], "bench-transfer", 0))
    return commands


def test_every_command_prints_one_json_object_with_kind_and_schema(
        trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    results = []
    for argv, kind, code in _json_commands(trace, tmp_path):
        assert main(argv) == code, argv
        out = capsys.readouterr().out
        assert out.count("\n") == 1, (argv, out[:200])  # one object, one line
        result = _strict_json(out)
        assert list(result)[:2] == ["kind", "schema"], argv
        assert result["kind"] == kind and result["schema"] == 1, argv
        results.append(result)
    # a few fields each kind promises (docs/cli.md)
    run, compare, replay, what_if, validate, check, counterexample = results[:7]
    assert run["workload"] == {"name": "synthetic", "requests": 20} and run["summary"]["requests"] == 20
    assert [r["stack"] for r in compare["rows"]] == compare["stacks"] == ["baseline", "shared-loads"]
    assert replay["mode"] == "exact" and replay["identical"] is True and replay["divergence"] is None
    assert what_if["what_if"]["stack"] == "async-lookup" and what_if["recorded"]["stack"] == "baseline"
    assert validate["ok"] is True and validate["findings"] == [] and 1 in validate["checked"]
    assert check["ok"] is True and check["violation"] is None
    assert counterexample["ok"] is False and counterexample["violation"]["invariant"] == 5
    assert counterexample["counterexample"]


def test_bench_engine_names_its_workload(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    workload = tmp_path / "w.jsonl"
    workload.write_text("".join(json.dumps({"timestamp": i * 40, "input_length": 700, "output_length": 3,
                                            "hash_ids": [0, i + 1]}) + "\n" for i in range(9)))
    args = ["bench", "engine", "--requests", "100", "--repeats", "1", "--reference-requests", "5",
            "--workload", str(workload), "--sim-repeats", "1", "--tracing", "off"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"simulation: {workload}, time scale 1" in out
    row = next(line for line in out.splitlines() if line.split()[:2] == ["9", "off"])
    assert row.rstrip().endswith("x")  # both engines ran: their ratio ends the row
    assert main([*args, "--sizes", "4", "--skip-transitions", "--json"]) == 0
    simulation = json.loads(capsys.readouterr().out)["simulations"][0]
    assert simulation["workload"] == str(workload) and simulation["requests"] == 4
    engines = simulation["engines"]
    assert set(engines) == {"python", "native"} and simulation["speedup"] > 0
    # The same run on both engines: the same requests finished, the same steps and events.
    assert engines["python"]["finished"] == engines["native"]["finished"] == 4
    assert engines["python"]["steps"] == engines["native"]["steps"]
    assert engines["python"]["engine_events"] == engines["native"]["engine_events"]


def test_bench_engine_never_switches_workload_silently(tmp_path: Path) -> None:
    missing = tmp_path / "missing.jsonl"
    proc = kvlife("bench", "engine", "--requests", "50", "--repeats", "1", "--reference-requests", "5",
                  "--workload", str(missing))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith(f"kvlife: error: {missing}") and proc.stderr.count("\n") == 1
    assert "simulation:" not in proc.stdout


def test_bench_engine_defaults_to_the_bundled_trace() -> None:
    parser = build_parser()
    args = parser.parse_args(["bench", "engine"])
    assert args.workload == "mooncake-conversation" and args.func.__name__ == "handle_engine"
    source = (ROOT / "lifecycle" / "cli" / "bench_engine.py").read_text()
    assert "shared" not in source.replace("shared-loads", "")


def test_json_never_writes_nan_or_infinity() -> None:
    text = output.dumps(output.result("x", a=float("nan"), b=[float("inf"), -float("inf"), 1.5],
                                      c={1: (2, Path("p"))}))
    assert text == '{"kind":"x","schema":1,"a":null,"b":[null,null,1.5],"c":{"1":[2,"p"]}}'
    with pytest.raises(TypeError):
        output.plain(object())


@pytest.mark.parametrize(("argv", "line"), [
    (["compare", "--stack", "baseline", "--json", "--markdown"],
     "kvlife compare: error: argument --markdown: not allowed with argument --json"),
    (["spec", "--json", "--format", "table"],
     "kvlife spec: error: argument --format: not allowed with argument --json"),
    (["run", "--time-scale", "nan"], "kvlife run: error: argument --time-scale: must be a finite number, got nan"),
    (["run", "--time-scale", "inf"], "kvlife run: error: argument --time-scale: must be a finite number, got inf"),
    (["run", "--time-scale", "0"], "kvlife run: error: argument --time-scale: must be a positive number, got 0"),
    (["compare", "--stack", "baseline", "--time-scale", "-2"],
     "kvlife compare: error: argument --time-scale: must be a positive number, got -2"),
    (["run", "--limit", "0"], "kvlife run: error: argument --limit: must be a positive integer, got 0"),
    (["run", "--redis-ttl", "60"], "kvlife run: error: --redis-ttl needs --live"),
    (["run", "--disk-path", "/tmp/x"], "kvlife run: error: --disk-path needs --live"),
    (["check", "--examples", "0"], "kvlife check: error: argument --examples: must be a positive integer, got 0"),
    (["bench", "transfer", "--block-sizes", "12Q"],
     "kvlife bench transfer: error: argument --block-sizes: expected a size like 64K or 1M, got '12Q'"),
    # Bounds: the config key's rule, with its limit and why.
    (["run", "--ranks", "1000000"], "kvlife run: error: argument --ranks: must be at most 1,024 (the ranks of one "
     "model instance: the largest NVLink domain, NVL576, has 576 GPUs), got 1000000"),
    (["run", "--time-scale", "1e7"], "kvlife run: error: argument --time-scale: must be at most 1e+06 (a million "
     "times the recorded arrival rate), got 10000000.0"),
    (["run", "--seed", "9223372036854775808"], "kvlife run: error: argument --seed: must be at most "
     "9,223,372,036,854,775,807 (the largest integer JSON traces hold exactly, signed 64-bit), "
     "got 9223372036854775808"),
    (["run", "--seed", "x"], "kvlife run: error: argument --seed: must be an integer, got 'x'"),
    (["run", "--tier", "disk=-1"], "kvlife run: error: argument --tier: must be a positive integer, got -1"),
    (["run", "--tier", "ssd=4"], "kvlife run: error: argument --tier: expected host=N, disk=N or remote=N "
     "(N blocks, 0 drops it), got 'ssd=4'"),
    (["run", "--model", ""], "kvlife run: error: argument --model: must be a non-empty string, got ''"),
    (["run", "--live", "--redis-url", "localhost:6379"], "kvlife run: error: argument --redis-url: must be a "
     "redis://, rediss:// or unix:// URL, got 'localhost:6379'"),
    (["run", "--live", "--redis-ttl", "-1"], "kvlife run: error: argument --redis-ttl: must be a non-negative "
     "integer, got -1"),
    # A value with a line break is still one line.
    (["run", "--hardware", "a\nb"], "kvlife run: error: --hardware a b: unknown hardware profile 'a\\nb' "
     "(known: a100-80gb, h100-sxm, h200, l40s; or give a path)"),
    (["run", "--workload", "synthetic:burst", "--time-scale", "300", "--limit", "5"],
     "kvlife run: error: argument --time-scale: synthetic:burst at time scale 300: burst_spread_ms: 20 ms at 1200 "
     "requests/s spans 24 arrivals, at most 20 (mean gaps between arrivals: a wider burst is no burst, and past "
     "about 30 the generator's window of the first num_requests arrivals stops closing)"),
])
def test_bad_flags_are_one_line_errors(argv: list[str], line: str) -> None:
    proc = kvlife(*argv)
    assert (proc.returncode, proc.stderr, proc.stdout) == (2, line + "\n", "")


# ---- nested bench, help --------------------------------------------------------------------------
def test_bench_alone_lists_the_two_and_exits_2() -> None:
    proc = kvlife("bench")
    assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("usage: kvlife bench")
    assert "engine" in proc.stderr and "transfer" in proc.stderr
    assert proc.stderr.splitlines()[-1] == "kvlife bench: error: choose a benchmark: engine, transfer or soak"
    proc = kvlife("bench", "engine", "--help")
    assert proc.returncode == 0 and "--skip-trace" in proc.stdout
    assert "(default: mooncake-conversation)" in " ".join(proc.stdout.split())
    assert kvlife().stderr.splitlines()[-1] == "kvlife: error: choose a command"


def test_every_option_has_help_and_says_its_default() -> None:
    parsers = iter_parsers(build_parser())
    progs = {p.prog for p in parsers}
    assert {"kvlife run", "kvlife compare", "kvlife bench engine", "kvlife bench transfer"} <= progs
    for parser in parsers:
        formatter = parser._get_formatter()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction | argparse._HelpAction | argparse._VersionAction):
                continue
            where = f"{parser.prog} {'/'.join(action.option_strings) or action.dest}"
            assert action.help and action.help.strip(), f"{where}: no help"
            if not action.option_strings or action.required:
                continue
            shown = formatter._get_help_string(action) % {"default": action.default}  # type: ignore[attr-defined]
            if action.default not in (None, False):
                assert "(default: " in shown or "default" in action.help, f"{where}: default not shown"
            elif action.nargs != 0 and not isinstance(action, argparse._AppendAction):
                assert "default" in action.help, f"{where}: say what happens when it is not given"


def test_check_parser_defaults_match_the_model_checker() -> None:
    from kvlife.specs.model_check import DEFAULT_EXAMPLES, DEFAULT_STEPS

    args = build_parser().parse_args(["check"])
    assert (args.examples, args.steps) == (DEFAULT_EXAMPLES, DEFAULT_STEPS)


# ---- flags mirror config keys --------------------------------------------------------------------
def test_size_flags_reach_the_recorded_config(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    assert main(["run", "--limit", "10", "--ranks", "3", "--device-blocks", "300", "--seed", "7",
                 "--stack", "shared-loads", "--trace", str(trace)]) == 0
    header = orjson.loads(trace.read_bytes().splitlines()[0])
    assert header["config"]["engine"]["ranks"] == 3 and header["config"]["engine"]["device_blocks"] == 300
    assert header["seed"] == 7 and header["config"]["policies"] == ["shared-loads"]


def test_time_scale_speeds_up_arrivals_once(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--limit", "30", "--json"]) == 0
    slow = json.loads(capsys.readouterr().out)
    assert main(["run", "--limit", "30", "--time-scale", "4", "--json"]) == 0
    fast = json.loads(capsys.readouterr().out)
    assert (slow["time_scale"], fast["time_scale"]) == (1.0, 4.0)
    assert fast["summary"]["simulated_s"] < slow["summary"]["simulated_s"] * 0.6


@pytest.mark.skipif(not HAS_LIVE, reason="needs kvlife[live] (torch, redis)")
def test_live_honours_an_explicit_time_scale_of_1(capsys: pytest.CaptureFixture[str]) -> None:
    from kvlife.lifecycle.workloads.synthetic import synthetic_workload

    last_arrival_ms = synthetic_workload(seed=0, num_requests=5, block_tokens=512,
                                         arrival_rate_per_s=4.0)[-1].arrival_ms
    assert last_arrival_ms > 1000  # five arrivals at 4/s: the run must last that long at scale 1
    args = ["run", "--live", "--limit", "5", "--ranks", "1", "--json"]
    assert main([*args, "--time-scale", "1"]) == 0
    honoured = json.loads(capsys.readouterr().out)
    assert honoured["time_scale"] == 1.0
    assert honoured["summary"]["simulated_s"] * 1000 >= last_arrival_ms
    assert main(args) == 0  # not given: the synthetic live default, 20x
    default = json.loads(capsys.readouterr().out)
    assert default["time_scale"] == 20.0
    assert default["summary"]["simulated_s"] * 1000 < last_arrival_ms


@pytest.mark.skipif(not HAS_LIVE, reason="needs kvlife[live] (torch, redis)")
def test_redis_ttl_reaches_the_redis_tier(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.redis_server import RedisServer

    with RedisServer() as server:
        trace = tmp_path / "live.jsonl"
        assert main(["run", "--live", "--limit", "30", "--ranks", "1", "--tier", "host=8", "--redis-url",
                     server.url, "--redis-ttl", "600", "--trace", str(trace), "--json"]) == 0
        header = orjson.loads(trace.read_bytes().splitlines()[0])
        assert header["config"]["live"]["redis_ttl_s"] == 600
        summary = json.loads(capsys.readouterr().out)["summary"]
        assert summary["prefix_hit_rate"]["remote"] >= 0 and summary["live"]["mismatches"] == 0


# ---- extras ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("hidden", "argv", "line"), [
    ("matplotlib", ["plot", "t.jsonl", "o.png"],
     "kvlife: error: kvlife plot needs matplotlib: pip install 'kvlife[plot]'"),
    ("torch", ["run", "--live"], "kvlife: error: kvlife run --live needs torch: pip install 'kvlife[live]'"),
    ("redis", ["run", "--live"], "kvlife: error: kvlife run --live needs redis: pip install 'kvlife[live]'"),
    ("torch", ["bench", "transfer", "--quick"],
     "kvlife: error: kvlife bench transfer needs torch: pip install 'kvlife[live]'"),
])
def test_a_missing_extra_is_one_line_naming_it(hidden: str, argv: list[str], line: str) -> None:
    proc = kvlife(*argv, prelude=f"import sys; sys.modules[{hidden!r}] = None")
    assert (proc.returncode, proc.stderr, proc.stdout) == (2, line + "\n", "")


def test_core_commands_need_no_extras(tmp_path: Path) -> None:
    """Simulation, traces, replay, validate, check, explain, export with torch, redis and
    matplotlib unimportable."""
    hide = "import sys\nfor m in ('torch', 'redis', 'matplotlib'): sys.modules[m] = None"
    steps = [
        ["run", "--limit", "20", "--trace", "r.jsonl"],
        ["compare", "--limit", "10", "--stack", "baseline", "--stack", "shared-loads"],
        ["replay", "r.jsonl"],
        ["replay", "r.jsonl", "--stack", "async-lookup"],
        ["validate", "r.jsonl"],
        ["check", "--examples", "3", "--steps", "10"],
        ["explain", "r.jsonl", "req-1"],
        ["export", "r.jsonl", "--perfetto", "p.json"],
        ["spec", "--format", "table"],
        ["policies"],
    ]
    for argv in steps:
        proc = kvlife(*argv, cwd=tmp_path, prelude=hide)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, (argv, proc.stderr)


# ---- progress ----------------------------------------------------------------------------------
def test_no_progress_when_stderr_is_not_a_terminal() -> None:
    proc = kvlife("run", "--limit", "300", "--json")
    assert proc.returncode == 0 and proc.stderr == ""
    json.loads(proc.stdout)


def test_progress_on_a_terminal_goes_to_stderr_with_rate(tmp_path: Path) -> None:
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "kvlife", "run", "--limit", "1500", "--json"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=slave, stdin=subprocess.DEVNULL, env=env)
    os.close(slave)
    seen = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    stdout = proc.communicate(timeout=120)[0]
    os.close(master)
    assert proc.returncode == 0
    assert b"kvlife run" in seen and b"req/s" in seen and b"1500" in seen
    assert _strict_json(stdout.decode())["kind"] == "run"  # stdout stays clean


# ---- interrupts --------------------------------------------------------------------------------
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_ends_the_run_in_one_line(tmp_path: Path, sig: signal.Signals, code: int) -> None:
    trace = tmp_path / "t.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # SIGINT is restored to its default in the child: a shell may start background jobs with it ignored.
    proc = subprocess.Popen([sys.executable, "-m", "kvlife", "run", "--limit", "100000", "--trace", str(trace)],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and written_so_far(trace) < 100_000:
        time.sleep(0.05)  # interrupt it mid-run, once the trace is being written
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert (proc.returncode, out) == (code, "")
    assert err.startswith("kvlife: interrupted") and err.count("\n") == 1, err
    lines = trace.read_bytes().splitlines()
    assert lines and all(isinstance(orjson.loads(line), dict) for line in lines[:-1])


def test_transfer_bench_module_entry_is_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    from kvlife.transfer.transfer_bench import main as bench_main

    assert bench_main(["--block-sizes", "16K", "--batches", "1", "--repeats", "1", "--pool-mb", "1",
                       "--tiers", "host", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kind"] == "bench-transfer"
