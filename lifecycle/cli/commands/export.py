"""``kvlife export TRACE --perfetto out.json``: a timeline for ui.perfetto.dev."""

from __future__ import annotations

import argparse
from typing import Any

from kvlife.lifecycle.cli import output
from kvlife.lifecycle.cli.parsing import add_json_flag, name_or_path


def register(sub: Any) -> None:
    parser = sub.add_parser("export", help="export a trace as a Perfetto/Chrome trace timeline")
    parser.add_argument("trace", type=name_or_path, help="JSON-lines trace")
    parser.add_argument("--perfetto", required=True, metavar="OUT.json",
                        help="write Chrome trace JSON here (opens in ui.perfetto.dev)")
    add_json_flag(parser, "what was written")
    parser.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    from kvlife.lifecycle.traces.export import export_perfetto

    events = export_perfetto(args.trace, args.perfetto)
    if args.json:
        output.emit("export", trace=args.trace, format="perfetto", out=args.perfetto, events=events)
        return 0
    print(f"wrote {args.perfetto}: {events:,} events (open it in https://ui.perfetto.dev)")
    return 0
