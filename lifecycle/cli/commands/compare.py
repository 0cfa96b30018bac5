"""``kvlife compare``: one workload, several policy stacks, side by side."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "compare",
        help="run one workload under several policy stacks and print them side by side",
        description='Example: kvlife compare --stack baseline --stack "async-lookup,shared-loads"',
    )
    parser.add_argument("--stack", action="append", required=True,
                        help='comma-separated policies, top first ("baseline" alone: the baseline); repeatable')
    parser.add_argument("--workload", help="Mooncake JSON-lines trace (default: built-in synthetic)")
    parser.add_argument("--limit", type=int, help="use only the first N requests")
    parser.add_argument("--time-scale", type=float, default=1.0, help="arrival rate multiplier")
    parser.add_argument("--config", help="TOML config file (its [policies] stack is ignored)")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--json", action="store_true", help="print the rows as one JSON array")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    parser.set_defaults(func=cmd_compare, policy=None)


def cmd_compare(args: argparse.Namespace) -> int:
    from kvlife.lifecycle.cli.compare import compare_stacks, format_comparison, parse_stack
    from kvlife.lifecycle.cli.main import _load_run_config, _load_workload

    config = _load_run_config(args)
    stacks = [parse_stack(s) for s in args.stack]
    workload, name = _load_workload(args, config)
    rows = compare_stacks(config, workload, stacks, workload_name=name)
    if args.json:
        print(json.dumps(rows))
        return 0
    if not args.markdown:
        print(f"kvlife compare: {name}, {len(workload)} requests, seed {config.sim.seed}, "
              f"time scale {args.time_scale:g}", file=sys.stdout)
    print(format_comparison(rows, markdown=args.markdown))
    return 0
