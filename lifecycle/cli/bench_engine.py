"""``kvlife bench engine``: transition throughput of the compiled core, and a whole-trace run.

Part 1 drives the same sequence of (request, trigger) transitions three ways, in one run:
a bare loop over a dict of (state, trigger) -> state, the engine's transition path (attrs
records over the compiled table, with state counts; recorder off), and python-statemachine
instances (the reference mode). Part 2 simulates a workload (by default the whole
conversation trace) with the trace written to a temporary file, and reports wall time and
peak memory. Medians over repeats; wall clock is used here, never in the core.
"""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from kvlife.lifecycle.config import EngineConfig, RunConfig
from kvlife.lifecycle.engine.core import Engine
from kvlife.lifecycle.engine.request import Request
from kvlife.policies.stack import PolicyStack
from kvlife.specs.table import TABLE, ReferenceRequest

# Paths through the lifecycle, weighted roughly as they occur.
PATHS: tuple[tuple[str, ...], ...] = (
    ("admitted", "completed"),
    ("admitted", "send_started", "completed"),
    ("lookup_submitted", "lookup_answered", "load_started", "load_done", "completed"),
    ("admitted", "preempted", "admitted", "completed"),
    ("load_started", "load_failed", "admitted", "completed"),
    ("lookup_submitted", "aborted"),
)

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "conversation_trace.jsonl"


def transition_sequence(requests: int, seed: int = 0) -> list[tuple[int, str]]:
    rng = random.Random(seed)
    paths = [rng.choice(PATHS) for _ in range(requests)]
    # Interleave requests the way a scheduler would: one step of each live request per round.
    sequence: list[tuple[int, str]] = []
    position = [0] * requests
    live = list(range(requests))
    while live:
        still = []
        for r in live:
            sequence.append((r, paths[r][position[r]]))
            position[r] += 1
            if position[r] < len(paths[r]):
                still.append(r)
        live = still
    return sequence


def bare_loop(sequence: list[tuple[int, str]], requests: int) -> float:
    edges = dict(TABLE.edges)
    states = ["waiting"] * requests
    start = time.perf_counter()
    for r, trigger in sequence:
        states[r] = edges[(states[r], trigger)]
    return time.perf_counter() - start


def engine_path(sequence: list[tuple[int, str]], requests: int) -> float:
    engine = Engine(EngineConfig(tiers=()), PolicyStack([]))
    records = [
        Request(f"req-{i}", i, 0.0, 1, (), False, 512) for i in range(requests)
    ]
    engine.state_counts["waiting"] = requests
    move = engine.lifecycle.move
    start = time.perf_counter()
    for r, trigger in sequence:
        move(records[r], trigger, "bench")
    return time.perf_counter() - start


def reference_path(sequence: list[tuple[int, str]], requests: int) -> float:
    machines = [ReferenceRequest(f"req-{i}") for i in range(requests)]
    start = time.perf_counter()
    for r, trigger in sequence:
        machines[r].fire(trigger)
    return time.perf_counter() - start


def bench_transitions(requests: int, repeats: int, reference_requests: int) -> dict[str, float]:
    sequence = transition_sequence(requests)
    small = transition_sequence(reference_requests)
    bare = statistics.median(bare_loop(sequence, requests) for _ in range(repeats))
    core = statistics.median(engine_path(sequence, requests) for _ in range(repeats))
    ref = statistics.median(reference_path(small, reference_requests) for _ in range(max(1, repeats // 2)))
    return {
        "transitions": len(sequence),
        "bare_per_s": len(sequence) / bare,
        "core_per_s": len(sequence) / core,
        "reference_per_s": len(small) / ref,
        "core_slowdown_vs_bare": core / bare,
    }


def bench_trace(path: Path | None, limit: int | None) -> dict[str, float] | None:
    from kvlife.lifecycle.drivers.runner import run_workload
    from kvlife.lifecycle.workloads.mooncake import load_mooncake
    from kvlife.lifecycle.workloads.synthetic import synthetic_workload

    if path is not None and path.exists():
        workload = load_mooncake(path, limit=limit)
        name = str(path)
    else:
        workload = synthetic_workload(num_requests=limit or 4000)
        name = "synthetic"
    config = RunConfig()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "bench.trace.jsonl"
        start = time.perf_counter()
        outcome = run_workload(config, workload, trace_path=trace, workload_name=name)
        wall = time.perf_counter() - start
        size = trace.stat().st_size
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "workload": name,  # type: ignore[dict-item]
        "requests": len(workload),
        "finished": sum(outcome.summary["finished"].values()),
        "engine_events": outcome.result.events,
        "trace_lines": outcome.trace_lines,
        "trace_mib": size / 2**20,
        "wall_s": wall,
        "events_per_s": outcome.result.events / wall,
        "peak_rss_mib": peak_kib / 1024,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvlife bench engine")
    parser.add_argument("--requests", type=int, default=20000, help="requests in the transition bench")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--reference-requests", type=int, default=500)
    parser.add_argument("--workload", type=Path, default=DEFAULT_TRACE,
                        help="Mooncake trace for part 2 (default: the conversation trace)")
    parser.add_argument("--limit", type=int, help="first N requests of the workload")
    parser.add_argument("--skip-trace", action="store_true")
    args = parser.parse_args(list(argv) if argv is not None else None)
    t = bench_transitions(args.requests, args.repeats, args.reference_requests)
    print(f"transitions: {t['transitions']:,} (median of {args.repeats})")
    print(f"  bare dict loop        {t['bare_per_s']:>14,.0f} /s")
    print(f"  compiled core         {t['core_per_s']:>14,.0f} /s   ({t['core_slowdown_vs_bare']:.2f}x the bare loop)")
    print(f"  python-statemachine   {t['reference_per_s']:>14,.0f} /s")
    if not args.skip_trace:
        r = bench_trace(args.workload, args.limit)
        if r is not None:
            print(f"whole-run simulation: {r['workload']}")
            print(f"  requests {r['requests']:,}, finished {r['finished']:,}, engine events {r['engine_events']:,}")
            print(f"  trace {r['trace_lines']:,} lines, {r['trace_mib']:.1f} MiB")
            print(f"  wall {r['wall_s']:.1f} s, {r['events_per_s']:,.0f} events/s,"
                  f" peak RSS {r['peak_rss_mib']:.0f} MiB")
    return 0
