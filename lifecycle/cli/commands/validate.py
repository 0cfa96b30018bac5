"""``kvlife validate TRACE``: every transition legal, invariants holding, line by line."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any) -> None:
    parser = sub.add_parser("validate", help="check a trace from any source against the spec")
    parser.add_argument("trace", help="JSON-lines trace")
    parser.add_argument("--limit", type=int, default=20, help="findings to list (default 20)")
    parser.add_argument("--sharing", choices=("auto", "on", "off"), default="auto",
                        help="check invariant 6 (no two in-flight loads of one block); auto: when "
                             "the header's stack has shared-loads")
    parser.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    from kvlife.lifecycle.traces.validate import validate

    sharing = {"auto": None, "on": True, "off": False}[args.sharing]
    report = validate(args.trace, sharing=sharing)
    print(report.format(limit=max(0, args.limit)))
    return 0 if report.ok else 1
