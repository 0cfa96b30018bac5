"""``kvlife plot TRACE out.png``: requests by state, TTFT CDF, tier hit rates."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any) -> None:
    parser = sub.add_parser("plot", help="plot requests by state, TTFT CDF and hit rates of a trace")
    parser.add_argument("trace", help="JSON-lines trace")
    parser.add_argument("out", help="image file (png, svg, pdf)")
    parser.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    from kvlife.lifecycle.traces.plot import plot

    plot(args.trace, args.out)
    print(f"wrote {args.out}")
    return 0
