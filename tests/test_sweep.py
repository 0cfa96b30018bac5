"""``kvlife sweep run|plot``: grid specs, rows, resuming, local processes against Ray."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvlife.lifecycle.cli.main import main
from kvlife.lifecycle.config import RunConfig
from kvlife.lifecycle.sweeps.grid import expand, read_spec
from kvlife.lifecycle.sweeps.plots import Pareto, pareto_front, parse_pareto
from kvlife.lifecycle.sweeps.points import INPUT_COLUMNS, OUTPUT_COLUMNS, Point, apply, execute
from kvlife.lifecycle.sweeps.results import ResultsFile, encode, read_rows

ROOT = Path(__file__).resolve().parents[1]

GRID = """\
workload = "synthetic"
limit = 20

[set]
engine.lookup_latency_ms = 2.0

[grid]
"policies.stack" = ["baseline", "async-lookup,shared-loads"]
sim.time_scale = [1, 4]
tiers.host.capacity_blocks = [0, 500]
"""


def _spec(tmp_path: Path, text: str = GRID, name: str = "grid.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _sweep(*argv: str, capsys: pytest.CaptureFixture[str]) -> dict:
    assert main(["sweep", "run", *argv, "--json"]) == 0
    out = capsys.readouterr().out
    report = json.loads(out)
    assert list(report)[:2] == ["kind", "schema"] and report["kind"] == "sweep"
    return report


def test_the_grid_is_every_combination_with_every_input_a_column(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    points = expand(read_spec(_spec(tmp_path)))
    assert len(points) == 8
    first = points[0]
    assert first.config.policies == () and first.config.sim.time_scale == 1.0
    assert first.config.engine.tiers == () and first.config.engine.lookup_latency_ms == 2.0
    # The last axis varies fastest; 1 and 1.0 are one input (one key).
    assert [p.config.engine.tiers[0].capacity_blocks if p.config.engine.tiers else 0 for p in points[:2]] == [0, 500]
    same = Point("synthetic", 20, apply(first.config, "sim.time_scale", 1.0))
    assert same.key() == first.key()
    report = _sweep(str(_spec(tmp_path)), "-o", str(tmp_path / "out.jsonl"), capsys=capsys)
    assert report["points"] == 8 and report["ran"] == 8 and report["resumed"] == 0
    rows = read_rows(tmp_path / "out.jsonl")
    assert [r["key"] for r in rows] == [p.key() for p in points]  # grid order once finished
    for row in rows:
        assert list(row) == [*INPUT_COLUMNS, *OUTPUT_COLUMNS]
        assert row["requests"] == 20 and row["stranded"] == 0
        assert "wall_s" not in row
    by = {(r["policies.stack"], r["sim.time_scale"], r["tiers.host.capacity_blocks"]): r for r in rows}
    assert by[("baseline", 1.0, None)]["hit_rate_host"] is None  # no host tier: null, not 0
    assert by[("baseline", 1.0, 500)]["hit_rate_host"] is not None
    assert by[("async-lookup,shared-loads", 4.0, 500)]["sync_lookups"] == 0
    assert by[("baseline", 4.0, 500)]["sync_lookups"] > 0
    # A second run of the same grid runs nothing.
    again = _sweep(str(_spec(tmp_path)), "-o", str(tmp_path / "out.jsonl"), capsys=capsys)
    assert again["ran"] == 0 and again["resumed"] == 8


def test_flags_add_axes_and_values(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = _sweep("--limit", "10", "--stack", "baseline", "--stack", "early-lookup", "--vary",
                    "engine.lookup_latency_ms=1,10", "--set", "sim.seed=3", "-o", str(tmp_path / "f.jsonl"),
                    capsys=capsys)
    assert report["points"] == 4
    rows = read_rows(tmp_path / "f.jsonl")
    assert {(r["policies.stack"], r["engine.lookup_latency_ms"]) for r in rows} == {
        ("baseline", 1.0), ("baseline", 10.0), ("early-lookup", 1.0), ("early-lookup", 10.0)}
    assert {r["sim.seed"] for r in rows} == {3} and {r["limit"] for r in rows} == {10}


def test_any_config_key_is_an_axis(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = _sweep("--limit", "10", "--vary", "sim.hardware=h100-sxm,a100-80gb", "--vary", "engine.max_running=2,64",
                    "--vary", "tiers.disk.capacity_blocks=0,100", "-o", str(tmp_path / "any.jsonl"), capsys=capsys)
    assert report["points"] == 8
    rows = read_rows(tmp_path / "any.jsonl")
    blocks = {r["sim.hardware"]: r["device_blocks"] for r in rows}
    assert blocks["h100-sxm"] != blocks["a100-80gb"]  # derived from each GPU's memory
    assert {r["tiers.disk.capacity_blocks"] for r in rows} == {None, 100}
    assert all((r["hit_rate_disk"] is None) == (r["tiers.disk.capacity_blocks"] is None) for r in rows)


@pytest.mark.parametrize(("text", "message"), [
    ('workload = "synthetic"\n[grid]\nsim.time_scale = [1, "fast"]\n',
     "grid.toml:3: field 'grid.sim.time_scale[1]': must be a positive number, got 'fast'"),
    ('[grid]\nsim.time_scal = [1, 2]\n',
     "grid.toml:2: field 'grid.sim.time_scal': unknown config key (did you mean 'sim.time_scale'?)"),
    ('limit = 5\n\n[grid]\n"policies.stack" = ["baseline", "no-such-policy"]\n',
     "grid.toml:4: field 'grid.policies.stack[1]': unknown policy 'no-such-policy'"),
    ('[grid.tiers.disk]\nlatency_ms = [1.0, 2.0]\n',
     "grid.toml:2: field 'grid.tiers.disk.latency_ms[0]': the config has no disk tier; "
     "set tiers.disk.capacity_blocks first"),
    ('[grid]\nengine.device_blocks = 64\n',
     "grid.toml:2: field 'grid.engine.device_blocks': must be a non-empty array of values, got 64"),
    ('[set]\nsim.hardware = "no-such-gpu"\n',
     "grid.toml:2: field 'set.sim.hardware': unknown hardware profile 'no-such-gpu'"),
    ('limt = 5\n', "grid.toml:1: field 'limt': unknown key (did you mean 'limit'?)"),
    ('[grid]\nsim.seed = [1, 2\n', "grid.toml:2:17: TOML syntax error: Unclosed array"),
])
def test_a_bad_grid_spec_is_one_line_naming_file_line_and_field(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                               text: str, message: str) -> None:
    spec = _spec(tmp_path, text)
    assert main(["sweep", "run", str(spec), "-o", str(tmp_path / "out.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"kvlife: error: {tmp_path / message.split(':')[0]}:{message.split(':', 1)[1]}"), err
    assert not (tmp_path / "out.jsonl").exists()  # nothing ran


def test_an_unreadable_grid_spec_is_one_line_naming_the_file(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    binary = tmp_path / "bin.toml"
    binary.write_bytes(b"limit = 5\n\xff\n")
    huge = _spec(tmp_path, "limit = 5\n[grid]\nsim.seed = [" + "9" * 4400 + "]\n", "huge.toml")
    for spec, message in [
        (tmp_path / "missing.toml", "cannot read grid spec: No such file or directory"),
        (tmp_path, "cannot read grid spec: Is a directory"),
        (binary, "cannot read grid spec: not UTF-8 text (byte 10)"),
        (huge, "3: field 'grid.sim.seed': an integer of more than 4300 digits"),
    ]:
        assert main(["sweep", "run", str(spec), "-o", str(tmp_path / "out.jsonl")]) == 2
        err = capsys.readouterr().err
        assert err == f"kvlife: error: {spec}:{'' if message[0].isdigit() else ' '}{message}\n", err
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize(("argv", "message"), [
    (["--vary", "sim.time_scale"], "argument --vary: expected KEY=V1,V2,..., got 'sim.time_scale'"),
    (["--vary", "engine.device_blok=1,2"], "argument --vary: engine.device_blok: unknown config key "
                                           "(did you mean 'engine.device_blocks'?)"),
    (["--vary", "engine.device_blocks=0,5"], "argument --vary: engine.device_blocks=0: must be a positive integer"),
    (["--set", "sim.completions=never"], "argument --set: sim.completions=never: must be one of"),
])
def test_bad_flags_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
                                message: str) -> None:
    assert main(["sweep", "run", "--limit", "5", *argv, "-o", str(tmp_path / "o.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvlife sweep run: error: {message}") and err.count("\n") == 1, err


# One row computed in a fresh interpreter: the point built from (time scale, stack), its row
# written as a results file writes it.
ROW_IN_A_CHILD = """
import sys
from kvlife.lifecycle.config import RunConfig
from kvlife.lifecycle.sweeps.points import Point, apply, execute
from kvlife.lifecycle.sweeps.results import encode

config = apply(apply(RunConfig(), "sim.time_scale", float(sys.argv[1])), "policies.stack", sys.argv[2])
sys.stdout.buffer.write(encode(execute(Point("synthetic", 15, config), (("ttft", 95.0),))))
"""


def test_rows_are_the_same_in_any_process() -> None:
    stack = "async-lookup,shared-loads"  # two policies: an order that followed a set would show

    def here(scale: float) -> dict:
        return execute(Point("synthetic", 15, apply(apply(RunConfig(), "sim.time_scale", scale),
                                                     "policies.stack", stack)), (("ttft", 95.0),))

    # Two other interpreters, with hash seeds 1 and 2 (this one's is random unless
    # PYTHONHASHSEED is set): a row that depended on its process (a set's order, an id, a pid,
    # the time) would differ between them somewhere.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    children = [subprocess.Popen([sys.executable, "-c", ROW_IN_A_CHILD, "2", stack], cwd=ROOT,
                                 env={**env, "PYTHONHASHSEED": seed}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                for seed in ("1", "2")]
    row = here(2.0)
    for child in children:
        out, err = child.communicate(timeout=300)
        assert child.returncode == 0, err.decode()
        assert out == encode(row)
    # A row carries what the run gave: another point, another row (outputs included).
    other = here(4.0)
    assert other["key"] != row["key"]
    assert [c for c in OUTPUT_COLUMNS if other[c] != row[c]], "a different load changed no output"
    assert row["policies"] == "async-lookup,shared-loads"
    assert row["ttft_p90_ms"] <= row["ttft_p95_ms"] <= row["ttft_p99_ms"]


def test_jobs_and_ray_give_identical_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _spec(tmp_path)
    _sweep(str(spec), "-o", str(tmp_path / "local.jsonl"), "--jobs", "2", capsys=capsys)
    local = (tmp_path / "local.jsonl").read_bytes()
    ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'kvlife[ray]')")
    # The workers Ray starts import kvlife from this checkout, as this process does.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        report = _sweep(str(spec), "-o", str(tmp_path / "ray.jsonl"), "--ray", capsys=capsys)
    finally:
        ray.shutdown()
    assert report["ran"] == 8 and report["executor"].startswith("Ray")
    assert (tmp_path / "ray.jsonl").read_bytes() == local
    assert len(read_rows(tmp_path / "ray.jsonl")) == 8


def test_a_ray_that_does_not_start_is_one_line_and_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'kvlife[ray]')")

    def timed_out(**_: object) -> None:
        raise Exception("The current node timed out during startup.\nThis could happen because ...")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", timed_out)
    out = tmp_path / "ray.jsonl"
    assert main(["sweep", "run", str(_spec(tmp_path)), "-o", str(out), "--ray"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("kvlife sweep run: error: Ray did not start (a local Ray): "
                          "Exception: The current node timed out")
    assert not out.exists() or read_rows(out) == []


def test_a_killed_sweep_resumes_without_redoing_finished_runs(tmp_path: Path) -> None:
    spec = _spec(tmp_path, GRID.replace("limit = 20", "limit = 150"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "killed.jsonl"
    command = [sys.executable, "-m", "kvlife", "sweep", "run", str(spec), "-o", str(out)]
    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if out.exists() and out.read_bytes().count(b"\n") >= 2:
            break
        time.sleep(0.01)
    assert proc.poll() is None, "the sweep finished before it could be killed: make its runs longer"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = ResultsFile(out).load(repair=False)
    assert 2 <= len(before) < 8
    resumed = subprocess.run([*command, "--json"], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0 and "Traceback" not in resumed.stderr, resumed.stderr
    report = json.loads(resumed.stdout)
    assert report["resumed"] == len(before) and report["ran"] == 8 - len(before)
    assert not set(report["ran_keys"]) & set(before)  # no finished run was redone
    whole = tmp_path / "whole.jsonl"
    subprocess.run([sys.executable, "-m", "kvlife", "sweep", "run", str(spec), "-o", str(whole)], cwd=tmp_path,
                   env=env, check=True, capture_output=True, timeout=300)
    assert out.read_bytes() == whole.read_bytes()


def test_a_row_cut_short_is_dropped_and_run_again(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = _spec(tmp_path, GRID.replace('"policies.stack" = ["baseline", "async-lookup,shared-loads"]\n', ""))
    out = tmp_path / "cut.jsonl"
    _sweep(str(spec), "-o", str(out), capsys=capsys)
    whole = out.read_bytes()
    lines = whole.splitlines(keepends=True)
    out.write_bytes(b"".join(lines[:2]) + lines[2][:40])  # killed while writing the third row
    report = _sweep(str(spec), "-o", str(out), capsys=capsys)
    assert report["resumed"] == 2 and report["ran"] == 2
    assert out.read_bytes() == whole


def test_dry_run_lists_points(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sweep", "run", str(_spec(tmp_path)), "-o", str(tmp_path / "d.jsonl"), "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 9 and out[-1] == f"8 points, 0 already in {tmp_path / 'd.jsonl'}"
    assert not (tmp_path / "d.jsonl").exists()


def _scores(row: dict, x: str, y: str) -> tuple[float, float]:
    return float(row[x]), float(row[y])


def assert_the_front(rows: list[dict], front_keys: list[str], x: tuple[str, bool], y: tuple[str, bool]) -> None:
    """``front_keys`` are the rows of ``rows`` that no other row beats, found here by brute force:
    each (column, maximize) pair oriented so that less is better, a row beaten by another that
    is no worse in both columns and better in one."""
    def better(a: dict, b: dict) -> bool:  # a beats b
        sa = [-float(a[c]) if up else float(a[c]) for c, up in (x, y)]
        sb = [-float(b[c]) if up else float(b[c]) for c, up in (x, y)]
        return all(p <= q for p, q in zip(sa, sb, strict=True)) and sa != sb

    assert len(set(front_keys)) == len(front_keys)
    front = [r for r in rows if r["key"] in front_keys]
    assert len(front) == len(front_keys)  # every front row is one of the rows
    for r in front:  # nothing beats a row of the front ...
        assert not any(better(o, r) for o in rows), r["key"]
    for r in rows:  # ... and every row off the front is beaten by a row of the front: it is complete
        if r["key"] not in front_keys:
            assert any(better(f, r) for f in front), r["key"]
    brute = [r for r in rows if not any(better(o, r) for o in rows)]
    assert len(front_keys) == len(brute)
    assert [r["key"] for r in sorted(front, key=lambda r: _scores(r, x[0], y[0]))] == front_keys  # sorted by x


def test_pareto_front_by_hand() -> None:
    # Minimizing both: b is beaten by a (same x, larger y), e by c (larger in both); c and d tie,
    # so neither beats the other; f has no x and is left out. The front is a, c, d.
    points = {"a": (1, 5), "b": (1, 6), "c": (2, 2), "d": (2, 2), "e": (3, 3), "f": (None, 1)}
    rows = [{"key": k, "x": x, "y": y} for k, (x, y) in points.items()]
    assert [r["key"] for r in pareto_front(rows, Pareto("x", "y"))] == ["a", "c", "d"]
    # Maximizing y: b has the smallest x and the largest y, so it beats every other row.
    assert [r["key"] for r in pareto_front(rows, parse_pareto("x=x,y=max:y"))] == ["b"]
    # Maximizing both: e has the largest x, b the largest y, and each of a, c, d is beaten by one of them.
    assert [r["key"] for r in pareto_front(rows, parse_pareto("x=max:x,y=max:y"))] == ["b", "e"]


def test_plot_draws_heatmaps_and_pareto_fronts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib", reason="the plot extra is not installed")
    results = tmp_path / "out.jsonl"
    _sweep(str(_spec(tmp_path)), "-o", str(results), capsys=capsys)
    image = tmp_path / "sweep.png"
    assert main(["sweep", "plot", str(results), "-o", str(image), "--where", "policies.stack=baseline",
                 "--heatmap", "x=sim.time_scale,y=tiers.host.capacity_blocks,value=ttft_p90_ms",
                 "--pareto", "x=ttft_p90_ms,y=max:throughput_tokens_per_s,label=policies.stack", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert list(report)[:2] == ["kind", "schema"] and report["kind"] == "sweep-plot"
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["rows"] == 4
    baseline = [r for r in read_rows(results) if r["policies.stack"] == "baseline"]
    front_keys = [r["key"] for r in report["paretos"][0]["front"]]
    assert 0 < len(front_keys) < len(baseline)  # some rows on the front, some off it
    assert_the_front(baseline, front_keys, ("ttft_p90_ms", False), ("throughput_tokens_per_s", True))
    # Every row, both stacks: two minimized columns, then the pair above. Rows equal in both
    # columns (the two stacks run alike without a host tier) are both on the front, as neither
    # beats the other.
    assert main(["sweep", "plot", str(results), "-o", str(image), "--pareto", "x=ttft_p90_ms,y=tpot_p90_ms",
                 "--pareto", "x=ttft_p90_ms,y=max:throughput_tokens_per_s", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = read_rows(results)
    assert report["rows"] == len(rows) == 8
    assert_the_front(rows, [r["key"] for r in report["paretos"][0]["front"]], ("ttft_p90_ms", False),
                     ("tpot_p90_ms", False))
    front_keys = [r["key"] for r in report["paretos"][1]["front"]]
    assert_the_front(rows, front_keys, ("ttft_p90_ms", False), ("throughput_tokens_per_s", True))
    assert any(a != b and _scores(a, "ttft_p90_ms", "throughput_tokens_per_s") == _scores(
        b, "ttft_p90_ms", "throughput_tokens_per_s") for a in rows for b in rows if a["key"] in front_keys
        and b["key"] in front_keys), "no tie on the front: the case is not exercised"
    # Two rows in one cell: one line naming what differs.
    assert main(["sweep", "plot", str(results), "-o", str(image),
                 "--heatmap", "x=sim.time_scale,y=tiers.host.capacity_blocks,value=ttft_p90_ms"]) == 2
    err = capsys.readouterr().err
    assert "several rows for sim.time_scale=1.0, tiers.host.capacity_blocks=None (they differ in policies.stack" \
           in err and err.count("\n") == 1
    assert main(["sweep", "plot", str(results), "-o", str(image), "--heatmap", "x=sim.time_scal,y=a,value=b"]) == 2
    assert "no column 'sim.time_scal' in the results (did you mean 'sim.time_scale'?)" in capsys.readouterr().err
