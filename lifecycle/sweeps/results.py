"""The results file of a sweep: JSON lines, one object per run, every column in every row.

Why JSON lines (docs/sweeps.md): ``pandas.read_json(path, lines=True)`` and
``polars.read_ndjson(path)`` read it directly, with types (integers stay integers, a missing
value is null, not an empty string); a row is one line written in one call, so rows can be
appended as runs finish and an interrupted sweep leaves whole rows (a last line cut short by
a kill is dropped when the file is read back). Parquet would need pyarrow in the base install.

Resuming: ``load`` reads the rows already there by key; the sweep runs the points whose key is
missing and appends them. When every point is done the file is rewritten in grid order
(``rewrite``), so the same grid gives the same file byte for byte however it ran.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import orjson

from kvlife.lifecycle.cli.output import plain
from kvlife.lifecycle.config import ConfigError
from kvlife.lifecycle.input_files import READ_ERRORS, Lines, error_line, read_error_message
from kvlife.lifecycle.output_files import atomic_output

Row = dict[str, Any]
# The longest results row read back: a row is every input and output of one run, a few KiB.
MAX_ROW_BYTES = 1 << 20


def encode(row: Mapping[str, Any]) -> bytes:
    return orjson.dumps(plain(row)) + b"\n"


class ResultsFile:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def load(self, repair: bool = True) -> dict[str, Row]:
        """The rows already written, by key (a later row of a key wins). A last line without
        its newline (the sweep was killed while writing it) is ignored, and with ``repair`` cut
        off the file. A line that is not a JSON object with a key is a ConfigError naming the
        file and line. Read through ``kvlife.lifecycle.input_files`` (a regular file, each
        row at most ``MAX_ROW_BYTES``)."""
        if not self.path.exists():
            return {}
        lines = Lines(self.path, MAX_ROW_BYTES, "a results row is a few KiB")
        rows: dict[str, Row] = {}
        last: tuple[int, bytes] | None = None
        try:
            for number, line in lines:
                if last is not None:
                    self._add(rows, *last)
                last = (number, line) if line.strip() else None
        except READ_ERRORS as exc:
            raise ConfigError(None, f"cannot read results: {read_error_message(exc)}", str(self.path),
                              error_line(exc, None)) from None
        if last is not None and lines.ended_with_newline:
            self._add(rows, *last)
        elif last is not None and repair:  # a row cut short by a kill: cut it off the file
            with self.path.open("r+b") as f:
                f.truncate(max(0, f.seek(0, os.SEEK_END) - len(last[1])))
        return rows

    def _add(self, rows: dict[str, Row], number: int, line: bytes) -> None:
        try:
            row = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            raise ConfigError(None, f"not a results row (JSON): {exc}", str(self.path), number) from None
        if not isinstance(row, dict) or not isinstance(row.get("key"), str):
            raise ConfigError("key", "not a results row: an object with a \"key\" is expected",
                              str(self.path), number)
        rows[row["key"]] = row

    def append(self, row: Mapping[str, Any]) -> None:
        """One row, written and flushed in one call."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("ab") as f:
            f.write(encode(row))
            f.flush()

    def rewrite(self, rows: Iterable[Mapping[str, Any]]) -> None:
        """Replace the file with ``rows`` (atomically: a temporary file renamed over it,
        ``kvlife.lifecycle.output_files``)."""
        with atomic_output(self.path) as tmp, tmp.open("wb") as f:
            for row in rows:
                f.write(encode(row))
            f.flush()
            os.fsync(f.fileno())


def read_rows(path: str | Path) -> list[Row]:
    """Every whole row of a results file, in file order (the file is not changed: a sweep may
    still be writing it)."""
    if not Path(path).is_file():
        raise ConfigError(None, "no such results file", str(path))
    return list(ResultsFile(path).load(repair=False).values())
