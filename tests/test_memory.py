"""Memory stays flat: workloads are streamed, finished requests leave the engine, and the
summary (and the trace) are exactly what they are when every request is kept."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import orjson
import pytest

from kvlife.lifecycle.config import EngineConfig, RunConfig, SimConfig, TierConfig
from kvlife.lifecycle.drivers.runner import run_workload
from kvlife.lifecycle.drivers.simulator import Simulator
from kvlife.lifecycle.engine.events import Abort, InputEvent
from kvlife.lifecycle.fidelity.stability import ttft_samples
from kvlife.lifecycle.metrics import summarize
from kvlife.lifecycle.traces.trace import read_header
from kvlife.lifecycle.workloads.mooncake import (
    WorkloadError,
    WorkloadRequest,
    count_requests,
    iter_mooncake,
    load_mooncake,
)
from kvlife.lifecycle.workloads.synthetic import synthetic_workload
from kvlife.policies.loading import load_stack

ROOT = Path(__file__).resolve().parents[1]

# Device memory short enough to preempt, a slow failing host tier (stores still in flight
# when requests finish, failed loads recomputed), async lookups (answers that come back
# after their request was aborted), shared loads, stores held while sending, a length limit.
PRESSURE = RunConfig(
    engine=EngineConfig(device_blocks=70, max_batched_tokens=4096,
                        tiers=(TierConfig("host", 400, bandwidth_gbps=0.1, latency_ms=5.0, failure_rate=0.05),)),
    sim=SimConfig(seed=3, max_output_tokens=100),
    policies=("async-lookup", "shared-loads", "early-lookup"),
)


class AbortingSimulator(Simulator):
    """Every 120th event, the client aborts one of the requests still in the engine's
    queues (the same one whether or not finished requests are kept); every 301st, an
    abort for a request that finished long ago."""

    def _feed(self, now: float, event: InputEvent, idle: bool = False) -> None:
        super()._feed(now, event, idle)
        if self._events % 120 == 0:
            victims = [r for r in self.engine.requests.values() if r.state != "finished"]
            if victims:
                super()._feed(now, Abort(now, victims[(self._events // 120) % len(victims)].request_id))
        if self._events % 301 == 0:
            super()._feed(now, Abort(now, "r-0"))


def _pressure_workload() -> list[WorkloadRequest]:
    workload = [attrs.evolve(w, request_id=f"r-{i}")
                for i, w in enumerate(synthetic_workload(seed=3, num_requests=60, arrival_rate_per_s=12.0))]
    # r-0 again, after every other arrival: a duplicate of a request that has left the engine
    return [*workload, attrs.evolve(workload[0], arrival_ms=workload[-1].arrival_ms + 1.0)]


def _aborting_run(keep_requests: bool) -> tuple[list[dict[str, Any]], dict[str, Any], Simulator, Any]:
    records: list[dict[str, Any]] = []
    sim = AbortingSimulator(PRESSURE, _pressure_workload(), load_stack(PRESSURE.policies), records.append,
                            keep_requests=keep_requests)
    result = sim.run()
    summary = summarize(result, 0.0, 4096)
    return records, summary, sim, result


def test_dropping_finished_requests_changes_neither_trace_nor_summary() -> None:
    kept_records, kept, _, kept_result = _aborting_run(keep_requests=True)
    dropped_records, dropped, sim, result = _aborting_run(keep_requests=False)
    # The workload does exercise what retention must get right.
    triggers = {(r["from"], r["trigger"]) for r in kept_records if r["kind"] == "transition"}
    # (An abort of a request in sending is ignored, as vLLM's finish_requests skips a finished one.)
    assert {("lookup_pending", "aborted"), ("running", "aborted"), ("running", "send_started"),
            ("running", "preempted")} <= triggers
    assert kept["warnings"]["abort_ignored"] > 0 and kept["warnings"]["duplicate_arrival"] == 1
    assert any(r["kind"] == "stale_lookup" and r["state"] == "finished" for r in kept_records)
    assert kept["failed_blocks"] > 0 and kept["preemptions"] > 0
    assert set(kept["finished"]) == {"aborted", "length", "stopped"}
    # Same records, same summary, to the last byte and float.
    assert orjson.dumps(dropped_records) == orjson.dumps(kept_records)
    assert dropped == kept
    assert ttft_samples(_outcome(result)) == ttft_samples(_outcome(kept_result))
    # ... while the dropping run let every request go.
    assert len(kept_result.engine.requests) == 61 - 1  # the duplicate never became a request
    assert len(result.engine.requests) == 0 and len(result.engine.state.retired) == 60
    assert result.retired is not None and result.retired.requests == 60
    assert sim._stops == {}  # the simulator forgot their stop rules too


def _outcome(result: Any) -> Any:
    from kvlife.lifecycle.drivers.runner import RunOutcome

    return RunOutcome(result, {}, 0)


def test_run_workload_summary_is_the_same_kept_or_dropped() -> None:
    workload = synthetic_workload(seed=3, num_requests=60, arrival_rate_per_s=12.0)
    kept = run_workload(PRESSURE, workload, keep_requests=True)
    dropped = run_workload(PRESSURE, workload)
    assert len(kept.result.engine.requests) == 60 and len(dropped.result.engine.requests) == 0
    assert kept.summary.pop("wall_s") >= 0 and dropped.summary.pop("wall_s") >= 0
    assert dropped.summary == kept.summary
    assert dropped.summary["preemptions"] > 0


def _write_workload(path: Path, workload: list[WorkloadRequest]) -> None:
    path.write_bytes(b"".join(
        orjson.dumps({"timestamp": w.arrival_ms, "input_length": w.input_length, "output_length": w.output_length,
                      "hash_ids": list(w.hash_ids)}) + b"\n" for w in workload))


def _kvlife(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvlife", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600, check=False)


def test_kvlife_run_streams_and_drops_with_the_trace_and_summary_of_keeping_all(tmp_path: Path) -> None:
    """``kvlife run --workload FILE`` (streamed, requests dropped) against the same run in
    process with every request kept and the workload loaded whole."""
    workload = synthetic_workload(seed=3, num_requests=60, arrival_rate_per_s=12.0)
    path = tmp_path / "w.jsonl"
    _write_workload(path, workload)
    config = tmp_path / "pressure.toml"
    config.write_text(
        "[engine]\ndevice_blocks = 70\nmax_batched_tokens = 4096\n"
        "[[tiers]]\nname = \"host\"\ncapacity_blocks = 400\nbandwidth_gbps = 0.1\nlatency_ms = 5.0\n"
        "failure_rate = 0.05\n"
        "[sim]\nseed = 3\nmax_output_tokens = 100\n"
        "[policies]\nstack = [\"async-lookup\", \"shared-loads\", \"early-lookup\"]\n")
    done = _kvlife("run", "--workload", str(path), "--config", str(config), "--trace", "cli.jsonl", "--json",
                   cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    cli = json.loads(done.stdout)
    assert cli["workload"]["requests"] == 60

    from kvlife.lifecycle.config import load_config

    loaded = load_config(config)
    # (kvlife run keeps a row per request: the breakdown, folded as requests leave, agrees too)
    kept = run_workload(loaded, load_mooncake(path, block_tokens=loaded.engine.block_tokens),
                        trace_path=tmp_path / "kept.jsonl", workload_name=str(path), keep_requests=True,
                        breakdown=True)
    assert kept.summary["preemptions"] > 0
    cli_summary = cli["summary"]
    for summary in (cli_summary, kept.summary):
        summary.pop("wall_s")
    assert cli_summary == json.loads(orjson.dumps(kept.summary))
    cli_lines = (tmp_path / "cli.jsonl").read_bytes().splitlines()
    kept_lines = (tmp_path / "kept.jsonl").read_bytes().splitlines()
    assert cli_lines[1:] == kept_lines[1:]  # the header holds the config file's path, the rest is equal


def _tiny_requests(n: int) -> Iterator[WorkloadRequest]:
    """One-block prompts, two output tokens, 5 ms apart: a long run that costs little."""
    for i in range(n):
        yield WorkloadRequest(f"req-{i}", 5.0 * i, 16, 2, (i,))


def test_a_12k_request_streamed_run_holds_a_bounded_number_of_requests(tmp_path: Path) -> None:
    n = 12_000
    path = tmp_path / "long.jsonl"
    _write_workload(path, list(_tiny_requests(n)))
    taken = 0
    held: list[int] = []
    ahead: list[int] = []

    def stream() -> Iterator[WorkloadRequest]:
        nonlocal taken
        for request in iter_mooncake(path, block_tokens=16):
            taken += 1
            yield request

    def progress(done: int, total: int) -> None:
        held.append(len(sim.engine.requests))
        ahead.append(taken - sim.engine.state.arrived())

    config = RunConfig(engine=EngineConfig(block_tokens=16, device_blocks=64, tiers=()))
    sim = Simulator(config, stream(), load_stack(()), progress=progress, size=count_requests(path),
                    keep_requests=False)
    result = sim.run()
    summary = summarize(result, 0.0, 1)
    assert summary["requests"] == n and summary["finished"] == {"stopped": n} and summary["stranded"] == 0
    assert len(held) >= n // 200  # sampled all along the run
    assert max(held) <= 50  # never more than a few in flight, not 12k
    assert len(result.engine.requests) == 0
    assert max(ahead) <= 1  # the file is read one arrival ahead of the engine, no more


def test_the_reader_streams_up_to_a_broken_line(tmp_path: Path) -> None:
    path = tmp_path / "w.jsonl"
    good = b'{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}\n'
    path.write_bytes(good + b'{"timestamp": 1, "input_length": \n' + b"not json at all\n")
    stream = iter_mooncake(path)
    assert next(stream) == WorkloadRequest("req-0", 0.0, 600, 5, (1, 2))
    with pytest.raises(WorkloadError) as error:
        next(stream)
    assert str(error.value).startswith(f"{path}:2: invalid JSON")
    assert load_mooncake(path, limit=1) == [WorkloadRequest("req-0", 0.0, 600, 5, (1, 2))]
    assert count_requests(path) == 3 and count_requests(path, limit=1) == 1
    # The command line reads only what --limit takes ...
    done = _kvlife("run", "--workload", str(path), "--limit", "1", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["summary"]["finished"] == {"stopped": 1}
    # ... and without it stops at the broken line with the usual one-line error.
    done = _kvlife("run", "--workload", str(path), cwd=tmp_path)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(f"kvlife: error: {path}:2: invalid JSON")


def test_bad_arguments_and_unreadable_files_fail_as_before(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="limit"):
        iter_mooncake(tmp_path / "missing.jsonl", limit=-1)  # at the call, not at the first request
    with pytest.raises(WorkloadError, match="cannot read"):
        next(iter_mooncake(tmp_path / "missing.jsonl"))
    with pytest.raises(WorkloadError, match="cannot read"):
        count_requests(tmp_path / "missing.jsonl")


def test_a_list_out_of_arrival_order_runs_as_if_sorted() -> None:
    workload = synthetic_workload(seed=5, num_requests=40)
    shuffled = workload[::2] + workload[1::2]
    traces: list[list[dict[str, Any]]] = [[], []]
    for records, given in zip(traces, (workload, shuffled), strict=True):
        Simulator(RunConfig(), given, load_stack(()), records.append).run()
    assert traces[0] == traces[1]


def test_a_stream_out_of_arrival_order_is_refused() -> None:
    backwards = iter([WorkloadRequest("a", 10.0, 16, 2, ()), WorkloadRequest("b", 5.0, 16, 2, ())])
    with pytest.raises(ValueError, match="arrival order"):
        Simulator(RunConfig(), backwards, load_stack(())).run()


def test_bench_soak_reports_peak_rss_per_size_in_fresh_processes(tmp_path: Path) -> None:
    done = _kvlife("bench", "soak", "--sizes", "50,100", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["kind"] == "bench-soak" and report["schema"] == 1
    assert [r["requests"] for r in report["runs"]] == [50, 100]
    for run in report["runs"]:
        assert run["finished"] == run["requests"] and run["stranded"] == 0
        assert run["held_at_end"] == 0 and run["retired"] == run["requests"]
        # A run of 50 or 100 requests adds less than the allocator's noise between two fresh
        # processes (about 0.1 MiB measured): the floor is a floor within that noise.
        assert run["peak_rss_mib"] >= report["floor_rss_mib"] - 1.0 and report["floor_rss_mib"] > 10
        assert run["wall_s"] > 0
    bad = _kvlife("bench", "soak", "--sizes", "12k,0", cwd=tmp_path)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


def test_soak_workload_is_the_trace_then_shifted_copies() -> None:
    from kvlife.lifecycle.cli.bench_soak import soak_workload, trace_shape

    shape = trace_shape("mooncake-conversation", 512, 1.0)
    first = load_mooncake("mooncake-conversation", limit=3)
    soak = list(soak_workload(shape.requests + 3, time_scale=1.0))
    assert soak[:3] == first
    copies = soak[shape.requests:]
    assert [w.request_id for w in copies] == [f"req-{shape.requests + i}" for i in range(3)]
    for original, copy in zip(first, copies, strict=True):
        assert copy.arrival_ms == original.arrival_ms + shape.period_ms
        assert copy.hash_ids == tuple(h + shape.hash_offset for h in original.hash_ids)
    assert copies[0].arrival_ms > soak[shape.requests - 1].arrival_ms
    assert not set(copies[0].hash_ids) & {h for w in soak[: shape.requests] for h in w.hash_ids}


def test_trace_of_a_dropping_run_validates(tmp_path: Path) -> None:
    from kvlife.lifecycle.traces.validate import validate

    trace = tmp_path / "t.jsonl"
    run_workload(PRESSURE, synthetic_workload(seed=3, num_requests=60, arrival_rate_per_s=12.0), trace_path=trace)
    assert read_header(trace)[0]["workload"]["requests"] == 60
    assert not validate(trace).findings
