"""Workloads for the simulator: the request record, the Mooncake trace reader, a summary.

The Mooncake format is JSON lines, one request per line::

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, ...]}

``timestamp`` is the arrival in ms, ``hash_ids`` are chained block hashes: one per
``block_tokens`` tokens of the prompt (the last may cover a partial block), and hash *i*
stands for the whole prefix up to block *i*, so two prompts share hash *i* only if they
share every block before it. That makes the ids directly usable as prefix-cache keys.

Trace files come from outside the project, so the reader checks every field and reports
the first problem as one ``file:line: field 'x': message`` line instead of letting a bad
value surface later as a confusing failure deep in the simulator.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterable, Iterator
from typing import Any, TypedDict

import attrs
import orjson

from kvlife.lifecycle.config import TOKENS, WORKLOAD_RULES
from kvlife.lifecycle.input_files import READ_ERRORS, Lines, error_line, read_error_message
from kvlife.lifecycle.workloads.bundled import BUNDLED, resolve_workload

__all__ = [
    "WorkloadError",
    "WorkloadRequest",
    "WorkloadSummary",
    "count_requests",
    "describe",
    "iter_mooncake",
    "load_mooncake",
    "max_line_bytes",
]


@attrs.frozen(slots=True)
class WorkloadRequest:
    """One request as the simulator feeds it to the engine."""

    request_id: str
    arrival_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    session: str | None = None


class WorkloadError(Exception):
    """A workload file that cannot be read or holds an invalid request."""

    def __init__(
        self, path: str, line: int | None, field: str | None, message: str
    ) -> None:
        # All four go to Exception so that args round-trip through pickle (multiprocessing).
        super().__init__(path, line, field, message)
        self.path = path
        self.line = line
        self.field = field
        self.message = message

    def __str__(self) -> str:
        where = self.path if self.line is None else f"{self.path}:{self.line}"
        parts = [where]
        if self.field is not None:
            parts.append(f"field '{self.field}'")
        parts.append(self.message)
        # One line whatever the parts contain, so the error stays greppable in logs.
        return ": ".join(parts).replace("\r", " ").replace("\n", " ")


def _describe_value(value: object) -> str:
    """How a bad value appears in a message: short, so one huge list cannot flood it."""
    if isinstance(value, bool | int | float):
        return repr(value)
    return type(value).__name__


def _plain(field: str) -> tuple[tuple[type, ...], int | float, int | float]:
    found = WORKLOAD_RULES[field].plain_range()
    if found is None:  # (a rule changed kind: the reader's fast path needs a range)
        raise AssertionError(f"WORKLOAD_RULES[{field!r}] has no plain range")
    return found


# The common case of each field, checked without a call per value (every refusal is still
# worded by the rule: the slow path below asks it).
_TIMESTAMP_TYPES, _TIMESTAMP_LOW, _TIMESTAMP_HIGH = _plain("timestamp")
_INPUT_TYPES, _INPUT_LOW, _INPUT_HIGH = _plain("input_length")
_OUTPUT_TYPES, _OUTPUT_LOW, _OUTPUT_HIGH = _plain("output_length")
_HASH_TYPES, _HASH_LOW, _HASH_HIGH = _plain("hash_ids")
_HASH_TYPE_SET = frozenset(_HASH_TYPES)


def _parse_record(
    record: object, block_tokens: int, path: str, line: int
) -> tuple[float, int, int, tuple[int, ...]]:
    """Validate one decoded line into (timestamp, input_length, output_length, hash_ids)."""
    if not isinstance(record, dict):
        raise WorkloadError(
            path, line, None, f"expected a JSON object, got {type(record).__name__}"
        )
    timestamp: Any = record.get("timestamp")
    input_length: Any = record.get("input_length")
    output_length: Any = record.get("output_length")
    hash_ids: Any = record.get("hash_ids")
    if not (
        type(timestamp) in _TIMESTAMP_TYPES and _TIMESTAMP_LOW <= timestamp <= _TIMESTAMP_HIGH
        and type(input_length) in _INPUT_TYPES and _INPUT_LOW <= input_length <= _INPUT_HIGH
        and type(output_length) in _OUTPUT_TYPES and _OUTPUT_LOW <= output_length <= _OUTPUT_HIGH
        and type(hash_ids) is list
    ):
        for field in ("timestamp", "input_length", "output_length", "hash_ids"):
            if field not in record:
                raise WorkloadError(path, line, field, "missing")
        # The rules of kvlife.lifecycle.config (the same layer as config files and flags);
        # orjson already refuses NaN and infinities, the rules refuse the rest.
        for field in ("timestamp", "input_length", "output_length"):
            problem = WORKLOAD_RULES[field].problem(record[field])
            if problem is not None:
                raise WorkloadError(path, line, field, problem)
        if type(hash_ids) is not list:
            raise WorkloadError(
                path,
                line,
                "hash_ids",
                f"expected a list of integers, got {_describe_value(hash_ids)}",
            )
    # Whole-list checks first: the all-valid case is the common one and must be fast (the
    # element types gathered in C: no Python frame per hash id).
    if not set(map(type, hash_ids)) <= _HASH_TYPE_SET or (
        hash_ids and (min(hash_ids) < _HASH_LOW or max(hash_ids) > _HASH_HIGH)
    ):
        rule = WORKLOAD_RULES["hash_ids"]
        for index, h in enumerate(hash_ids):
            problem = rule.problem(h)
            if problem is not None:
                raise WorkloadError(path, line, "hash_ids", f"element {index}: {problem}")
    expected = -(-input_length // block_tokens)
    if len(hash_ids) != expected:
        raise WorkloadError(
            path,
            line,
            "hash_ids",
            f"expected {expected} block hashes for input_length {input_length}, "
            f"got {len(hash_ids)}",
        )
    return (timestamp, input_length, output_length, tuple(hash_ids))


def load_mooncake(
    path: str | os.PathLike[str],
    *,
    limit: int | None = None,
    block_tokens: int = 512,
    time_scale: float = 1.0,
) -> list[WorkloadRequest]:
    """Read a Mooncake JSON-lines trace: a file (``.gz`` is decompressed on the fly) or
    a bundled workload's name such as ``mooncake-conversation``.

    ``limit`` keeps only the first N requests and stops reading there. ``time_scale``
    divides arrival times: 2.0 replays the trace at twice its arrival rate. Request ids
    are ``req-{index}`` in file order; blank lines are skipped but still count for line
    numbers, and unknown keys are ignored. Raises ``WorkloadError`` for the first bad
    line, ``ValueError`` for bad arguments. The whole list: ``iter_mooncake`` streams.
    """
    return list(iter_mooncake(path, limit=limit, block_tokens=block_tokens, time_scale=time_scale))


def iter_mooncake(
    path: str | os.PathLike[str],
    *,
    limit: int | None = None,
    block_tokens: int = 512,
    time_scale: float = 1.0,
) -> Iterator[WorkloadRequest]:
    """``load_mooncake`` one request at a time: the file is read as the requests are
    taken, so memory does not grow with its length, and a bad line is reported (the same
    ``WorkloadError``) only when the reading reaches it. Bad arguments raise
    ``ValueError`` at the call; the file is opened at the first request taken and closed
    when the iterator ends or is closed."""
    _check_arguments(limit, block_tokens, time_scale)
    return _stream(path, limit, block_tokens, time_scale)


def count_requests(path: str | os.PathLike[str], *, limit: int | None = None, block_tokens: int = 512) -> int:
    """How many requests ``iter_mooncake(path, limit=limit)`` yields if every line is valid:
    the non-blank lines, counted without decoding them (a cheap first pass, for a
    progress total and the trace header). Raises ``WorkloadError`` when the file cannot
    be read (or a line is longer than one of ``block_tokens`` can be)."""
    _check_arguments(limit, block_tokens, 1.0)
    count = 0
    with _opened(path, block_tokens) as (lines, _):
        for _number, raw in lines:
            if limit is not None and count >= limit:
                break
            if raw.strip():
                count += 1
    return count


def max_line_bytes(block_tokens: int) -> int:
    """The longest line a well-formed workload of this block size holds: its hash ids (at
    most the longest prompt, 2^24 tokens, over the block size) at 48 bytes each (20
    digits, a comma, a space, and as much again of other white space), and 64 KiB for
    the other fields. A longer line is refused unread (``kvlife.lifecycle.input_files``)."""
    return (64 << 10) + 48 * -(-int(TOKENS.value) // block_tokens)


def _check_arguments(limit: int | None, block_tokens: int, time_scale: float) -> None:
    if limit is not None and (type(limit) is not int or limit < 0):
        raise ValueError(f"limit: expected None or an integer >= 0, got {limit!r}")
    if type(block_tokens) is not int or block_tokens < 1:
        raise ValueError(
            f"block_tokens: expected an integer >= 1, got {block_tokens!r}"
        )
    if (
        isinstance(time_scale, bool)
        or not isinstance(time_scale, int | float)
        or not math.isfinite(time_scale)
        or time_scale <= 0
    ):
        raise ValueError(
            f"time_scale: expected a finite number > 0, got {time_scale!r}"
        )


@contextlib.contextmanager
def _opened(path: str | os.PathLike[str], block_tokens: int) -> Iterator[tuple[Lines, str]]:
    """The workload's lines (each within ``max_line_bytes``) and the name errors give it
    (for a bundled name, the packaged file); an error opening or reading it (a truncated
    gzip shows only when read, a line too long when it is reached) is a ``WorkloadError``
    naming the file, and the line when there is one."""
    resolved = resolve_workload(os.fspath(path))
    name = os.fspath(resolved)
    lines = Lines(resolved, max_line_bytes(block_tokens),
                  f"the longest line a workload of {block_tokens}-token blocks can hold")
    try:
        yield lines, name
    except READ_ERRORS as exc:
        message = f"cannot read: {read_error_message(exc)}"
        if isinstance(exc, FileNotFoundError) and os.sep not in os.fspath(path):
            message += f" (and not a bundled workload: {', '.join(BUNDLED)})"
        raise WorkloadError(name, error_line(exc, None), None, message) from exc


def _stream(
    path: str | os.PathLike[str], limit: int | None, block_tokens: int, time_scale: float
) -> Iterator[WorkloadRequest]:
    with _opened(path, block_tokens) as (lines, name):
        yield from _read_requests(lines, name, limit, block_tokens, time_scale)


def _read_requests(
    lines: Iterable[tuple[int, bytes]],
    name: str,
    limit: int | None,
    block_tokens: int,
    time_scale: float,
) -> Iterator[WorkloadRequest]:
    count = 0
    previous_timestamp: float = 0.0
    previous_line = 0
    for line_number, raw in lines:
        if limit is not None and count >= limit:
            break
        if not raw.strip():
            continue
        try:
            record = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise WorkloadError(
                name, line_number, None, f"invalid JSON: {exc}"
            ) from None
        timestamp, input_length, output_length, hash_ids = _parse_record(
            record, block_tokens, name, line_number
        )
        if timestamp < previous_timestamp:
            raise WorkloadError(
                name,
                line_number,
                "timestamp",
                f"{timestamp} is earlier than {previous_timestamp} on line "
                f"{previous_line}; timestamps must not decrease",
            )
        previous_timestamp, previous_line = timestamp, line_number
        yield WorkloadRequest(
            request_id=f"req-{count}",
            arrival_ms=timestamp / time_scale,
            input_length=input_length,
            output_length=output_length,
            hash_ids=hash_ids,
        )
        count += 1


class WorkloadSummary(TypedDict):
    requests: int
    sessions: int
    input_tokens: int
    output_tokens: int
    prompt_blocks: int
    unique_blocks: int
    repeated_blocks: int
    ideal_hit_rate: float


def describe(workload: list[WorkloadRequest]) -> WorkloadSummary:
    """Counts that say what a workload will exercise.

    ``ideal_hit_rate`` is the fraction of prompt blocks whose hash already appeared in an
    earlier request (in list order): the prefix-cache hit rate with an infinite cache and
    instant stores, an upper bound for any policy.
    """
    seen: set[int] = set()
    prompt_blocks = 0
    repeated = 0
    sessions: set[str] = set()
    for request in workload:
        prompt_blocks += len(request.hash_ids)
        repeated += sum(1 for h in request.hash_ids if h in seen)
        seen.update(request.hash_ids)
        if request.session is not None:
            sessions.add(request.session)
    return WorkloadSummary(
        requests=len(workload),
        sessions=len(sessions),
        input_tokens=sum(r.input_length for r in workload),
        output_tokens=sum(r.output_length for r in workload),
        prompt_blocks=prompt_blocks,
        unique_blocks=len(seen),
        repeated_blocks=repeated,
        ideal_hit_rate=repeated / prompt_blocks if prompt_blocks else 0.0,
    )
