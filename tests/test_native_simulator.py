"""The native simulator loop against the reference (``lifecycle/drivers/simulator.py``).

Each example runs one drawn workload and config twice: through the Python ``Simulator`` and
through ``bridge.simulate`` (the native ``Simulator<PyEngine>`` loop), each around its own
fresh Python ``Engine`` and policy stack, each writing a trace with ``TraceWriter``. The two
trace files must be byte-identical and the ``SimResult`` fields equal (floats by
``float.hex``); a run the reference refuses must be refused alike (type and message).

Configs span async scheduling, one or two ranks, tiers that fail blocks, rank jitter, both
completion modes, short deadlines, a small device pool (preemptions), retirement
(``keep_requests=False``), an output limit and several built-in policy stacks. A reach check
makes sure the examples got where the loop's branches are: preemptions, loads, stores,
joins, flushes, idle steps, deadline wake-ups, held completions and sync-lookup waits.
"""

from __future__ import annotations

import filecmp
import os
import signal
import subprocess
import sys
import tempfile
import time
from array import array
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvlife.lifecycle.config import EngineConfig, RunConfig, SimConfig, TierConfig
from kvlife.lifecycle.drivers import interrupts
from kvlife.lifecycle.drivers.runner import recording
from kvlife.lifecycle.drivers.simulator import SimResult, Simulator
from kvlife.lifecycle.engine.events import StartLoad
from kvlife.lifecycle.metrics import RequestTotals
from kvlife.lifecycle.workloads.mooncake import WorkloadRequest
from kvlife.lifecycle.workloads.synthetic import synthetic_workload
from kvlife.policies.loading import load_stack

pytest.importorskip("kvlife.lifecycle.native._core")
from kvlife.lifecycle.native.bridge import simulate  # noqa: E402  (needs the built core)

BLOCK_TOKENS = 64
STACKS = [
    ("baseline",),
    ("sync-lookup",),
    ("async-lookup",),
    ("async-lookup", "shared-loads"),
    ("keep-lookup-answers", "async-lookup"),
    ("early-lookup", "shared-loads"),
    ("early-prefetch",),
    ("prefetch-timeout", "early-prefetch"),
    ("defer-while-loading", "async-lookup"),
    ("naive-stores-unsafe",),
]

REACH: Counter[str] = Counter()


class Spy(Simulator):
    """The reference, counting the loop's rarer paths for the reach check."""

    def _flush(self, now: float, job_id: int) -> None:
        REACH["flush"] += 1
        super()._flush(now, job_id)

    def _follow(self, now: float, join: StartLoad) -> None:
        REACH["join"] += 1
        super()._follow(now, join)

    def _push_wake(self, wake: float) -> None:
        REACH["wake-up"] += 1
        super()._push_wake(wake)

    def _feed(self, now: float, event: Any, idle: bool = False) -> None:
        REACH["idle step output"] += idle
        super()._feed(now, event, idle)

    def _pay_sync_lookups(self, now: float, key_counts: tuple[int, ...]) -> float:
        ready = super()._pay_sync_lookups(now, key_counts)
        REACH["sync lookup wait"] += ready > now
        return ready


@st.composite
def sessions(draw: st.DrawFn) -> list[WorkloadRequest]:
    """A short synthetic stream of conversations (system prompts, later turns) at a high rate:
    loads of evicted prefixes, loads of the same blocks at once (joins), preemptions."""
    return synthetic_workload(seed=draw(st.integers(0, 2**16)), num_requests=draw(st.integers(5, 24)),
                              block_tokens=BLOCK_TOKENS, arrival_rate_per_s=draw(st.sampled_from([20.0, 100.0])),
                              user_tokens=(50, 300), output_tokens=(2, 40), think_time_s=(0.05, 0.5))


@st.composite
def handmade(draw: st.DrawFn) -> list[WorkloadRequest]:
    """A few requests over a few shared prefixes (or a turn continuing an earlier request),
    arriving in bursts (equal times too) and after pauses long enough for tiers to matter."""
    prefixes = [tuple(range(100 * p, 100 * p + 8)) for p in range(4)]
    out: list[WorkloadRequest] = []
    t = 0.0
    for n in range(draw(st.integers(1, 14))):
        t += draw(st.sampled_from([0.0, 0.0, 0.5, 3.0, 17.25, 80.0, 400.0]))
        tokens = draw(st.integers(1, 9 * BLOCK_TOKENS))
        full = tokens // BLOCK_TOKENS
        # A later turn (an earlier request's blocks first), or a system prompt.
        later = bool(out) and draw(st.booleans())
        prefix = draw(st.sampled_from(out)).hash_ids if later else draw(st.sampled_from(prefixes))
        prefix = prefix[:draw(st.integers(0, min(full, len(prefix))))]
        hashes = prefix + tuple(10_000 + 100 * n + i for i in range(full - len(prefix)))
        out.append(WorkloadRequest(f"req-{n}", t, tokens, draw(st.sampled_from([1, 2, 5, 10, 150])), hashes))
        if draw(st.booleans()):  # a twin at the same time: two loads of the same blocks
            out.append(WorkloadRequest(f"req-{n}-twin", t, tokens, 3, hashes))
    if draw(st.booleans()):  # a list out of arrival order: both sort it the same way
        out.reverse()
    return out


def workloads() -> st.SearchStrategy[list[WorkloadRequest]]:
    return st.one_of(handmade(), sessions())


@st.composite
def configs(draw: st.DrawFn) -> RunConfig:
    names = [name for name in ("host", "disk", "remote") if draw(st.booleans())] or ["host"]
    tiers = tuple(
        TierConfig(name, draw(st.integers(2, 40) if name == "host" else st.integers(20, 80)),
                   eviction=draw(st.sampled_from(["lru", "arc"])),
                   bandwidth_gbps=draw(st.sampled_from([None, 0.5, 4.0])),
                   latency_ms=draw(st.sampled_from([None, 0.0, 2.0])),
                   failure_rate=draw(st.sampled_from([0.0, 0.0, 0.1, 0.4])))
        for name in names)
    engine = EngineConfig(
        block_tokens=BLOCK_TOKENS,
        device_blocks=draw(st.integers(9, 24)),
        max_batched_tokens=draw(st.sampled_from([128, 512, 2048])),
        max_running=draw(st.integers(1, 6)),
        ranks=draw(st.integers(1, 2)),
        async_scheduling=draw(st.booleans()),
        transfer_deadline_ms=draw(st.sampled_from([None, None, 2.0, 15.0])),
        lookup_latency_ms=draw(st.sampled_from([0.0, 1.5, 6.0])),
        lookup_deadline_ms=draw(st.sampled_from([5000.0, 3.0, 12.0])),
        reclaim_deadline_ms=draw(st.sampled_from([480000.0, 30.0])),
        max_async_lookups=draw(st.sampled_from([1024, 2])),
        kv_load_failure_policy=draw(st.sampled_from(["recompute", "fail"])),
        tiers=tiers,
    )
    sim = SimConfig(
        seed=draw(st.integers(0, 2**32)),
        completions=draw(st.sampled_from(["step_boundary", "exact"])),
        lookup_workers=draw(st.integers(1, 2)),
        lookup_per_key_ms=draw(st.sampled_from([0.0, 0.005, 0.5])),
        rank_jitter_ms=draw(st.sampled_from([0.0, 0.2, 4.0])),
        max_output_tokens=draw(st.sampled_from([None, None, 3])),
    )
    return RunConfig(engine=engine, sim=sim, policies=draw(st.sampled_from(STACKS)))


def _plain(value: Any) -> Any:
    """A result field as comparable data: floats by their bits, arrays by their bytes."""
    if isinstance(value, float):
        return value.hex()
    if isinstance(value, array):
        return value.typecode, value.tobytes()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _totals(totals: RequestTotals | None) -> Any:
    if totals is None:
        return None
    return {name: _plain(getattr(totals, name)) for name in RequestTotals.__slots__}


def _fields(result: SimResult) -> Any:
    return (_plain(result.makespan_ms), result.events, result.stranded, _plain(result.critical_path_lookup_ms),
            result.physics, _totals(result.retired), len(result.engine.requests))


Run = Callable[..., SimResult]


def _run(run: Run, path: Path, config: RunConfig, workload: list[WorkloadRequest], keep: bool,
         stream: bool, progress: list[tuple[int, int]]) -> tuple[str, Any]:
    """One run; ("ok", its result's fields) or ("raised", type and message)."""
    stack = load_stack(config.policies)
    given = iter(workload) if stream else workload
    try:
        with recording(path, config, stack) as writer:
            assert writer is not None
            result = run(config, given, stack, writer.record, lambda done, total: progress.append((done, total)),
                         check_every=7, keep_requests=keep, size=len(workload) if stream else None)
    except Exception as exc:  # a refusal: the same one from both loops
        return "raised", (type(exc).__name__, str(exc))
    return "ok", _fields(result)


def _reach(trace: Path) -> None:
    for line in trace.read_bytes().splitlines():
        record = orjson.loads(line)
        if record["kind"] == "transition" and record["trigger"] == "preempted":
            REACH["preemption"] += 1
        elif record["kind"] == "job":
            REACH[record["op"]] += 1
        elif record["kind"] == "input" and record["type"] == "step_output" and record.get("reports"):
            REACH["held report"] += 1


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example(  # a load joins another's (shared-loads), preemptions flush stores in flight
    config=RunConfig(engine=EngineConfig(block_tokens=BLOCK_TOKENS, device_blocks=16,
                                         tiers=(TierConfig("host", 20, bandwidth_gbps=0.5),)),
                     policies=("async-lookup", "shared-loads")),
    workload=synthetic_workload(seed=4, num_requests=24, block_tokens=BLOCK_TOKENS, arrival_rate_per_s=100.0,
                                user_tokens=(50, 300), output_tokens=(2, 40), think_time_s=(0.05, 0.5)),
    keep=False, stream=True, chunk=3)
@example(  # early prefetches from a slow disk into a small host tier, with two ranks
    config=RunConfig(engine=EngineConfig(block_tokens=BLOCK_TOKENS, device_blocks=16, ranks=2, async_scheduling=True,
                                         tiers=(TierConfig("host", 6), TierConfig("disk", 60, bandwidth_gbps=0.5))),
                     policies=("early-prefetch",)),
    workload=synthetic_workload(seed=4, num_requests=24, block_tokens=BLOCK_TOKENS, arrival_rate_per_s=20.0,
                                user_tokens=(50, 300), output_tokens=(2, 40), think_time_s=(0.05, 0.5)),
    keep=True, stream=False, chunk=1)
@given(config=configs(), workload=workloads(), keep=st.booleans(), stream=st.booleans(), chunk=st.integers(1, 4))
def test_native_loop_writes_the_reference_trace(config: RunConfig, workload: list[WorkloadRequest], keep: bool,
                                                stream: bool, chunk: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        _compare(Path(tmp), config, workload, keep, stream, chunk)


def _compare(tmp_path: Path, config: RunConfig, workload: list[WorkloadRequest], keep: bool, stream: bool,
             chunk: int) -> None:
    if stream:  # a stream must come in arrival order (an out-of-order one is refused: tested below)
        workload = sorted(workload, key=lambda w: w.arrival_ms)
    ref_path, nat_path = tmp_path / "ref.jsonl", tmp_path / "native.jsonl"
    ref_progress: list[tuple[int, int]] = []
    nat_progress: list[tuple[int, int]] = []

    def reference(config: RunConfig, given: Any, stack: Any, recorder: Any, progress: Any, **kw: Any) -> SimResult:
        check_every = kw.pop("check_every")
        return Spy(config, given, stack, recorder, progress, check_every=check_every, **kw).run()

    def native(*args: Any, **kw: Any) -> SimResult:
        return simulate(*args, chunk=chunk, **kw)

    ref = _run(reference, ref_path, config, workload, keep, stream, ref_progress)
    nat = _run(native, nat_path, config, workload, keep, stream, nat_progress)
    assert nat == ref
    assert nat_progress == ref_progress
    assert filecmp.cmp(ref_path, nat_path, shallow=False)
    if ref[0] == "ok":
        REACH["run"] += 1
        REACH["stranded"] += bool(ref[1][2])
        REACH["retired"] += ref[1][5] is not None and ref[1][5]["requests"] > 0
        _reach(ref_path)
    else:
        REACH["refused"] += 1


def test_the_examples_reach_every_path() -> None:
    """Each rare path was taken by some example of the property (run here if it has not run yet)."""
    if not REACH["run"]:
        test_native_loop_writes_the_reference_trace()
    wanted = ["preemption", "load", "store", "prefetch", "join", "flush", "idle step output", "wake-up",
              "held report", "sync lookup wait"]
    missing = [name for name in wanted if not REACH[name]]
    assert not missing, (missing, REACH)


def _long_workload(n: int) -> list[WorkloadRequest]:
    """Requests 2 ms apart sharing a first block (one or two full 512-token blocks each)."""
    return [WorkloadRequest(f"req-{i}", 2.0 * i, 700 + 400 * (i % 2), 4, (1, 50 + i)[: 1 + i % 2]) for i in range(n)]


def test_progress_every_200_finished_and_at_the_end(tmp_path: Path) -> None:
    config = RunConfig(engine=EngineConfig(device_blocks=200, tiers=(TierConfig("host", 400),)))
    workload = _long_workload(450)
    calls: dict[str, list[tuple[int, int]]] = {}
    for name, run in (("ref", lambda *a, **k: Simulator(*a, **k).run()), ("native", simulate)):
        seen: list[tuple[int, int]] = []
        run(config, workload, load_stack(config.policies), None,
            lambda d, t, seen=seen: seen.append((d, t)))
        calls[name] = seen
    assert calls["native"] == calls["ref"]
    assert [t for _, t in calls["ref"]] == [450] * 3 and calls["ref"][-1][0] == 450


def test_an_out_of_order_stream_is_refused_where_the_reference_refuses_it(tmp_path: Path) -> None:
    workload = _long_workload(30)
    workload[20], workload[21] = workload[21], workload[20]
    config = RunConfig(engine=EngineConfig(device_blocks=100))
    outcomes = []
    for name, run in (("ref", lambda *a, **k: Simulator(*a, **k).run()), ("native", simulate)):
        path = tmp_path / f"{name}.jsonl"
        stack = load_stack(config.policies)
        with pytest.raises(ValueError) as caught, recording(path, config, stack) as writer:
            assert writer is not None
            run(config, iter(workload), stack, writer.record)
        outcomes.append((str(caught.value), path.read_bytes()))
    assert outcomes[0] == outcomes[1]
    assert "'req-20' arrives at 40.0 ms, before the 42.0 ms" in outcomes[0][0]


def test_a_readers_error_comes_when_the_loop_reaches_it(tmp_path: Path) -> None:
    """A stream that fails part-way: the requests before it run exactly as in the reference
    (chunks are read ahead, the error held back until the loop asks for that request)."""
    workload = _long_workload(25)

    def failing() -> Iterator[WorkloadRequest]:
        yield from workload[:17]
        raise ValueError("workload.jsonl:18: field 'timestamp': bad")

    config = RunConfig(engine=EngineConfig(device_blocks=100, tiers=(TierConfig("host", 50),)))
    outcomes = []
    for name, run in (("ref", lambda *a, **k: Simulator(*a, **k).run()), ("native", simulate)):
        path = tmp_path / f"{name}.jsonl"
        stack = load_stack(config.policies)
        with pytest.raises(ValueError) as caught, recording(path, config, stack) as writer:
            assert writer is not None
            run(config, failing(), stack, writer.record)
        outcomes.append((str(caught.value), path.read_bytes()))
    assert outcomes[0] == outcomes[1]
    # The 17th request's arrival pops, the loop queues the next one first, and that raises.
    assert outcomes[0][1].count(b'"type":"arrival"') == 16


def test_chaos_and_check_stay_on_the_python_engine() -> None:
    for sim in (SimConfig(check=True), SimConfig(chaos=3)):
        config = RunConfig(engine=EngineConfig(device_blocks=100, transfer_deadline_ms=50.0), sim=sim)
        with pytest.raises(ValueError, match="--chaos or --check"):
            simulate(config, [], load_stack(config.policies))


@pytest.mark.parametrize(("signum", "name"), [(signal.SIGTERM, "SIGTERM"), (signal.SIGINT, "SIGINT")])
def test_a_signal_cuts_the_native_loop_between_two_events(tmp_path: Path, signum: int, name: str) -> None:
    """The signal arrives inside an engine call (it started a load); the gate holds it and the
    loop's hook raises it before the next event: the same cut, record and trace as the reference."""
    config = RunConfig(engine=EngineConfig(device_blocks=200, ranks=2,
                                           tiers=(TierConfig("host", 400), TierConfig("disk", 2000))),
                       policies=("async-lookup", "shared-loads"))
    workload = synthetic_workload(seed=3, num_requests=2000, arrival_rate_per_s=40.0)
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    interrupts.install_sigterm_handler()
    interrupts.install_sigint_handler()
    traces = []
    try:
        for label, run in (("ref", lambda *a, **k: Simulator(*a, **k).run()), ("native", simulate)):
            path = tmp_path / f"{label}.jsonl"
            stack = load_stack(config.policies)
            with recording(path, config, stack) as writer:
                assert writer is not None
                loads: list[int] = []

                def record(entry: dict[str, Any], writer: Any = writer, loads: list[int] = loads) -> None:
                    writer.record(entry)
                    if entry["kind"] == "job" and entry["op"] == "load":
                        loads.append(entry["job"])
                        if len(loads) == 5:
                            os.kill(os.getpid(), signum)

                with pytest.raises(KeyboardInterrupt) as caught:
                    run(config, workload, stack, record)
                assert interrupts.signal_name(caught.value) == name
            traces.append(path.read_bytes())
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    assert traces[0] == traces[1]
    last = orjson.loads(traces[1].splitlines()[-1])
    assert last["kind"] == "interrupted" and last["signal"] == name and last["clean"] is True
    assert last["not_arrived"] > 0


ALWAYS_DEFER = '''
from kvlife.policies.base import Decision

class AlwaysDefer:
    name = "always-defer"

    def admission(self, request, engine, load):
        return Decision("defer", "never admit a request that would load")
'''


def test_a_user_policy_that_strands_requests(tmp_path: Path) -> None:
    """A policy from a file that never admits a request that would load: the requests that
    hit the host tier are stranded, and both loops end the trace with the same warnings."""
    policy = tmp_path / "defer.py"
    policy.write_text(ALWAYS_DEFER)
    config = RunConfig(engine=EngineConfig(block_tokens=BLOCK_TOKENS, device_blocks=16,
                                           tiers=(TierConfig("host", 40),)),
                       policies=(f"{policy}:AlwaysDefer",))
    workload = synthetic_workload(seed=4, num_requests=24, block_tokens=BLOCK_TOKENS, arrival_rate_per_s=100.0,
                                  user_tokens=(50, 300), output_tokens=(2, 40), think_time_s=(0.05, 0.5))
    results = [_run(run, tmp_path / f"{name}.jsonl", config, workload, True, False, [])
               for name, run in (("ref", lambda *a, **k: Simulator(*a, **k).run()), ("native", simulate))]
    assert results[0] == results[1] and results[0][0] == "ok"
    assert filecmp.cmp(tmp_path / "ref.jsonl", tmp_path / "native.jsonl", shallow=False)
    stranded = results[0][1][2]
    assert stranded and all(entry.endswith(":waiting") for entry in stranded)
    warned = [orjson.loads(line) for line in (tmp_path / "native.jsonl").read_bytes().splitlines()[-len(stranded):]]
    assert [f"{w['req']}:{w['state']}" for w in warned] == stranded
    assert {w["what"] for w in warned} == {"stranded"}


CUT_CHILD = '''
import sys
from kvlife.lifecycle.config import EngineConfig, RunConfig, TierConfig
from kvlife.lifecycle.drivers import interrupts
from kvlife.lifecycle.drivers.runner import recording
from kvlife.lifecycle.native.bridge import simulate
from kvlife.lifecycle.workloads.mooncake import WorkloadRequest
from kvlife.policies.loading import load_stack

config = RunConfig(engine=EngineConfig(device_blocks=200, ranks=2, tiers=(TierConfig("host", 400),)),
                   policies=("async-lookup", "shared-loads"))
stream = (WorkloadRequest(f"req-{i}", 5.0 * i, 1100 + 400 * (i % 3), 8, (1, 2, 100 + i % 50)[: 2 + i % 2])
          for i in range(10**7))
interrupts.install_sigterm_handler()
interrupts.install_sigint_handler()
stack = load_stack(config.policies)
try:
    with recording(sys.argv[1], config, stack) as writer:
        simulate(config, stream, stack, writer.record)
except KeyboardInterrupt as exc:
    print(f"interrupted ({interrupts.signal_name(exc)})", file=sys.stderr)
    sys.exit(interrupts.exit_code(exc))
'''


@pytest.mark.parametrize(("signum", "name", "code"), [(signal.SIGINT, "SIGINT", 130), (signal.SIGTERM, "SIGTERM", 143)])
def test_a_signal_from_outside_cuts_a_native_run_with_a_valid_trace(tmp_path: Path, signum: int, name: str,
                                                                     code: int) -> None:
    """A process running the native loop, signalled once its trace is under way: it stops
    between two events, ends the trace with a clean ``interrupted`` record, and exits 128 + N."""
    from kvlife.lifecycle.traces.validate import validate
    from tests.conftest import written_so_far

    trace = tmp_path / "cut.jsonl"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen([sys.executable, "-c", CUT_CHILD, str(trace)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline and written_so_far(trace) < 200_000:
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert (proc.returncode, err) == (code, f"interrupted ({name})\n")
    last = orjson.loads(trace.read_bytes().rstrip(b"\n").rsplit(b"\n", 1)[1])
    assert last["kind"] == "interrupted" and last["signal"] == name and last["clean"] is True
    report = validate(trace)
    assert report.ok, report.findings[:3]
