"""``kvlife check``: model-check a policy stack with Hypothesis."""

from __future__ import annotations

import argparse
import time
from typing import Any

from kvlife.lifecycle.cli import output
from kvlife.lifecycle.cli.parsing import add_json_flag, add_stack_flag, positive_int

# specs.model_check's DEFAULT_EXAMPLES / DEFAULT_STEPS, written here so building the parser
# does not import Hypothesis (a test checks they agree).
DEFAULT_EXAMPLES = 200
DEFAULT_STEPS = 50


def register(sub: Any) -> None:
    parser = sub.add_parser("check", help="model-check the engine with a policy stack (Hypothesis)",
                            description="Model-check the engine with a policy stack: Hypothesis plays the driver "
                                        "as an adversary and checks invariants 1-8 and 10-13 after every input.\n\n"
                                        "example:\n  kvlife check --stack async-lookup,shared-loads --examples 50")
    add_stack_flag(parser)
    parser.add_argument("--examples", type=positive_int, default=DEFAULT_EXAMPLES, metavar="N",
                        help="examples to run")
    parser.add_argument("--steps", type=positive_int, default=DEFAULT_STEPS, metavar="N",
                        help="max steps per example")
    parser.add_argument("--random", action="store_true",
                        help="fresh random examples (default: derandomized, the same every run)")
    parser.add_argument("--no-shrink", action="store_true",
                        help="report the first counterexample as found, unshrunk (a faster verdict, a longer "
                             "counterexample; the mutation detector uses it)")
    parser.add_argument("--sharing", choices=("auto", "on", "off"), default="auto",
                        help="check invariant 6 (no duplicate in-flight loads): auto detects a joining stack")
    add_json_flag(parser, "the verdict")
    parser.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    from kvlife.lifecycle.cli.compare import parse_stack, stack_label
    from kvlife.policies.loading import load_stack
    from kvlife.specs.model_check import run_check

    stack = list(parse_stack(args.stack or ""))
    load_stack(stack)  # a bad policy is a one-line error here, not a failure inside Hypothesis
    sharing = {"auto": None, "on": True, "off": False}[args.sharing]
    started = time.perf_counter()
    result = run_check(stack, examples=args.examples, steps=args.steps, sharing=sharing,
                       derandomize=not args.random, shrink=not args.no_shrink)
    wall = time.perf_counter() - started
    name = ", ".join(stack) or "baseline"
    if args.json:
        v = result.violation
        output.emit("check", stack=stack_label(stack), examples=args.examples, steps=args.steps,
                    derandomized=not args.random,
                    sharing=args.sharing, ok=result.ok, wall_s=wall,
                    violation=None if v is None else {"invariant": v.invariant, "message": v.message,
                                                      "t": v.t, "text": str(v)},
                    error=result.error, counterexample=list(result.events), reproduce=result.reproduce)
        return 0 if result.ok else 1
    if result.ok:
        print(f"kvlife check: stack {name}: {args.examples} examples x up to {args.steps} steps, "
              f"invariants 1-8 and 10-13 hold, nothing stranded ({wall:.1f} s)")
        return 0
    print(f"kvlife check: stack {name}: counterexample found ({wall:.1f} s)")
    print(result.report())
    return 1
