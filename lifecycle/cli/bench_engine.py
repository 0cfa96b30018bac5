"""``kvlife bench engine``: transition throughput of the compiled core, and a whole-trace run.

Part 1 drives the same sequence of (request, trigger) transitions three ways, in one run:
a bare loop over a dict of (state, trigger) -> state, the engine's transition path (attrs
records over the compiled table, with state counts; recorder off), and python-statemachine
instances (the reference mode). Part 2 simulates a workload (by default the whole bundled
Mooncake conversation trace, ``mooncake-conversation``; larger sizes add shifted copies of
it) with tracing off and on, on the Python engine and the native one side by side, each
run in a fresh process: the run's own CPU time (median over repeats), requests per CPU
second beside the anchor (``ANCHOR_PER_S``), peak memory, and the Python/native ratio. A
workload that cannot be read is an error, never a silent switch to another one. Clocks are
read here, never in the core.
"""

from __future__ import annotations

import contextlib
import random
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

from kvlife.lifecycle.config import EngineConfig
from kvlife.lifecycle.drivers.simulator import Progress
from kvlife.lifecycle.engine.core import Engine
from kvlife.lifecycle.engine.request import Request
from kvlife.policies.stack import PolicyStack
from kvlife.specs.names import Trigger
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

# A progress bar for one phase: (description, unit, total) -> a context yielding a callback.
Bars = Callable[[str, str, int | None], AbstractContextManager[Progress]]


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
    move = engine.core.lifecycle.move
    typed = [(r, Trigger(trigger)) for r, trigger in sequence]
    start = time.perf_counter()
    for r, trigger in typed:
        move(records[r], trigger, "bench")
    return time.perf_counter() - start


def reference_path(sequence: list[tuple[int, str]], requests: int) -> float:
    machines = [ReferenceRequest(f"req-{i}") for i in range(requests)]
    start = time.perf_counter()
    for r, trigger in sequence:
        machines[r].fire(trigger)
    return time.perf_counter() - start


def _median_runs(fn: Callable[[], float], repeats: int, step: Callable[[], None]) -> float:
    samples = []
    for _ in range(repeats):
        samples.append(fn())
        step()
    return statistics.median(samples)


def bench_transitions(requests: int, repeats: int, reference_requests: int,
                      bars: Bars | None = None) -> dict[str, float]:
    sequence = transition_sequence(requests)
    small = transition_sequence(reference_requests)
    ref_repeats = max(1, repeats // 2)
    total = 2 * repeats + ref_repeats
    with (bars or _no_bars)("transitions", "run", total) as progress:
        done = 0

        def step() -> None:
            nonlocal done
            done += 1
            progress(done, total)

        bare = _median_runs(lambda: bare_loop(sequence, requests), repeats, step)
        core = _median_runs(lambda: engine_path(sequence, requests), repeats, step)
        ref = _median_runs(lambda: reference_path(small, reference_requests), ref_repeats, step)
    return {
        "transitions": len(sequence),
        "repeats": repeats,
        "bare_per_s": len(sequence) / bare,
        "core_per_s": len(sequence) / core,
        "reference_transitions": len(small),
        "reference_per_s": len(small) / ref,
        "core_slowdown_vs_bare": core / bare,
    }


# The anchor ``bench engine`` sets its requests/s beside: a published Rust simulator
# replays Mooncake's tool&agent trace (23,608 requests, another trace than the bundled
# conversation one) in 2.41 s, about 9,800 requests/s (issue 13 of this project). Another
# trace, another language, another model of the engine: a scale, not a like-for-like race.
ANCHOR_REQUESTS = 23_608
ANCHOR_WALL_S = 2.41
ANCHOR_PER_S = ANCHOR_REQUESTS / ANCHOR_WALL_S
ANCHOR_NOTE = (f"anchor: a published Rust simulator replays Mooncake's tool&agent trace ({ANCHOR_REQUESTS:,} "
               f"requests, another trace) in {ANCHOR_WALL_S} s, {ANCHOR_PER_S:,.0f} requests/s "
               "(another language and engine model)")


def bench_simulation(workload_name: str, sizes: Sequence[int | None], engines: Sequence[str],
                     tracings: Sequence[bool], repeats: int) -> list[dict[str, Any]]:
    """Part 2: ``workload_name`` simulated at each size (None: the whole workload; a size
    past its length adds shifted copies, ``bench_soak.soak_workload``), tracing off and on,
    on each engine, at time scale 1 with the recorded arrivals. Every run is a fresh process
    (``bench_soak.run_child``: the peak RSS is that run's alone); CPU and wall time are the
    run's own (the interpreter's start and the imports left out), medians over ``repeats``.
    One row per size and tracing mode: each engine's figures and the python/native ratio."""
    from kvlife.lifecycle.cli.bench_soak import run_child, trace_shape

    whole = trace_shape(workload_name, 512, 1.0).requests
    rows = []
    for size in sizes:
        requests = whole if size is None else size
        for tracing in tracings:
            row: dict[str, Any] = {"workload": workload_name, "requests": requests, "tracing": tracing,
                                   "repeats": repeats, "engines": {}}
            for engine in engines:
                runs = [run_child(requests, 1.0, False, tracing, engine=engine, arrivals="recorded",
                                  source=workload_name) for _ in range(repeats)]
                cpu = statistics.median(r["cpu_s"] for r in runs)
                row["engines"][engine] = {
                    "cpu_s": cpu,
                    "wall_s": statistics.median(r["wall_s"] for r in runs),
                    "requests_per_cpu_s": requests / cpu,
                    "peak_rss_mib": max(r["peak_rss_mib"] for r in runs),
                    "trace_mib": runs[0]["trace_mib"],
                    "finished": runs[0]["finished"],
                    "engine_events": runs[0]["engine_events"],
                    "steps": runs[0]["steps"],
                }
            if "python" in row["engines"] and "native" in row["engines"]:
                row["speedup"] = row["engines"]["python"]["cpu_s"] / row["engines"]["native"]["cpu_s"]
            rows.append(row)
    return rows


@contextlib.contextmanager
def _no_bars(desc: str, unit: str, total: int | None) -> Iterator[Progress]:
    yield lambda done, total: None


def format_report(transitions: dict[str, float] | None, runs: list[dict[str, Any]]) -> str:
    lines = []
    if transitions is not None:
        t = transitions
        lines += [
            f"transitions: {t['transitions']:,} (median of {t['repeats']})",
            f"  bare dict loop        {t['bare_per_s']:>14,.0f} /s",
            f"  compiled core         {t['core_per_s']:>14,.0f} /s   ({t['core_slowdown_vs_bare']:.2f}x the bare loop)",
            f"  python-statemachine   {t['reference_per_s']:>14,.0f} /s",
        ]
    if runs:
        r0 = runs[0]
        lines.append(f"simulation: {r0['workload']}, time scale 1, recorded arrivals, each run a fresh process; "
                     f"CPU of the run itself, median of {r0['repeats']}")
        engines = list(r0["engines"])
        head = f"{'requests':>9}  {'tracing':>7}"
        for engine in engines:
            head += f"  {engine + ' CPU s':>15}  {'req/CPU s':>10}  {'peak RSS MiB':>12}"
        if len(engines) == 2:
            head += f"  {'speedup':>8}"
        lines.append(head)
        for r in runs:
            line = f"{r['requests']:>9,}  {'on' if r['tracing'] else 'off':>7}"
            for engine in engines:
                e = r["engines"][engine]
                line += f"  {e['cpu_s']:>15,.3f}  {e['requests_per_cpu_s']:>10,.0f}  {e['peak_rss_mib']:>12,.1f}"
            if "speedup" in r:
                line += f"  {r['speedup']:>7.1f}x"
            lines.append(line)
    if runs:
        lines.append(ANCHOR_NOTE)
    return "\n".join(lines)
