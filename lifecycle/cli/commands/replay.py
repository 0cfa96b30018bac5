"""``kvlife replay TRACE [--stack P]``: exact replay, or a what-if under another stack."""

from __future__ import annotations

import argparse
import time
from typing import Any

from kvlife.lifecycle.cli import output
from kvlife.lifecycle.cli.parsing import STACK_HELP, add_json_flag, add_stack_flag, name_or_path


def register(sub: Any) -> None:
    parser = sub.add_parser("replay", help="re-feed a trace's inputs: identical, or the first divergence",
                            description="Re-feed a trace's recorded inputs to a fresh engine: identical, or the "
                                        "first diverging line (exit 1). With --stack: what-if, the same workload "
                                        "under the recorded stack and under this one, side by side.")
    parser.add_argument("trace", type=name_or_path, help="JSON-lines trace written by kvlife run --trace")
    add_stack_flag(parser, help_text="what-if: simulate the recorded workload under this stack too; " + STACK_HELP,
                   default_text="exact replay")
    parser.add_argument("--allow-code", action="store_true",
                        help="trust the trace: import the policy code its header names (pkg.mod:Class, file.py:Class, "
                             "an installed entry point) and, for a what-if, read the profile files it names; without "
                             "it only built-in policies load (a policy also named in --stack counts as trusted)")
    add_json_flag(parser, "the verdict (or both summaries)")
    parser.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    from kvlife.lifecycle.cli.compare import parse_stack, stack_label
    from kvlife.lifecycle.traces.replay import format_side_by_side, replay, what_if

    if args.stack is not None:
        stack = list(parse_stack(args.stack))
        recorded, other, config = what_if(args.trace, stack, allow_code=args.allow_code)
        if args.json:
            output.emit("replay", trace=args.trace, mode="what-if",
                        recorded={"stack": stack_label(config.policies), "summary": recorded},
                        what_if={"stack": stack_label(stack), "summary": other})
            return 0
        left = "recorded: " + (", ".join(config.policies) or "baseline")
        print(format_side_by_side(left, recorded, "what-if: " + (", ".join(stack) or "baseline"), other))
        return 0
    started = time.perf_counter()
    result = replay(args.trace, allow_code=args.allow_code)
    wall = time.perf_counter() - started
    d = result.divergence
    if args.json:
        output.emit("replay", trace=args.trace, mode="exact", identical=d is None, lines=result.lines,
                    inputs=result.inputs, wall_s=wall,
                    divergence=None if d is None else d.as_dict())
        return 0 if d is None else 1
    if d is None:
        print(f"identical: {result.lines:,} lines, {result.inputs:,} inputs re-fed in {wall:.3f} s")
        return 0
    print(f"diverged at the end of the trace (after line {d.line - 1})" if d.end else f"diverged at line {d.line}")
    print(f"  expected: {d.expected}")
    print(f"  got:      {d.got}")
    return 1
