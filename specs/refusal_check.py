"""Does the trace reader refuse an altered input? The model checker's bad-input check.

A trace is data a user may have edited or crafted, and ``kvlife replay``, ``validate`` and
``explain`` read its input records through one reader (``traces.inputs.read_input``). The
project's promise for bad input is a one-line error naming the field, never a crash and
never a silently different run. ``refuses_altered`` holds the reader to it on the inputs
of a checked example: each record is altered one value at a time, in ways no writer makes
and no reading could take as meant (``alterations``):

- a value of the wrong JSON type: an integer where a count, id or time is (JSON ``true`` is
  not 1), a number where a name is, a string where a number or a list is, an integer where
  ``true``/``false`` is;
- an entry of a list of the wrong type (a block hash ``true``, a tier name 7);
- an item of a list of fixed-size items (a step output's ``[request, reason]`` pairs and
  ``[job, rank, [failed]]`` reports) one element short or one too long, or with an entry
  of the wrong type;
- a field the input needs, left out; an input type the engine does not know.

Each must be refused with the reader's ``BadEvent`` naming the field that was altered.
Which fields an input has and which it needs come from the input's own class (its attrs
fields); what counts as wrong comes from the value's JSON type alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs

from kvlife.lifecycle.engine.events import BadEvent
from kvlife.lifecycle.traces.inputs import read_input
from kvlife.lifecycle.traces.trace import parse_record, render_record

# (the altered record's field, what was done, the altered record)
Alteration = tuple[str, str, dict[str, Any]]
PER_TYPE = 2  # records of each input type altered per example (plus each of a new shape)


def _wrong(value: Any) -> list[Any]:
    """Values of another JSON type than ``value``'s that no reader may take for it."""
    if isinstance(value, bool):
        return [1]
    if isinstance(value, int | float):
        return [True, "7"]
    if isinstance(value, str):
        return [7]
    if isinstance(value, list):
        return ["x"]
    return []


def _entries(value: list[Any]) -> Iterator[tuple[str, list[Any]]]:
    """``value`` with one entry altered: its first and last entry (a list of fixed-size
    lists: one short, one long, and their entries altered)."""
    positions = sorted({0, len(value) - 1}) if value else []
    for i in positions:
        entry = value[i]
        for bad in _wrong(entry):
            yield f"entry {i} set to {bad!r}", value[:i] + [bad] + value[i + 1:]
        if isinstance(entry, list) and entry and all(isinstance(e, list) for e in value):
            yield f"entry {i} one element short", value[:i] + [entry[:-1]] + value[i + 1:]
            yield f"entry {i} one element too long", value[:i] + [entry + [0]] + value[i + 1:]
            for what, inner in _entries(entry):
                yield f"entry {i}'s {what}", value[:i] + [inner] + value[i + 1:]


def alterations(record: dict[str, Any], needed: Sequence[str]) -> Iterator[Alteration]:
    """Every alteration of one input record (module docstring). ``needed``: the fields the
    input cannot do without."""
    yield "type", "an unknown input type", {**record, "type": "no-such-input"}
    for name, value in record.items():
        if name in ("kind", "type"):
            continue
        for bad in _wrong(value):
            yield name, f"set to {bad!r}", {**record, name: bad}
        if isinstance(value, list):
            for what, altered in _entries(value):
                yield name, what, {**record, name: altered}
        if name in needed:
            yield name, "left out", {k: v for k, v in record.items() if k != name}


def _shape(value: Any) -> Any:
    """A record's shape: which fields it has, and which lists hold lists (of what shape)."""
    if isinstance(value, dict):
        return tuple((k, _shape(v)) for k, v in value.items() if k not in ("t", "request_id"))
    if isinstance(value, list):
        return ("list", _shape(value[0]) if value else None)
    return type(value).__name__


def refuses_altered(records: Sequence[dict[str, Any]],
                    read: Callable[[dict[str, Any]], Any] = read_input) -> str | None:
    """None when ``read`` refuses every alteration of the example's input records, as a
    trace file holds them (the first ``PER_TYPE`` of each type, and the first of each new
    shape), with a ``BadEvent`` naming the altered field; else one line saying which
    alteration it took, or how it failed."""
    seen: dict[str, int] = {}
    shapes: set[Any] = set()
    for line, written in enumerate(records, 1):
        if written.get("kind") != "input":
            continue
        record = parse_record("the example's trace", line, render_record(written))  # as a file holds it
        kind = str(record.get("type"))
        shape = _shape(record)
        if seen.get(kind, 0) >= PER_TYPE and shape in shapes:
            continue
        seen[kind] = seen.get(kind, 0) + 1
        shapes.add(shape)
        needed = [f.name for f in attrs.fields(type(read(record))) if f.default is attrs.NOTHING]
        for field, what, altered in alterations(record, needed):
            try:
                event = read(altered)
            except BadEvent as exc:
                if exc.field != field:
                    return (f"the trace reader refuses input line {line}'s {kind} with its field {field!r} {what}, "
                            f"but names the field {exc.field!r}: {exc}")
                continue
            except Exception as exc:  # noqa: BLE001 - any other error is the finding
                return (f"the trace reader fails on input line {line}'s {kind} with its field {field!r} {what}: "
                        f"{type(exc).__name__}: {exc}")
            return (f"the trace reader takes input line {line}'s {kind} with its field {field!r} {what}: "
                    f"read as {event!r}")
    return None
