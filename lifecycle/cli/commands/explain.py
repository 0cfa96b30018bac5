"""``kvlife explain TRACE REQ``: one request's life, each state, how long and why;
``--brief``: one line, where its time went; ``--slowest N``: the N slowest requests."""

from __future__ import annotations

import argparse
from typing import Any

from kvlife.lifecycle.cli import output
from kvlife.lifecycle.cli.parsing import STACK_HELP, UsageError, add_json_flag, add_stack_flag, name_or_path
from kvlife.lifecycle.config import POSITIVE_INT


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "explain", help="explain one request's life from a trace, or list the slowest requests",
        description="Explain one request's life from a trace: each state, how long, and why (the engine's "
                    "reasons and the policies' decisions). --brief gives one line: its time per phase (queue, "
                    "lookup, load, prefill, decode, hold) and where its prompt tokens came from; --slowest N "
                    "lists the N slowest requests that way. The brief forms replay the trace exactly.\n\n"
                    "examples:\n"
                    "  kvlife explain run.jsonl req-17\n"
                    "  kvlife explain run.jsonl req-17 --brief\n"
                    "  kvlife explain run.jsonl --slowest 10")
    parser.add_argument("trace", type=name_or_path, help="JSON-lines trace")
    parser.add_argument("request", nargs="?", help="request id, e.g. req-17 (not with --slowest)")
    parser.add_argument("--brief", action="store_true", help="one line: the request's time per phase, its prompt "
                                                             "tokens by source and its policies' answers")
    parser.add_argument("--slowest", type=POSITIVE_INT.parse, metavar="N",
                        help="list the N slowest requests, one line each (default: off)")
    parser.add_argument("--by", choices=("e2e", "ttft"), default="e2e", help="what --slowest ranks by")
    add_stack_flag(parser, help_text="replay under this stack instead of the header's (the brief forms come from "
                                     "an exact replay); " + STACK_HELP,
                   default_text="the header's stack, built-in policies only unless --allow-code")
    parser.add_argument("--allow-code", action="store_true",
                        help="trust the trace: import the policy code its header names for the replay")
    add_json_flag(parser, "the explanation")
    parser.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    from kvlife.lifecycle.cli.compare import parse_stack
    from kvlife.lifecycle.traces.explain import brief_line, explain, slowest_table, trace_rows

    if args.slowest is not None and args.request is not None:
        raise UsageError("--slowest lists requests: give no request id with it")
    if args.slowest is None and args.request is None:
        raise UsageError("give a request id, or --slowest N")
    options: dict[str, Any] = {"allow_code": args.allow_code,
                               "stack": list(parse_stack(args.stack)) if args.stack is not None else None}
    if args.slowest is not None:
        rows = trace_rows(args.trace, **options)
        table = slowest_table(rows, args.slowest, args.by)
        if args.json:
            from kvlife.lifecycle.breakdown import slowest

            output.emit("explain", trace=args.trace, request=None, lines=[],
                        slowest=[r.as_dict() for r in slowest(rows, args.slowest, args.by)], by=args.by)
            return 0
        print(f"the {len(table) - 1} slowest of {len(rows):,} requests by {args.by} (ms; prompt tokens by source)")
        print(output.columns(table))
        return 0
    lines = [brief_line(args.trace, args.request, **options)] if args.brief else explain(args.trace, args.request)
    if args.json:
        output.emit("explain", trace=args.trace, request=args.request, lines=lines)
        return 0
    for line in lines:
        print(line)
    return 0
