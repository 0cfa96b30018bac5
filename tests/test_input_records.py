"""Input records read back (``events.input_from_record``): what `replay`, `validate` and
`kvlife check --replay` rebuild the engine's inputs from.

Every well-formed input event writes a record that reads back to the same event
(Hypothesis draws them), and every malformed field is refused with ``BadEvent`` naming it
(a one-line error, exit 2, in the commands): never a traceback, never taken as something
else. Found missing by issue 26's mutation round: a report of two items raised an
IndexError, a rank 0 could be refused, and a ``max_tokens`` of ``"5"``, ``true`` or ``2.5``
slipped past or raised a TypeError, with no test failing.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvlife.lifecycle.engine.events import (
    Abort,
    Arrival,
    BadEvent,
    InputEvent,
    LookupAnswer,
    StepOutput,
    Tick,
    TransferReport,
    input_from_record,
    input_to_record,
)

ids = st.text(st.characters(codec="utf-8", categories=("L", "N", "P")), min_size=1, max_size=8)
counts = st.integers(0, 2**40)
times = st.floats(0, 1e9, allow_nan=False)
hashes = st.lists(st.integers(-(2**63), 2**63 - 1), max_size=4).map(tuple)

events: st.SearchStrategy[InputEvent] = st.one_of(
    st.builds(Arrival, times, ids, counts, hashes, st.booleans(), st.none() | st.integers(1, 10**6)),
    st.builds(Abort, times, ids),
    st.builds(Tick, times),
    st.builds(LookupAnswer, times, ids, counts, st.none() | st.lists(st.sampled_from(["host", "disk"])).map(tuple)),
    st.builds(TransferReport, times, counts, st.integers(0, 64), hashes),
    st.builds(StepOutput, times, counts,
              st.lists(st.tuples(ids, st.sampled_from(["stopped", "length"])), max_size=3).map(tuple),
              st.lists(st.tuples(counts, st.integers(0, 64), hashes), max_size=3).map(tuple),
              st.lists(st.integers(0, 64), max_size=3).map(tuple)),
)


@given(events)
def test_every_input_reads_back_as_itself(event: InputEvent) -> None:
    assert input_from_record(orjson.loads(orjson.dumps(input_to_record(event)))) == event


def _step(**fields: Any) -> dict[str, Any]:
    return {"kind": "input", "type": "step_output", "t": 1.0, "step_id": 3, "finished": [], **fields}


def _arrival(**fields: Any) -> dict[str, Any]:
    return {"kind": "input", "type": "arrival", "t": 1.0, "request_id": "a", "prompt_tokens": 40,
            "block_hashes": [1, 2], **fields}


@pytest.mark.parametrize(("record", "field"), [
    (_step(reports=[[1, 0]]), "reports"),  # a report of two items, not [job, rank, [failed]]
    (_step(reports=[[1, 0, 5]]), "reports"),
    (_step(reports=[["1", 0, []]]), "reports"),
    (_step(reports=[[1, 0.5, []]]), "reports"),
    (_step(reports=[[True, 0, []]]), "reports"),
    (_step(reports=[[1, 0, ["x"]]]), "reports"),
    (_step(reports={"job": 1}), "reports"),
    (_step(failed_ranks=[]), "failed_ranks"),
    (_step(failed_ranks=[-1]), "failed_ranks"),
    (_step(failed_ranks=["0"]), "failed_ranks"),
    (_step(failed_ranks=[True]), "failed_ranks"),
    (_step(finished=[["a"]]), "finished"),
    (_step(step_id="3"), "step_id"),
    (_arrival(max_tokens="5"), "max_tokens"),
    (_arrival(max_tokens=True), "max_tokens"),
    (_arrival(max_tokens=2.5), "max_tokens"),
    (_arrival(max_tokens=0), "max_tokens"),
    (_arrival(prompt_tokens=True), "prompt_tokens"),
    (_arrival(t=False), "t"),
    (_arrival(request_id=7), "request_id"),
    ({"kind": "input", "type": "transfer_report", "t": 1.0, "job_id": 2, "rank": "0"}, "rank"),
    ({"kind": "input", "type": "nap", "t": 1.0}, "type"),
])
def test_a_malformed_field_is_refused_naming_it(record: dict[str, Any], field: str) -> None:
    with pytest.raises(BadEvent) as refused:
        input_from_record(record)
    assert refused.value.field == field


def test_the_edges_of_each_rule_are_taken() -> None:
    """Rank 0, one failed rank, an output limit of 1 and an empty report list are inputs."""
    assert input_from_record(_step(failed_ranks=[0])).failed_ranks == (0,)  # type: ignore[union-attr]
    assert input_from_record(_step(reports=[[1, 0, []]])).reports == ((1, 0, ()),)  # type: ignore[union-attr]
    assert input_from_record(_arrival(max_tokens=1)).max_tokens == 1  # type: ignore[union-attr]
    assert input_from_record(_arrival(max_tokens=None)).max_tokens is None  # type: ignore[union-attr]
