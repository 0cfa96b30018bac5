"""Markdown for the report: tables, number formats, and rewriting only the generated blocks.

A generated block is delimited by two HTML comments, invisible when the Markdown is rendered::

    <!-- generated:hit-ratio -->
    ... written by `kvlife fidelity` ...
    <!-- /generated -->

``replace_blocks`` rewrites what lies between the markers of each named block and leaves
every other byte of the document alone, so hand-written prose around the tables survives a
regeneration. A block the document lacks is appended at its end.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

END_MARKER = "<!-- /generated -->"
_START = re.compile(r"<!-- generated:(?P<name>[a-z0-9-]+) -->")


class DocumentError(ValueError):
    """A document whose generated markers cannot be matched (one line)."""


def start_marker(name: str) -> str:
    return f"<!-- generated:{name} -->"


def replace_blocks(text: str, blocks: Mapping[str, str]) -> str:
    """``text`` with the content of each named generated block replaced (appended if absent)."""
    for name, content in blocks.items():
        body = f"\n{content.strip()}\n"
        start = text.find(start_marker(name))
        if start < 0:
            text = text.rstrip("\n") + f"\n\n{start_marker(name)}{body}{END_MARKER}\n"
            continue
        begin = start + len(start_marker(name))
        end = text.find(END_MARKER, begin)
        nested = _START.search(text, begin)
        if end < 0 or (nested is not None and nested.start() < end):
            line = text.count("\n", 0, start) + 1
            raise DocumentError(f"line {line}: {start_marker(name)} has no {END_MARKER} after it")
        text = text[:begin] + body + text[end:]
    return text


def generated_blocks(text: str) -> dict[str, str]:
    """The content of every generated block of ``text``, by name (stripped)."""
    found: dict[str, str] = {}
    for match in _START.finditer(text):
        end = text.find(END_MARKER, match.end())
        if end >= 0:
            found[match["name"]] = text[match.end():end].strip()
    return found


def _cell(value: str) -> str:
    return value.replace("|", "\\|").replace("\n", " ")


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], align: str = "") -> str:
    """A Markdown table; ``align`` has one letter per column, ``l`` or ``r`` (default: the first
    column left, the others right)."""
    align = align or "l" + "r" * (len(headers) - 1)
    if len(align) != len(headers) or any(len(row) != len(headers) for row in rows):
        raise ValueError("every row needs one cell per header")
    rule = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(_cell(h) for h in headers) + " |", "|" + "|".join(rule) + "|"]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# ---- numbers as the tables show them -------------------------------------------------------
def ms(value: float | None) -> str:
    """Milliseconds: ``-`` for none, one decimal under 100, else whole with thousands commas."""
    if value is None or not math.isfinite(value):
        return "-"
    return f"{value:,.1f}" if abs(value) < 100 else f"{value:,.0f}"


def seconds_or_ms(value_ms: float) -> str:
    """A duration in the unit that reads best: ``7.23 ms``, ``1.50 s``, ``1,770 s``."""
    if value_ms < 1000:
        return f"{value_ms:,.2f} ms"
    value = value_ms / 1000
    return f"{value:,.2f} s" if value < 100 else f"{value:,.0f} s"


def percent(fraction: float | None, digits: int = 1) -> str:
    if fraction is None or not math.isfinite(fraction):
        return "-"
    return f"{fraction * 100:.{digits}f} %"


def signed_percent(fraction: float | None, digits: int = 1) -> str:
    """A relative change: ``+3.2 %``, ``-12.0 %`` (a true minus sign is avoided: plain ASCII)."""
    if fraction is None or not math.isfinite(fraction):
        return "-"
    return f"{fraction * 100:+.{digits}f} %"


def points(difference: float) -> str:
    """A difference of two ratios in percentage points: ``+0.3 pt``."""
    return f"{difference * 100:+.1f} pt"


def count(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    return f"{value:,.0f}"


def tokens(n: int | None) -> str:
    """A token count as capacities are quoted: ``3M``, ``512k``, ``infinite`` for None."""
    if n is None:
        return "infinite"
    if n >= 1_000_000 and n % 100_000 == 0:
        return f"{n / 1_000_000:g}M"
    if n >= 1000 and n % 1000 == 0:
        return f"{n // 1000}k"
    return f"{n:,}"
