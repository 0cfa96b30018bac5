"""``--json`` output: one JSON object per command, ``"kind"`` and ``"schema": 1`` first.

Values are made plain before they are written: tuples become lists, paths strings,
mapping keys strings, and a float that is NaN or infinite becomes ``null`` (JSON has no
such numbers; Python's ``json`` would write ``NaN``, which other parsers refuse).
The shapes of every kind are documented in ``docs/cli.md``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
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
