"""``kvlife export TRACE --perfetto out.json``: a timeline for ui.perfetto.dev;
``--otlp out.json``: OpenTelemetry spans (OTLP/JSON) for a collector."""

from __future__ import annotations

import argparse
from typing import Any

from kvlife.lifecycle.cli import output
from kvlife.lifecycle.cli.parsing import STACK_HELP, add_json_flag, add_stack_flag, name_or_path


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "export", help="export a trace as a Perfetto/Chrome timeline or as OpenTelemetry spans (OTLP/JSON)",
        description="Export a trace: --perfetto writes Chrome trace JSON for ui.perfetto.dev; --otlp writes "
                    "OTLP/JSON (an ExportTraceServiceRequest, what a collector takes at /v1/traces): a span per "
                    "request with its latencies, time per phase and prompt tokens by source as attributes, a "
                    "child span per state, each policy decision an event.\n\n"
                    "examples:\n  kvlife export run.jsonl --perfetto timeline.json\n"
                    "  kvlife export run.jsonl --otlp spans.json\n"
                    "  curl -X POST -H 'Content-Type: application/json' --data @spans.json "
                    "http://localhost:4318/v1/traces")
    parser.add_argument("trace", type=name_or_path, help="JSON-lines trace")
    fmt = parser.add_mutually_exclusive_group(required=True)
    fmt.add_argument("--perfetto", metavar="OUT.json",
                     help="write Chrome trace JSON here (opens in ui.perfetto.dev; no default: give this or --otlp)")
    fmt.add_argument("--otlp", metavar="OUT.json",
                     help="write OpenTelemetry spans here, OTLP/JSON (the per-request figures come from an exact "
                          "replay of the trace; no default: give this or --perfetto)")
    add_stack_flag(parser, help_text="--otlp: replay under this stack instead of the header's; " + STACK_HELP,
                   default_text="the header's stack, built-in policies only unless --allow-code")
    parser.add_argument("--allow-code", action="store_true",
                        help="--otlp: trust the trace: import the policy code its header names for the replay")
    add_json_flag(parser, "what was written")
    parser.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    if args.otlp is not None:
        from kvlife.lifecycle.cli.compare import parse_stack
        from kvlife.lifecycle.traces.export import export_otlp

        stack = list(parse_stack(args.stack)) if args.stack is not None else None
        spans = export_otlp(args.trace, args.otlp, allow_code=args.allow_code, stack=stack)
        if args.json:
            output.emit("export", trace=args.trace, format="otlp", out=args.otlp, events=spans)
            return 0
        print(f"wrote {args.otlp}: {spans:,} spans (OTLP/JSON: POST it to a collector's /v1/traces)")
        return 0
    from kvlife.lifecycle.traces.export import export_perfetto

    events = export_perfetto(args.trace, args.perfetto)
    if args.json:
        output.emit("export", trace=args.trace, format="perfetto", out=args.perfetto, events=events)
        return 0
    print(f"wrote {args.perfetto}: {events:,} events (open it in https://ui.perfetto.dev)")
    return 0
