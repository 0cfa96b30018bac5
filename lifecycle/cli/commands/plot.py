"""``kvlife plot TRACE [TRACE ...] out.png``: requests by state, TTFT CDF, tier hit rates, the
traces overlaid (needs kvlife[plot])."""

from __future__ import annotations

import argparse
from typing import Any

from kvlife.lifecycle.cli import output
from kvlife.lifecycle.cli.parsing import STACK_HELP, add_json_flag, add_stack_flag, name_or_path


def register(sub: Any) -> None:
    parser = sub.add_parser("plot", help="plot requests by state, TTFT CDF and hit rates of one or more traces, "
                                         "overlaid (needs kvlife[plot])",
                            description="Plot requests running and waiting over time, the TTFT CDF and the prefix "
                                        "hit rate per tier of each trace, one colour per trace, labelled by its "
                                        "policies.\n\nexample:\n  kvlife plot base.jsonl shared.jsonl both.png")
    parser.add_argument("trace", nargs="+", type=name_or_path, help="JSON-lines trace(s)")
    parser.add_argument("out", type=name_or_path, help="image file (png, svg, pdf)")
    add_stack_flag(parser, help_text="replay under this stack instead of the header's (the TTFT and hit-rate "
                                     "panels come from an exact replay); " + STACK_HELP,
                   default_text="the header's stack, built-in policies only unless --allow-code")
    parser.add_argument("--allow-code", action="store_true",
                        help="trust the trace: import the policy code its header names (pkg.mod:Class, file.py:Class, "
                             "an installed entry point); without it only built-in policies load")
    add_json_flag(parser, "what was written")
    parser.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    from kvlife.lifecycle.cli.extras import require

    require("matplotlib", "plot", "kvlife plot")
    from kvlife.lifecycle.cli.compare import parse_stack
    from kvlife.lifecycle.traces.plot import plot

    stack = list(parse_stack(args.stack)) if args.stack is not None else None
    plot(args.trace, args.out, allow_code=args.allow_code, stack=stack)
    if args.json:
        output.emit("plot", trace=args.trace[0], traces=args.trace, out=args.out)
        return 0
    print(f"wrote {args.out}")
    return 0
