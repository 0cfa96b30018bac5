"""``kvlife compare``: one workload, several policy stacks, side by side."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from kvlife.lifecycle.cli import output
from kvlife.lifecycle.cli.parsing import add_json_flag, add_stack_flag


def register(sub: Any) -> None:
    from kvlife.lifecycle.cli.run_options import add_report_flags, add_sim_flags, add_size_flags, add_workload_flags

    parser = sub.add_parser(
        "compare",
        help="run one workload under several policy stacks and print them side by side",
        description="Run one workload under several policy stacks (same config, seed and arrivals) and print "
                    "the results side by side, one column per --stack.\n\n"
                    "A stack whose run is overloaded (its queue grows: the last arrival decile's mean TTFT more "
                    "than 1.5x the first's) is marked, with a warning on stderr: its latencies depend on the "
                    "length of the run, not only on the policies.\n\n"
                    "example:\n"
                    '  kvlife compare --limit 500 --stack baseline --stack "async-lookup,shared-loads" --plot cdf.png',
    )
    add_stack_flag(parser, repeated=True, required=True)
    add_workload_flags(parser)
    add_size_flags(parser)
    add_sim_flags(parser)
    add_report_flags(parser)
    parser.add_argument("--plot", metavar="FILE.png",
                        help="draw the TTFT and TPOT CDFs of every stack, one line each (png, svg, pdf; "
                             "needs kvlife[plot]; default: none)")
    fmt = parser.add_mutually_exclusive_group()
    add_json_flag(fmt, "the rows")
    fmt.add_argument("--markdown", action="store_true", help="print a Markdown table")
    parser.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    from kvlife.lifecycle.cli.compare import compare_stacks, format_comparison, parse_stack, stack_label
    from kvlife.lifecycle.cli.progress import progress_bar
    from kvlife.lifecycle.cli.run_options import apply_sim, apply_sizes, load_run_config, load_workload, time_scale
    from kvlife.lifecycle.drivers.physics import resolve
    from kvlife.lifecycle.metrics import setup_rows

    if args.plot is not None:  # checked before any run: the extra, the image format
        from kvlife.lifecycle.cli.extras import require

        require("matplotlib", "plot", "kvlife compare --plot")
        from kvlife.lifecycle.traces.plot import image_format

        image_format(args.plot)
    # The config's [policies] stack is not used: each --stack is a column.
    config = apply_sim(args, apply_sizes(args, load_run_config(args, use_stack=False)))
    origin = "--device-blocks" if args.device_blocks is not None else None
    setup = resolve(config)[1].summary(origin)
    scale, config = time_scale(args, config, 1.0)
    stacks = [parse_stack(s) for s in args.stack]
    workload, name = load_workload(args, config, scale)
    with progress_bar("kvlife compare", unit="stack", total=len(stacks)) as overall:
        finished = 0

        @contextlib.contextmanager
        def per_stack(label: str) -> Iterator[Any]:
            nonlocal finished
            with progress_bar(label, total=len(workload), position=1) as bar:
                yield bar
            finished += 1
            overall(finished, len(stacks))

        per_request: list[Any] = []
        rows = compare_stacks(config, workload, stacks, workload_name=name, progress=per_stack,
                              goodput=args.goodput, keep_rows=per_request)
    for row in rows:
        if row["overloaded"]:
            ratio = row["stability_ratio"]
            growth = f"{ratio:,.1f}x the first" if ratio is not None and ratio != float("inf") else "unbounded"
            print(f"kvlife compare: overloaded: {row['stack']}: TTFT of the last arrival decile is {growth}; "
                  "its latencies grow with the length of the run", file=sys.stderr)
    if args.plot is not None:
        from kvlife.lifecycle.traces.plot import plot_cdfs, stack_names

        # Lines labelled by the policies' own names, not by the specs that loaded them.
        plot_cdfs({stack_names(s): rows_of for s, rows_of in zip(stacks, per_request, strict=True)}, args.plot,
                  title=f"{name}, {len(workload)} requests, time scale {scale:g}")
    if args.json:
        output.emit("compare", workload={"name": name, "requests": len(workload)}, seed=config.sim.seed,
                    time_scale=scale, request_rate=config.sim.request_rate, setup=setup,
                    stacks=[stack_label(s) for s in stacks], rows=rows, plot=args.plot)
        return 0
    if not args.markdown:
        print(f"kvlife compare: {name}, {len(workload)} requests, seed {config.sim.seed}, time scale {scale:g}")
        for label, value in setup_rows(setup):
            print(f"{label}: {value}")
    print(format_comparison(rows, markdown=args.markdown))
    if args.plot is not None and not args.markdown:
        print(f"wrote {args.plot}")
    return 0
