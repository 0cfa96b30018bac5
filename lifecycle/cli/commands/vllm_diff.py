"""``kvlife vllm-diff``: one workload through vLLM's scheduler with KVLifeConnector and through
kvlife's engine, step by step (needs vLLM 0.33: ``bash scripts/install-vllm.sh``)."""

from __future__ import annotations

import argparse
import tempfile
import time
from typing import Any

import attrs

from kvlife.lifecycle.cli import output
from kvlife.lifecycle.cli.parsing import UsageError, add_json_flag, add_stack_flag, positive_int
from kvlife.lifecycle.config import REQUESTS


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "vllm-diff", help="step-by-step agreement of kvlife's engine with vLLM's scheduler (needs vLLM)",
        description="Run one workload through vLLM 0.33's real scheduler with KVLifeConnector and simulated workers, "
                    "and through kvlife's engine stepped in vLLM's order with the same simulated workers, and compare "
                    "each scheduler step: the requests scheduled with their (computed before, tokens), external hit "
                    "tokens, loads started, requests waiting for remote KV, preemptions. Prints steps identical / "
                    "compared and the first difference with both sides' request states (docs/vllm.md). Needs vLLM: "
                    "build its virtualenv with scripts/install-vllm.sh and run .venv-vllm/bin/kvlife.\n\n"
                    "examples:\n"
                    "  kvlife vllm-diff --workload mooncake-conversation --limit 300 --async-scheduling\n"
                    "  kvlife vllm-diff --workload my-trace.jsonl --device-blocks 95 --abort-rate 0.2 --json\n"
                    "  kvlife vllm-diff --family prefix-sharing-preemption --seeds 0,1,2")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--workload", default="mooncake-conversation", metavar="NAME|PATH",
                        help="a workload the simulator takes: a bundled name, a Mooncake JSON-lines file (.gz read "
                             "as gzip) or synthetic (default: mooncake-conversation)")
    source.add_argument("--prefix-sharing", type=int, metavar="SEED",
                        help="a random prefix-sharing workload drawn with this seed instead (default: --workload)")
    source.add_argument("--family", metavar="NAME",
                        help="a built-in family of workloads and setups (see docs/vllm.md), over --seeds "
                             "(default: --workload)")
    parser.add_argument("--seeds", default="0", metavar="N,N,...", help="the seeds of --family (default: 0)")
    parser.add_argument("--limit", type=REQUESTS.parse, default=300, metavar="N",
                        help="requests of the workload (default: 300)")
    parser.add_argument("--offset", type=int, default=0, metavar="K", help="skip the first K requests (default: 0)")
    parser.add_argument("--ms-per-step", type=float, default=250.0, metavar="MS",
                        help="trace milliseconds per scheduler step: arrivals are placed on steps (default: 250)")
    parser.add_argument("--max-output", type=positive_int, default=64, metavar="N",
                        help="cap on each request's output tokens, after scaling (default: 64)")
    parser.add_argument("--max-prompt", type=positive_int, default=4096, metavar="N",
                        help="cap on each prompt's tokens, after scaling (default: 4096)")
    parser.add_argument("--block-size", type=positive_int, default=16, metavar="N",
                        help="tokens per block; each Mooncake 512-token block becomes one (default: 16)")
    parser.add_argument("--device-blocks", type=positive_int, default=511, metavar="N",
                        help="device blocks (vLLM's pool is one more: its null block); small to preempt "
                             "(default: 511)")
    parser.add_argument("--max-running", type=positive_int, default=16, metavar="N",
                        help="vLLM's max_num_seqs (default: 16)")
    parser.add_argument("--budget", type=positive_int, default=256, metavar="N",
                        help="vLLM's max_num_batched_tokens (default: 256)")
    parser.add_argument("--host-blocks", type=positive_int, default=4096, metavar="N",
                        help="the connector's host tier, in blocks (default: 4096)")
    parser.add_argument("--async-scheduling", action="store_true", help="vLLM's AsyncScheduler: one step in flight")
    parser.add_argument("--workers", type=positive_int, default=1, metavar="N",
                        help="simulated workers (ranks) reporting each job (default: 1)")
    parser.add_argument("--load-delay", type=int, default=2, metavar="STEPS",
                        help="steps before worker r reports a load (plus r) (default: 2)")
    parser.add_argument("--lookup-delay", type=int, default=1, metavar="STEPS",
                        help="scheduler passes before an async lookup answers (default: 1)")
    parser.add_argument("--abort-rate", type=float, default=0.0, metavar="R",
                        help="share of the requests aborted 1-40 steps after they arrive (default: 0)")
    parser.add_argument("--seed", type=int, default=0, metavar="N", help="seed of the aborts (default: 0)")
    parser.add_argument("--steps", type=positive_int, default=4000, metavar="N",
                        help="stop after this many scheduler steps (default: 4000)")
    add_stack_flag(parser)
    add_json_flag(parser, "the agreement per run")
    parser.set_defaults(func=handle)


def _setup(args: argparse.Namespace) -> Any:
    from kvlife.lifecycle.drivers.vllm_diff import DiffSetup

    return DiffSetup(block_size=args.block_size, num_blocks=args.device_blocks + 1, max_num_seqs=args.max_running,
                     max_num_batched_tokens=args.budget, host_blocks=args.host_blocks, stack=args.stack or "",
                     lookup_delay_steps=args.lookup_delay, load_delay=args.load_delay,
                     async_scheduling=args.async_scheduling, ranks=args.workers)


def _items(args: argparse.Namespace) -> list[Any]:
    from kvlife.lifecycle.cli.run_options import load_workload
    from kvlife.lifecycle.config import RunConfig
    from kvlife.lifecycle.drivers.vllm_diff import prefix_sharing_items, workload_items

    if args.prefix_sharing is not None:
        return prefix_sharing_items(args.prefix_sharing, requests=args.limit, block=args.block_size,
                                    abort_rate=args.abort_rate)
    wanted = argparse.Namespace(workload=args.workload, limit=args.offset + args.limit)
    workload = load_workload(wanted, RunConfig(), 1.0)[0][args.offset:]
    return workload_items(workload, block=args.block_size, ms_per_step=args.ms_per_step, max_output=args.max_output,
                          max_prompt=args.max_prompt, abort_rate=args.abort_rate, seed=args.seed)


def handle(args: argparse.Namespace) -> int:
    if not 0.0 <= args.abort_rate <= 1.0:
        raise UsageError(f"argument --abort-rate: {args.abort_rate} is not between 0 and 1")
    if args.ms_per_step <= 0:
        raise UsageError(f"argument --ms-per-step: {args.ms_per_step} is not positive")
    seeds = _seeds(args.seeds)
    if args.stack:
        from kvlife.lifecycle.cli.compare import parse_stack
        from kvlife.policies.loading import load_stack

        load_stack(list(parse_stack(args.stack)))  # a bad policy is a one-line error before vLLM loads
    try:
        from kvlife.lifecycle.drivers.vllm import differential
        from kvlife.lifecycle.drivers.vllm.harness import offline_model_dir
    except ImportError as exc:
        raise UsageError(f"needs vLLM 0.33 ({exc.name or exc} is missing): build its virtualenv with "
                         f"'bash scripts/install-vllm.sh' and run .venv-vllm/bin/kvlife vllm-diff") from None
    from kvlife.lifecycle.drivers.vllm_diff import Agreement, format_agreement

    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model = offline_model_dir(tmp)
        if args.family is not None:
            if args.family not in differential.FAMILIES:
                raise UsageError(f"argument --family: unknown family {args.family!r} "
                                 f"(one of {', '.join(sorted(differential.FAMILIES))})")
            runs: list[Agreement] = list(differential.run_family(model, args.family, seeds).runs)
        else:
            items = _items(args)
            if not items:
                raise UsageError(f"argument --workload: {args.workload} has no request past --offset {args.offset}")
            runs = [differential.diff(model, "workload", items, _setup(args), limit=args.steps)]
    wall = time.perf_counter() - start
    steps = sum(r.steps for r in runs)
    identical = sum(r.identical for r in runs)
    code = 0 if identical == steps else 1
    if args.json:
        output.emit("vllm-diff", steps=steps, identical=identical, wall_s=wall,
                    runs=[attrs.asdict(r) for r in runs])
        return code
    for run in runs:
        print("\n".join(format_agreement(run)))
    if len(runs) > 1:
        print(f"all: {identical}/{steps} steps identical ({100 * identical / max(1, steps):.1f} %)")
    print(f"wall time (s) {wall:.1f}")
    return code


def _seeds(text: str) -> list[int]:
    """``--seeds 0,1,2``: a one-line error for anything else."""
    words = [w.strip() for w in text.split(",")]
    if not words or not all(w.isascii() and w.isdecimal() for w in words):
        raise UsageError(f"argument --seeds: expected non-negative integers separated by commas, got {text!r}")
    return [int(w) for w in words]

