"""No silent failures, no tracebacks: what a user sees when something goes wrong.

Each test drives the real command line (``python -m kvlife``) or the drivers and asserts
the exit code, the absence of a traceback and the exact line printed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from kvlife.lifecycle.config import EngineConfig, LiveConfig, RunConfig, SimConfig, TierConfig
from kvlife.lifecycle.drivers import interrupts
from kvlife.lifecycle.traces.replay import replay
from kvlife.lifecycle.traces.validate import validate
from kvlife.lifecycle.workloads.synthetic import synthetic_workload
from tests.conftest import written_so_far
from tests.redis_server import REDIS_SERVER, RedisServer, _free_port

ROOT = Path(__file__).resolve().parents[1]


def kvlife(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "kvlife", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=timeout)


def records(path: Path) -> list[dict[str, object]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


# ---- 1. tier events are warnings: counted, traced, in --json ------------------------------
def test_dead_redis_is_warned_about_not_silent(tmp_path: Path) -> None:
    dead = f"redis://127.0.0.1:{_free_port()}/0"
    trace = tmp_path / "live.jsonl"
    proc = kvlife("run", "--live", "--limit", "20", "--redis-url", dead, "--trace", str(trace), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    (line,) = [row for row in proc.stdout.splitlines() if row.startswith("warnings ")]
    shown = dict(item.split() for item in line.removeprefix("warnings").split(","))
    count = int(shown["redis_unavailable"])
    # A few refused connections, then the circuit breaker treats the server as down; each
    # store to the remote tier failed, and each failure is a warning of the engine's.
    assert set(shown) == {"redis_breaker_open", "redis_unavailable", "store_failed"}
    assert shown["redis_breaker_open"] == "1" and count > 0
    engine_warned = [r for r in records(trace) if r["kind"] == "warning" and r["what"] == "store_failed"]
    assert len(engine_warned) == int(shown["store_failed"]) > 0
    warned = [r for r in records(trace) if r["kind"] == "warning" and r.get("origin") == "driver"]
    assert len(warned) == count + 1
    unavailable = [r for r in warned if r["what"] == "redis_unavailable"]
    assert len(unavailable) == count
    assert all(r["tier"] == "remote" for r in unavailable)
    assert all("Connection" in str(r["error"]) or (r["op"] == "cleanup" and "circuit breaker open" in str(r["error"]))
               for r in unavailable)
    assert validate(trace).ok
    result = replay(trace)  # the driver's warnings are not engine output: the trace still replays
    assert result.identical, result.divergence

    proc = kvlife("run", "--live", "--limit", "10", "--redis-url", dead, "--json", cwd=tmp_path)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr
    summary = json.loads(proc.stdout)["summary"]
    assert summary["warnings"]["redis_unavailable"] > 0
    assert summary["live"]["tier_events"] == summary["warnings"]["redis_unavailable"] + 1  # + breaker open
    assert summary["live"]["redis_breaker"] == {"opened": 1, "state": "open"}


# ---- 2. Ctrl-C and SIGTERM -----------------------------------------------------------------
def interrupted_cli_run(tmp_path: Path, signum: int) -> tuple[subprocess.CompletedProcess[str], Path]:
    """A big synthetic run, signalled once its trace is well under way."""
    trace = tmp_path / "t.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # A runner started in the background (nohup, `&` without job control) ignores SIGINT and
    # its children inherit that: the run must get Ctrl-C's default disposition back.
    proc = subprocess.Popen([sys.executable, "-m", "kvlife", "run", "--limit", "100000", "--trace", str(trace)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            if written_so_far(trace) > 300_000:
                break
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), trace


@pytest.mark.parametrize(("signum", "name", "code"), [(signal.SIGINT, "SIGINT", 130), (signal.SIGTERM, "SIGTERM", 143)])
def test_signal_ends_a_simulated_run_cleanly_and_the_trace_validates(
    tmp_path: Path, signum: int, name: str, code: int
) -> None:
    proc, trace = interrupted_cli_run(tmp_path, signum)
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr == f"kvlife: interrupted ({name})\n"
    data = trace.read_bytes()
    assert data.endswith(b"\n")
    last = orjson.loads(data.rstrip(b"\n").rsplit(b"\n", 1)[1])
    assert last["kind"] == "interrupted" and last["signal"] == name and last["clean"] is True
    assert isinstance(last["t"], float) and last["t"] > 0
    assert last["not_arrived"] > 0  # it really was cut short
    checked = kvlife("validate", str(trace), cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout
    assert "Traceback" not in checked.stderr
    assert f"note: run interrupted ({name}) at t=" in checked.stdout
    assert ", 0 findings" in checked.stdout.splitlines()[0]


def test_interrupted_small_run_replays_and_open_work_is_not_a_violation(tmp_path: Path) -> None:
    """In process: SIGTERM arrives while the engine is inside a call that just started a
    load; the gate holds it until that call is over, so the cut falls between two
    events with the load in flight."""
    from kvlife.lifecycle.drivers.runner import recording
    from kvlife.lifecycle.drivers.simulator import Simulator
    from kvlife.policies.loading import load_stack

    config = RunConfig(engine=EngineConfig(device_blocks=200, ranks=2,
                                           tiers=(TierConfig("host", 400), TierConfig("disk", 2000))),
                       policies=("async-lookup", "shared-loads"))
    workload = synthetic_workload(seed=3, num_requests=2000, arrival_rate_per_s=40.0)
    stack = load_stack(config.policies)
    trace = tmp_path / "cut.jsonl"
    previous = signal.getsignal(signal.SIGTERM)
    interrupts.install_sigterm_handler()
    try:
        with recording(trace, config, stack) as writer:
            loads = []

            def record(entry: dict[str, object]) -> None:
                writer.record(entry)
                if entry["kind"] == "job" and entry["op"] == "load":
                    loads.append(entry["job"])
                    if len(loads) == 20:
                        os.kill(os.getpid(), signal.SIGTERM)

            with pytest.raises(interrupts.Terminated):
                Simulator(config, workload, stack, record).run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    last = records(trace)[-1]
    assert last["kind"] == "interrupted" and last["signal"] == "SIGTERM" and last["clean"] is True
    assert last["jobs"] > 0 and last["requests"]["loading"] > 0, last  # IO open at the cut
    report = validate(trace)
    assert report.ok, report.findings[:3]
    assert any("run interrupted (SIGTERM)" in note for note in report.notes)
    assert replay(trace).identical

    # The relaxation is only for the cut: the same trace without its interrupted record is
    # an unfinished run, and invariant 7 says so.
    lines = trace.read_bytes().splitlines(keepends=True)
    (tmp_path / "uncut.jsonl").write_bytes(b"".join(lines[:-1]))
    uncut = validate(tmp_path / "uncut.jsonl")
    assert 7 in uncut.counts() or 3 in uncut.counts()
    # ...and nothing may follow the cut.
    (tmp_path / "after.jsonl").write_bytes(b"".join(lines) + lines[-2])
    after = validate(tmp_path / "after.jsonl")
    assert [f.invariant for f in after.findings] == [0]
    assert "after the interrupted record" in after.findings[0].message


def test_terminated_is_a_keyboard_interrupt_with_its_exit_code() -> None:
    exc = interrupts.Terminated()
    assert isinstance(exc, KeyboardInterrupt)
    assert (exc.signal_name, exc.exit_code) == ("SIGTERM", 143)
    assert (interrupts.signal_name(KeyboardInterrupt()), interrupts.exit_code(KeyboardInterrupt())) == ("SIGINT", 130)


@pytest.fixture
def ctrl_c_raises() -> Iterator[None]:
    """Python's own SIGINT handler for the test (a runner started in the background
    inherits SIGINT ignored, and then Ctrl-C raises nothing)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not on PATH")
@pytest.mark.usefixtures("ctrl_c_raises")
def test_live_run_interrupted_with_a_store_in_flight(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while disk stores are slow: the trace ends with the cut and validates, the
    rank threads are joined, the temporary disk directory and this run's Redis keys are
    gone."""
    import redis

    from kvlife.lifecycle.drivers.live import LiveRuntime
    from kvlife.lifecycle.drivers.runner import recording
    from kvlife.policies.loading import load_stack

    real_pwritev = os.pwritev

    def slow_pwritev(fd: int, buffers: object, offset: int) -> int:
        time.sleep(0.01)
        return real_pwritev(fd, buffers, offset)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "pwritev", slow_pwritev)
    with RedisServer() as server:
        config = RunConfig(
            engine=EngineConfig(device_blocks=48, max_running=12, ranks=2, transfer_deadline_ms=5000.0,
                                tiers=(TierConfig("host", 16), TierConfig("disk", 300), TierConfig("remote", 2000))),
            sim=SimConfig(max_output_tokens=12),
            live=LiveConfig(redis_url=server.url),
        )
        stack = load_stack(())
        seen: dict[str, object] = {}

        def interrupt(done: int, total: int) -> None:
            # Past 15 requests, at a moment a store is in flight (on a loaded machine the
            # disk keeps up at times: the moment is looked for, not assumed).
            in_flight = any(job.kind == "store" for job in runtime.engine.state.jobs.values())
            if done >= 15 and in_flight and "sent" not in seen:
                seen["sent"] = True
                seen["keys"] = len(admin.keys(f"{runtime.redis_prefix}:*"))
                os.kill(os.getpid(), signal.SIGINT)

        admin = redis.Redis.from_url(server.url)
        trace = tmp_path / "live-cut.jsonl"
        with recording(trace, config, stack, driver="live") as writer:
            runtime = LiveRuntime(config, synthetic_workload(seed=11, num_requests=200, arrival_rate_per_s=4.0),
                                  stack, writer.record, time_scale=40.0, progress=interrupt)
            disk_dir = runtime.disk_dir
            assert disk_dir is not None and disk_dir.exists()
            with pytest.raises(KeyboardInterrupt) as info:
                runtime.run()
        assert not isinstance(info.value, interrupts.Terminated)
        assert seen["keys"], "the run had written Redis keys before the cut"
        assert admin.keys(f"{runtime.redis_prefix}:*") == []
        admin.close()
    assert not disk_dir.exists()
    # The rank threads are joined (the policy watchdog is one daemon thread per process,
    # policies/watchdog.py: it ends by itself once no call is watched).
    assert not [t.name for t in threading.enumerate() if t.name.startswith("kvlife-") and t.name != "kvlife-watchdog"]
    last = records(trace)[-1]
    assert last["kind"] == "interrupted" and last["signal"] == "SIGINT" and last["clean"] is True
    assert last["jobs"] > 0, last  # stores (slow disk) were in flight at the cut
    report = validate(trace)
    assert report.ok, report.findings[:3]


# ---- 3. plot: an image format matplotlib does not write ------------------------------------
def test_plot_to_an_unknown_extension_is_one_line(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    trace = tmp_path / "run.jsonl"
    assert kvlife("run", "--limit", "5", "--trace", str(trace), cwd=tmp_path).returncode == 0
    proc = kvlife("plot", str(trace), "out.xyz", cwd=tmp_path)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    line = proc.stderr.rstrip("\n")
    assert "\n" not in line
    assert line.startswith("kvlife: error: out.xyz: unsupported image extension '.xyz'; supported: ")
    assert ".png" in line and ".svg" in line and ".pdf" in line
    assert not (tmp_path / "out.xyz").exists()
    proc = kvlife("plot", str(trace), "out", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith("kvlife: error: out: no image extension; supported: ")


# ---- 7. an empty workload -------------------------------------------------------------------
@pytest.mark.parametrize("live", [False, True])
def test_empty_workload_file_is_bad_input(tmp_path: Path, live: bool) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    proc = kvlife("run", *(["--live"] if live else []), "--workload", str(empty), cwd=tmp_path)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr == f"kvlife: error: {empty}: no requests\n"


def test_empty_workload_in_the_drivers_names_it() -> None:
    from kvlife.lifecycle.drivers.runner import run_workload
    from kvlife.lifecycle.workloads.mooncake import WorkloadError

    with pytest.raises(WorkloadError, match=r"^w\.jsonl: no requests$"):
        run_workload(RunConfig(), [], workload_name="w.jsonl")


# ---- 8. a broken user policy module (issue 12) ------------------------------------------------------
@pytest.mark.parametrize(("body", "line"), [
    ("class P(:\n    pass\n", "policy 'P.py:P': importing 'P.py' failed: SyntaxError: invalid syntax (P.py, line 1)"),
    ("import no_such_module_for_kvlife\n",
     "policy 'P.py:P': importing 'P.py' failed: ModuleNotFoundError: No module named 'no_such_module_for_kvlife'"),
    ("import sys\nsys.exit(4)\n", "policy 'P.py:P': importing 'P.py' failed: SystemExit: 4"),
    ("Q = 1\n", "policy 'P.py:P': module 'P.py' has no attribute 'P'"),
    ("P = 3\n", "policy 'P.py:P': P is not a class (got int)"),
    ("class P:\n    def __init__(self):\n        raise RuntimeError('boom')\n",
     "policy 'P.py:P': constructing P failed: RuntimeError: boom"),
    ("class P:\n    @property\n    def admission(self):\n        raise KeyError('x')\n",
     "policy 'P.py:P': inspecting P's hooks failed: KeyError: 'x'"),
    ("class P:\n    def lookup_mode(self, req, engine):\n        return 'async'\n",
     "policy P (module DIR/P.py): hook lookup_mode returned str, expected Decision or None"),
    ("from kvlife.policies.base import Decision\nclass P:\n    def lookup_mode(self, req, engine):\n"
     "        return Decision('fast', 'why')\n",
     "policy P (module DIR/P.py): hook lookup_mode returned 'fast', expected one of ('sync', 'async')"),
    ("class P:\n    def store_limit(self, req, engine):\n        raise ValueError('no\\nlimit')\n",
     "policy P (module DIR/P.py): hook store_limit raised ValueError: no limit "
     "(at DIR/P.py:3 in store_limit; --traceback shows the whole traceback)"),
    ("import sys\nclass P:\n    def store_limit(self, req, engine):\n        sys.exit(0)\n",
     "policy P (module DIR/P.py): hook store_limit raised SystemExit: 0 "
     "(at DIR/P.py:4 in store_limit; --traceback shows the whole traceback)"),
])
def test_a_broken_policy_module_is_one_line_and_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str], body: str,
                                                        line: str) -> None:
    from kvlife.lifecycle.cli.main import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "P.py").write_text(body)
    assert main(["run", "--stack", "P.py:P", "--limit", "10"]) == 2
    err = capsys.readouterr().err
    assert err == f"kvlife: error: {line.replace('DIR', str(tmp_path))}\n"


def test_a_broken_policy_module_through_the_real_command_line(tmp_path: Path) -> None:
    (tmp_path / "mine.py").write_text("class Mine:\n    def __init__(self):\n        raise OSError('no GPU')\n")
    (tmp_path / "stack.toml").write_text('# my stack\n[policies]\nstack = ["mine.py:Mine"]\n')
    proc = kvlife("run", "--config", "stack.toml", "--limit", "5", cwd=tmp_path)
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == ("kvlife: error: stack.toml:3: field 'policies.stack': policy 'mine.py:Mine': "
                           "constructing Mine failed: OSError: no GPU\n")
