"""``kvlife export TRACE --perfetto out.json``: a timeline for ui.perfetto.dev."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any) -> None:
    parser = sub.add_parser("export", help="export a trace as a Perfetto/Chrome trace timeline")
    parser.add_argument("trace", help="JSON-lines trace")
    parser.add_argument("--perfetto", required=True, metavar="OUT.json",
                        help="write Chrome trace JSON (opens in ui.perfetto.dev)")
    parser.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    from kvlife.lifecycle.traces.export import export_perfetto

    events = export_perfetto(args.trace, args.perfetto)
    print(f"wrote {args.perfetto}: {events:,} events (open it in https://ui.perfetto.dev)")
    return 0
