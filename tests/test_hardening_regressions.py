"""Regression tests for the failures of issue 24 ("Hardening, second round"), one per
numbered failure (each failed on the main branch the issue was filed against).

The fuzz suite for the same surfaces is ``tests/test_fuzz_hardening.py``; the campaign of
generated bad inputs is ``scripts/hardening_campaign.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from kvlife.lifecycle.cli.main import main
from kvlife.lifecycle.config import EngineConfig, RunConfig, SimConfig, TierConfig
from kvlife.lifecycle.drivers.runner import run_workload
from kvlife.lifecycle.traces.validate import ValidationReport, validate
from kvlife.lifecycle.workloads.synthetic import synthetic_workload


class Hang(BaseException):
    """A test ran past its bound (a BaseException: nothing in kvlife swallows it)."""


@contextlib.contextmanager
def bounded(seconds: float) -> Iterator[None]:
    """Fail instead of hanging: SIGALRM after ``seconds``."""

    def expire(signum: int, frame: object) -> None:
        raise Hang(f"still running after {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def exit_code(argv: list[str]) -> int:
    """``kvlife ARGV`` in-process: its exit code (argparse's own errors exit)."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2


# ---- 1: validate and --check agree on the async lookup cap (invariant 12) ------------------
def test_validate_accepts_answers_kept_past_the_lookup_cap(tmp_path: Path) -> None:
    """Past ``engine.max_async_lookups`` the engine keeps a request's last answer (a
    ``lookup_limit`` warning); validate counted no lookups from a trace and called every
    later use of that answer a violation of 12, while ``--check`` called the run clean."""
    config = RunConfig(engine=EngineConfig(device_blocks=40, max_async_lookups=2,
                                           tiers=(TierConfig("host", capacity_blocks=200),)),
                       policies=("async-lookup",), sim=SimConfig(check=True))
    path = tmp_path / "cap.jsonl"
    outcome = run_workload(config, synthetic_workload(seed=3, num_requests=40, arrival_rate_per_s=20.0),
                           trace_path=path)
    assert outcome.summary["warnings"].get("lookup_limit", 0) > 0  # the cap was reached
    assert outcome.summary["check"]["violations"] == 0
    report = validate(path)
    assert report.ok, report.format()


# ---- 2: validate finds repeated and missing records, and the header's request count -------
@pytest.fixture(scope="module")
def small_run(tmp_path_factory: pytest.TempPathFactory) -> list[bytes]:
    """A run that frees, evicts and reuses blocks: a small device and a small host tier."""
    path = tmp_path_factory.mktemp("structure") / "run.jsonl"
    config = RunConfig(engine=EngineConfig(device_blocks=40, max_batched_tokens=2048,
                                           tiers=(TierConfig("host", capacity_blocks=60),)))
    run_workload(config, synthetic_workload(seed=2, num_requests=50, arrival_rate_per_s=20.0, num_system_prompts=2,
                                            user_tokens=(200, 1500)), trace_path=path)
    lines = path.read_bytes().splitlines()
    assert validate(path).ok
    return lines


def _validate_lines(tmp_path: Path, lines: list[bytes]) -> ValidationReport:
    path = tmp_path / "corrupt.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return validate(path)


def _first(lines: list[bytes], needle: bytes) -> int:
    return next(i for i, raw in enumerate(lines) if needle in raw)


@pytest.mark.parametrize(("needle", "invariant"), [
    (b'"type":"arrival"', 0),
    (b'"kind":"step"', 0),
    (b'"kind":"free"', 8),
    (b'"kind":"evict"', 8),
])
def test_a_repeated_record_is_found(small_run: list[bytes], tmp_path: Path, needle: bytes, invariant: int) -> None:
    i = _first(small_run, needle)
    report = _validate_lines(tmp_path, [*small_run[: i + 1], small_run[i], *small_run[i + 1:]])
    assert not report.ok
    assert invariant in report.counts(), report.format()


def test_a_dropped_evict_record_is_found(small_run: list[bytes], tmp_path: Path) -> None:
    i = _first(small_run, b'"kind":"evict"')
    report = _validate_lines(tmp_path, small_run[:i] + small_run[i + 1:])
    assert 8 in report.counts() and "an evict record is missing" in report.format(), report.format()


def test_a_dropped_free_record_is_found(small_run: list[bytes], tmp_path: Path) -> None:
    # The last free of the run: its blocks, moved by a job, are never freed after it.
    i = max(i for i, raw in enumerate(small_run) if b'"kind":"free"' in raw)
    report = _validate_lines(tmp_path, small_run[:i] + small_run[i + 1:])
    assert 8 in report.counts() and "a free record is missing" in report.format(), report.format()


def test_a_header_only_trace_that_announces_requests_is_not_valid(small_run: list[bytes], tmp_path: Path) -> None:
    header = orjson.loads(small_run[0])
    header["workload"] = {"name": "synthetic", "requests": 8}
    report = _validate_lines(tmp_path, [orjson.dumps(header)])
    assert not report.ok and "announces 8 requests, 0 arrived" in report.format(), report.format()


# ---- 3: a refused run never replaces an existing trace ------------------------------------
BAD_POLICY = '''
class P:
    asked = 0

    def on_arrival(self, req, engine):
        P.asked += 1
        return 5 if P.asked > 3 else None
'''


@pytest.mark.parametrize("refusal", ["workload", "policy"])
def test_a_refused_run_keeps_the_existing_trace(tmp_path: Path, refusal: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "keep.jsonl"
    assert main(["run", "--limit", "20", "--trace", str(trace)]) == 0
    kept = trace.read_bytes()
    if refusal == "workload":
        workload = tmp_path / "bad.jsonl"
        workload.write_text('{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}\n{bad\n')
        argv = ["run", "--workload", str(workload), "--trace", str(trace)]
    else:
        (tmp_path / "badp.py").write_text(BAD_POLICY)
        argv = ["run", "--limit", "20", "--stack", f"{tmp_path / 'badp.py'}:P", "--trace", str(trace)]
    capsys.readouterr()
    assert main(argv) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert trace.read_bytes() == kept  # untouched
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary file left
    # Where no trace was, the refused run leaves the trace so far, ended by its error: valid.
    fresh = tmp_path / "fresh.jsonl"
    assert main([*argv[:-1], str(fresh)]) == 2
    last = orjson.loads(fresh.read_bytes().splitlines()[-1])
    assert last["kind"] == "interrupted" and last["signal"] is None and last["error"]
    assert validate(fresh).ok, validate(fresh).format()


# ---- 4: an integer past a float's range, in any number field, is one line ----------------
HUGE = "9" * 400


@pytest.mark.parametrize("argv", [
    ["run", "--time-scale", HUGE],
    ["run", "--transfer-deadline", HUGE],
    ["capacity", "--slo", "ttft_p90=2s", "--min-scale", HUGE],
    ["capacity", "--slo", "ttft_p90=2s", "--stability-ratio", HUGE],
    ["sweep", "run", "-o", "unused.jsonl", "--vary", f"sim.time_scale=1,{HUGE}", "--dry-run"],
    ["sweep", "run", "-o", "unused.jsonl", "--set", f"engine.lookup_latency_ms={HUGE}", "--dry-run"],
])
def test_a_huge_integer_flag_is_one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert exit_code(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "must be a finite number" in err, err


@pytest.mark.parametrize(("name", "text"), [
    ("config.toml", f"[sim]\ntime_scale = {HUGE}\n"),
    ("grid.toml", f'[grid]\n"sim.time_scale" = [1, {HUGE}]\n'),
])
def test_a_huge_integer_in_a_file_is_one_line(tmp_path: Path, name: str, text: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / name
    path.write_text(text)
    argv = ["run", "--config", str(path)] if name == "config.toml" else \
        ["sweep", "run", str(path), "-o", str(tmp_path / "out.jsonl"), "--dry-run"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{path}:2: field" in err and "must be a finite number" in err, err


# ---- 7 and 8: a sweep's grid is capped, --jobs bounded, --dry-run imports nothing ---------
def test_an_oversized_grid_is_refused_before_it_is_expanded(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """8 axes of 40 values never returned, even with --dry-run."""
    axes = [f"sim.seed={','.join(str(i) for i in range(40))}"] + [
        f"{key}={','.join(str(v) for v in range(1, 41))}"
        for key in ("engine.max_running", "sim.lookup_workers", "engine.max_async_lookups", "engine.lookup_latency_ms",
                    "sim.rank_jitter_ms", "engine.max_batched_tokens", "tiers.host.capacity_blocks")]
    argv = ["sweep", "run", "-o", str(tmp_path / "r.jsonl"), "--dry-run"]
    for axis in axes:
        argv += ["--vary", axis]
    assert exit_code(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "6,553,600,000,000 points" in err and "--max-points" in err, err
    # The cap is the user's to move: the same grid within it runs.
    small = ["sweep", "run", "-o", str(tmp_path / "r.jsonl"), "--dry-run", "--vary", "sim.seed=1,2,3",
             "--vary", "engine.max_running=1,2", "--max-points", "6", "--limit", "3"]
    assert exit_code(small) == 0
    assert exit_code([*small[:-4], "--max-points", "5", "--limit", "3"]) == 2


def test_jobs_is_bounded_by_the_cpus(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvlife.lifecycle.cli.commands.capacity import usable_cpus

    argv = ["sweep", "run", "-o", str(tmp_path / "r.jsonl"), "--limit", "3", "--dry-run",
            "--jobs", str(usable_cpus() + 1)]
    assert exit_code(argv) == 2
    assert "argument --jobs: must be at most" in capsys.readouterr().err


def test_a_dry_run_imports_no_policy_module(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    marker = tmp_path / "imported"
    (tmp_path / "p.py").write_text(f"open({str(marker)!r}, 'w').close()\n"
                                   "class P:\n    def admission(self, req, load, engine):\n        return None\n")
    argv = ["sweep", "run", "-o", str(tmp_path / "r.jsonl"), "--limit", "3", "--dry-run",
            "--stack", f"{tmp_path / 'p.py'}:P"]
    assert exit_code(argv) == 0, capsys.readouterr().err
    assert not marker.exists()
    assert exit_code([*argv[:-1], f"{tmp_path / 'missing.py'}:P"]) == 2  # a wrong name is still refused


# ---- 10: calibrate and sweep plot refuse in one line --------------------------------------
@pytest.mark.parametrize(("row", "field"), [
    (b"512,0,0,5e-324\n", "step_ms"),  # ZeroDivisionError
    (b"512,0,0,\xff\xfe\n", "-"),  # not UTF-8
])
def test_calibrate_refuses_a_bad_row_in_one_line(tmp_path: Path, row: bytes, field: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "steps.csv"
    path.write_bytes(b"prefill_tokens,decode_requests,context_tokens,step_ms\n" + row)
    assert main(["calibrate", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{path}:2: field '{field}'" in err, err


@pytest.fixture(scope="module")
def sweep_results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sweep") / "results.jsonl"
    assert main(["sweep", "run", "-o", str(path), "--limit", "3", "--vary", "sim.time_scale=0.5,1,2"]) == 0
    return path


@pytest.mark.parametrize("value", [1e308, -1e308])
def test_sweep_plot_refuses_values_too_large_to_draw(sweep_results: Path, tmp_path: Path, value: float,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    rows = [orjson.loads(line) for line in sweep_results.read_bytes().splitlines()]
    rows[0]["ttft_p90_ms"] = value
    path = tmp_path / "big.jsonl"
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    capsys.readouterr()
    assert main(["sweep", "plot", str(path), "-o", str(tmp_path / "p.png"),
                 "--pareto", "x=sim.time_scale,y=ttft_p90_ms"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "too large to plot" in err, err
    assert not (tmp_path / "p.png").exists()


def test_sweep_plot_refuses_an_unknown_image_format(sweep_results: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    capsys.readouterr()
    assert main(["sweep", "plot", str(sweep_results), "-o", str(tmp_path / "p.nope"),
                 "--pareto", "x=sim.time_scale,y=ttft_p90_ms"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unsupported image extension '.nope'" in err, err


# ---- 9: a policy hook that never returns ends the run in one line -------------------------
NEVER_RETURNS = '''
import time


class Spin:
    def on_arrival(self, req, engine):
        if req.request_id == "req-3":
            while True:
                pass
        return None


class Sleep:
    def on_arrival(self, req, engine):
        if req.request_id == "req-3":
            time.sleep(10**6)
        return None
'''


@pytest.mark.parametrize("policy", ["Spin", "Sleep"])
def test_a_hook_that_never_returns_ends_the_run(tmp_path: Path, policy: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "hang.py").write_text(NEVER_RETURNS)
    trace = tmp_path / "t.jsonl"
    argv = ["run", "--limit", "10", "--stack", f"{tmp_path / 'hang.py'}:{policy}", "--hook-budget", "0.3",
            "--trace", str(trace)]
    with bounded(30.0):  # (on main this ran for ever: an assertion, not a hung suite)
        code = main(argv)
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"policy {policy}" in err and "hook on_arrival ran past its time budget of 0.3 s" in err
    assert "request req-3" in err
    assert validate(trace).ok  # the trace so far, ended by the error


def test_a_policy_raising_keyboard_interrupt_is_a_policy_error(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """14: it exited 130, "interrupted (SIGINT)", though no signal came."""
    (tmp_path / "p.py").write_text("class P:\n    def on_arrival(self, req, engine):\n"
                                   "        raise KeyboardInterrupt\n")
    assert main(["run", "--limit", "10", "--stack", f"{tmp_path / 'p.py'}:P"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "hook on_arrival raised KeyboardInterrupt" in err, err


# ---- 11: defaults are None until resolved once; an empty config file changes nothing -------
def test_a_bare_engine_and_a_run_share_one_default() -> None:
    from kvlife.lifecycle.drivers.physics import resolve
    from kvlife.lifecycle.engine.core import Engine
    from kvlife.policies.stack import PolicyStack

    config = RunConfig()
    assert config.engine.device_blocks_set is None and config.engine.ranks_set is None
    derived = resolve(config)[0].engine
    engine = Engine(EngineConfig(), PolicyStack([]))
    assert engine.pool.capacity == derived.device_blocks == 821  # it was 2,000 against 821
    assert engine.ranks.world_size == derived.ranks == 1


def test_an_empty_config_file_changes_nothing_in_a_live_run(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    headers = []
    for extra in ([], ["--config", str(empty)]):
        trace = tmp_path / f"live{len(extra)}.jsonl"
        assert main(["run", "--live", "--limit", "3", "--trace", str(trace), *extra]) == 0
        text = trace.read_bytes().splitlines()[0]
        assert b"Derived" not in text
        headers.append(orjson.loads(text)["config"])
    assert headers[1] == headers[0]  # (2 ranks, a host and a disk tier; it was 1 rank, 8,000 host blocks)
    assert headers[0]["engine"]["ranks"] == 2 and [t["name"] for t in headers[0]["engine"]["tiers"]] == ["host",
                                                                                                          "disk"]


# ---- 12: a kept disk tier's recovered blocks are indexed, and replay starts from them ------
def test_a_restarted_live_run_hits_the_blocks_its_disk_tier_recovered(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    from kvlife.lifecycle.traces.replay import replay

    disk = tmp_path / "disk"
    runs = []
    for n in (1, 2):
        trace = tmp_path / f"run{n}.jsonl"
        assert main(["run", "--live", "--limit", "40", "--disk-path", str(disk), "--trace", str(trace), "--json"]) == 0
        runs.append((json.loads(capsys.readouterr().out)["summary"], trace))
    (first, _), (second, trace) = runs
    header = orjson.loads(trace.read_bytes().splitlines()[0])
    recovered = header["recovered"]["disk"]
    assert len(recovered) > 0  # the first run's disk blocks, indexed again
    assert second["prefix_hit_rate"]["disk"] > first["prefix_hit_rate"]["disk"]  # (it loaded 0 of them before)
    assert second["live"]["blocks_verified"] > 0 and second["live"]["mismatches"] == 0
    assert validate(trace).ok
    assert replay(trace).identical  # the replayed engine starts from the same index


# ---- 13: each extra declares what its code imports ------------------------------------------
ROOT = Path(__file__).resolve().parents[1]
# Import names -> distribution names where they differ.
DISTRIBUTIONS = {"statemachine": "python-statemachine"}


def _requirement_names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[ ;]", r, maxsplit=1)[0].strip().lower() for r in requirements}


def test_every_extra_declares_what_its_code_imports() -> None:
    """``pip install 'kvlife[live]'`` gave a live mode that failed every store: numpy (which
    torch's Tensor.numpy() needs, transfer/layout.py) was not declared, and ``dev`` hid it."""
    import ast
    import sys
    import tomllib

    from kvlife.lifecycle.cli.extras import OPTIONAL_EXTRAS

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = {name: _requirement_names(reqs) for name, reqs in project["optional-dependencies"].items()}
    core = _requirement_names(project["dependencies"])
    for module, extra in OPTIONAL_EXTRAS.items():
        assert DISTRIBUTIONS.get(module, module) in extras[extra], (module, extra)
    assert "numpy" in extras["live"]
    # Every third-party module the package imports is core or an extra's (vLLM's connector runs inside vLLM).
    imported: set[str] = set()
    for top in ("lifecycle", "policies", "specs", "transfer"):
        for path in (ROOT / top).rglob("*.py"):
            if "drivers/vllm" in path.as_posix():
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    imported.update(alias.name.split(".")[0] for alias in node.names)
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    imported.add(node.module.split(".")[0])
    third_party = {m for m in imported if m not in sys.stdlib_module_names and m != "kvlife"}
    undeclared = {m for m in third_party if DISTRIBUTIONS.get(m, m) not in core and m not in OPTIONAL_EXTRAS}
    assert undeclared == set(), undeclared


# ---- 14: the minor ones -------------------------------------------------------------------------
def test_an_empty_workload_name_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert exit_code(["run", "--workload", "", "--limit", "3"]) == 2  # it ran the synthetic workload
    assert "argument --workload: must be a non-empty string" in capsys.readouterr().err


def test_mrc_of_an_empty_file_is_refused_as_run_refuses_it(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["run", "--workload", str(empty)]) == 2
    assert main(["mrc", str(empty)]) == 2  # it exited 0
    assert capsys.readouterr().err.splitlines()[-1] == f"kvlife: error: {empty}: no requests"


def test_export_refuses_to_overwrite_its_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    assert main(["run", "--limit", "5", "--trace", str(trace)]) == 0
    kept = trace.read_bytes()
    capsys.readouterr()
    assert main(["export", str(trace), "--perfetto", str(trace)]) == 2
    assert "it is an input of this command" in capsys.readouterr().err
    assert trace.read_bytes() == kept


def test_a_missing_profile_file_is_blamed_on_the_config_line_that_names_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "c.toml"
    config.write_text('[sim]\nseed = 1\nhardware = "gone.toml"\n')
    assert main(["run", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvlife: error: {config}:3: field 'sim.hardware': cannot read hardware profile"), err


def test_a_profile_figure_past_any_hardware_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvlife.lifecycle.profiles.catalog import _data_dir

    text = (_data_dir("hardware") / "h100-sxm.toml").read_text()
    profile = tmp_path / "hw.toml"
    profile.write_text(re.sub(r"(?m)^host_link_gb_s = .*$", f"host_link_gb_s = {2**63 - 1}", text))
    assert main(["run", "--limit", "3", "--hardware", str(profile)]) == 2
    assert "field 'host_link_gb_s': must be from" in capsys.readouterr().err


def test_a_fifo_given_as_an_input_is_refused_not_waited_on(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for argv in (["run", "--workload", str(fifo)], ["validate", str(fifo)], ["run", "--config", str(fifo)],
                 ["calibrate", str(fifo)]):
        with bounded(20.0):
            assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "FIFO" in err, err


# ---- 5: a gzip bomb is refused before it takes the machine's memory -----------------------
@pytest.fixture(scope="module")
def one_line_bomb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """128 MiB of one line in 128 KiB (the issue's was 512 MiB in 0.5 MB)."""
    import gzip

    path = tmp_path_factory.mktemp("bomb") / "bomb.jsonl.gz"
    with gzip.open(path, "wb", compresslevel=9) as f:
        for _ in range(128):
            f.write(b"a" * (1 << 20))
    return path


@pytest.mark.parametrize("command", [["validate"], ["run", "--workload"], ["explain", "{}", "req-0"], ["replay"],
                                     ["mrc"]], ids=lambda c: c[0])
def test_a_gzip_bomb_is_refused_in_bounded_memory(one_line_bomb: Path, command: list[str],
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    import tracemalloc

    argv = [command[0], str(one_line_bomb), *command[2:]] if "{}" in command else [*command, str(one_line_bomb)]
    tracemalloc.start()
    try:
        code = exit_code(argv)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert code == 2
    assert "longer than" in capsys.readouterr().err
    assert peak < 64 << 20, f"peak {peak >> 20} MiB"  # (1.2-2.7 GB for the bomb)


# ---- 6: a trace header's sizes are no request for memory ----------------------------------
def test_replay_refuses_a_header_that_asks_for_gigabytes(small_run: list[bytes], tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    header = orjson.loads(small_run[0])
    header["config"]["engine"]["device_blocks"] = 24_000_000
    path = tmp_path / "bomb.jsonl"
    path.write_bytes(b"\n".join([orjson.dumps(header), *small_run[1:60]]) + b"\n")
    assert main(["replay", str(path)]) == 2  # (it took 3.9 GB and 54 s)
    err = capsys.readouterr().err
    assert "field 'config.engine.device_blocks'" in err and "rebuild the engine" in err, err


# ---- 14: a large calibration CSV is fitted on a sample ----------------------------------------
def test_calibrate_fits_a_large_csv_on_a_sample_and_judges_all_rows(tmp_path: Path) -> None:
    """A 200,000-row CSV took over 90 s: every trial of the search evaluated every row."""
    from kvlife.lifecycle.profiles.calibrate import FIT_ROWS, calibrate
    from kvlife.lifecycle.profiles.catalog import load_hardware, load_model

    path = tmp_path / "steps.csv"
    rows = [f"{512 * (i % 4)},{1 + i % 64},{(i * 37) % 8192},{5 + (i % 97) * 0.7:.3f}" for i in range(4 * FIT_ROWS)]
    path.write_text("prefill_tokens,decode_requests,context_tokens,step_ms\n" + "\n".join(rows) + "\n")
    result = calibrate(path, load_model("llama-3-8b"), load_hardware("h100-sxm"))
    assert result.rows == 4 * FIT_ROWS and result.fitted_rows == FIT_ROWS


def test_a_prompt_of_2_to_the_63_tokens_fails_at_its_arrival_without_deriving_its_block_names() -> None:
    """Found by the deep fuzz profile (replay of an arrival of 2^63 tokens hung): a prompt that
    can never fit fails at its arrival, and only the device's size of block names is derived
    for it (the connector core is told of it all the same)."""
    from kvlife.lifecycle.config import EngineConfig
    from kvlife.lifecycle.engine.core import Engine
    from kvlife.lifecycle.engine.events import Arrival
    from kvlife.policies.stack import PolicyStack

    engine = Engine(EngineConfig(device_blocks=32), PolicyStack([]))
    engine.handle(Arrival(0.0, "a", 2**63, (1, 2)))
    req = engine.requests["a"]
    assert (req.state, req.finish_reason) == ("finished", "error")
    assert len(req.hashes) == 32 + 1 and req.hashes[:2] == (1, 2)
