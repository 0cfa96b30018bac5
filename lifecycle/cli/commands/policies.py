"""``kvlife policies``: the built-in policies, and those installed packages register."""

from __future__ import annotations

import argparse
from typing import Any

from kvlife.lifecycle.cli import output
from kvlife.lifecycle.cli.parsing import add_json_flag


def register(sub: Any) -> None:
    parser = sub.add_parser("policies", help="list the built-in policies and those of the kvlife.policies entry "
                                             "points of installed packages")
    add_json_flag(parser, "the list")
    parser.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    from kvlife.policies.loading import entry_point_policies
    from kvlife.policies.registry import BUILTIN, DESCRIPTIONS

    rows = [{"name": n, "source": "built-in", "description": DESCRIPTIONS.get(n, "")} for n in BUILTIN]
    rows += [{"name": n, "source": "entry point", "description": f"{target} (kvlife.policies entry point)"}
             for n, target in sorted(entry_point_policies().items()) if n not in BUILTIN]
    if args.json:
        output.emit("policies", policies=rows)
        return 0
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        print(f"{r['name']:<{width}}  {r['description']}")
    return 0
