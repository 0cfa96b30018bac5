"""``kvlife check``: model-check a policy stack with Hypothesis."""

from __future__ import annotations

import argparse
import time
from typing import Any

import attrs

from kvlife.lifecycle.cli import output
from kvlife.lifecycle.cli.parsing import add_json_flag, add_stack_flag, positive_int

# specs.model_check's DEFAULT_EXAMPLES / DEFAULT_STEPS, written here so building the parser
# does not import Hypothesis (a test checks they agree).
DEFAULT_EXAMPLES = 200
DEFAULT_STEPS = 50


def register(sub: Any) -> None:
    parser = sub.add_parser("check", help="model-check the engine with a policy stack (Hypothesis)",
                            description="Model-check the engine with a policy stack: Hypothesis plays the driver "
                                        "as an adversary and checks invariants 1-8 and 10-13 after every input, and "
                                        "that a run's trace replays exactly (15, on one example in three); first, "
                                        "the guards the stack runs under stop hostile policies (a hook that never "
                                        "returns, one that raises, an overlong reason).\n\n"
                                        "example:\n  kvlife check --stack async-lookup,shared-loads --examples 50")
    add_stack_flag(parser)
    parser.add_argument("--examples", type=positive_int, default=DEFAULT_EXAMPLES, metavar="N",
                        help="examples to run")
    parser.add_argument("--steps", type=positive_int, default=DEFAULT_STEPS, metavar="N",
                        help="max steps per example")
    parser.add_argument("--random", action="store_true",
                        help="fresh random examples from a new seed, printed with a failure (default: derandomized, "
                             "the same every run)")
    parser.add_argument("--seed", type=seed_flag, metavar="N",
                        help="draw the examples from this seed (a failing check prints the command that replays it; "
                             "default: derandomized, or a new seed with --random)")
    parser.add_argument("--no-shrink", action="store_true",
                        help="report the first counterexample as found, unshrunk (a faster verdict, a longer "
                             "counterexample; the mutation detector uses it)")
    parser.add_argument("--sharing", choices=("auto", "on", "off"), default="auto",
                        help="check invariant 6 (no duplicate in-flight loads): auto detects a joining stack")
    add_json_flag(parser, "the verdict")
    parser.set_defaults(func=handle)


def seed_flag(text: str) -> int:
    """--seed: a non-negative integer below 2^64 (what Hypothesis takes as a seed)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if not 0 <= value < 2**64:
        raise argparse.ArgumentTypeError(f"must be from 0 to 2^64 - 1, got {text}")
    return value


def replay_command(args: argparse.Namespace, seed: int | None) -> str:
    """The ``kvlife check`` command that finds (and shrinks) the same counterexample again:
    the same stack, sizes and options, and the seed when there was one."""
    import shlex

    words = ["kvlife", "check"]
    if args.stack:
        words += ["--stack", args.stack]
    words += ["--examples", str(args.examples), "--steps", str(args.steps)]
    if args.sharing != "auto":
        words += ["--sharing", args.sharing]
    if args.no_shrink:
        words.append("--no-shrink")
    if seed is not None:
        words += ["--seed", str(seed)]
    return " ".join(shlex.quote(w) for w in words)


def handle(args: argparse.Namespace) -> int:
    import random

    from kvlife.lifecycle.cli.compare import parse_stack, stack_label
    from kvlife.lifecycle.cli.parsing import UsageError
    from kvlife.policies.loading import load_stack
    from kvlife.specs.guards import guard_problems
    from kvlife.specs.model_check import REPLAY_EVERY, CheckResult, run_check

    if args.random and args.seed is not None:
        raise UsageError("--random draws a new seed: give it or --seed, not both")
    stack = list(parse_stack(args.stack or ""))
    built = load_stack(stack)  # a bad policy is a one-line error here, not a failure inside Hypothesis
    sharing = {"auto": None, "on": True, "off": False}[args.sharing]
    # --random: a fresh seed, drawn here so that a failure can say it (no clock in the core).
    seed = random.SystemRandom().getrandbits(32) if args.random else args.seed
    started = time.perf_counter()
    # The guards first (hostile policies on top of this stack, specs/guards.py): well under a second.
    guards = guard_problems(built)
    if guards:
        result = CheckResult(False, error=f"policy guard: {guards[0]}")
    else:
        result = run_check(stack, examples=args.examples, steps=args.steps, sharing=sharing,
                           derandomize=seed is None, shrink=not args.no_shrink, seed=seed)
    wall = time.perf_counter() - started
    name = ", ".join(stack) or "baseline"
    command = None if result.ok else replay_command(args, seed)
    if args.json:
        v = result.violation
        output.emit("check", stack=stack_label(stack), examples=args.examples, steps=args.steps,
                    derandomized=seed is None, seed=seed,
                    sharing=args.sharing, ok=result.ok, wall_s=wall,
                    violation=None if v is None else {"invariant": v.invariant, "message": v.message,
                                                      "t": v.t, "text": str(v)},
                    error=result.error, counterexample=list(result.events), reproduce=command,
                    reproduce_failure=result.reproduce)
        return 0 if result.ok else 1
    if result.ok:
        seeded = f", seed {seed}" if seed is not None else ""
        print(f"kvlife check: stack {name}: {args.examples} examples x up to {args.steps} steps{seeded}, "
              f"guards hold, invariants 1-8 and 10-13 hold, nothing stranded, the traces of 1 example in "
              f"{REPLAY_EVERY} replay exactly and altered inputs are refused (15) ({wall:.1f} s)")
        return 0
    print(f"kvlife check: stack {name}: counterexample found ({wall:.1f} s)")
    # Hypothesis's own advice (an @reproduce_failure decorator) has no use on the command line.
    print(attrs.evolve(result, reproduce=None).report())
    print(f"replay: {command}")
    return 1
