"""``specs.refusal_check.refuses_altered`` and its use by ``kvlife check`` (invariant 15):
the trace reader refuses an input record altered one value at a time, naming the field."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from kvlife.lifecycle.config import RunConfig
from kvlife.lifecycle.drivers.runner import run_workload
from kvlife.lifecycle.engine import events
from kvlife.lifecycle.engine.events import BadEvent
from kvlife.lifecycle.traces.inputs import read_input
from kvlife.lifecycle.workloads.synthetic import synthetic_workload
from kvlife.specs.model_check import run_check
from kvlife.specs.refusal_check import refuses_altered


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """A simulated run's records, read back from its trace file."""
    path = tmp_path_factory.mktemp("refusal-check") / "run.jsonl"
    config = RunConfig(policies=("async-lookup",))
    workload = synthetic_workload(seed=5, num_requests=30, block_tokens=config.engine.block_tokens,
                                  arrival_rate_per_s=8.0)
    run_workload(config, workload, trace_path=path)
    return [orjson.loads(line) for line in path.read_bytes().splitlines()[1:]]


def _first(records: list[dict[str, Any]], kind: str, field: str) -> int:
    return next(i for i, r in enumerate(records) if r.get("type") == kind and r.get(field))


def test_the_reader_refuses_every_alteration_of_a_real_runs_inputs(records: list[dict[str, Any]]) -> None:
    kinds = {r["type"] for r in records if r["kind"] == "input"}
    assert {"arrival", "tick", "step_output", "lookup_answer"} <= kinds
    assert any(r.get("reports") for r in records) and any(r.get("finished") for r in records)
    assert refuses_altered(records) is None


def test_a_reader_that_takes_true_for_a_count_is_found(records: list[dict[str, Any]]) -> None:
    def lax(record: dict[str, Any]) -> Any:  # JSON true read as the count 1
        return read_input({**record, "prompt_tokens": 1} if record.get("prompt_tokens") is True else record)

    found = refuses_altered(records, read=lax)
    assert found is not None
    line = _first(records, "arrival", "prompt_tokens") + 1
    assert found.startswith(f"the trace reader takes input line {line}'s arrival with its field "
                            "'prompt_tokens' set to True: read as Arrival(")


def test_a_reader_that_crashes_on_a_short_item_is_found(records: list[dict[str, Any]]) -> None:
    def indexes(record: dict[str, Any]) -> Any:  # reads a finished pair's reason before checking its length
        for pair in record.get("finished") or ():
            if isinstance(pair, list):
                pair[1]  # noqa: B018 - the crash under test
        return read_input(record)

    found = refuses_altered(records, read=indexes)
    assert found is not None
    assert "with its field 'finished' entry 0 one element short: IndexError" in found


def test_a_refusal_that_names_another_field_is_found(records: list[dict[str, Any]]) -> None:
    def misnames(record: dict[str, Any]) -> Any:
        try:
            return read_input(record)
        except BadEvent as exc:
            if exc.field == "block_hashes":
                raise BadEvent("t", str(exc)) from None
            raise

    found = refuses_altered(records, read=misnames)
    assert found is not None
    assert "with its field 'block_hashes' set to 'x', but names the field 't'" in found


def test_kvlife_check_finds_a_validator_that_takes_true_for_max_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    checked = events._check_types

    def lax(values: dict[str, Any]) -> None:  # the validator's bool test dropped for max_tokens
        checked({**values, "max_tokens": 1} if values.get("max_tokens") is True else values)

    assert run_check(examples=60, steps=50, shrink=False).ok
    monkeypatch.setattr(events, "_check_types", lax)
    result = run_check(examples=60, steps=50, shrink=False)
    assert result.violation is not None and result.violation.invariant == 15
    assert "with its field 'max_tokens' set to True: read as Arrival(" in result.violation.message
