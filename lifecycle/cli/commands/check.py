"""``kvlife check``: model-check a policy stack with Hypothesis."""

from __future__ import annotations

import argparse
import time
from typing import Any


def register(sub: Any) -> None:
    parser = sub.add_parser("check", help="model-check the engine with a policy stack (Hypothesis)")
    parser.add_argument("--stack", action="append", metavar="POLICY",
                        help="policy (name, pkg.mod:Class, file.py:Class) or a comma list A,B, top first; "
                             "repeatable; default baseline")
    parser.add_argument("--examples", type=int, default=None, help="examples to run (default 100)")
    parser.add_argument("--steps", type=int, default=None, help="max steps per example (default 50)")
    parser.add_argument("--random", action="store_true",
                        help="fresh random examples (default: derandomized, the same every run)")
    parser.add_argument("--sharing", choices=("auto", "on", "off"), default="auto",
                        help="check invariant 6 (no duplicate in-flight loads): auto detects a joining stack")
    parser.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    from kvlife.lifecycle.cli.compare import parse_stack
    from kvlife.lifecycle.cli.main import UsageError
    from kvlife.policies.loading import load_stack
    from kvlife.specs.model_check import DEFAULT_EXAMPLES, DEFAULT_STEPS, run_check

    examples = args.examples if args.examples is not None else DEFAULT_EXAMPLES
    steps = args.steps if args.steps is not None else DEFAULT_STEPS
    if examples <= 0 or steps <= 0:
        raise UsageError(f"--examples and --steps must be positive, got {examples} and {steps}")
    # --stack A,B and --stack A --stack B both name the stack A, B (top-down), as in compare.
    stack = [spec for entry in args.stack or [] for spec in parse_stack(entry)]
    load_stack(stack)  # a bad policy is a one-line error here, not a failure inside Hypothesis
    sharing = {"auto": None, "on": True, "off": False}[args.sharing]
    started = time.perf_counter()
    result = run_check(stack, examples=examples, steps=steps, sharing=sharing, derandomize=not args.random)
    wall = time.perf_counter() - started
    name = ", ".join(stack) or "baseline"
    if result.ok:
        print(f"kvlife check: stack {name}: {examples} examples x up to {steps} steps, "
              f"invariants 1-8 hold, nothing stranded ({wall:.1f} s)")
        return 0
    print(f"kvlife check: stack {name}: counterexample found ({wall:.1f} s)")
    print(result.report())
    return 1
