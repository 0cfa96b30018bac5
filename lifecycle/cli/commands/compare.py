"""``kvlife compare``: one workload, several policy stacks, side by side."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from typing import Any

from kvlife.lifecycle.cli import output
from kvlife.lifecycle.cli.parsing import add_json_flag, add_stack_flag


def register(sub: Any) -> None:
    from kvlife.lifecycle.cli.run_options import add_sim_flags, add_size_flags, add_workload_flags

    parser = sub.add_parser(
        "compare",
        help="run one workload under several policy stacks and print them side by side",
        description="Run one workload under several policy stacks (same config, seed and arrivals) and print "
                    "the results side by side, one column per --stack.\n\n"
                    "example:\n"
                    '  kvlife compare --limit 500 --stack baseline --stack "async-lookup,shared-loads"',
    )
    add_stack_flag(parser, repeated=True, required=True)
    add_workload_flags(parser)
    add_size_flags(parser)
    add_sim_flags(parser)
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

        rows = compare_stacks(config, workload, stacks, workload_name=name, progress=per_stack)
    if args.json:
        output.emit("compare", workload={"name": name, "requests": len(workload)}, seed=config.sim.seed,
                    time_scale=scale, setup=setup, stacks=[stack_label(s) for s in stacks], rows=rows)
        return 0
    if not args.markdown:
        print(f"kvlife compare: {name}, {len(workload)} requests, seed {config.sim.seed}, time scale {scale:g}")
        for label, value in setup_rows(setup):
            print(f"{label}: {value}")
    print(format_comparison(rows, markdown=args.markdown))
    return 0
