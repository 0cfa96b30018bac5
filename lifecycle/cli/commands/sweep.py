"""``kvlife sweep run|plot``: a grid of simulated runs into one results file, and its plots."""

from __future__ import annotations

import argparse
from typing import Any

from kvlife.lifecycle.cli import output
from kvlife.lifecycle.cli.parsing import KvlifeParser, add_json_flag, add_stack_flag, name_or_path
from kvlife.lifecycle.config import DEFAULT_MAX_POINTS, MAX_POINTS, REQUESTS, flag_type


def register(sub: Any) -> None:
    sweep: KvlifeParser = sub.add_parser(
        "sweep", help="run a grid of configs (TOML spec or flags) into a JSON-lines results file; plot it",
        description="Sweeps: `kvlife sweep run` runs every combination of a grid of config values, one row per "
                    "run in a JSON-lines file (resumable); `kvlife sweep plot` draws heatmaps and Pareto fronts "
                    "from it. Docs: docs/sweeps.md.")
    sweep.set_defaults(func=lambda args: sweep.missing_subcommand("run or plot"))
    which = sweep.add_subparsers(title="subcommands", dest="sweep", metavar="{run,plot}")
    _register_run(which)
    _register_plot(which)


def _register_run(which: Any) -> None:
    from kvlife.lifecycle.cli.commands.capacity import add_executor_flags

    parser = which.add_parser(
        "run", help="run every point of a grid not yet in the results file, appending a row per run",
        description="Run every combination of the grid (a TOML spec and/or --stack, --vary, --set) and append one "
                    "row per run to OUT (JSON lines: every input and output a column). A point already in OUT (same "
                    "inputs, same key) is not run again, so an interrupted sweep resumes where it stopped. When "
                    "every point is done OUT is rewritten in grid order.\n\n"
                    "example:\n"
                    "  kvlife sweep run --limit 50 --stack baseline --stack async-lookup \\\n"
                    "      --vary sim.time_scale=0.5,1,2 -o results.jsonl --jobs 2")
    parser.add_argument("spec", nargs="?", type=name_or_path, metavar="GRID.toml",
                        help="grid spec: workload, limit, config, [set] and [grid] tables (docs/sweeps.md); "
                             "default: the flags alone")
    parser.add_argument("-o", "--out", required=True, type=name_or_path, metavar="FILE.jsonl",
                        help="results file: rows are appended; the points it already holds are not run again")
    add_stack_flag(parser, repeated=True, help_text="an axis of stacks (config: policies.stack), over the spec's; "
                                                    "comma-separated, top first: \"async-lookup,shared-loads\"")
    parser.add_argument("--vary", action="append", default=[], metavar="KEY=V1,V2,...",
                        help="an axis: config key KEY (engine.*, sim.*, tiers.NAME.*) takes each value; repeatable, "
                             "over the spec's [grid]")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="config key KEY set for every run; repeatable, over the spec's [set]")
    parser.add_argument("--workload", type=name_or_path, metavar="NAME|PATH",
                        help="mooncake-conversation, synthetic, synthetic:burst or a Mooncake JSON-lines file "
                             "(default: the spec's, else the built-in synthetic workload)")
    parser.add_argument("--limit", type=REQUESTS.parse, metavar="N",
                        help="use only the first N requests of the workload (default: the spec's, else all)")
    parser.add_argument("--config", type=name_or_path, metavar="FILE.toml",
                        help="config file the points start from (default: the spec's config, else the built-in "
                             "config)")
    parser.add_argument("--seed", type=flag_type("sim.seed"), metavar="N",
                        help="random seed, sim.seed (default: the spec's, else 0)")
    add_executor_flags(parser, "run the points")
    parser.add_argument("--max-points", type=MAX_POINTS.parse, metavar="N",
                        help="refuse a grid of more than N points (default: the spec's max_points, else "
                             f"{DEFAULT_MAX_POINTS:,})")
    parser.add_argument("--dry-run", action="store_true",
                        help="list the points (key, what varies, whether OUT holds it) without running any; policy "
                             "modules are named, not imported")
    add_json_flag(parser, "what was run")
    parser.set_defaults(func=handle_run)


def _register_plot(which: Any) -> None:
    parser = which.add_parser(
        "plot", help="heatmaps and Pareto fronts of a results file (needs kvlife[plot])",
        description="Draw a sweep's results: --heatmap x=COL,y=COL,value=COL (one row per cell: --where picks a "
                    "slice) and --pareto x=COL,y=COL (both minimized; max:COL maximizes one), one panel each, "
                    "into one image.\n\n"
                    "example:\n"
                    "  kvlife sweep plot results.jsonl -o sweep.png --where policies.stack=baseline \\\n"
                    "      --heatmap x=sim.time_scale,y=tiers.host.capacity_blocks,value=ttft_p90_ms")
    parser.add_argument("results", type=name_or_path, metavar="RESULTS.jsonl",
                        help="a results file of kvlife sweep run")
    parser.add_argument("-o", "--out", required=True, type=name_or_path, metavar="FILE.png",
                        help="image file (png, svg, pdf)")
    parser.add_argument("--heatmap", action="append", default=[], metavar="x=COL,y=COL,value=COL",
                        help="a heatmap of column value over columns x and y; repeatable")
    parser.add_argument("--pareto", action="append", default=[], metavar="x=COL,y=COL[,label=COL]",
                        help="a Pareto front of columns x and y, each minimized unless written max:COL; label names "
                             "the front's points by a column; repeatable")
    parser.add_argument("--where", action="append", default=[], metavar="COL=VALUE",
                        help="keep only the rows where column COL equals VALUE; repeatable")
    add_json_flag(parser, "what was drawn, with each Pareto front's rows")
    parser.set_defaults(func=handle_plot)


def handle_run(args: argparse.Namespace) -> int:
    from kvlife.lifecycle.cli.commands.capacity import executor_check
    from kvlife.lifecycle.cli.progress import progress_bar
    from kvlife.lifecycle.output_files import check_output
    from kvlife.lifecycle.sweeps.executors import Serial, make_executor
    from kvlife.lifecycle.sweeps.grid import Grid, check_stacks, expand, read_spec, with_flags
    from kvlife.lifecycle.sweeps.results import ResultsFile
    from kvlife.lifecycle.sweeps.run import run_sweep

    grid = read_spec(args.spec) if args.spec else Grid()
    grid = with_flags(grid, workload=args.workload, limit=args.limit, config=args.config, seed=args.seed,
                      stacks=args.stack, vary=args.vary, sets=args.sets, max_points=args.max_points)
    points = expand(grid)
    check_stacks(grid, points, imports=not args.dry_run)
    _check_workloads(points)
    check_output(args.out, [args.spec, args.config, *_workload_files(points)])
    if args.dry_run:
        done = ResultsFile(args.out).load(repair=False)
        varying = [a.key for a in grid.axes]
        listed = [{"key": p.key(), "done": p.key() in done,
                   **{k: v for k, v in p.inputs().items() if k in varying}} for p in points]
        if args.json:
            output.emit("sweep", out=args.out, points=len(points), dry_run=True, rows=listed)
        else:
            for row in listed:
                values = ", ".join(f"{k}={v}" for k, v in row.items() if k not in ("key", "done"))
                print(f"{row['key']}  {'done' if row['done'] else 'to run'}  {values}")
            print(f"{len(points)} points, {sum(r['done'] for r in listed)} already in {args.out}")
        return 0
    executor_check(args)
    done = ResultsFile(args.out).load(repair=False)
    # No more workers than runs left (nothing left to run: no worker processes, no Ray to start).
    left = sum(1 for p in points if p.key() not in done)
    executor = make_executor(min(args.jobs, left), args.ray) if left else Serial()
    where = executor.describe()
    with progress_bar("kvlife sweep", unit="run", total=len(points)) as bar:
        report = run_sweep(points, args.out, executor, on_row=bar)
    if args.json:
        output.emit("sweep", **report.to_dict(), dry_run=False, executor=where)
        return 0
    print(f"kvlife sweep: {report.points} points: {report.resumed} already in {report.out}, {len(report.ran)} run "
          f"now ({where})" + (f"; {report.other_rows} other rows kept" if report.other_rows else ""))
    print(f"wrote {report.out} (JSON lines, one row per run; pandas.read_json(path, lines=True))")
    return 0


def _workload_files(points: Any) -> list[str]:
    """The workload files the points read (the results file may not be one of them)."""
    from kvlife.lifecycle.workloads.bundled import resolve_workload
    from kvlife.lifecycle.workloads.synthetic import SYNTHETIC_NAMES

    return sorted({str(resolve_workload(p.workload)) for p in points if p.workload not in SYNTHETIC_NAMES})


def _check_workloads(points: Any) -> None:
    """Every workload file exists and reads (the first line): a bad path fails before any run."""
    from kvlife.lifecycle.workloads.synthetic import SYNTHETIC_NAMES

    seen: set[str] = set()
    for point in points:
        if point.workload in seen or point.workload in SYNTHETIC_NAMES:
            continue
        seen.add(point.workload)
        from kvlife.lifecycle.workloads.bundled import resolve_workload
        from kvlife.lifecycle.workloads.mooncake import count_requests

        count_requests(resolve_workload(point.workload), limit=1, block_tokens=point.config.engine.block_tokens)


def handle_plot(args: argparse.Namespace) -> int:
    from kvlife.lifecycle.cli.extras import require
    from kvlife.lifecycle.cli.parsing import UsageError

    require("matplotlib", "plot", "kvlife sweep plot")
    from kvlife.lifecycle.sweeps.plots import (
        draw,
        heatmap_cells,
        pareto_front,
        parse_heatmap,
        parse_pareto,
        parse_where,
        select,
    )
    from kvlife.lifecycle.sweeps.results import read_rows
    from kvlife.lifecycle.traces.plot import check_image

    heatmaps = [parse_heatmap(t) for t in args.heatmap]
    paretos = [parse_pareto(t) for t in args.pareto]
    if not heatmaps and not paretos:
        raise UsageError("give at least one --heatmap or --pareto")
    check_image(args.out, (args.results,))  # a bad extension (or the results file itself) before any work
    rows = read_rows(args.results)
    if not rows:
        raise UsageError(f"{args.results} holds no rows")
    rows = select(rows, [parse_where(t) for t in args.where])
    for spec in heatmaps:
        heatmap_cells(rows, spec)  # refuse a bad spec before drawing anything
    fronts = [pareto_front(rows, spec) for spec in paretos]
    draw(rows, heatmaps, paretos, args.out, (args.results,))
    if args.json:
        output.emit("sweep-plot", results=args.results, out=args.out, rows=len(rows),
                    heatmaps=[{"x": h.x, "y": h.y, "value": h.value} for h in heatmaps],
                    paretos=[{"x": p.x, "y": p.y, "x_max": p.x_max, "y_max": p.y_max,
                              "front": [{"key": r["key"], p.x: r[p.x], p.y: r[p.y]} for r in front]}
                             for p, front in zip(paretos, fronts, strict=True)])
        return 0
    for pareto, front in zip(paretos, fronts, strict=True):
        print(f"Pareto front of {pareto.x} and {pareto.y}: {len(front)} of {len(rows)} rows")
        for r in front:
            label = f"  {r[pareto.label]}" if pareto.label else ""
            print(f"  {r['key']}  {pareto.x}={r[pareto.x]:.6g}  {pareto.y}={r[pareto.y]:.6g}{label}")
    print(f"wrote {args.out}")
    return 0
