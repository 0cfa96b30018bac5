"""Flags shared by the commands that run a workload (``run``, ``compare``), and what they build.

Each flag mirrors a config key, and a flag given on the command line wins over the file:
``--device-blocks`` engine.device_blocks, ``--ranks`` engine.ranks, ``--seed`` sim.seed,
``--stack`` policies.stack, ``--time-scale`` sim.time_scale, ``--tier NAME=N`` the
``[[tiers]]`` table, ``--hardware`` sim.hardware, ``--model`` sim.model, ``--tp`` sim.tp,
``--efficiency`` sim.efficiency, ``--completions`` sim.completions; the live flags are in
``kvlife.lifecycle.cli.commands.run``.
"""

from __future__ import annotations

import argparse
import tomllib
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from kvlife.lifecycle.cli.parsing import UsageError, name_or_path
from kvlife.lifecycle.config import (
    REQUESTS,
    TIER_ORDER,
    TIME_SCALE_MAX,
    TIME_SCALE_MIN,
    ConfigError,
    RunConfig,
    field_line,
    field_rule,
    flag_type,
    is_derived,
    is_fit_error,
    key_line,
    load_config,
    size_problem,
    with_tier,
)
from kvlife.lifecycle.workloads.mooncake import WorkloadRequest
from kvlife.policies.base import PolicyError

SYNTHETIC_REQUESTS = 400
SYNTHETIC_RATE_PER_S = 4.0  # arrivals of the built-in synthetic workload at time scale 1


def time_scale_flag(text: str) -> float:
    """``--time-scale X``: the rule of sim.time_scale."""
    return float(flag_type("sim.time_scale")(text))


def parse_tier(text: str) -> tuple[str, int]:
    """``NAME=BLOCKS`` of ``--tier``: a tier name and a size under the rule of
    tiers.capacity_blocks, or 0 (drop the tier). ArgumentTypeError otherwise."""
    name, sep, size = text.partition("=")
    if not sep or name not in TIER_ORDER:
        raise argparse.ArgumentTypeError(
            f"expected host=N, disk=N or remote=N (N blocks, 0 drops it), got {text!r}")
    if size.strip() == "0":
        return name, 0
    blocks: int = field_rule("tiers.capacity_blocks").parse(size)
    return name, blocks


def tier_spec(text: str) -> str:
    """The argparse type of ``--tier``: checked here, read by ``apply_sizes``."""
    parse_tier(text)
    return text


def add_workload_flags(parser: argparse.ArgumentParser, synthetic_requests: str = str(SYNTHETIC_REQUESTS),
                       time_scale_default: str = "1, or sim.time_scale of --config") -> None:
    parser.add_argument("--workload", type=name_or_path, metavar="NAME|PATH",
                        help="mooncake-conversation (the bundled Mooncake trace), synthetic:burst (bursts of "
                             "requests for one shared prefix) or a Mooncake JSON-lines file "
                             "(.gz is read as gzip); default: the built-in synthetic workload "
                             f"({synthetic_requests} requests)")
    parser.add_argument("--limit", type=REQUESTS.parse, metavar="N",
                        help="use only the first N requests (default: all)")
    parser.add_argument("--time-scale", type=time_scale_flag, default=None, metavar="X",
                        help=f"arrival rate multiplier, a finite number from 1e-06 to 1e+06 "
                             f"(default: {time_scale_default})")
    parser.add_argument("--request-rate", type=flag_type("sim.request_rate"), default=None, metavar="R",
                        help="the mean arrival rate in requests/s, instead of --time-scale: recorded and spread "
                             "arrivals are scaled to it, poisson and gamma arrivals drawn at it "
                             "(config: sim.request_rate; default: the workload's own rate x the time scale)")
    parser.add_argument("--config", type=name_or_path, metavar="FILE.toml",
                        help="TOML config file (default: built-in config)")
    parser.add_argument("--seed", type=flag_type("sim.seed"), metavar="N",
                        help="random seed (config: sim.seed; default 0)")


def goodput_flag(text: str) -> dict[str, float]:
    """``--goodput ttft=2s,tpot=100ms,e2e=30s``: per-request limits in ms by metric."""
    from kvlife.lifecycle.sweeps.capacity import parse_goodput

    try:
        return parse_goodput(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_report_flags(parser: argparse.ArgumentParser) -> None:
    """--goodput: what ``run`` and ``compare`` add to the summary."""
    parser.add_argument("--goodput", type=goodput_flag, metavar="SLO",
                        help="count the requests that met every per-request limit, e.g. ttft=2s,tpot=100ms,e2e=30s "
                             "(metrics ttft, tpot, e2e; a duration in ms or s), as vLLM's benchmark counts goodput "
                             "(default: none)")


def add_size_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device-blocks", type=flag_type("engine.device_blocks"), metavar="N",
                        help="device KV capacity in blocks (config: engine.device_blocks; default: derived "
                             "from the model and hardware as vLLM sizes its KV cache, 821 for llama-3-8b on "
                             "one h100-sxm; a live run 64)")
    parser.add_argument("--tier", action="append", type=tier_spec, metavar="NAME=BLOCKS",
                        help="size a tier (host, disk, remote) in blocks, 0 drops it; repeatable "
                             "(default: the config's [[tiers]], a host tier of 8000 blocks)")
    parser.add_argument("--ranks", type=flag_type("engine.ranks"), metavar="N",
                        help="ranks that report each transfer: a transfer is done when every rank reported it "
                             "(config: engine.ranks; default: the TP degree, a live run 2)")


# Flags of the simulated physics, and the [sim] key each mirrors.
SIM_FLAGS = {"hardware": "--hardware", "model": "--model", "tp": "--tp", "efficiency": "--efficiency",
             "completions": "--completions", "arrivals": "--arrivals"}


def add_sim_flags(parser: argparse.ArgumentParser) -> None:
    """--hardware, --model, --tp, --efficiency, --completions, --arrivals: what the simulator
    times, and how it replays recorded arrivals."""
    from kvlife.lifecycle.config import ARRIVALS, COMPLETIONS
    from kvlife.lifecycle.profiles import list_profiles

    known = list_profiles()
    group = parser.add_argument_group("hardware and model (simulated runs; docs/fidelity-model.md)")
    group.add_argument("--hardware", type=flag_type("sim.hardware"), metavar="NAME|FILE.toml",
                       help=f"GPU profile: {', '.join(known['hardware'])}, or a TOML file "
                            "(config: sim.hardware; default h100-sxm)")
    group.add_argument("--model", type=flag_type("sim.model"), metavar="NAME|FILE.toml",
                       help=f"model profile: {', '.join(known['models'])}, or a TOML file "
                            "(config: sim.model; default llama-3-8b)")
    group.add_argument("--tp", type=flag_type("sim.tp"), metavar="N",
                       help="tensor-parallel degree: weights and KV heads split over N GPUs as vLLM splits them "
                            "(config: sim.tp; default 1)")
    group.add_argument("--efficiency", type=flag_type("sim.efficiency"), metavar="FILE.toml",
                       help="step-cost efficiency factors fitted by `kvlife calibrate -o FILE.toml`, over the "
                            "hardware profile's (config: sim.efficiency; default: the profile's)")
    group.add_argument("--completions", choices=COMPLETIONS,
                       help="when a finished transfer or lookup reaches the scheduler: with the next step output, "
                            "as in vLLM, or at its exact time (config: sim.completions; default step_boundary)")
    group.add_argument("--arrivals", type=arrivals_flag, metavar="|".join((*ARRIVALS[:-1], "gamma:CV")),
                       help="replay arrival times as recorded; spread requests that share a timestamp evenly "
                            "up to the next one (Mooncake traces round timestamps to seconds); or keep the order "
                            "and draw the gaps from the seed: poisson, or gamma with coefficient of variation CV "
                            "(above 1 burstier than Poisson) at the mean rate (--request-rate, else the workload's "
                            "own x the time scale) (config: sim.arrivals, sim.arrival_cv; default recorded)")


def arrivals_flag(text: str) -> str:
    """``--arrivals``: recorded, spread, poisson, gamma or gamma:CV (CV under the rule of
    sim.arrival_cv); returned as given, split by ``apply_sim``."""
    from kvlife.lifecycle.config import ARRIVALS

    name, sep, cv = text.partition(":")
    if name not in ARRIVALS or (sep and name != "gamma"):
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(ARRIVALS[:-1])}, gamma or gamma:CV, got {text!r}")
    if sep:
        try:
            flag_type("sim.arrival_cv")(cv)
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"gamma:CV: the CV {exc}") from None
    return text


def apply_sim(args: argparse.Namespace, config: RunConfig) -> RunConfig:
    """The --hardware/--model/--tp/--efficiency/--completions/--arrivals flags over the config,
    checked: a bad profile name or a TP degree the model refuses is a one-line error naming
    the flag (a problem inside a profile file names the file, line and field)."""
    from kvlife.lifecycle.drivers.physics import resolve
    from kvlife.lifecycle.profiles import ProfileError

    given = {key: getattr(args, key) for key in SIM_FLAGS if getattr(args, key, None) is not None}
    if given:
        sim = dict(given)
        if "arrivals" in sim:  # gamma:CV is two keys
            name, _, cv = str(sim["arrivals"]).partition(":")
            sim["arrivals"] = name
            sim["arrival_cv"] = flag_type("sim.arrival_cv")(cv) if cv else None
        config = attrs.evolve(config, sim=attrs.evolve(config.sim, **sim))
    if config.sim.arrival_cv is not None and config.sim.arrivals != "gamma":
        message = f"sets the CV of gamma arrivals, but arrivals are {config.sim.arrivals!r}"
        path = getattr(args, "config", None)
        raise ConfigError("sim.arrival_cv", message, path, field_line(path, "sim.arrival_cv") if path else None)
    try:
        resolved, _ = resolve(config)
    except ProfileError as exc:
        if exc.path and exc.path != "-":
            raise  # inside a profile file: FILE:LINE: field 'x.y': ...
        from kvlife.lifecycle.config import FIT_FIELDS, PROFILE_ERROR_KEYS

        key = PROFILE_ERROR_KEYS.get(exc.field, exc.field)
        if key in given:
            raise UsageError(f"{SIM_FLAGS[key]} {given[key]}: {exc.message}") from None
        if given:  # a combination the flags made (e.g. --model llama-3-70b at the default tp)
            flags = " ".join(f"{SIM_FLAGS[k]} {v}" for k, v in given.items())
            raise UsageError(f"{flags}: {exc.message}") from None
        path = getattr(args, "config", None)
        field = f"sim.{key}"
        if path and is_fit_error(exc.field, exc.message):  # the key of the file that made the block too big
            field = next((f for f in FIT_FIELDS if field_line(path, f) is not None), field)
        raise ConfigError(field, exc.message, path, field_line(path, field) if path else None) from None
    check_sizes(args, resolved, derived=is_derived(config.engine))
    return config


def check_sizes(args: argparse.Namespace, config: RunConfig, live: bool = False, derived: bool = False) -> None:
    """Refuse sizes that together need more memory than this machine has
    (``kvlife.lifecycle.config.size_problem``), naming the flag that set the size blamed, else
    the config file's line."""
    problem = size_problem(config, live=live)
    if problem is None:
        return
    field, message = problem
    if field == "engine.device_blocks" and getattr(args, "device_blocks", None) is not None:
        raise UsageError(f"argument --device-blocks: {message}")
    if field.startswith("tiers["):
        name = config.engine.tiers[int(field[6:field.index("]")])].name
        for spec in getattr(args, "tier", None) or []:
            if spec.partition("=")[0] == name:
                raise UsageError(f"argument --tier: {spec}: {message}")
    if field == "engine.device_blocks" and derived:
        message += " (engine.device_blocks is derived from sim.model and sim.hardware; set it)"
    path = getattr(args, "config", None)
    raise ConfigError(field, message, path, field_line(path, field) if path else None)


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
    for spec in args.tier or []:
        try:
            name, size = parse_tier(spec)
        except argparse.ArgumentTypeError as exc:
            raise UsageError(f"argument --tier: {exc}") from None
        engine = with_tier(engine, name, "capacity_blocks", size)  # 0 drops it
    return attrs.evolve(config, engine=engine)


def _file_sets(path: str, key: str) -> bool:
    from kvlife.lifecycle.input_files import read_limited

    try:
        data = tomllib.loads(read_limited(path).decode("utf-8"))
    except (OSError, ValueError):  # (a TOMLDecodeError and a UnicodeDecodeError are ValueErrors)
        return False
    sim = data.get("sim")
    return isinstance(sim, dict) and key in sim


def time_scale(args: argparse.Namespace, config: RunConfig, default: float) -> tuple[float, RunConfig]:
    """The arrival rate multiplier: --time-scale, else sim.time_scale when the config file sets
    it, else the command's default. The config records the value when it has the field.

    With a request rate (--request-rate, or sim.request_rate of the config file; not with a
    time scale too, and a flag wins over the file's key), recorded and spread arrivals get
    the scale that makes their mean rate that (the workload's own rate is read first:
    ``recorded_rate``); poisson and gamma arrivals are drawn at the rate given, else at the
    workload's own rate times the scale (recorded in sim.request_rate)."""
    from kvlife.lifecycle.workloads.arrivals import DRAWN

    scale = args.time_scale
    rate = getattr(args, "request_rate", None)
    configured = getattr(config.sim, "time_scale", None)
    file_scale = bool(args.config) and _file_sets(args.config, "time_scale")
    file_rate = bool(args.config) and _file_sets(args.config, "request_rate")
    if rate is not None and scale is not None:
        raise UsageError("--request-rate and --time-scale both set the arrival rate: give one")
    if file_scale and file_rate and rate is None and scale is None:
        raise ConfigError("sim.request_rate", "sim.time_scale sets the arrival rate too: give one",
                          args.config, field_line(args.config, "sim.request_rate"))
    # A flag wins over the file's key for the same thing (the rate and the scale are one thing).
    if rate is None and scale is None:
        if file_rate:
            rate = config.sim.request_rate
        elif file_scale and configured is not None:
            scale = float(configured)
    drawn = config.sim.arrivals in DRAWN
    if rate is not None and not drawn:
        own = recorded_rate(args, config)
        if own is None:
            raise UsageError(f"--request-rate: {workload_name(args)} has no rate to scale (fewer than two "
                             "requests, or all at one time); use --arrivals poisson")
        scale = rate / own
        if not TIME_SCALE_MIN.value <= scale <= TIME_SCALE_MAX.value:
            raise UsageError(f"--request-rate {rate:g}: {workload_name(args)} arrives at {own:.4g} requests/s, "
                             f"so that is a time scale of {scale:.3g}, outside 1e-06 to 1e+06")
    if scale is None:
        scale = default
    if drawn and rate is None:
        own = recorded_rate(args, config)
        if own is None:
            raise UsageError(f"--arrivals {config.sim.arrivals}: {workload_name(args)} has no rate of its own "
                             "(fewer than two requests, or all at one time); give --request-rate")
        rate = own * scale
    changes: dict[str, Any] = {"request_rate": rate}
    if configured is not None:  # the field exists (config.py has sim.time_scale): record the value
        changes["time_scale"] = scale
    config = attrs.evolve(config, sim=attrs.evolve(config.sim, **changes))
    return scale, config


def recorded_rate(args: argparse.Namespace, config: RunConfig) -> float | None:
    """The workload's own mean arrival rate at time scale 1 (requests/s): a file's is read
    (one pass over its first --limit requests), the synthetic generators' is their nominal
    rate."""
    from kvlife.lifecycle.workloads.synthetic import SYNTHETIC_NAMES

    if not args.workload or args.workload in SYNTHETIC_NAMES:
        return SYNTHETIC_RATE_PER_S
    from kvlife.lifecycle.workloads.arrivals import mean_rate
    from kvlife.lifecycle.workloads.bundled import resolve_workload
    from kvlife.lifecycle.workloads.mooncake import iter_mooncake

    return mean_rate(iter_mooncake(resolve_workload(args.workload), limit=args.limit,
                                   block_tokens=config.engine.block_tokens))


def workload_name(args: argparse.Namespace) -> str:
    return str(args.workload) if args.workload else "synthetic"


def stream_workload(args: argparse.Namespace, config: RunConfig,
                    scale: float) -> tuple[Iterable[WorkloadRequest], int, str]:
    """``load_workload`` for a simulated run: a workload file is read as the run goes
    (``mooncake.iter_mooncake``), its requests counted first by a cheap pass over its lines
    (for progress and the trace header); a synthetic workload is the list. Returns the
    requests, their number and the workload's name."""
    from kvlife.lifecycle.workloads.synthetic import SYNTHETIC_NAMES

    if not args.workload or args.workload in SYNTHETIC_NAMES:
        workload, name = load_workload(args, config, scale)
        return workload, len(workload), name
    from kvlife.lifecycle.workloads.bundled import resolve_workload
    from kvlife.lifecycle.workloads.mooncake import count_requests

    size = count_requests(resolve_workload(args.workload), limit=args.limit, block_tokens=config.engine.block_tokens)
    return _file_requests(args, config, scale), size, workload_name(args)


def _file_requests(args: argparse.Namespace, config: RunConfig, scale: float) -> Iterable[WorkloadRequest]:
    """The requests of the --workload file, streamed, arrivals as ``sim.arrivals`` says."""
    from kvlife.lifecycle.workloads.bundled import resolve_workload
    from kvlife.lifecycle.workloads.mooncake import iter_mooncake

    stream = iter_mooncake(resolve_workload(args.workload), limit=args.limit,
                           block_tokens=config.engine.block_tokens, time_scale=scale)
    return with_arrivals(stream, config)


def with_arrivals(requests: Iterable[WorkloadRequest], config: RunConfig) -> Iterable[WorkloadRequest]:
    """``requests`` with their arrivals as ``sim.arrivals`` makes them: drawn ones at
    ``sim.request_rate`` (``time_scale`` sets it), else, for a list, at its own mean rate."""
    from kvlife.lifecycle.workloads.arrivals import DRAWN, apply_arrivals, mean_rate

    sim = config.sim
    rate = sim.request_rate
    if rate is None and sim.arrivals in DRAWN and isinstance(requests, Sequence):
        rate = mean_rate(requests)
    return apply_arrivals(requests, sim.arrivals, rate_per_s=rate, cv=sim.arrival_cv, seed=sim.seed)


def load_workload(args: argparse.Namespace, config: RunConfig, scale: float,
                  synthetic_requests: int = SYNTHETIC_REQUESTS) -> tuple[list[WorkloadRequest], str]:
    """The workload of --workload (a bundled name or a file) or the synthetic one, arrivals
    sped up ``scale`` times."""
    from kvlife.lifecycle.workloads.synthetic import SYNTHETIC_NAMES, named_synthetic_workload

    if args.workload and args.workload not in SYNTHETIC_NAMES:
        return list(_file_requests(args, config, scale)), workload_name(args)
    try:
        workload = named_synthetic_workload(
            workload_name(args),
            seed=config.sim.seed,
            num_requests=args.limit or synthetic_requests,
            block_tokens=config.engine.block_tokens,
            arrival_rate_per_s=SYNTHETIC_RATE_PER_S * scale,
        )
    except ValueError as exc:  # options the flags made: the rate is the time scale's
        flag = "argument --time-scale: " if str(exc).startswith(("arrival_rate_per_s", "burst_spread_ms")) else ""
        raise UsageError(f"{flag}{workload_name(args)} at time scale {scale:g}: {exc}") from None
    if config.sim.arrivals != "recorded":
        workload = list(with_arrivals(workload, config))
    return workload, workload_name(args)
