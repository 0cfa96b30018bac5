"""``kvlife spec``: the request lifecycle, from the spec itself."""

from __future__ import annotations

import argparse
from typing import Any

from kvlife.lifecycle.cli import output
from kvlife.lifecycle.cli.parsing import add_json_flag


def register(sub: Any) -> None:
    parser = sub.add_parser("spec", help="print the request lifecycle spec (Mermaid diagram, table or JSON)")
    fmt = parser.add_mutually_exclusive_group()
    fmt.add_argument("--format", choices=("mermaid", "table"), default="mermaid",
                     help="a Mermaid state diagram or one line per transition")
    add_json_flag(fmt, "the states and transitions")
    parser.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    from kvlife.specs.table import TABLE, mermaid

    if args.json:
        output.emit("spec", states=list(TABLE.states), initial=TABLE.initial, final=sorted(TABLE.final),
                    transitions=[{"from": state, "trigger": trigger, "to": target}
                                 for (state, trigger), target in TABLE.edges.items()])
    elif args.format == "mermaid":
        print(mermaid())
    else:
        for (state, trigger), target in TABLE.edges.items():
            print(f"{state:<15} --{trigger}--> {target}")
    return 0
