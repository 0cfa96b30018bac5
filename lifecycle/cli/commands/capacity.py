"""``kvlife capacity``: the highest arrival rate at which each stack still meets an SLO."""

from __future__ import annotations

import argparse
from typing import Any

from kvlife.lifecycle.cli import output
from kvlife.lifecycle.cli.parsing import UsageError, add_json_flag, add_stack_flag, name_or_path, positive_float
from kvlife.lifecycle.config import REQUESTS, flag_type

DEFAULT_PRECISION = 0.05
DEFAULT_MIN_SCALE = 1 / 64
DEFAULT_MAX_SCALE = 64.0


def slo_type(text: str) -> Any:
    from kvlife.lifecycle.sweeps.capacity import parse_slo

    try:
        return parse_slo(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def precision_type(text: str) -> float:
    value = positive_float(text)
    if not 1e-4 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be a relative precision from 0.0001 to 1, got {text}")
    return value


def ratio_type(text: str) -> float:
    value = positive_float(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (the last decile within N x the first's), got {text}")
    return value


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, else the machine's count)."""
    import os

    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def jobs_type(text: str) -> int:
    """``--jobs N``: 1 to the CPUs this process may use (more processes than CPUs only wait)."""
    from kvlife.lifecycle.config import Limit, Rule

    rule = Rule("int", low=1, maximum=Limit(usable_cpus(), "the CPUs this process may use"))
    value: int = rule.parse(text)
    return value


def add_executor_flags(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--jobs", type=jobs_type, default=1, metavar="N",
                        help=f"{what} in N local processes at once, at most the CPUs this process may use, and no "
                             "more than there are runs (with --ray and no address: the CPUs of the local Ray)")
    parser.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                        help=f"{what} on Ray (needs kvlife[ray]): 'auto' joins the running cluster, HOST:PORT or "
                             "ray://HOST:PORT a given one, no address starts a local Ray (default: no Ray)")


def register(sub: Any) -> None:
    from kvlife.lifecycle.cli.run_options import add_sim_flags, add_size_flags, time_scale_flag

    parser = sub.add_parser(
        "capacity",
        help="the highest arrival rate at which each stack meets an SLO (effective request capacity)",
        description="Effective request capacity: for each --stack, the highest arrival-rate scale (x the workload's "
                    "recorded rate, as --time-scale) at which a run meets every --slo objective, keeps its queue "
                    "stable (the last arrival decile's mean TTFT within --stability-ratio x the first's) and "
                    "strands no request. Found by galloping (x2) then bisecting until the highest scale that meets "
                    "and the lowest that fails are within --precision; a stack that meets it at --max-scale or "
                    "fails at --min-scale is reported as a bound. Docs: docs/sweeps.md.\n\n"
                    "example:\n"
                    "  kvlife capacity --workload mooncake-conversation --limit 2000 --arrivals spread \\\n"
                    "      --stack baseline --stack async-lookup --slo ttft_p90=5s,tpot_p90=100ms --jobs 2",
    )
    add_stack_flag(parser, repeated=True, required=True)
    parser.add_argument("--slo", type=slo_type, required=True, metavar="METRIC_pQ=VALUE,...",
                        help="latency objectives, all to be met: ttft or tpot, any percentile, a duration in ms or s "
                             "(e.g. ttft_p90=2000ms,tpot_p90=100ms)")
    parser.add_argument("--stability-ratio", type=ratio_type, default=1.5, metavar="X",
                        help="stable: the last arrival decile's mean TTFT at most X times the first decile's")
    parser.add_argument("--stability-slack-ms", type=positive_float, default=100.0, metavar="MS",
                        help="...or at most MS above it (a light load whose TTFTs are tens of ms is stable)")
    parser.add_argument("--precision", type=precision_type, default=DEFAULT_PRECISION, metavar="P",
                        help="relative precision: the search stops when the lowest failing scale is within "
                             "(1 + P) x the highest meeting one")
    parser.add_argument("--start", type=time_scale_flag, default=1.0, metavar="X", help="first scale tried")
    parser.add_argument("--min-scale", type=time_scale_flag, default=DEFAULT_MIN_SCALE, metavar="X",
                        help="lowest scale tried: failing there reports the capacity as below it")
    parser.add_argument("--max-scale", type=time_scale_flag, default=DEFAULT_MAX_SCALE, metavar="X",
                        help="highest scale tried: meeting the SLO there reports the capacity as at least it")
    parser.add_argument("--workload", type=name_or_path, metavar="NAME|PATH",
                        help="mooncake-conversation (the bundled trace), synthetic, synthetic:burst or a Mooncake "
                             "JSON-lines file (.gz read as gzip); default: the built-in synthetic workload")
    parser.add_argument("--limit", type=REQUESTS.parse, metavar="N",
                        help="use only the first N requests (default: all)")
    parser.add_argument("--config", metavar="FILE.toml",
                        help="TOML config file (default: built-in config); its sim.time_scale is the search's")
    parser.add_argument("--seed", type=flag_type("sim.seed"), metavar="N",
                        help="random seed (config: sim.seed; default 0)")
    add_size_flags(parser)
    add_sim_flags(parser)
    add_executor_flags(parser, "run the searches")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="also draw the load-latency curves with the SLO line (kvlife[plot]; default: no plot)")
    fmt = parser.add_mutually_exclusive_group()
    add_json_flag(fmt, "the capacities and every run of the searches")
    fmt.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    parser.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    import attrs

    from kvlife.lifecycle.cli.compare import parse_stack, stack_label
    from kvlife.lifecycle.cli.progress import progress_bar
    from kvlife.lifecycle.cli.run_options import apply_sim, apply_sizes, load_run_config
    from kvlife.lifecycle.drivers.physics import resolve
    from kvlife.lifecycle.fidelity.runs import load
    from kvlife.lifecycle.metrics import setup_rows
    from kvlife.lifecycle.sweeps.capacity import Target, base_rate, relative, search_capacity
    from kvlife.lifecycle.sweeps.points import Point
    from kvlife.policies.loading import load_stack

    if args.min_scale >= args.max_scale:
        raise UsageError(f"--min-scale {args.min_scale:g} must be below --max-scale {args.max_scale:g}")
    if args.plot:
        from kvlife.lifecycle.cli.extras import require

        require("matplotlib", "plot", "kvlife capacity --plot")
        from kvlife.lifecycle.cli.commands.run import run_inputs
        from kvlife.lifecycle.traces.plot import check_image

        check_image(args.plot, run_inputs(args))  # before the runs
    executor_check(args)
    config = apply_sim(args, apply_sizes(args, load_run_config(args, use_stack=False)))
    origin = "--device-blocks" if args.device_blocks is not None else None
    setup = resolve(config)[1].summary(origin)
    stacks = [parse_stack(s) for s in args.stack]
    for stack in stacks:
        load_stack(stack)  # a bad policy fails before any run
    name = args.workload or "synthetic"
    recorded = load(name, args.limit, 1.0, config)
    rate = base_rate([r.arrival_ms for r in recorded])
    points = [Point(name, args.limit, attrs.evolve(config, policies=tuple(stack))) for stack in stacks]
    target = Target(args.slo, args.stability_ratio, args.stability_slack_ms)

    from kvlife.lifecycle.sweeps.executors import make_executor

    executor = make_executor(min(args.jobs, len(points)), args.ray)  # the stacks' searches run side by side
    try:
        with progress_bar("kvlife capacity", unit="run") as bar:
            runs = 0

            def on_probe(i: int, probe: Any) -> None:
                nonlocal runs
                runs += 1
                bar(runs, runs + len(stacks))

            results = search_capacity(points, target, executor, start=args.start, min_scale=args.min_scale,
                                      max_scale=args.max_scale, precision=args.precision, base_rate=rate,
                                      on_probe=on_probe)
    finally:
        executor.close()
    if args.plot:
        from kvlife.lifecycle.sweeps.plots import draw_capacity

        draw_capacity(results, args.slo, args.plot, run_inputs(args))
    workload: dict[str, Any] = {"name": name, "requests": len(recorded), "requests_per_s": rate}
    if args.json:
        rows = []
        for r in results:
            value, kind = relative(r, results[0])
            rows.append({**r.to_dict(), "relative": {"value": value, "kind": kind}})
        output.emit("capacity", workload=workload, seed=config.sim.seed, setup=setup,
                    slo=[{"metric": o.metric, "percentile": o.q, "limit_ms": o.limit_ms} for o in args.slo],
                    stability={"ratio": args.stability_ratio, "slack_ms": args.stability_slack_ms},
                    precision=args.precision, min_scale=args.min_scale, max_scale=args.max_scale,
                    stacks=[stack_label(s) for s in stacks], results=rows, plot=args.plot)
        return 0
    from kvlife.lifecycle.sweeps.capacity import format_table

    if not args.markdown:
        recorded_rate = "" if rate is None else f" ({rate:,.3g} requests/s as recorded)"
        print(f"kvlife capacity: {name}, {len(recorded):,} requests{recorded_rate}, seed {config.sim.seed}")
        for label, text in setup_rows(setup):
            print(f"{label}: {text}")
        print(f"target: {target.describe()}")
        print(f"search: scales {args.min_scale:g} to {args.max_scale:g} from {args.start:g}, precision "
              f"{args.precision:g}: the threshold lies in [capacity, capacity x {1 + args.precision:g})")
    print(format_table(results, markdown=args.markdown))
    if args.plot and not args.markdown:
        print(f"wrote {args.plot}")
    return 0


def executor_check(args: argparse.Namespace) -> None:
    """``--ray`` needs the ray extra: one line naming it (exit 2)."""
    if args.ray is not None:
        from kvlife.lifecycle.cli.extras import require

        require("ray", "ray", f"{args.command_prog} --ray")
