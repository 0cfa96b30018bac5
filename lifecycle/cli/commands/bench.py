"""``kvlife bench engine|transfer|soak``: the benchmarks, each a real subcommand with its flags."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvlife.lifecycle.cli import output
from kvlife.lifecycle.cli.parsing import (
    KvlifeParser,
    UsageError,
    add_json_flag,
    name_or_path,
    positive_float,
    positive_int,
)
from kvlife.lifecycle.config import REQUESTS

KB = 1024
MB = 1024 * KB
DEFAULT_ENGINE_WORKLOAD = "mooncake-conversation"  # the bundled trace; never replaced silently


def register(sub: Any) -> None:
    bench: KvlifeParser = sub.add_parser(
        "bench", help="benchmarks: engine (transitions, whole-trace simulation), transfer (copy engine), "
                      "soak (peak memory of long simulated runs)",
        description="Benchmarks. Performance is measured here, never by timed tests.")
    bench.set_defaults(func=lambda args: bench.missing_subcommand("a benchmark: engine, transfer or soak"))
    which = bench.add_subparsers(title="benchmarks", dest="bench", metavar="{engine,transfer,soak}")
    _register_engine(which)
    _register_transfer(which)
    _register_soak(which)


def _register_engine(which: Any) -> None:
    parser = which.add_parser(
        "engine", help="transitions/s of the compiled core vs a bare dict loop vs python-statemachine; "
                       "then a whole workload simulated on the python and native engines side by side",
        description="Part 1: the same transitions three ways (bare dict loop, compiled core, python-statemachine). "
                    "Part 2: a whole workload simulated, tracing off and on (the trace to a temporary file), on "
                    "the python and native engines side by side, each run in a fresh process: the run's CPU "
                    "time (median), requests per CPU second beside an anchor (a published Rust simulator's "
                    "9,800 requests/s on Mooncake's tool&agent trace: another trace, another language), peak "
                    "RSS, and the python/native ratio.")
    parser.add_argument("--requests", type=positive_int, default=20000, metavar="N",
                        help="requests in the transition bench")
    parser.add_argument("--repeats", type=positive_int, default=5, metavar="N", help="repeats (the median is shown)")
    parser.add_argument("--reference-requests", type=positive_int, default=500, metavar="N",
                        help="requests for python-statemachine (it is ~250x slower)")
    parser.add_argument("--workload", type=name_or_path, default=DEFAULT_ENGINE_WORKLOAD, metavar="NAME|PATH",
                        help="workload of part 2: a bundled name or a Mooncake JSON-lines file (.gz read as gzip)")
    parser.add_argument("--sizes", type=_request_counts, metavar="N,N,...",
                        help="part 2's sizes in requests (12k, 50000, ...): the workload's first N, or it and "
                             "shifted copies past its length (default: the whole workload)")
    parser.add_argument("--engines", type=_engines, default=("python", "native"), metavar="python,native",
                        help="the engines part 2 runs, side by side (default both; native needs the built core)")
    parser.add_argument("--sim-repeats", type=positive_int, default=3, metavar="N",
                        help="part 2's runs per size, tracing mode and engine (the median CPU time is shown)")
    parser.add_argument("--tracing", choices=("off", "on", "both"), default="both",
                        help="part 2 with tracing off, on (the trace to a temporary file), or both, off first")
    skip = parser.add_mutually_exclusive_group()
    skip.add_argument("--skip-trace", action="store_true", help="skip part 2 (the whole-workload simulation)")
    skip.add_argument("--skip-transitions", action="store_true", help="skip part 1 (the transition bench)")
    add_json_flag(parser, "the results")
    parser.set_defaults(func=handle_engine)


def handle_engine(args: argparse.Namespace) -> int:
    from kvlife.lifecycle.cli.bench_engine import ANCHOR_NOTE, bench_simulation, bench_transitions, format_report
    from kvlife.lifecycle.cli.progress import progress_bar

    transitions = None if args.skip_transitions else bench_transitions(
        args.requests, args.repeats, args.reference_requests, bars=progress_bar)
    modes = {"off": (False,), "on": (True,), "both": (False, True)}[args.tracing]
    if "native" in args.engines:
        from kvlife.lifecycle.config import RunConfig
        from kvlife.lifecycle.native.choice import uncovered

        why = uncovered(RunConfig())
        if why is not None:
            raise UsageError(f"argument --engines: the native engine cannot run: {why}; "
                             "give --engines python")
    runs = [] if args.skip_trace else bench_simulation(args.workload, args.sizes or (None,), args.engines, modes,
                                                       args.sim_repeats)
    if args.json:
        output.emit("bench-engine", transitions=transitions, simulations=runs, anchor=ANCHOR_NOTE)
    else:
        print(format_report(transitions, runs))
    return 0


def _engines(text: str) -> tuple[str, ...]:
    engines = tuple(dict.fromkeys(e.strip() for e in text.split(",")))
    bad = [e for e in engines if e not in ("python", "native")]
    if bad or not engines:
        raise argparse.ArgumentTypeError(f"unknown engine {bad[0] if bad else text!r}: choose from python, native")
    return engines


def parse_size(text: str) -> int:
    """``16K`` -> 16384, ``1M`` -> 1048576, ``4096`` -> 4096."""
    units = {"K": KB, "M": MB}
    clean = text.strip().upper().removesuffix("B")
    try:
        if not clean.isascii():  # (int() reads "٣" as 3)
            raise ValueError(clean)
        value = int(clean[:-1]) * units[clean[-1]] if clean and clean[-1] in units else int(clean)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size like 64K or 1M, got {text[:40]!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"sizes must be positive, got {text[:40]!r}")
    if value > 1 << 30:  # a KV block of Llama-3-70B at 512 tokens is 160 MiB
        raise argparse.ArgumentTypeError(f"sizes must be at most 1G (no KV block is larger), got {text[:40]!r}")
    return value


def _sizes(text: str) -> list[int]:
    return [parse_size(x) for x in text.split(",")]


def _batches(text: str) -> list[int]:
    return [positive_int(x) for x in text.split(",")]


def _tiers(text: str) -> list[str]:
    tiers = [t.strip() for t in text.split(",")]
    bad = [t for t in tiers if t not in ("host", "disk", "redis")]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown tier {bad[0]!r}: choose from host, disk, redis")
    return tiers


def _register_transfer(which: Any) -> None:
    parser = which.add_parser(
        "transfer", help="copy engine vs a raw torch copy, per tier, block size and batch (needs kvlife[live])",
        description="Copy-engine throughput vs a raw torch copy of the same bytes, per tier, block size and batch.")
    parser.add_argument("--quick", action="store_true",
                        help="a small smoke-test run: other defaults for the four flags below (a flag given "
                             "explicitly still wins)")
    parser.add_argument("--block-sizes", type=_sizes, metavar="SIZES",
                        help="comma-separated block sizes (default: 16K,64K,256K,1M,2M; --quick 64K,1M)")
    parser.add_argument("--batches", type=_batches, metavar="NS",
                        help="comma-separated batch sizes in blocks (default: 1,8,32,128,1024; --quick 1,32)")
    parser.add_argument("--repeats", type=positive_int, metavar="N",
                        help="repeats, medians shown (default: 9; --quick 2)")
    parser.add_argument("--pool-mb", type=positive_int, metavar="MB",
                        help="device and host pool size (default: 512; --quick 64)")
    parser.add_argument("--tiers", type=_tiers, default="host,disk", metavar="TIERS",
                        help="comma-separated subset of host,disk,redis")
    parser.add_argument("--redis-url", metavar="URL",
                        help="measure a Redis tier at this URL, e.g. redis://127.0.0.1:6379/0 (default: no Redis)")
    parser.add_argument("--disk-dir", metavar="DIR", help="where the disk tier's file goes (default: a temporary dir)")
    parser.add_argument("--threads", type=positive_int, metavar="N",
                        help="torch intra-op threads (default: torch's choice); 1 keeps a busy machine from "
                             "stalling multi-threaded copies on a descheduled thread")
    add_json_flag(parser, "the rows")
    parser.set_defaults(func=handle_transfer)


def handle_transfer(args: argparse.Namespace) -> int:
    from kvlife.lifecycle.cli.extras import require

    require("torch", "live", "kvlife bench transfer")
    require("redis", "live", "kvlife bench transfer")
    require("numpy", "live", "kvlife bench transfer")
    from kvlife.lifecycle.cli.progress import progress_bar
    from kvlife.transfer import transfer_bench as tb

    quick = args.quick
    block_sizes = args.block_sizes or list(tb.QUICK_BLOCK_SIZES if quick else tb.DEFAULT_BLOCK_SIZES)
    batches = args.batches or list(tb.QUICK_BATCHES if quick else tb.DEFAULT_BATCHES)
    repeats = args.repeats or (2 if quick else 9)
    pool_mb = args.pool_mb or (64 if quick else 512)
    tiers = list(args.tiers)
    if args.redis_url and "redis" not in tiers:
        tiers.append("redis")
    with progress_bar("kvlife bench transfer", unit="row") as progress:
        rows = tb.run_transfer_bench(
            block_sizes=block_sizes,
            batches=batches,
            repeats=repeats,
            tiers=tiers,
            redis_url=args.redis_url,
            pool_bytes=pool_mb * tb.MB,
            disk_batch_bytes=(16 if quick else 64) * tb.MB,
            disk_dir=args.disk_dir,
            lookup_samples=20 if quick else 200,
            progress=progress,
            threads=args.threads,
        )
    if args.json:
        output.emit("bench-transfer", quick=quick, tiers=tiers, block_sizes=block_sizes, batches=batches,
                    repeats=repeats, pool_mb=pool_mb, rows=rows)
    else:
        print(tb.format_table(rows))
    return 0


def _request_counts(text: str) -> list[int]:
    """``12000,50k,100k`` -> [12000, 50000, 100000]."""
    sizes = []
    for part in text.split(","):
        clean = part.strip().lower()
        try:
            if not clean.isascii():  # (int() reads "٣" as 3)
                raise ValueError(clean)
            size = int(clean[:-1]) * 1000 if clean.endswith("k") else int(clean)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected request counts like 12000,50k,100k, got {text[:40]!r}") \
                from None
        if size <= 0:
            raise argparse.ArgumentTypeError(f"request counts must be positive, got {part.strip()[:40]!r}")
        problem = REQUESTS.problem(size)
        if problem is not None:
            raise argparse.ArgumentTypeError(f"{part.strip()[:40]}: {problem}")
        sizes.append(size)
    return sizes


def _register_soak(which: Any) -> None:
    from kvlife.lifecycle.cli.bench_soak import DEFAULT_TIME_SCALE, SIZES

    parser = which.add_parser(
        "soak", help="peak RSS and wall time of long simulated runs (12k, 50k, 100k requests), each in a fresh process",
        description="Simulate the bundled conversation trace followed by shifted copies of itself (streamed, "
                    "tracing off unless --trace) at each size, each in a fresh Python process, and report its peak "
                    "resident set size (ru_maxrss) and wall time.")
    parser.add_argument("--sizes", type=_request_counts, default=",".join(str(n) for n in SIZES), metavar="N,N,...",
                        help="comma-separated request counts (a k suffix is thousands), e.g. 12k,50k,100k")
    parser.add_argument("--time-scale", type=positive_float, default=DEFAULT_TIME_SCALE, metavar="X",
                        help="arrival rate multiplier (the default is one the baseline engine keeps up with)")
    parser.add_argument("--keep-requests", action="store_true",
                        help="keep every finished request in the engine (the old behaviour), for comparison")
    parser.add_argument("--trace", action="store_true",
                        help="write each run's trace (to a temporary file, removed after): tracing on")
    add_json_flag(parser, "the runs")
    parser.set_defaults(func=handle_soak)


def handle_soak(args: argparse.Namespace) -> int:
    from kvlife.lifecycle.cli.bench_soak import SoakError, bench_soak, format_report

    try:
        report = bench_soak(args.sizes, args.time_scale, args.keep_requests, args.trace)
    except SoakError as exc:
        print(f"kvlife bench soak: {exc}", file=sys.stderr)
        return 1
    if args.json:
        output.emit("bench-soak", **report)
    else:
        print(format_report(report))
    return 0
