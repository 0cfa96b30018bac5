"""A trace is data: reading one runs no code it names, and its header is checked as a config file is.

The crafted policy file below creates a marker file when it is imported. Every command that
reads a trace (replay, what-if, plot, explain, export, validate) must leave the marker
absent unless the user trusted the trace (``--allow-code``) or named the policy on the
command line (``--stack``). The header's config goes through the config-file validator,
bounds included, before the engine allocates anything.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from kvlife.lifecycle.cli.main import main
from kvlife.lifecycle.config import RunConfig
from kvlife.lifecycle.drivers.runner import run_workload
from kvlife.lifecycle.workloads.synthetic import synthetic_workload
from kvlife.policies.loading import load_stack

EVIL = """\
from pathlib import Path

Path({marker!r}).write_text("imported")


class P:
    name = "p"

    def lookup_mode(self, req, engine):
        return None
"""


@pytest.fixture(scope="module")
def crafted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    """(trace, marker, spec): a genuine trace recorded with the crafted policy (so that
    with --allow-code it replays identically), the marker deleted afterwards."""
    root = tmp_path_factory.mktemp("crafted")
    marker = root / "MARKER"
    policy = root / "evil.py"
    policy.write_text(EVIL.format(marker=str(marker)))
    spec = f"{policy}:P"
    config = RunConfig(policies=(spec,))
    workload = synthetic_workload(seed=5, num_requests=12, block_tokens=config.engine.block_tokens)
    trace = root / "t.jsonl"
    run_workload(config, workload, load_stack([spec]), trace_path=trace)
    assert marker.exists()
    marker.unlink()
    return trace, marker, spec


def _refusal(trace: Path, spec: str) -> str:
    return (f"kvlife: error: {trace}:1: field 'config.policies': trace names code '{spec}'; "
            f"pass --allow-code to import it\n")


@pytest.mark.parametrize("command", [
    lambda t, out: ["replay", str(t)],
    lambda t, out: ["replay", str(t), "--json"],
    lambda t, out: ["replay", str(t), "--stack", "async-lookup"],
    lambda t, out: ["plot", str(t), str(out / "p.png")],
])
def test_commands_that_need_the_stack_refuse_its_code(
        crafted: tuple[Path, Path, str], command: Callable[[Path, Path], list[str]], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    trace, marker, spec = crafted
    assert main(command(trace, tmp_path)) == 2
    captured = capsys.readouterr()
    assert captured.err == _refusal(trace, spec)
    assert captured.out == ""
    assert not marker.exists()
    assert not (tmp_path / "p.png").exists()


@pytest.mark.parametrize("command", [
    lambda t, out: ["validate", str(t)],
    lambda t, out: ["explain", str(t), "req-0"],
    lambda t, out: ["export", str(t), "--perfetto", str(out / "x.json")],
])
def test_commands_that_only_read_records_work_without_importing(
        crafted: tuple[Path, Path, str], command: Callable[[Path, Path], list[str]], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    trace, marker, _spec = crafted
    assert main(command(trace, tmp_path)) == 0
    assert "Traceback" not in capsys.readouterr().err
    assert not marker.exists()


def test_allow_code_imports_it_and_replays(crafted: tuple[Path, Path, str], capsys: pytest.CaptureFixture[str]) -> None:
    trace, marker, _spec = crafted
    try:
        assert main(["replay", str(trace), "--allow-code"]) == 0
        assert capsys.readouterr().out.startswith("identical")
        assert marker.exists()
    finally:
        marker.unlink(missing_ok=True)


def test_naming_the_policy_in_stack_trusts_it(crafted: tuple[Path, Path, str], tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    trace, marker, spec = crafted
    try:
        assert main(["replay", str(trace), "--stack", spec]) == 0  # what-if under the same stack
        assert "what-if:" in capsys.readouterr().out
        assert marker.exists()
        marker.unlink()
        pytest.importorskip("matplotlib")
        assert main(["plot", str(trace), str(tmp_path / "p.png"), "--stack", spec]) == 0
        assert marker.exists() and (tmp_path / "p.png").stat().st_size > 0
    finally:
        marker.unlink(missing_ok=True)


def test_plot_with_allow_code(crafted: tuple[Path, Path, str], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    trace, marker, _spec = crafted
    try:
        assert main(["plot", str(trace), str(tmp_path / "p.png"), "--allow-code"]) == 0
        assert marker.exists()
    finally:
        marker.unlink(missing_ok=True)


def test_a_module_spec_is_refused_and_never_imported(crafted: tuple[Path, Path, str], tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    trace, _marker, _spec = crafted
    package = tmp_path / "evilpkg"
    package.mkdir()
    marker = tmp_path / "PKG_MARKER"
    (package / "__init__.py").write_text("")
    (package / "mod.py").write_text(EVIL.format(marker=str(marker)))
    monkeypatch.syspath_prepend(str(tmp_path))
    path = _with_header(trace, tmp_path / "m.jsonl", lambda h: h["config"].update(policies=["evilpkg.mod:P"]))
    for argv in (["replay", str(path)], ["replay", str(path), "--stack", "shared-loads"]):
        assert main(argv) == 2
        assert capsys.readouterr().err == _refusal(path, "evilpkg.mod:P")
    assert not marker.exists() and "evilpkg.mod" not in sys.modules
    assert main(["replay", str(path), "--allow-code"]) == 0  # the same class: it replays
    assert marker.exists()


def test_an_unknown_name_is_bad_input(crafted: tuple[Path, Path, str], tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    trace, _marker, _spec = crafted
    path = _with_header(trace, tmp_path / "u.jsonl", lambda h: h["config"].update(policies=["no-such-policy"]))
    assert main(["replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvlife: error: {path}:1: field 'config.policies': unknown policy 'no-such-policy'")
    assert err.count("\n") == 1


def test_built_in_names_resolve_from_the_registry(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = RunConfig(policies=("async-lookup", "shared-loads"))
    trace = tmp_path / "b.jsonl"
    workload = synthetic_workload(seed=2, num_requests=10, block_tokens=config.engine.block_tokens)
    run_workload(config, workload, trace_path=trace)
    assert main(["replay", str(trace)]) == 0
    assert capsys.readouterr().out.startswith("identical")


def test_what_if_reads_no_profile_file_a_trace_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = RunConfig()
    trace = tmp_path / "w.jsonl"
    run_workload(config, synthetic_workload(seed=2, num_requests=8, block_tokens=512), trace_path=trace)
    path = _with_header(trace, tmp_path / "f.jsonl", lambda h: h["config"]["sim"].update(hardware="/dev/zero"))
    assert main(["replay", str(path), "--stack", "async-lookup"]) == 2
    assert capsys.readouterr().err == (f"kvlife: error: {path}:1: field 'config.sim.hardware': trace names the "
                                       f"file '/dev/zero'; pass --allow-code to read it\n")


# ---- the header is checked as a config file is -------------------------------------------------
def _with_header(trace: Path, out: Path, change: Callable[[dict], object]) -> Path:
    lines = trace.read_bytes().splitlines()
    header = orjson.loads(lines[0])
    change(header)
    out.write_bytes(b"\n".join([orjson.dumps(header), *lines[1:]]) + b"\n")
    return out


def _engine(**values: object) -> Callable[[dict], object]:
    return lambda h: h["config"]["engine"].update(values)


def _tier(**values: object) -> Callable[[dict], object]:
    return lambda h: h["config"]["engine"]["tiers"][0].update(values)


@pytest.mark.parametrize(("change", "field", "message"), [
    (_engine(device_blocks=10**10), "config.engine.device_blocks", "must be at most"),
    (_engine(device_blocks=1e8), "config.engine.device_blocks", "must be a positive integer, got 100000000.0"),
    (_engine(block_tokens=1_000_000_000), "config.engine.block_tokens", "must be at most"),
    (_engine(ranks=1_000_000), "config.engine.ranks", "must be at most"),
    (_tier(capacity_blocks=10**11), "config.engine.tiers[0].capacity_blocks", "must be at most"),
    (_tier(failure_rate=2.0), "config.engine.tiers[0].failure_rate", "must be a number from 0 to 1"),
    (_engine(max_running="8"), "config.engine.max_running", "must be a positive integer, got '8'"),
    (_engine(wat=1), "config.engine.wat", "unknown key"),
    (lambda h: h["config"]["sim"].update(seed=[1]), "config.sim.seed", "must be an integer, got an array"),
    (lambda h: h["config"].update(policies="baseline"), "config.policies", "must be an array of policy names"),
    (lambda h: h["config"].update(extra={}), "config.extra", "unknown section"),
    (lambda h: h.update(config=[1]), "config", "must be an object, got a list"),
])
@pytest.mark.parametrize("command", ["replay", "validate", "explain", "export", "plot"])
def test_bad_header_values_are_one_line_errors_before_allocation(
        crafted: tuple[Path, Path, str], tmp_path: Path, change: Callable[[dict], object], field: str,
        message: str, command: str, capsys: pytest.CaptureFixture[str]) -> None:
    trace, marker, _spec = crafted
    path = _with_header(trace, tmp_path / "h.jsonl", change)
    argv = {"replay": ["replay", str(path)], "validate": ["validate", str(path)],
            "explain": ["explain", str(path), "req-0"],
            "export": ["export", str(path), "--perfetto", str(tmp_path / "x.json")],
            "plot": ["plot", str(path), str(tmp_path / "p.png")]}[command]
    if command == "plot":
        pytest.importorskip("matplotlib")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvlife: error: {path}:1: field '{field}': {message}"), err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not marker.exists()


@pytest.mark.parametrize(("literal", "field"), [
    (b"NaN", "config.engine.lookup_latency_ms"),
    (b"Infinity", "config.engine.lookup_latency_ms"),
    (b"1e999", "config.engine.lookup_latency_ms"),
])
@pytest.mark.parametrize("command", ["replay", "validate", "explain"])
def test_non_finite_header_values_name_their_field(crafted: tuple[Path, Path, str], tmp_path: Path,
                                                   literal: bytes, field: str, command: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    trace, _marker, _spec = crafted
    lines = trace.read_bytes().splitlines()
    lines[0] = lines[0].replace(b'"lookup_latency_ms":1.5', b'"lookup_latency_ms":' + literal)
    path = tmp_path / "n.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    argv = [command, str(path)] + (["req-0"] if command == "explain" else [])
    assert main(argv) == 2
    assert capsys.readouterr().err == (f"kvlife: error: {path}:1: field '{field}': must be a finite number "
                                       f"(JSON has no NaN or infinity)\n")


def test_huge_device_blocks_fail_fast_not_with_memory_error(crafted: tuple[Path, Path, str], tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's case: device_blocks 1e8 drove replay to 6 GB and a MemoryError."""
    import time

    trace, _marker, _spec = crafted
    path = _with_header(trace, tmp_path / "big.jsonl", _engine(device_blocks=100_000_000))
    started = time.perf_counter()
    assert main(["replay", str(path)]) == 2
    assert time.perf_counter() - started < 5.0
    assert "MemoryError" not in capsys.readouterr().err


def test_the_installed_command_refuses_too(crafted: tuple[Path, Path, str]) -> None:
    """The same refusal through a fresh ``python -m kvlife`` process (no module cached)."""
    import os
    import subprocess

    trace, marker, spec = crafted
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    for command in (["replay", str(trace)], ["validate", str(trace)], ["explain", str(trace), "req-1"]):
        proc = subprocess.run([sys.executable, "-m", "kvlife", *command], capture_output=True, text=True,
                              env=env, timeout=120, stdin=subprocess.DEVNULL)
        assert "Traceback" not in proc.stderr
        assert proc.returncode == (2 if command[0] == "replay" else 0), proc.stderr
        if command[0] == "replay":
            assert proc.stderr == _refusal(trace, spec)
        assert not marker.exists()
