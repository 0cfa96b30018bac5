"""Input records as the engine takes them, checked as untrusted data.

``kvlife.lifecycle.engine.events.input_from_record`` checks an input's fields and types;
the engine then trusts the values, as its own drivers make them. A trace may have been
edited or crafted, so ``read_input`` also checks what the engine would trip over: block
hashes and failed blocks are integers, tier names are strings, token counts are not negative,
a finished request's reason is one the engine knows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvlife.lifecycle.engine.events import (
    Arrival,
    BadEvent,
    InputEvent,
    LookupAnswer,
    StepOutput,
    TransferReport,
    input_from_record,
)
from kvlife.lifecycle.engine.request import FINISHED_STATUS


def read_input(record: dict[str, Any]) -> InputEvent:
    """The input event of a trace record; a BadEvent naming the field otherwise."""
    event = input_from_record(record)
    check_input_values(event)
    return event


def check_input_values(event: InputEvent) -> None:
    """Values a well-typed input can still hold that the engine takes on trust (it is fed
    by its own drivers): block hashes and failed blocks are 64-bit integers, tiers are names,
    finish reasons are the engine's.
    A BadEvent naming the field otherwise."""
    if isinstance(event, Arrival):
        if event.prompt_tokens < 0:
            raise BadEvent("prompt_tokens", f"must be >= 0, got {event.prompt_tokens}")
        _check_hashes("block_hashes", event.block_hashes)
    elif isinstance(event, TransferReport):
        _check_hashes("failed", event.failed)
    elif isinstance(event, StepOutput):
        for _request_id, reason in event.finished:
            if reason not in FINISHED_STATUS:
                raise BadEvent("finished", f"unknown finish reason {reason!r} (one of {', '.join(FINISHED_STATUS)})")
    elif isinstance(event, LookupAnswer) and event.tiers is not None \
            and not all(isinstance(t, str) for t in event.tiers):
        raise BadEvent("tiers", "expected a list of tier names or null")


def _check_hashes(field: str, values: Sequence[Any] | None) -> None:
    # orjson reads no integer past 64 bits: an int here is a block hash the engine can use.
    if not isinstance(values, tuple | list):  # (null reaches here: the record's lists may be null)
        raise BadEvent(field, f"expected a list of integer block hashes, got {values!r}")
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int):
            raise BadEvent(field, f"expected a list of integer block hashes, got an entry {value!r}")
