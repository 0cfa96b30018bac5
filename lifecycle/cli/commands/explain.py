"""``kvlife explain TRACE REQ``: one request's life, each state, how long and why."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any) -> None:
    parser = sub.add_parser("explain", help="explain one request's life from a trace")
    parser.add_argument("trace", help="JSON-lines trace")
    parser.add_argument("request", help="request id, e.g. req-17")
    parser.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    from kvlife.lifecycle.traces.explain import explain

    for line in explain(args.trace, args.request):
        print(line)
    return 0
