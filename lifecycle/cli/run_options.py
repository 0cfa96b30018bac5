"""Flags shared by the commands that run a workload (``run``, ``compare``), and what they build.

Each flag mirrors a config key, and a flag given on the command line wins over the file:
``--device-blocks`` engine.device_blocks, ``--ranks`` engine.ranks, ``--seed`` sim.seed,
``--stack`` policies.stack, ``--time-scale`` sim.time_scale, ``--tier NAME=N`` the
``[[tiers]]`` table; the live flags are in ``kvlife.lifecycle.cli.commands.run``.
"""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path
from typing import Any

import attrs

from kvlife.lifecycle.cli.parsing import UsageError, positive_float, positive_int
from kvlife.lifecycle.config import ConfigError, RunConfig, TierConfig, key_line, load_config
from kvlife.lifecycle.workloads.mooncake import WorkloadRequest
from kvlife.policies.base import PolicyError

SYNTHETIC_REQUESTS = 400
SYNTHETIC_RATE_PER_S = 4.0  # arrivals of the built-in synthetic workload at time scale 1


def add_workload_flags(parser: argparse.ArgumentParser, synthetic_requests: str = str(SYNTHETIC_REQUESTS),
                       time_scale_default: str = "1, or sim.time_scale of --config") -> None:
    parser.add_argument("--workload", metavar="NAME|PATH",
                        help="mooncake-conversation (the bundled Mooncake trace), synthetic:burst (bursts of "
                             "requests for one shared prefix) or a Mooncake JSON-lines file "
                             "(.gz is read as gzip); default: the built-in synthetic workload "
                             f"({synthetic_requests} requests)")
    parser.add_argument("--limit", type=positive_int, metavar="N", help="use only the first N requests (default: all)")
    parser.add_argument("--time-scale", type=positive_float, default=None, metavar="X",
                        help=f"arrival rate multiplier, a finite number > 0 (default: {time_scale_default})")
    parser.add_argument("--config", metavar="FILE.toml", help="TOML config file (default: built-in config)")
    parser.add_argument("--seed", type=int, metavar="N", help="random seed (config: sim.seed; default 0)")


def add_size_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device-blocks", type=positive_int, metavar="N",
                        help="device KV capacity in blocks (config: engine.device_blocks; default 2000)")
    parser.add_argument("--tier", action="append", metavar="NAME=BLOCKS",
                        help="size a tier (host, disk, remote) in blocks, 0 drops it; repeatable "
                             "(default: the config's [[tiers]], a host tier of 8000 blocks)")
    parser.add_argument("--ranks", type=positive_int, metavar="N",
                        help="tensor-parallel ranks: a transfer is done when every rank reported it "
                             "(config: engine.ranks; default 1, a live run 2)")


def load_run_config(args: argparse.Namespace, use_stack: bool = True) -> RunConfig:
    """The config file (or defaults) with --stack and --seed over it."""
    from kvlife.lifecycle.cli.compare import parse_stack

    config = load_config(args.config) if args.config else RunConfig()
    stack = getattr(args, "stack", None)
    if use_stack and isinstance(stack, str):
        config = attrs.evolve(config, policies=parse_stack(stack))
    elif use_stack and args.config and config.policies:
        # A bad name in the file is a config error: point at the file and the line.
        from kvlife.policies.loading import load_stack

        try:
            load_stack(config.policies)
        except PolicyError as exc:
            raise ConfigError("policies.stack", str(exc), args.config, key_line(args.config, "stack")) from None
    if args.seed is not None:
        config = attrs.evolve(config, sim=attrs.evolve(config.sim, seed=args.seed))
    return config


def apply_sizes(args: argparse.Namespace, config: RunConfig) -> RunConfig:
    """--device-blocks N, --ranks N and --tier NAME=BLOCKS (0 drops the tier) over the config."""
    engine = config.engine
    if args.device_blocks is not None:
        engine = attrs.evolve(engine, device_blocks=args.device_blocks)
    if args.ranks is not None:
        engine = attrs.evolve(engine, ranks=args.ranks)
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


def _file_sets_time_scale(path: str) -> bool:
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return False
    sim = data.get("sim")
    return isinstance(sim, dict) and "time_scale" in sim


def time_scale(args: argparse.Namespace, config: RunConfig, default: float) -> tuple[float, RunConfig]:
    """The arrival rate multiplier: --time-scale, else sim.time_scale when the config file sets
    it, else the command's default. The config records the value when it has the field."""
    scale = args.time_scale
    configured = getattr(config.sim, "time_scale", None)
    if scale is None and args.config and configured is not None and _file_sets_time_scale(args.config):
        scale = float(configured)
    if scale is None:
        scale = default
    if configured is not None:  # the field exists (config.py has sim.time_scale): record the value
        recorded: dict[str, Any] = {"time_scale": scale}
        config = attrs.evolve(config, sim=attrs.evolve(config.sim, **recorded))
    return scale, config


def workload_name(args: argparse.Namespace) -> str:
    return str(args.workload) if args.workload else "synthetic"


def load_workload(args: argparse.Namespace, config: RunConfig, scale: float,
                  synthetic_requests: int = SYNTHETIC_REQUESTS) -> tuple[list[WorkloadRequest], str]:
    """The workload of --workload (a bundled name or a file) or the synthetic one, arrivals
    sped up ``scale`` times."""
    from kvlife.lifecycle.workloads.synthetic import SYNTHETIC_NAMES, named_synthetic_workload

    if args.workload and args.workload not in SYNTHETIC_NAMES:
        from kvlife.lifecycle.workloads.bundled import resolve_workload
        from kvlife.lifecycle.workloads.mooncake import load_mooncake

        workload = load_mooncake(resolve_workload(args.workload), limit=args.limit,
                                 block_tokens=config.engine.block_tokens, time_scale=scale)
        return workload, workload_name(args)
    try:
        workload = named_synthetic_workload(
            workload_name(args),
            seed=config.sim.seed,
            num_requests=args.limit or synthetic_requests,
            block_tokens=config.engine.block_tokens,
            arrival_rate_per_s=SYNTHETIC_RATE_PER_S * scale,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return workload, workload_name(args)
