"""``kvlife plot TRACE out.png``: requests by state, TTFT CDF, tier hit rates (needs kvlife[plot])."""

from __future__ import annotations

import argparse
from typing import Any

from kvlife.lifecycle.cli import output
from kvlife.lifecycle.cli.parsing import add_json_flag


def register(sub: Any) -> None:
    parser = sub.add_parser("plot", help="plot requests by state, TTFT CDF and hit rates of a trace "
                                         "(needs kvlife[plot])")
    parser.add_argument("trace", help="JSON-lines trace")
    parser.add_argument("out", help="image file (png, svg, pdf)")
    add_json_flag(parser, "what was written")
    parser.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    from kvlife.lifecycle.cli.extras import require

    require("matplotlib", "plot", "kvlife plot")
    from kvlife.lifecycle.traces.plot import plot

    plot(args.trace, args.out)
    if args.json:
        output.emit("plot", trace=args.trace, out=args.out)
        return 0
    print(f"wrote {args.out}")
    return 0
