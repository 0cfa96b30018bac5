"""The live driver under faults (issue 12, items 3, 6 and 7): nothing hangs, nothing fails
silently, nothing grows.

- a policy that defers forever: the watchdog stops the run, the unfinished requests are
  named as stranded, the exit code is 1 and the trace still validates;
- a lost rank report with no deadline configured ends by the default deadline;
- a frozen (SIGSTOP) Redis costs at most 1.5x the healthy run's wall time (breaker);
- a forward step that raises is a failed step: its requests are aborted, the summary,
  the trace and the exit code say so; errors in the poll path and the tier-event drain
  are reported, the run goes on;
- the per-job maps stay empty under --no-verify and are empty at the end on every path;
- a rank thread still alive at shutdown keeps its temporary directory;
- SIGINT while Redis is frozen ends within 10 s, with a trace that validates and the
  temporary files gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import attrs
import orjson
import pytest

from kvlife.lifecycle.config import EngineConfig, LiveConfig, RunConfig, SimConfig, TierConfig
from kvlife.lifecycle.drivers import live as live_driver
from kvlife.lifecycle.drivers.live import DEFAULT_REPORT_DEADLINE_MS, LiveRuntime, RankWorker, run_live
from kvlife.lifecycle.traces.replay import replay
from kvlife.lifecycle.traces.trace import read_trace
from kvlife.lifecycle.traces.validate import validate
from kvlife.lifecycle.workloads.synthetic import synthetic_workload
from kvlife.policies.base import Admission, Decision, EngineView, LoadView, RequestView
from kvlife.policies.loading import load_stack
from kvlife.policies.stack import PolicyStack
from kvlife.transfer.copy_engine import CopyEngine
from tests.conftest import written_so_far
from tests.redis_server import REDIS_SERVER, SKIP_REASON, RedisServer

ROOT = Path(__file__).resolve().parent.parent
needs_redis = pytest.mark.skipif(REDIS_SERVER is None, reason=SKIP_REASON)


def config(*tiers: TierConfig, deadline: float | None = 5000.0, **live: Any) -> RunConfig:
    return RunConfig(
        engine=EngineConfig(device_blocks=48, max_running=12, ranks=2, transfer_deadline_ms=deadline,
                            tiers=tiers or (TierConfig("host", 40), TierConfig("disk", 300))),
        sim=SimConfig(max_output_tokens=12),
        live=LiveConfig(**live),
    )


def workload(n: int = 60) -> list:  # type: ignore[type-arg]
    return synthetic_workload(seed=11, num_requests=n, arrival_rate_per_s=4.0)


def warnings_in(trace: Path, what: str) -> list[dict[str, Any]]:
    return [r for _, r in read_trace(trace) if r["kind"] == "warning" and r["what"] == what]


class AlwaysDefer:
    name = "always-defer"

    def admission(self, req: RequestView, load: LoadView, engine: EngineView) -> Decision[Admission]:
        return Decision("defer", "always")


# ---- item 3: progress is guaranteed or reported ------------------------------------------------
def test_always_defer_is_stopped_by_the_watchdog_with_stranded_requests(tmp_path: Path) -> None:
    """Every request with a hit in a tier is deferred, forever (admission is asked only
    when there is something to load): the others finish, those never do."""
    trace = tmp_path / "defer.jsonl"
    cfg = config(stall_timeout_s=1.0)
    # A small device and a host tier that keeps everything: tier hits stay tier hits.
    cfg = attrs.evolve(cfg, engine=attrs.evolve(cfg.engine, device_blocks=24, tiers=(TierConfig("host", 400),)))
    started = time.monotonic()
    outcome = run_live(cfg, workload(20), PolicyStack([AlwaysDefer()]), trace_path=trace, time_scale=40.0)
    assert time.monotonic() - started < 15
    live = outcome.summary["live"]
    stranded = live["stranded_requests"]
    assert live["stalled"]["reason"] == "no progress for 1 s of wall time"
    assert stranded and live["stalled"]["stranded"] == len(stranded) == outcome.summary["stranded"]
    assert all(name.endswith(":waiting") for name in stranded)
    assert outcome.summary["finished"]["aborted"] == len(stranded)
    assert outcome.summary["finished"]["length"] == 20 - len(stranded)
    assert outcome.exit_code == 1
    assert any(f"{len(stranded)} requests stranded: req-" in p for p in outcome.problems())
    (stalled,) = warnings_in(trace, "stalled")
    assert stalled["requests"] == stranded
    # They were aborted after being named: the trace ends with every request finished.
    report = validate(trace)
    assert report.ok, report.findings[:3]
    # It waited, it did not spin: ticks at most every few ms, fewer once idle.
    assert outcome.result.engine.stats.ticks < 600


def test_cli_always_defer_exits_1_naming_the_stranded(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvlife.lifecycle.cli.main import main

    policy = tmp_path / "defer.py"
    policy.write_text("from kvlife.policies.base import Decision\n\n\nclass AlwaysDefer:\n"
                      "    name = 'always-defer'\n\n"
                      "    def admission(self, req, load, engine):\n"
                      "        return Decision('defer', 'always')\n")
    cfg = tmp_path / "live.toml"
    # A small device and tiers that keep everything: hits below the device stay there, so
    # the requests that have them are deferred for ever.
    cfg.write_text("[engine]\ndevice_blocks = 24\nranks = 2\n\n"
                   "[[tiers]]\nname = \"host\"\ncapacity_blocks = 400\n\n"
                   "[live]\nstall_timeout_s = 1.0\n")
    trace = tmp_path / "t.jsonl"
    code = main(["run", "--live", "--config", str(cfg), "--limit", "20", "--stack", f"{policy}:AlwaysDefer",
                 "--trace", str(trace)])
    out, err = capsys.readouterr()
    assert code == 1, out + err
    lines = err.splitlines()
    assert lines[0] == "kvlife run --live: stopped: no progress for 1 s of wall time", lines
    count = int(lines[1].split("kvlife run --live: ", 1)[1].split(" requests stranded: req-")[0])
    assert count > 0 and len(lines) == 2
    assert f"stranded / quarantined jobs  {count} / 0" in out
    assert validate(trace).ok


def test_a_lost_report_without_a_configured_deadline_ends_by_the_default_one(tmp_path: Path) -> None:
    """With a config that sets no ``transfer_deadline_ms``, a rank that never reports a job
    does not hang the run: the live default deadline gives up on it."""
    silenced: list[object] = []

    def rank1_loses_one_report(rank: int, job_id: object) -> bool:
        if rank == 1 and not silenced:
            silenced.append(job_id)
            return True
        return False

    cfg = config(TierConfig("host", 60), deadline=None)
    runtime = LiveRuntime(cfg, workload(30), load_stack(()), time_scale=40.0, silent=rank1_loses_one_report)
    assert runtime.config.engine.transfer_deadline_ms == DEFAULT_REPORT_DEADLINE_MS
    started = time.monotonic()
    result = runtime.run()
    # Without the deadline it would wait for ever (until the stall watchdog, which would
    # strand requests); the bound is loose for a loaded machine.
    assert time.monotonic() - started < DEFAULT_REPORT_DEADLINE_MS / 1000 + 45
    assert len(silenced) == 1 and result.engine.stats.rank_timeouts == 1
    assert result.stranded == [] and all(r.state == "finished" for r in result.engine.requests.values())
    # run_live writes the deadline it used into the header, so the trace replays the same.
    trace = tmp_path / "d.jsonl"
    run_live(cfg, workload(5), trace_path=trace, time_scale=40.0)
    header = next(read_trace(trace))[1]
    assert header["config"]["engine"]["transfer_deadline_ms"] == DEFAULT_REPORT_DEADLINE_MS
    assert replay(trace).identical


@needs_redis
def test_a_frozen_redis_costs_at_most_half_again_the_healthy_wall_time() -> None:
    wl = synthetic_workload(seed=5, num_requests=60, block_tokens=64, user_tokens=(64, 512), output_tokens=(4, 12),
                            arrival_rate_per_s=4.0)
    with RedisServer() as server:
        cfg = RunConfig(engine=EngineConfig(block_tokens=64, device_blocks=64, max_running=12, ranks=2,
                                            tiers=(TierConfig("host", 16), TierConfig("remote", 2000))),
                        live=LiveConfig(redis_url=server.url))
        started = time.monotonic()
        healthy = run_live(cfg, wl, time_scale=5.0)
        healthy_s = time.monotonic() - started
        assert healthy.summary["prefix_hit_rate"]["remote"] > 0 and healthy.exit_code == 0
        frozen_at: list[int] = []

        def freeze(done: int, total: int) -> None:
            if not frozen_at and done >= total // 4:
                server.freeze()  # mid-run: stores and loads in flight meet a server that never answers
                frozen_at.append(done)

        started = time.monotonic()
        frozen = run_live(cfg, wl, time_scale=5.0, progress=freeze)
        frozen_s = time.monotonic() - started
        server.thaw()
    assert frozen_at
    assert frozen_s <= 1.5 * healthy_s, (frozen_s, healthy_s)
    assert frozen.result.stranded == [] and sum(frozen.summary["finished"].values()) == 60
    assert frozen.summary["warnings"]["redis_breaker_open"] >= 1
    assert frozen.summary["live"]["redis_breaker"]["opened"] >= 1
    assert frozen.stats.mismatches == 0


def test_an_empty_step_behind_a_computing_one_reports_in_plan_order(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Async scheduling: while every running request has a step in flight, the next pass
    schedules nothing. No rank runs such a step, so the driver ends it at once, but its
    output must reach the engine after the output of the step still computing (vLLM's
    outputs come in plan order): one delivered first was refused (``unknown_step``), the
    step before it never ended, and the run stalled with requests stranded."""
    forward = RankWorker._forward

    def slow_forward(self: RankWorker, plan: Any) -> None:
        time.sleep(0.02)  # a step computes long enough for the next pass to find nothing to do
        forward(self, plan)

    monkeypatch.setattr(RankWorker, "_forward", slow_forward)
    run = config()
    # Two output tokens: the pass after a prefill finds its request at its limit (a token in
    # flight), so it schedules nothing while the prefill computes.
    run = attrs.evolve(run, engine=attrs.evolve(run.engine, async_scheduling=True),
                       sim=attrs.evolve(run.sim, max_output_tokens=2))
    trace = tmp_path / "async.jsonl"
    outcome = run_live(run, workload(16), trace_path=trace, time_scale=40.0)
    steps = [r for _, r in read_trace(trace) if r["kind"] == "step"]
    assert any(r["requests"] == 0 for r in steps)  # the case arose
    assert outcome.result.stranded == [] and sum(outcome.summary["finished"].values()) == 16
    assert warnings_in(trace, "unknown_step") == []
    outputs = [r["step_id"] for _, r in read_trace(trace) if r["kind"] == "input" and r["type"] == "step_output"]
    assert outputs == sorted(outputs) == [r["step"] for r in steps]
    assert replay(trace).identical


# ---- item 3: live rank loops catch everything ---------------------------------------------------
def test_a_failing_forward_step_is_a_failed_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    forward = RankWorker._forward
    failed: list[int] = []

    def every_fifth_step_fails_on_rank_1(self: RankWorker, plan: Any) -> None:
        if self.rank == 1 and plan.step_id % 5 == 3:
            failed.append(plan.step_id)
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        forward(self, plan)

    monkeypatch.setattr(RankWorker, "_forward", every_fifth_step_fails_on_rank_1)
    trace = tmp_path / "fail.jsonl"
    outcome = run_live(config(), workload(40), trace_path=trace, time_scale=40.0)
    live = outcome.summary["live"]
    assert failed and live["failed_steps"] == len(failed) == outcome.summary["warnings"]["step_failed"]
    assert live["failed_requests"] > 0 and outcome.summary["finished"]["aborted"] == live["failed_requests"]
    assert live["rank_errors"] == len(failed) and outcome.exit_code == 1
    assert "illegal memory access" in outcome.rank_errors[0]
    step_failures = warnings_in(trace, "step_failed")
    assert len(step_failures) == len(failed) and all(w["requests"] for w in step_failures)
    failed_outputs = [r for _, r in read_trace(trace) if r["kind"] == "input" and r.get("failed_ranks")]
    assert sorted(r["step_id"] for r in failed_outputs) == sorted(failed)
    assert all(r["failed_ranks"] == [1] for r in failed_outputs)
    aborted = {r["req"] for _, r in read_trace(trace) if r["kind"] == "transition" and r["trigger"] == "aborted"}
    assert aborted == {rid for w in step_failures for rid in w["requests"]}
    assert outcome.stats.mismatches == 0  # nothing half-computed was stored and served
    assert validate(trace).ok
    assert replay(trace).identical


def test_errors_in_the_poll_path_and_the_event_drain_are_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    poll = CopyEngine.poll
    drain = RankWorker._drain_tier_events
    faults = {"poll": 0, "drain": 0}

    def poll_fails_twice(self: CopyEngine) -> Any:
        if self.rank == 0 and faults["poll"] < 2 and (self._inflight or self._pending["load"]):
            faults["poll"] += 1
            raise RuntimeError("cudaErrorLaunchFailure")
        return poll(self)

    def drain_fails_once(self: RankWorker) -> None:
        if self.rank == 1 and not faults["drain"]:
            faults["drain"] += 1
            raise OSError("event queue broke")
        drain(self)

    monkeypatch.setattr(CopyEngine, "poll", poll_fails_twice)
    monkeypatch.setattr(RankWorker, "_drain_tier_events", drain_fails_once)
    runtime = LiveRuntime(config(), workload(40), load_stack(()), time_scale=40.0)
    result = runtime.run()
    assert faults == {"poll": 2, "drain": 1}
    assert len(runtime.rank_errors) == 3
    assert any("cudaErrorLaunchFailure" in e for e in runtime.rank_errors)
    assert any("tier events: OSError: event queue broke" in e for e in runtime.rank_errors)
    # The jobs the broken poll held were reported failed: the run went on and finished.
    assert result.stranded == [] and all(r.state == "finished" for r in result.engine.requests.values())
    assert runtime.stats().mismatches == 0
    assert not any(w.is_alive() for w in runtime.ranks)


# ---- item 7: per-job maps are cleaned on every path ---------------------------------------------
@pytest.mark.parametrize("verify", [False, True])
def test_per_job_maps_stay_bounded_and_end_empty(verify: bool) -> None:
    sizes: list[int] = []

    def look(done: int, total: int) -> None:
        sizes.append(max(len(w._moves_of) for w in runtime.ranks))

    cfg = config(TierConfig("host", 24), TierConfig("disk", 300), verify=verify)
    runtime = LiveRuntime(cfg, workload(60), load_stack(()), time_scale=40.0, progress=look)
    result = runtime.run()
    assert result.stranded == [] and result.engine.stats.loads > 0 and sizes
    if not verify:
        assert max(sizes) == 0  # nothing is kept for checks that will not run
    assert all(w._moves_of == {} and w._open == {} for w in runtime.ranks)
    assert runtime._steps == {} and runtime._pending_lookups == {}


def test_a_rank_still_alive_at_shutdown_keeps_the_temp_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank stuck in a step (a hung kernel): the watchdog stops the run, shutdown gives up
    joining it and leaves its tiers and the temporary directory alone."""
    release = threading.Event()
    forward = RankWorker._forward

    def rank_1_hangs(self: RankWorker, plan: Any) -> None:
        if self.rank == 1 and plan.step_id >= 3:
            release.wait(30)
        forward(self, plan)

    monkeypatch.setattr(RankWorker, "_forward", rank_1_hangs)
    monkeypatch.setattr(live_driver, "_JOIN_S", 0.3)
    runtime = LiveRuntime(config(stall_timeout_s=0.5), workload(20), load_stack(()), time_scale=40.0)
    disk_dir = runtime.disk_dir
    assert disk_dir is not None
    try:
        result = runtime.run()
        assert runtime.stalled is not None and result.stranded
        assert runtime.ranks[1].is_alive()
        assert disk_dir.exists(), "removed under a live rank thread"
        assert runtime.driver_warnings["rank_still_running"] == 1
    finally:
        release.set()
        runtime.ranks[1].join(timeout=10)
        if runtime._tmp is not None:
            runtime._tmp.cleanup()


# ---- item 6: interrupts leave valid traces, also while Redis is frozen --------------------------
@needs_redis
def test_sigint_while_redis_is_frozen_ends_in_10_s_with_a_valid_trace(tmp_path: Path) -> None:
    """SIGTERM takes the same path (``interrupts``: a KeyboardInterrupt subclass);
    tests/test_failures.py covers it for simulated runs."""
    sig, name, code = signal.SIGINT, "SIGINT", 130
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    trace = tmp_path / "t.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp)}
    with RedisServer() as server:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvlife", "run", "--live", "--limit", "400", "--time-scale", "4",
             "--redis-url", server.url, "--trace", str(trace)],
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and written_so_far(trace) < 30_000:
                time.sleep(0.05)
            assert proc.poll() is None, proc.communicate()
            assert [p.name for p in tmp.iterdir()], "the run has its temporary disk directory"
            server.freeze()
            time.sleep(1.0)  # transfers are now blocked on the frozen server
            sent = time.monotonic()
            proc.send_signal(sig)
            out, err = proc.communicate(timeout=30)
            took = time.monotonic() - sent
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            server.thaw()
    assert took < 10, took
    assert proc.returncode == code, err
    assert "Traceback" not in err
    assert err.splitlines()[-1] == f"kvlife: interrupted ({name})"
    data = trace.read_bytes()
    assert data.endswith(b"\n")
    last = orjson.loads(data.rstrip(b"\n").rsplit(b"\n", 1)[1])
    assert last["kind"] == "interrupted" and last["signal"] == name
    report = validate(trace)
    assert report.ok, report.findings[:3]
    assert list(tmp.iterdir()) == [], "temporary files were left behind"


def test_evolve_keeps_a_set_deadline() -> None:
    cfg = config(deadline=250.0)
    assert live_driver.with_report_deadline(cfg) is cfg
    unset = attrs.evolve(cfg, engine=attrs.evolve(cfg.engine, transfer_deadline_ms=None))
    assert live_driver.with_report_deadline(unset).engine.transfer_deadline_ms == DEFAULT_REPORT_DEADLINE_MS
