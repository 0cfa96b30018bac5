"""Built-in policies by name, with one line each for ``kvlife policies``."""

from __future__ import annotations

from collections.abc import Callable

from policies.baseline import Baseline

BUILTIN: dict[str, Callable[[], object]] = {
    "baseline": Baseline,
}

DESCRIPTIONS: dict[str, str] = {
    "baseline": "sync lookup, admit all (no load sharing), store computed blocks, hold while sending",
}
