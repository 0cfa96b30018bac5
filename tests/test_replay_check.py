"""``specs.replay_check.replays_exactly`` and its use by ``kvlife check`` (invariant 15)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from kvlife.lifecycle.config import EngineConfig, RunConfig
from kvlife.lifecycle.drivers.runner import run_workload
from kvlife.lifecycle.engine.core import Engine
from kvlife.lifecycle.traces.replay import config_from_header
from kvlife.lifecycle.workloads.synthetic import synthetic_workload
from kvlife.policies.loading import load_stack
from kvlife.specs.model_check import run_check
from kvlife.specs.replay_check import replays_exactly

STACK = ("async-lookup", "shared-loads")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[EngineConfig, list[str], list[dict[str, Any]]]:
    """A simulated run's trace: its engine config, its header's stack and its records."""
    path = tmp_path_factory.mktemp("replay-check") / "run.jsonl"
    config = RunConfig(policies=STACK)
    workload = synthetic_workload(seed=5, num_requests=30, block_tokens=config.engine.block_tokens,
                                  arrival_rate_per_s=8.0)
    run_workload(config, workload, trace_path=path)
    header, *lines = path.read_bytes().splitlines()
    head = orjson.loads(header)
    return config_from_header(head).engine, head["policies"], [orjson.loads(line) for line in lines]


def _engine(config: EngineConfig, recorder: Any) -> Engine:
    return Engine(config, load_stack(STACK), recorder=recorder)


def test_a_real_run_replays_exactly(run: tuple[EngineConfig, list[str], list[dict[str, Any]]]) -> None:
    config, names, records = run
    assert names == [*STACK, "baseline"]
    assert sum(r["kind"] == "input" for r in records) > 30
    assert replays_exactly(records, config, names, _engine) is None


def test_one_field_changed_is_the_first_difference(
        run: tuple[EngineConfig, list[str], list[dict[str, Any]]]) -> None:
    config, names, records = run
    index = next(i for i, r in enumerate(records) if r["kind"] == "transition" and i > 40)
    tampered = [dict(r) for r in records]
    tampered[index]["reason"] = "tampered"
    found = replays_exactly(tampered, config, names, _engine)
    assert found is not None
    # The header is line 1: record i is line i + 2.
    assert f"at line {index + 2}," in found
    written, replayed = found.split(" ; replayed ")
    assert '"reason":"tampered"' in written
    assert orjson.loads(replayed.strip()) == records[index]


def test_a_record_the_reader_refuses_is_reported_not_raised(
        run: tuple[EngineConfig, list[str], list[dict[str, Any]]]) -> None:
    config, names, records = run
    index = next(i for i, r in enumerate(records) if r["kind"] == "input" and r["type"] == "arrival")
    tampered = [dict(r) for r in records]
    tampered[index]["prompt_tokens"] = "many"
    found = replays_exactly(tampered, config, names, _engine)
    assert found == (f"the run's trace does not read back: line {index + 2}: field 'prompt_tokens': expected an "
                     f"integer, got 'many'")


class ForgetsResumable(Engine):
    """Records its arrivals without ``resumable``: a trace that reads back as a different
    run (the explorer and early policies skip resumable requests). The observers read the
    records as made and see nothing wrong; only a replay does."""

    def __init__(self, config: EngineConfig, policies: Any, tiers: Any = None, recorder: Any = None,
                 **extra: Any) -> None:
        def forget(record: dict[str, Any]) -> None:
            if record.get("type") == "arrival":
                record = {k: v for k, v in record.items() if k != "resumable"}
            recorder(record)

        super().__init__(config, policies, tiers, forget if recorder is not None else None, **extra)


def test_kvlife_check_finds_a_trace_that_does_not_replay() -> None:
    result = run_check((), examples=30, engine_factory=ForgetsResumable, shrink=False)
    assert result.violation is not None, result.report()
    assert result.violation.invariant == 15
    assert "does not replay exactly" in result.violation.message
