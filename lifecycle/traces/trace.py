"""Trace writing and reading: one JSON object per line.

Each record goes through a small structlog processor pipeline: ``kind_first`` puts the
record's kind first, then structlog's ``JSONRenderer`` renders it with orjson and a
newline, written in one write per line. The pipeline is called directly, without a bound
logger (a traced run of the conversation trace writes some 700,000 records: a logger's
per-call machinery cost more than the rendering), and library code never calls
``structlog.configure()``. The first line is a header
with the schema version, the config, the policy stack and the seed; then every input
event, transition, decision, job and warning in the order the engine produced them.
Same inputs and config give the same bytes.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

import orjson

from kvlife.lifecycle.engine import records
from kvlife.lifecycle.input_files import READ_ERRORS, Lines, error_line, read_error_message

SCHEMA_VERSION = 1


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class TraceError(Exception):
    """Bad trace input: ``FILE:LINE: message``, always one line (control characters a
    crafted trace put in a field name or value are shown escaped)."""

    def __init__(self, path: str, line: int | None, message: str) -> None:
        where = f"{path}:{line}" if line is not None else path
        message = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", message)
        super().__init__(f"{where}: {message}")
        self.path = path
        self.line = line


def kind_first(logger: Any, method_name: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    """A structlog processor: ``kind`` first (the engine's records have it first already:
    no copy then)."""
    if next(iter(event_dict)) != "kind":
        return {"kind": event_dict["kind"], **{k: v for k, v in event_dict.items() if k != "kind"}}
    return event_dict


@functools.cache
def pipeline() -> tuple[Any, ...]:
    """The trace's processor pipeline: each takes (logger, method name, record) and returns
    what the next one gets; the last renders bytes (one line, newline included). Built on
    first use: a run that writes no trace never imports structlog."""
    import structlog

    return (
        kind_first,
        structlog.processors.JSONRenderer(serializer=orjson.dumps, option=orjson.OPT_APPEND_NEWLINE),
    )


class TraceWriter:
    """Writes records to a JSON-lines file; use as a context manager so that whatever
    was recorded before an error is flushed and the file stays valid line by line.

    The records go to a temporary file beside ``path`` (``kvlife.lifecycle.output_files``),
    which becomes ``path`` when the run ends: replacing what was there when it completed
    (the block ended normally, or ``close()``) or was interrupted cleanly (Ctrl-C or
    SIGTERM, its ``interrupted`` record saying ``clean``); only where no file was when it
    was refused part-way (an error): a refused run never replaces an existing trace.
    ``inputs`` are the run's input files, which the trace may not be."""

    def __init__(self, path: str | Path, inputs: Iterable[str | Path | None] = ()) -> None:
        from kvlife.lifecycle.output_files import OutputError, PendingOutput

        self.path = Path(path)
        try:
            self._pending = PendingOutput(self.path, inputs)
            self._stream: IO[bytes] = self._pending.open()
        except OutputError as exc:
            message = str(exc).split(": ", 1)[-1].removeprefix("cannot write: ")
            raise TraceError(str(path), None, f"cannot write trace: {message}") from None
        except OSError as exc:
            self._pending.discard()
            raise TraceError(str(path), None, f"cannot write trace: {exc.strerror}") from None
        self.lines = 0
        self._last: bytes = b""
        self._pipeline = pipeline()

    def write_header(self, config: dict[str, Any], policies: list[str], seed: int, **extra: Any) -> None:
        self.record(records.header(SCHEMA_VERSION, config, policies, seed, **extra))

    def record(self, record: dict[str, Any]) -> None:
        out: Any = record
        for processor in self._pipeline:
            out = processor(None, "record", out)
        # One write per line: an interrupt between two writes must not leave half a line.
        self._stream.write(out)
        self._last = out
        self.lines += 1

    def write_rendered(self, lines: bytes, count: int) -> None:
        """Whole record lines rendered elsewhere (the native core's JSON writer, which
        writes the bytes ``record`` would): ``count`` lines, each ending in a newline, in one
        write, so an interrupt leaves no half line."""
        if not lines:
            return
        if not lines.endswith(b"\n"):
            raise ValueError("rendered trace lines must end with a newline")
        self._stream.write(lines)
        start = lines.rfind(b"\n", 0, len(lines) - 1) + 1
        self._last = lines[start:]
        self.lines += count

    def last_t(self) -> float:
        """The time of the last record written (0 when it has none)."""
        try:
            t = orjson.loads(self._last).get("t") if self._last else None
        except (orjson.JSONDecodeError, AttributeError):
            t = None
        return float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else 0.0

    def close(self, complete: bool = True) -> bool:
        """Close the file and put it at ``path``: replacing what was there when the run is
        ``complete`` (or cut cleanly), else only where no file was. Returns whether the
        trace is at ``path`` now."""
        if not self._stream.closed:
            self._stream.close()
        if self._pending.done:
            return False
        if complete:
            self._pending.commit()
            return True
        return self._pending.commit_if_absent()

    def _cut_cleanly(self) -> bool:
        try:
            last = orjson.loads(self._last) if self._last else None
        except orjson.JSONDecodeError:
            return False
        return isinstance(last, dict) and last.get("kind") == "interrupted" and last.get("clean") is True

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        complete = kind is None or (issubclass(kind, KeyboardInterrupt) and self._cut_cleanly())
        self.close(complete)


def render_record(record: dict[str, Any]) -> bytes:
    """The exact bytes TraceWriter writes for a record (without the newline)."""
    out: Any = record
    for processor in pipeline():
        out = processor(None, "record", out)
    return bytes(out[:-1])


KNOWN_KINDS = frozenset(
    {"header", "input", "transition", "decision", "step", "job", "job_done", "free", "evict", "stale_lookup",
     "lookup_reuse", "store_rejected", "warning", "interrupted", "reclaim", "abandon"}
)


def is_driver_record(record: dict[str, Any]) -> bool:
    """Written by a driver, not by the engine: tier warnings (``"origin": "driver"``) and the
    final ``interrupted`` record. An exact replay skips them: no engine call produces them."""
    kind = record.get("kind")
    return kind == "interrupted" or (kind == "warning" and record.get("origin") == "driver")


# The header line: the config, the stack, the workload and (a live run on a kept disk
# tier) the slots it recovered. The lines after it are bounded by what the header says.
HEADER_LINE_MAX = 16 << 20
_TOKENS_MAX = 1 << 24  # the longest prompt a config allows (kvlife.lifecycle.config.TOKENS)


def _count(value: Any, default: int = 0) -> int:
    """A size from a header that has not been checked yet: a non-negative int, else ``default``."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else default


def _table(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def record_line_max(header: dict[str, Any]) -> int:
    """The longest record line a run with this header can write: 1 MiB plus 64 bytes for
    each thing one record may list: every device block (a free, a job's moves), every tier
    slot, every running request (a step), every block of the longest prompt (an arrival,
    a lookup answer) and every request of the workload (a live run's stall warning)."""
    config: dict[str, Any] = _table(header.get("config"))
    engine: dict[str, Any] = _table(config.get("engine"))
    found = engine.get("tiers")
    tiers: list[Any] = found if isinstance(found, list) else []
    workload: dict[str, Any] = _table(header.get("workload"))
    items = (_count(engine.get("device_blocks"), 1 << 20) + _count(engine.get("max_running"), 1 << 10)
             + sum(_count(t.get("capacity_blocks")) for t in tiers if isinstance(t, dict))
             + -(-_TOKENS_MAX // max(1, _count(engine.get("block_tokens"), 1)))
             + _count(workload.get("requests")))
    return (1 << 20) + 64 * items


class TraceLines:
    """The non-empty lines of a trace, as (line number, raw line without its newline); a
    ``.gz`` file is decompressed on the fly. Read through ``kvlife.lifecycle.input_files``:
    the header line is at most ``HEADER_LINE_MAX``, and once ``bound_by(header)`` is called,
    each later line at most ``record_line_max(header)``. Anything unreadable is a
    ``TraceError`` naming the file and line."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lines = Lines(self.path, HEADER_LINE_MAX, "a trace header is at most this long")
        self._iter = self._read()

    def bound_by(self, header: dict[str, Any]) -> None:
        self._lines.set_max_line(record_line_max(header), "the longest record this trace's header allows")

    @property
    def ended_with_newline(self) -> bool:
        """Once read to the end: whether the last line had its newline (a run cut mid-write
        leaves a last line without one)."""
        return self._lines.ended_with_newline

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        return self._iter

    def __next__(self) -> tuple[int, bytes]:
        return next(self._iter)

    def _read(self) -> Iterator[tuple[int, bytes]]:
        try:
            for number, line in self._lines:
                if line.strip():
                    yield number, line
        except READ_ERRORS as exc:
            number = self._lines.number
            where = error_line(exc, number + 1 if number else None)
            raise TraceError(str(self.path), where, f"cannot read trace: {read_error_message(exc)}") from None


def iter_lines(path: str | Path) -> TraceLines:
    """(line number, raw line without its newline) for every non-empty line (see ``TraceLines``)."""
    return TraceLines(path)


_NOT_A_NUMBER = object()  # what json's parse_constant makes of NaN, Infinity, -Infinity


def unrepresentable_field(raw: bytes) -> tuple[str, str] | None:
    """(dotted field, message) for the first value JSON cannot carry but Python's json
    module reads anyway: NaN, infinities (also 1e999) and integers past 64 bits. None when
    the line has none (or is not JSON even to Python)."""
    try:
        value = json.loads(raw, parse_constant=lambda _name: _NOT_A_NUMBER)
    except (ValueError, RecursionError):
        return None
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        where, item = stack.pop()
        if item is _NOT_A_NUMBER or (isinstance(item, float) and not math.isfinite(item)):
            return where or "(the line)", "must be a finite number (JSON has no NaN or infinity)"
        if isinstance(item, int) and not isinstance(item, bool) and not -(1 << 63) <= item < (1 << 64):
            return where or "(the line)", "integer out of range (more than 64 bits)"
        if isinstance(item, dict):
            stack.extend((f"{where}.{k}" if where else str(k), v) for k, v in reversed(list(item.items())))
        elif isinstance(item, list):
            stack.extend((f"{where}[{i}]", v) for i, v in reversed(list(enumerate(item))))
    return None


def not_json(path: str, number: int, raw: bytes, exc: orjson.JSONDecodeError, what: str = "not JSON") -> TraceError:
    """The error for a line orjson refused: the field when it is a value JSON cannot hold."""
    found = unrepresentable_field(raw)
    if found is not None:
        return TraceError(path, number, f"field '{found[0]}': {found[1]}")
    return TraceError(path, number, f"{what}: {exc}")


def parse_header(path: str | Path, number: int, raw: bytes) -> dict[str, Any]:
    """The header record, checked: a clear TraceError otherwise."""
    try:
        record = orjson.loads(raw)
    except orjson.JSONDecodeError:
        found = unrepresentable_field(raw)
        if found is not None:
            raise TraceError(str(path), number, f"field '{found[0]}': {found[1]}") from None
        raise TraceError(str(path), number, "missing header: the first line is not JSON") from None
    if not isinstance(record, dict) or record.get("kind") != "header":
        raise TraceError(str(path), number, "missing header: the first record must have kind 'header'")
    schema = record.get("schema")
    if not isinstance(schema, int) or isinstance(schema, bool):
        raise TraceError(str(path), number, f"field 'schema': expected an integer, got {schema!r}")
    if schema > SCHEMA_VERSION:
        raise TraceError(str(path), number, f"field 'schema': trace schema {schema} is newer than this kvlife "
                                            f"(reads schema {SCHEMA_VERSION} and older)")
    return record


def parse_record(path: str | Path, number: int, raw: bytes) -> dict[str, Any]:
    """One trace line as a record of a known kind; a TraceError naming the line otherwise."""
    try:
        record = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise not_json(str(path), number, raw, exc) from None
    kind = record.get("kind") if isinstance(record, dict) else None
    if not isinstance(kind, str) or kind not in KNOWN_KINDS:
        raise TraceError(str(path), number, f"field 'kind': unknown record kind {kind!r}")
    parsed: dict[str, Any] = record
    return parsed


def read_header(path: str | Path) -> tuple[dict[str, Any], int, TraceLines]:
    """The checked header, its line number, and the remaining (line number, raw) lines
    (each bounded by what the header allows)."""
    lines = iter_lines(path)
    first = next(lines, None)
    if first is None:
        raise TraceError(str(path), None, "empty trace: missing header")
    header = parse_header(path, *first)
    lines.bound_by(header)
    return header, first[0], lines


def read_trace(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield (line number, record); raises TraceError naming the line on bad input."""
    p = Path(path)
    lines = iter_lines(p)
    for number, raw in lines:
        try:
            record = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise not_json(str(p), number, raw, exc) from None
        if not isinstance(record, dict) or not isinstance(record.get("kind"), str):
            raise TraceError(str(p), number, "field 'kind': missing (not a trace record)")
        if record["kind"] == "header":
            lines.bound_by(record)
        yield number, record
