"""``kvlife bench soak``: peak memory and wall time of long simulated runs.

The workload is the bundled Mooncake conversation trace (12,031 requests over 3,537 s)
followed by as many shifted copies of itself as it takes to reach the requested size:
copy *k* arrives *k* periods later (a period is the trace's span plus its mean gap between
arrivals) and has its block hashes offset by *k* times (the largest hash + 1), so copies
share no prefix, as a longer trace of new conversations would not; request ids are
``req-{n}`` in order. It is streamed: the copies are read from the file as the run goes,
never built as a list. Arrivals are replayed at ``--time-scale`` (0.25 by default, where
the baseline engine keeps up: the queue does not grow over the run, so memory measures
the simulator, not a backlog) with tied timestamps spread (``sim.arrivals = "spread"``),
tracing off (``--trace``: written to a temporary file), the default config otherwise.

Each size runs in a fresh Python process, so one size's peak cannot hide another's: the
child runs ``kvlife.lifecycle.drivers.runner.run_workload`` and reports its own peak
resident set size (``resource.getrusage(RUSAGE_SELF).ru_maxrss``) and the run's wall time
as one JSON line. A child that only imports the same modules gives the floor (the
interpreter and kvlife's imports). Wall time is measured here, never in the core.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs

from kvlife.lifecycle.config import RunConfig, SimConfig
from kvlife.lifecycle.workloads.mooncake import WorkloadRequest, iter_mooncake

SIZES = (12_000, 50_000, 100_000)
DEFAULT_TIME_SCALE = 0.25
SOURCE = "mooncake-conversation"


@attrs.frozen
class TraceShape:
    """What shifting copies of a trace needs to know of it (arrivals already scaled)."""

    requests: int
    first_ms: float
    last_ms: float
    hash_offset: int  # the largest block hash + 1

    @property
    def period_ms(self) -> float:
        """Copy k arrives k periods after the original: its span plus the mean gap."""
        span = self.last_ms - self.first_ms
        return span + (span / (self.requests - 1) if self.requests > 1 else 0.0)


def trace_shape(source: str, block_tokens: int, time_scale: float) -> TraceShape:
    """One streaming pass over ``source``."""
    requests, first, last, top = 0, 0.0, 0.0, -1
    for w in iter_mooncake(source, block_tokens=block_tokens, time_scale=time_scale):
        if requests == 0:
            first = w.arrival_ms
        last = w.arrival_ms
        if w.hash_ids:
            top = max(top, max(w.hash_ids))
        requests += 1
    return TraceShape(requests, first, last, top + 1)


def soak_workload(requests: int, *, source: str = SOURCE, block_tokens: int = 512,
                  time_scale: float = DEFAULT_TIME_SCALE) -> Iterator[WorkloadRequest]:
    """``requests`` requests: ``source`` and then shifted copies of it (see the module
    docstring), read from the file as they are taken. The copies need the trace's shape:
    a pass of its own (``trace_shape``), made only when the trace runs out before
    ``requests``, so a run of at most the trace's length reads it once."""
    n = 0
    for w in iter_mooncake(source, limit=requests, block_tokens=block_tokens, time_scale=time_scale):
        # (the reader names the n-th request req-{n} already; a session-tagged one is renamed)
        yield w if w.request_id == f"req-{n}" and w.session is None else WorkloadRequest(
            f"req-{n}", w.arrival_ms, w.input_length, w.output_length, w.hash_ids)
        n += 1
    if n == 0 or n == requests:
        return
    shape = trace_shape(source, block_tokens, time_scale)
    period = shape.period_ms
    copy = 1
    while n < requests:
        shift = copy * period
        offset = copy * shape.hash_offset
        for w in iter_mooncake(source, limit=min(shape.requests, requests - n), block_tokens=block_tokens,
                               time_scale=time_scale):
            yield WorkloadRequest(f"req-{n}", w.arrival_ms + shift, w.input_length, w.output_length,
                                  tuple(h + offset for h in w.hash_ids))
            n += 1
        copy += 1


def soak_config(time_scale: float, arrivals: str = "spread") -> RunConfig:
    return RunConfig(sim=SimConfig(arrivals=arrivals, time_scale=time_scale))


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def run_one(requests: int, time_scale: float, keep_requests: bool, tracing: bool = False, *,
            engine: str = "python", arrivals: str = "spread", source: str = SOURCE) -> dict[str, Any]:
    """The child's side: one soak run in this process (``requests`` 0: imports only);
    ``tracing``: the trace written to a temporary file (removed after); ``engine``: which
    engine simulates (``kvlife bench engine`` runs both); ``cpu_s``: the run's own CPU time
    (``time.process_time`` around it: the interpreter's start and the imports left out)."""
    from kvlife.lifecycle.cli.progress import progress_bar
    from kvlife.lifecycle.drivers.runner import run_workload
    from kvlife.lifecycle.workloads.arrivals import spread_ties

    if requests == 0:
        return {"requests": 0, "peak_rss_mib": _peak_rss_mib()}
    stream = soak_workload(requests, source=source, time_scale=time_scale)
    workload = spread_ties(stream) if arrivals == "spread" else stream
    with tempfile.TemporaryDirectory() as tmp, \
            progress_bar(f"kvlife bench soak {requests:,}", total=requests) as progress:
        trace = Path(tmp) / "soak.trace.jsonl" if tracing else None
        start, cpu = time.perf_counter(), time.process_time()
        outcome = run_workload(soak_config(time_scale, arrivals), workload, workload_name=f"soak-{requests}",
                               progress=progress, size=requests, keep_requests=keep_requests,
                               trace_path=trace, engine=engine)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        trace_mib = trace.stat().st_size / 2**20 if trace is not None else 0.0
    summary = outcome.summary
    retired = outcome.result.retired  # the requests that left the engine, folded
    return {
        "requests": requests,
        "engine": engine,
        "tracing": tracing,
        "wall_s": wall,
        "cpu_s": cpu,
        "requests_per_s": requests / wall,
        "trace_mib": trace_mib,
        "steps": summary["steps"],
        "peak_rss_mib": _peak_rss_mib(),
        "finished": sum(summary["finished"].values()),
        "stranded": summary["stranded"],
        "ttft_p50_ms": summary["ttft_ms"]["p50"],
        "ttft_p99_ms": summary["ttft_ms"]["p99"],
        "engine_events": outcome.result.events,
        "held_at_end": summary["requests"] - retired.requests if retired is not None else summary["requests"],
        "retired": retired.requests if retired is not None else 0,
    }


class SoakError(Exception):
    """A soak child failed."""


def run_child(requests: int, time_scale: float, keep_requests: bool, tracing: bool = False, *,
              engine: str = "python", arrivals: str = "spread", source: str = SOURCE) -> dict[str, Any]:
    """``run_one`` in a fresh interpreter; its JSON line back."""
    command = [sys.executable, "-m", "kvlife.lifecycle.cli.bench_soak", str(requests), repr(time_scale),
               "keep" if keep_requests else "drop", "trace" if tracing else "notrace",
               "--engine", engine, "--arrivals", arrivals, "--source", source]
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=False)
    if done.returncode != 0:
        raise SoakError(f"the {requests:,}-request run failed (exit {done.returncode})")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def bench_soak(sizes: Sequence[int], time_scale: float = DEFAULT_TIME_SCALE,
               keep_requests: bool = False, tracing: bool = False) -> dict[str, Any]:
    floor = run_child(0, time_scale, keep_requests)["peak_rss_mib"]
    runs = [run_child(n, time_scale, keep_requests, tracing) for n in sizes]
    for run in runs:
        run["over_floor_mib"] = run["peak_rss_mib"] - floor
    return {"workload": f"{SOURCE} + shifted copies", "time_scale": time_scale, "arrivals": "spread",
            "trace": tracing, "keep_requests": keep_requests, "floor_rss_mib": floor,
            "runs": runs}


def format_report(report: dict[str, Any]) -> str:
    kept = "kept (--keep-requests)" if report["keep_requests"] else "dropped once folded"
    lines = [
        f"soak: {report['workload']}, time scale {report['time_scale']:g}, {report['arrivals']} arrivals, "
        f"tracing {'on' if report['trace'] else 'off'}, finished requests {kept}",
        f"{'requests':>10}  {'wall s':>8}  {'peak RSS MiB':>12}  {'over floor':>10}  {'held at end':>11}  "
        f"{'TTFT p50 ms':>11}  {'stranded':>8}",
    ]
    for r in report["runs"]:
        p50 = "-" if r["ttft_p50_ms"] is None else f"{r['ttft_p50_ms']:,.0f}"
        lines.append(f"{r['requests']:>10,}  {r['wall_s']:>8,.1f}  {r['peak_rss_mib']:>12,.1f}  "
                     f"{r['over_floor_mib']:>10,.1f}  {r['held_at_end']:>11,}  {p50:>11}  {r['stranded']:>8,}")
    lines.append(f"floor (a child that only imports): {report['floor_rss_mib']:,.1f} MiB; "
                 "each size in a fresh process (ru_maxrss)")
    return "\n".join(lines)


def _main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(description="one soak run (a child of kvlife bench soak)")
    parser.add_argument("requests", type=int, help="requests (0: imports only)")
    parser.add_argument("time_scale", type=float, help="arrival time scale")
    parser.add_argument("retention", choices=("keep", "drop"), help="keep or drop finished requests")
    parser.add_argument("tracing", nargs="?", choices=("trace", "notrace"), default="notrace",
                        help="write the trace (to a temporary file) or not")
    parser.add_argument("--engine", choices=("python", "native"), default="python", help="the engine that runs")
    parser.add_argument("--arrivals", choices=("recorded", "spread"), default="spread", help="arrival times")
    parser.add_argument("--source", default=SOURCE, help="the workload copied (a bundled name or a file)")
    args = parser.parse_args(argv)
    print(json.dumps(run_one(args.requests, args.time_scale, args.retention == "keep", args.tracing == "trace",
                             engine=args.engine, arrivals=args.arrivals, source=args.source)), flush=True)


if __name__ == "__main__":
    _main(sys.argv[1:])
