"""``kvlife validate TRACE``: every transition legal, invariants holding, line by line."""

from __future__ import annotations

import argparse
from typing import Any

from kvlife.lifecycle.cli import output
from kvlife.lifecycle.cli.parsing import add_json_flag, name_or_path, non_negative_int


def register(sub: Any) -> None:
    parser = sub.add_parser("validate", help="check a trace from any source against the spec")
    parser.add_argument("trace", type=name_or_path, help="JSON-lines trace")
    parser.add_argument("--limit", type=non_negative_int, default=20, metavar="N", help="findings to list")
    parser.add_argument("--sharing", choices=("auto", "on", "off"), default="auto",
                        help="check invariant 6 (no two in-flight loads of one block); auto: when "
                             "the header's stack has shared-loads")
    add_json_flag(parser, "the report")
    parser.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    from kvlife.lifecycle.traces.validate import validate
    from kvlife.specs.invariants import INVARIANTS

    sharing = {"auto": None, "on": True, "off": False}[args.sharing]
    report = validate(args.trace, sharing=sharing)
    if args.json:
        output.emit("validate", trace=args.trace, ok=report.ok, lines=report.lines, sharing=report.sharing,
                    checked=list(report.checked), skipped=list(report.skipped), notes=list(report.notes),
                    truncated_line=report.truncated_line, findings_total=len(report.findings),
                    counts={str(inv): {"name": INVARIANTS.get(inv, "?"), "findings": n}
                            for inv, n in report.counts().items()},
                    findings=[{"invariant": f.invariant, "line": f.line, "t": f.t, "message": f.message}
                              for f in report.findings[:args.limit]])
        return 0 if report.ok else 1
    print(report.format(limit=args.limit))
    return 0 if report.ok else 1
