"""The ``kvlife`` command line. User errors end with one line and exit code 2."""

from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import sys
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from kvlife.lifecycle.cli import commands
from kvlife.lifecycle.config import ConfigError, RunConfig, load_config
from kvlife.lifecycle.traces.trace import TraceError
from kvlife.lifecycle.workloads.mooncake import WorkloadError, WorkloadRequest, load_mooncake
from kvlife.policies.base import PolicyError

USER_ERRORS = (ConfigError, WorkloadError, PolicyError, TraceError)

# Optional dependencies -> the extra that installs them (pyproject.toml).
OPTIONAL_EXTRAS = {"torch": "live", "redis": "live", "matplotlib": "plot"}


class UsageError(Exception):
    """A bad flag value the parser itself cannot catch."""


def _progress_bar(stream: Any) -> Callable[[int, int], None]:
    def show(done: int, total: int) -> None:
        width = 30
        filled = int(width * done / total) if total else width
        stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} requests")
        if done >= total:
            stream.write("\n")
        stream.flush()

    return show


def _load_run_config(args: argparse.Namespace) -> RunConfig:
    config = load_config(args.config) if args.config else RunConfig()
    if args.policy:
        config = attrs.evolve(config, policies=tuple(args.policy))
    elif args.config and config.policies:
        # A bad name in the file is a config error: point at the file and the line.
        from kvlife.lifecycle.config import key_line
        from kvlife.policies.loading import load_stack

        try:
            load_stack(config.policies)
        except PolicyError as exc:
            raise ConfigError("policies.stack", str(exc), args.config, key_line(args.config, "stack")) from None
    if args.seed is not None:
        config = attrs.evolve(config, sim=attrs.evolve(config.sim, seed=args.seed))
    return config


def _apply_sizes(args: argparse.Namespace, config: RunConfig) -> RunConfig:
    """--device-blocks N and --tier NAME=BLOCKS (0 drops the tier) over the config."""
    from kvlife.lifecycle.config import TierConfig

    engine = config.engine
    if args.device_blocks is not None:
        engine = attrs.evolve(engine, device_blocks=args.device_blocks)
    tiers = {t.name: t for t in engine.tiers}
    for spec in args.tier or []:
        name, sep, size = spec.partition("=")
        if not sep or name not in ("host", "disk", "remote") or not size.isdigit():
            raise UsageError(f"--tier {spec!r}: expected host=N, disk=N or remote=N (N blocks, 0 drops it)")
        if int(size) == 0:
            tiers.pop(name, None)
        elif name in tiers:
            tiers[name] = attrs.evolve(tiers[name], capacity_blocks=int(size))
        else:
            defaults = {"disk": {"bandwidth_gbps": 3.0, "latency_ms": 0.1},
                        "remote": {"bandwidth_gbps": 1.0, "latency_ms": 0.5}}.get(name, {})
            tiers[name] = TierConfig(name, capacity_blocks=int(size), **defaults)  # type: ignore[arg-type]
    order = ("host", "disk", "remote")
    engine = attrs.evolve(engine, tiers=tuple(tiers[n] for n in order if n in tiers))
    return attrs.evolve(config, engine=engine)


def _load_workload(args: argparse.Namespace, config: RunConfig) -> tuple[list[WorkloadRequest], str]:
    if args.workload:
        workload = load_mooncake(
            args.workload, limit=args.limit, block_tokens=config.engine.block_tokens,
            time_scale=args.time_scale,
        )
        return workload, str(args.workload)
    from kvlife.lifecycle.workloads.synthetic import synthetic_workload

    try:
        workload = synthetic_workload(
            seed=config.sim.seed,
            num_requests=args.limit or 400,
            block_tokens=config.engine.block_tokens,
            arrival_rate_per_s=4.0 * args.time_scale,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return workload, "synthetic"


def cmd_run(args: argparse.Namespace) -> int:
    from kvlife.lifecycle.drivers.runner import run_workload
    from kvlife.lifecycle.metrics import format_summary

    config = _load_run_config(args)
    if args.live:
        return _run_live(args, config)
    config = _apply_sizes(args, config)
    workload, name = _load_workload(args, config)
    progress = _progress_bar(sys.stderr) if sys.stdout.isatty() and len(workload) >= 1000 else None
    outcome = run_workload(config, workload, trace_path=args.trace, progress=progress, workload_name=name)
    if args.json:
        print(json.dumps(outcome.summary, sort_keys=False))
    else:
        print(f"kvlife run: {name}, {len(workload)} requests, stack {', '.join(config.policies) or 'baseline'}")
        print(format_summary(outcome.summary))
        if args.trace:
            print(f"trace: {args.trace} ({outcome.trace_lines:,} lines)")
    return 0


def _run_live(args: argparse.Namespace, config: RunConfig) -> int:
    from kvlife.lifecycle.drivers.live import live_defaults, run_live
    from kvlife.lifecycle.metrics import format_summary

    config = _apply_sizes(args, live_defaults(config, explicit_config=bool(args.config)))
    live = config.live
    if args.ranks is not None:
        config = attrs.evolve(config, engine=attrs.evolve(config.engine, ranks=args.ranks))
    if args.disk_path is not None:
        live = attrs.evolve(live, disk_path=args.disk_path)
    if args.redis_url is not None:
        live = attrs.evolve(live, redis_url=args.redis_url)
        if not any(t.name == "remote" for t in config.engine.tiers):
            from kvlife.lifecycle.config import TierConfig

            tiers = (*config.engine.tiers, TierConfig("remote", capacity_blocks=4096))
            config = attrs.evolve(config, engine=attrs.evolve(config.engine, tiers=tiers))
    if args.no_verify:
        live = attrs.evolve(live, verify=False)
    config = attrs.evolve(config, live=live)
    if args.workload is None and args.limit is None:
        args.limit = 200
    workload, name = _load_workload(args, config)
    scale = args.time_scale if args.time_scale != 1.0 or args.workload else 20.0
    progress = _progress_bar(sys.stderr) if sys.stdout.isatty() and len(workload) >= 1000 else None
    outcome = run_live(config, workload, trace_path=args.trace, time_scale=scale, progress=progress,
                       workload_name=name)
    if args.json:
        print(json.dumps(outcome.summary))
    else:
        tier_sizes = ", ".join(f"{t.name} {t.capacity_blocks}" for t in config.engine.tiers)
        print(f"kvlife run --live: {name}, {len(workload)} requests, {config.engine.ranks} ranks,"
              f" tiers {tier_sizes}, stack {', '.join(config.policies) or 'baseline'}")
        print(format_summary(outcome.summary))
        live_summary = outcome.summary["live"]
        print(f"verified loads             {live_summary['blocks_verified']:,} blocks,"
              f" {live_summary['mismatches']} mismatches" if live.verify else "verified loads             off")
        print(f"tier events                {live_summary['tier_events']}, rank errors {live_summary['rank_errors']}")
        if args.trace:
            print(f"trace: {args.trace} ({outcome.trace_lines:,} lines)")
    return 1 if live.verify and outcome.stats.mismatches else 0


def cmd_spec(args: argparse.Namespace) -> int:
    from kvlife.specs.table import TABLE, mermaid

    if args.format == "mermaid":
        print(mermaid())
    else:
        for (state, trigger), target in TABLE.edges.items():
            print(f"{state:<15} --{trigger}--> {target}")
    return 0


def cmd_policies(args: argparse.Namespace) -> int:
    from kvlife.policies.registry import BUILTIN, DESCRIPTIONS

    width = max(len(n) for n in BUILTIN)
    for name in BUILTIN:
        print(f"{name:<{width}}  {DESCRIPTIONS.get(name, '')}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if args.what == "engine":
        from kvlife.lifecycle.cli.bench_engine import main as bench_engine

        return bench_engine(args.rest)
    if args.what == "transfer":
        from kvlife.transfer.transfer_bench import main as bench_transfer

        return bench_transfer(args.rest)
    raise UsageError(f"unknown benchmark {args.what!r}")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvlife")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvlife", description="KV-cache request lifecycle engine")
    parser.add_argument("--version", action="version", version=f"kvlife {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="simulate a workload (or --live: real KV bytes) and print a summary")
    run.add_argument("--workload", help="Mooncake JSON-lines trace (default: built-in synthetic)")
    run.add_argument("--limit", type=int, help="use only the first N requests")
    run.add_argument("--time-scale", type=float, default=1.0,
                     help="arrival rate multiplier (a --live run of the synthetic workload defaults to 20)")
    run.add_argument("--config", help="TOML config file")
    run.add_argument("--policy", action="append", help="policy (name, pkg.mod:Class, file.py:Class); repeatable")
    run.add_argument("--seed", type=int)
    run.add_argument("--trace", help="write the JSON-lines trace here")
    run.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    run.add_argument("--device-blocks", type=int, help="device KV capacity in blocks")
    run.add_argument("--tier", action="append", metavar="NAME=BLOCKS",
                     help="size a tier (host, disk, remote); 0 drops it; repeatable")
    run.add_argument("--live", action="store_true",
                     help="drive the engine in wall-clock time with real KV bytes (host + disk tiers)")
    run.add_argument("--ranks", type=int, help="live: tensor-parallel ranks (threads)")
    run.add_argument("--disk-path", help="live: directory for the disk tier's files")
    run.add_argument("--redis-url", help="live: add a Redis tier at this URL (redis://127.0.0.1:6379/0)")
    run.add_argument("--no-verify", action="store_true", help="live: skip byte-exact checks of loads")
    run.set_defaults(func=cmd_run)

    spec = sub.add_parser("spec", help="print the request lifecycle spec")
    spec.add_argument("--format", choices=("mermaid", "table"), default="mermaid")
    spec.set_defaults(func=cmd_spec)

    pol = sub.add_parser("policies", help="list built-in policies")
    pol.set_defaults(func=cmd_policies)

    bench = sub.add_parser("bench", help="benchmarks: engine, transfer")
    bench.add_argument("what", choices=("engine", "transfer"))
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(func=cmd_bench)

    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{commands.__name__}.{info.name}")
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    import signal

    from kvlife.lifecycle.drivers import interrupts

    previous = signal.getsignal(signal.SIGTERM)
    interrupts.install_sigterm_handler()
    try:
        return _main(argv)
    except KeyboardInterrupt as exc:  # SIGINT or SIGTERM: the run already wrote its trace
        print(f"kvlife: interrupted ({interrupts.signal_name(exc)})", file=sys.stderr)
        return interrupts.exit_code(exc)
    finally:
        if previous is not None and signal.getsignal(signal.SIGTERM) is not previous:
            signal.signal(signal.SIGTERM, previous)


def _main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "limit", None) is not None and args.limit <= 0:
        parser.exit(2, f"kvlife: error: --limit must be positive, got {args.limit}\n")
    if getattr(args, "time_scale", 1.0) <= 0:
        parser.exit(2, f"kvlife: error: --time-scale must be positive, got {args.time_scale}\n")
    try:
        result: int = args.func(args)
        return result
    except (*USER_ERRORS, UsageError) as exc:
        print(f"kvlife: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0
    except ModuleNotFoundError as exc:
        # An optional dependency of this command (the core needs none of them).
        extra = OPTIONAL_EXTRAS.get((exc.name or "").partition(".")[0])
        if extra is None:
            raise
        print(f"kvlife: error: this command needs {exc.name}, which is not installed: "
              f"pip install 'kvlife[{extra}]'", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
