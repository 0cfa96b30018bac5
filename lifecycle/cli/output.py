"""``--json`` output: one JSON object per command, ``"kind"`` and ``"schema": 1`` first.

Values are made plain before they are written: tuples become lists, paths strings,
mapping keys strings, and a float that is NaN or infinite becomes ``null`` (JSON has no
such numbers; Python's ``json`` would write ``NaN``, which other parsers refuse).
The shapes of every kind are documented in ``docs/cli.md``. ``columns`` is the table the
commands print without ``--json`` (aligned text, or Markdown with ``--markdown``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

SCHEMA = 1


def plain(value: Any) -> Any:
    """A JSON-safe copy of ``value``: non-finite floats -> None, tuples -> lists, keys -> str."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [plain(v) for v in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    raise TypeError(f"cannot write {type(value).__name__} as JSON")


def result(kind: str, **fields: Any) -> dict[str, Any]:
    """The object a command prints: kind and schema first, then its fields."""
    return {"kind": kind, "schema": SCHEMA, **plain(fields)}


def dumps(obj: Mapping[str, Any]) -> str:
    return orjson.dumps(plain(obj)).decode()


def emit(kind: str, **fields: Any) -> None:
    print(dumps(result(kind, **fields)), flush=True)


def columns(rows: Sequence[Sequence[str]], markdown: bool = False) -> str:
    """A table as the commands print it, ``rows[0]`` its header: in aligned columns, the
    first left-aligned and the others right-aligned, two spaces apart (trailing spaces cut),
    or with ``markdown`` a Markdown table, the first column left and the others right. Cells
    are printed as given (``kvlife.lifecycle.fidelity.markdown.table`` escapes them)."""
    if markdown:
        lines = ["| " + " | ".join(rows[0]) + " |", "|" + "|".join(["---"] + ["---:"] * (len(rows[0]) - 1)) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in rows[1:]]
        return "\n".join(lines)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)
