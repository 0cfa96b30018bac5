"""``kvlife run``: simulate a workload (or ``--live``: real KV bytes) and print a summary."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import attrs

from kvlife.lifecycle.cli import output
from kvlife.lifecycle.cli.parsing import UsageError, add_json_flag, add_stack_flag
from kvlife.lifecycle.cli.run_options import (
    SIM_FLAGS,
    add_report_flags,
    add_sim_flags,
    add_size_flags,
    add_workload_flags,
    apply_sim,
    apply_sizes,
    check_sizes,
    load_run_config,
    load_workload,
    stream_workload,
    time_scale,
)
from kvlife.lifecycle.config import HOOK_BUDGET_S, ConfigError, RunConfig, chaos_problem, flag_type, key_line

LIVE_SYNTHETIC_REQUESTS = 200
LIVE_SYNTHETIC_TIME_SCALE = 20.0
# Flags that only mean something with --live, and the config key each mirrors.
LIVE_ONLY = {"disk_path": "--disk-path", "redis_url": "--redis-url", "redis_ttl": "--redis-ttl",
             "no_verify": "--no-verify"}
# Flags of simulated runs only, beside SIM_FLAGS.
SIM_ONLY = {"requests_out": "--requests-out", "goodput": "--goodput", "request_rate": "--request-rate",
            "engine": "--engine"}
# Flags of simulated runs only: the adversary and the online invariant check.
CHECK_FLAGS = {"chaos": "--chaos", "check": "--check"}


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "run", help="simulate a workload (or --live: real KV bytes) and print a summary",
        description="Simulate a workload through the engine and print a summary; --live drives the same "
                    "engine in wall-clock time with real KV bytes.\n\n"
                    "examples:\n"
                    "  kvlife run --workload mooncake-conversation --limit 2000 --time-scale 0.26 --arrivals spread\n"
                    "  kvlife run --request-rate 6 --arrivals gamma:2 --requests-out requests.csv\n"
                    '  kvlife run --stack "async-lookup,shared-loads" --device-blocks 400 --tier disk=4000\n'
                    "  kvlife run --model llama-3-70b --tp 4 --limit 200\n"
                    "  kvlife run --live --limit 50")
    add_stack_flag(parser)
    add_workload_flags(parser, time_scale_default="1, a --live run of the synthetic workload 20; "
                                                  "or sim.time_scale of --config")
    add_size_flags(parser)
    add_sim_flags(parser)
    parser.add_argument("--trace", metavar="FILE", help="write the JSON-lines trace here (default: no trace)")
    parser.add_argument("--engine", choices=("python", "native"),
                        help="the engine that runs the simulation: the Python reference or the native core, "
                             "which must write the same trace byte for byte; the header's engine line says which "
                             "ran and why not native (simulated runs; default: native where it covers the run)")
    parser.add_argument("--requests-out", metavar="FILE.csv",
                        help="write one CSV row per request: latencies, time per phase (queue, lookup, load, "
                             "prefill, decode, hold), prompt tokens by source and each policy hook's answer; "
                             "pandas.read_csv reads it (simulated runs; default: none)")
    add_report_flags(parser)
    parser.add_argument("--transfer-deadline", type=flag_type("engine.transfer_deadline_ms"), metavar="MS",
                        help="a rank that has not reported a transfer this long after it started is declared "
                             "failed for it (config: engine.transfer_deadline_ms; default: none)")
    parser.add_argument("--hook-budget", type=HOOK_BUDGET_S.parse, metavar="S",
                        help="how long one policy hook may run: past it the run stops with one line naming the "
                             "policy, the hook and the request (config: policies.hook_budget_s; default 5)")
    checks = parser.add_argument_group("adversarial and checked runs (simulated; docs/replay-and-check.md)")
    checks.add_argument("--chaos", type=flag_type("sim.chaos"), metavar="SEED",
                        help="an adversarial driver: rank reports, lookup answers and step outputs delayed, "
                             "duplicated, reordered and dropped within the protocol's rules, from this seed; "
                             "implies --check and needs --transfer-deadline (config: sim.chaos; default: none)")
    checks.add_argument("--check", action="store_true", default=None,
                        help="run the invariant observer beside the engine (provenance, budgets, epochs, liveness) "
                             "and exit 1 on a violation (config: sim.check; default: off)")
    add_json_flag(parser, "the summary")
    live = parser.add_argument_group("live runs (--live)")
    live.add_argument("--live", action="store_true",
                      help="drive the engine in wall-clock time with real KV bytes: rank threads, host and disk "
                           "tiers, byte-exact checks of every load (needs kvlife[live])")
    live.add_argument("--disk-path", type=flag_type("live.disk_path"), metavar="DIR",
                      help="directory for the disk tier's files (config: live.disk_path; default: a temporary one)")
    live.add_argument("--redis-url", type=flag_type("live.redis_url"), metavar="URL",
                      help="add a Redis tier at this URL, e.g. redis://127.0.0.1:6379/0 "
                           "(config: live.redis_url; default: no Redis tier)")
    live.add_argument("--redis-ttl", type=flag_type("live.redis_ttl_s"), metavar="SECONDS",
                      help="the Redis tier's keys expire after this many seconds, 0 never "
                           "(config: live.redis_ttl_s; default: the config's value)")
    live.add_argument("--no-verify", action="store_true", help="skip the byte-exact checks of loaded blocks")
    parser.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    if not args.live:
        given = [flag for dest, flag in LIVE_ONLY.items() if getattr(args, dest) not in (None, False)]
        if given:
            raise UsageError(f"{given[0]} needs --live")
    else:
        given = [flag for dest, flag in SIM_FLAGS.items() if getattr(args, dest) is not None]
        if given:
            raise UsageError(f"{given[0]} applies to simulated runs; --live moves the real bytes of its own "
                             "small model shape ([live] in the config)")
        given = [flag for dest, flag in CHECK_FLAGS.items() if getattr(args, dest) is not None]
        if given:
            raise UsageError(f"{given[0]} applies to simulated runs; a live run checks its bytes (--no-verify)")
        given = [flag for dest, flag in SIM_ONLY.items() if getattr(args, dest) is not None]
        if given:
            raise UsageError(f"{given[0]} applies to simulated runs")
    config = load_run_config(args)
    if args.hook_budget is not None:
        config = attrs.evolve(config, hook_budget_s=args.hook_budget)
    if args.transfer_deadline is not None:
        config = attrs.evolve(config, engine=attrs.evolve(config.engine, transfer_deadline_ms=args.transfer_deadline))
    if args.live:
        return _run_live(args, config)
    return _run_sim(args, config)


def _label(config: RunConfig) -> str:
    from kvlife.lifecycle.cli.compare import stack_label

    return stack_label(config.policies)


def _names(config: RunConfig) -> str:
    return ", ".join(config.policies) or "baseline"


def _run_sim(args: argparse.Namespace, config: RunConfig) -> int:
    from kvlife.lifecycle.cli.progress import progress_bar
    from kvlife.lifecycle.drivers.runner import run_workload
    from kvlife.lifecycle.metrics import format_summary, overload_line
    from kvlife.lifecycle.native.choice import choose

    config = _apply_checks(args, apply_sim(args, apply_sizes(args, config)))
    scale, config = time_scale(args, config, 1.0)
    out = _requests_out(args.requests_out)
    engine = choose(args.engine, config)
    notice = engine.notice()
    if notice is not None:
        print(f"kvlife run: {notice}", file=sys.stderr)
    # A workload file is streamed: read as the run goes, never held whole.
    workload, size, name = stream_workload(args, config, scale)
    origin = "--device-blocks" if args.device_blocks is not None else None
    with progress_bar("kvlife run", total=size) as progress:
        outcome = run_workload(config, workload, trace_path=args.trace, progress=progress, workload_name=name,
                               device_blocks_origin=origin, size=size, breakdown=True, goodput=args.goodput,
                               inputs=run_inputs(args), engine=engine.engine)
    rows_written = None
    if out is not None and outcome.rows is not None:
        from kvlife.lifecycle.breakdown import save_csv

        try:
            rows_written = save_csv(outcome.rows, out)
        except OSError as exc:
            raise UsageError(f"argument --requests-out: cannot write {out}: {exc.strerror}") from None
    for problem in outcome.problems():
        print(f"kvlife run: {problem}", file=sys.stderr)
    warning = overload_line(outcome.summary, scale, args.request_rate)
    if warning is not None:
        print(f"kvlife run: {warning}", file=sys.stderr)
    exit_code = outcome.exit_code
    if args.json:
        output.emit("run", driver="sim", engine=engine.to_dict(), workload={"name": name, "requests": size},
                    stack=_label(config), seed=config.sim.seed, time_scale=scale,
                    request_rate=config.sim.request_rate, arrivals=_arrivals(config),
                    trace={"path": args.trace, "lines": outcome.trace_lines} if args.trace else None,
                    requests_out={"path": out, "rows": rows_written} if out is not None else None,
                    overloaded=outcome.summary["overloaded"], summary=outcome.summary)
        return exit_code
    rate = f", request rate {config.sim.request_rate:g}/s" if config.sim.request_rate is not None else ""
    print(f"kvlife run: {name}, {size} requests, stack {_names(config)}, time scale {scale:g}{rate}, "
          f"arrivals {_arrivals(config)}")
    print(f"{'engine':<29}{engine.header()}")
    print(format_summary(outcome.summary))
    if args.trace:
        print(f"trace: {args.trace} ({outcome.trace_lines:,} lines)")
    if out is not None:
        print(f"requests: {out} ({rows_written:,} rows)")
    return exit_code


def _arrivals(config: RunConfig) -> str:
    """``recorded``, ``spread``, ``poisson`` or ``gamma:CV``, as --arrivals writes it."""
    sim = config.sim
    return f"gamma:{sim.arrival_cv or 1.0:g}" if sim.arrivals == "gamma" else sim.arrivals


def _requests_out(path: str | None) -> str | None:
    """--requests-out: a CSV file (checked before the run: Parquet would need pyarrow, which
    kvlife does not depend on)."""
    if path is None:
        return None
    if path.lower().endswith((".parquet", ".pq")):
        raise UsageError(f"argument --requests-out: {path}: kvlife writes CSV (Parquet would need pyarrow); "
                         "name a .csv file and convert it with pandas.read_csv(...).to_parquet(...)")
    return path


def run_inputs(args: argparse.Namespace) -> tuple[str | None, ...]:
    """The files a run reads (a workload file, the config), which its trace may not be."""
    from kvlife.lifecycle.workloads.bundled import resolve_workload

    return (str(resolve_workload(args.workload)) if args.workload else None, args.config)


def _apply_checks(args: argparse.Namespace, config: RunConfig) -> RunConfig:
    """--chaos and --check over the config; a chaos run without a transfer deadline is a
    one-line error naming the flag (or the config key) that asked for chaos."""
    sim = config.sim
    if args.chaos is not None:
        sim = attrs.evolve(sim, chaos=args.chaos)
    if args.check:
        sim = attrs.evolve(sim, check=True)
    config = attrs.evolve(config, sim=sim)
    problem = chaos_problem(config)
    if problem is not None:
        if args.chaos is not None:
            raise UsageError(f"argument --chaos: {problem}")
        line = key_line(args.config, "sim.chaos") if args.config else None
        raise ConfigError("sim.chaos", problem, args.config, line)
    return config


def _run_live(args: argparse.Namespace, config: RunConfig) -> int:
    from kvlife.lifecycle.cli.extras import require

    require("torch", "live", "kvlife run --live")
    require("redis", "live", "kvlife run --live")
    require("numpy", "live", "kvlife run --live")  # (torch's Tensor.numpy(), for the disk tier's bytes)
    from kvlife.lifecycle.cli.progress import progress_bar
    from kvlife.lifecycle.config import TierConfig, given_keys
    from kvlife.lifecycle.drivers.live import live_defaults, run_live
    from kvlife.lifecycle.metrics import format_summary

    config = apply_sizes(args, live_defaults(config, given_keys(args.config) if args.config else ()))
    live = config.live
    if args.disk_path is not None:
        live = attrs.evolve(live, disk_path=args.disk_path)
    if args.redis_url is not None:
        live = attrs.evolve(live, redis_url=args.redis_url)
        if not any(t.name == "remote" for t in config.engine.tiers):
            tiers = (*config.engine.tiers, TierConfig("remote", capacity_blocks=4096))
            config = attrs.evolve(config, engine=attrs.evolve(config.engine, tiers=tiers))
    if args.redis_ttl is not None:
        live = attrs.evolve(live, redis_ttl_s=args.redis_ttl)
    if args.no_verify:
        live = attrs.evolve(live, verify=False)
    config = attrs.evolve(config, live=live)
    check_sizes(args, config, live=True)
    # Arrivals are read at their own pace and sped up once, by the live runtime.
    default_scale = 1.0 if args.workload else LIVE_SYNTHETIC_TIME_SCALE
    scale, config = time_scale(args, config, default_scale)
    workload, name = load_workload(args, config, 1.0, synthetic_requests=LIVE_SYNTHETIC_REQUESTS)
    from kvlife.policies.loading import load_stack

    # A hook runs at most half the stall watchdog's wait (live.stall_timeout_s): a hook that
    # never returns is named as such, before the watchdog finds the whole loop standing still.
    stack = load_stack(config.policies, min(config.hook_budget_s, config.live.stall_timeout_s / 2))
    with progress_bar("kvlife run --live", total=len(workload)) as progress:
        outcome = run_live(config, workload, stack, trace_path=args.trace, time_scale=scale, progress=progress,
                           workload_name=name, inputs=run_inputs(args))
    # 1: a check found a problem (mismatches, stranded requests, failed steps, rank errors).
    exit_code = outcome.exit_code
    for problem in outcome.problems():
        print(f"kvlife run --live: {problem}", file=sys.stderr)
    if args.json:
        output.emit("run", driver="live", workload={"name": name, "requests": len(workload)},
                    stack=_label(config), seed=config.sim.seed, time_scale=scale,
                    trace={"path": args.trace, "lines": outcome.trace_lines} if args.trace else None,
                    summary=outcome.summary)
        return exit_code
    tier_sizes = ", ".join(f"{t.name} {t.capacity_blocks}" for t in config.engine.tiers)
    print(f"kvlife run --live: {name}, {len(workload)} requests, {config.engine.ranks} ranks,"
          f" tiers {tier_sizes}, stack {_names(config)}, time scale {scale:g}")
    print(format_summary(outcome.summary))
    live_summary = outcome.summary["live"]
    print(f"verified loads             {live_summary['blocks_verified']:,} blocks,"
          f" {live_summary['mismatches']} mismatches" if live.verify else "verified loads             off")
    print(f"tier events                {live_summary['tier_events']}, rank errors {live_summary['rank_errors']}")
    if args.trace:
        print(f"trace: {args.trace} ({outcome.trace_lines:,} lines)")
    return exit_code
