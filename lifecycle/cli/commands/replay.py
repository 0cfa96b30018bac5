"""``kvlife replay TRACE [--stack P ...]``: exact replay, or a what-if under another stack."""

from __future__ import annotations

import argparse
import time
from typing import Any


def register(sub: Any) -> None:
    parser = sub.add_parser("replay", help="re-feed a trace's inputs: identical, or the first divergence")
    parser.add_argument("trace", help="JSON-lines trace written by kvlife run --trace")
    parser.add_argument("--stack", action="append", metavar="POLICY",
                        help="what-if: simulate the same workload under this stack (a policy or a comma list A,B; "
                             "repeatable) "
                             "and print both runs side by side")
    parser.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    from kvlife.lifecycle.cli.compare import parse_stack
    from kvlife.lifecycle.traces.replay import format_side_by_side, replay, what_if

    if args.stack:
        # --stack A,B and --stack A --stack B both name the stack A, B (top-down), as in compare.
        args.stack = [spec for entry in args.stack for spec in parse_stack(entry)]
        recorded, other, config = what_if(args.trace, args.stack)
        left = "recorded: " + (", ".join(config.policies) or "baseline")
        print(format_side_by_side(left, recorded, "what-if: " + (", ".join(args.stack) or "baseline"), other))
        return 0
    started = time.perf_counter()
    result = replay(args.trace)
    wall = time.perf_counter() - started
    if result.divergence is None:
        print(f"identical: {result.lines:,} lines, {result.inputs:,} inputs re-fed in {wall:.3f} s")
        return 0
    d = result.divergence
    print(f"diverged at line {d.line}")
    print(f"  expected: {d.expected}")
    print(f"  got:      {d.got}")
    return 1
