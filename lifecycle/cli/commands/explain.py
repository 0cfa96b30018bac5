"""``kvlife explain TRACE REQ``: one request's life, each state, how long and why."""

from __future__ import annotations

import argparse
from typing import Any

from kvlife.lifecycle.cli import output
from kvlife.lifecycle.cli.parsing import add_json_flag, name_or_path


def register(sub: Any) -> None:
    parser = sub.add_parser("explain", help="explain one request's life from a trace")
    parser.add_argument("trace", type=name_or_path, help="JSON-lines trace")
    parser.add_argument("request", help="request id, e.g. req-17")
    add_json_flag(parser, "the explanation")
    parser.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    from kvlife.lifecycle.traces.explain import explain

    lines = explain(args.trace, args.request)
    if args.json:
        output.emit("explain", trace=args.trace, request=args.request, lines=lines)
        return 0
    for line in lines:
        print(line)
    return 0
