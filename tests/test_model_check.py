"""The model checker itself: a correct engine passes, the one-liner API works."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvlife.lifecycle.config import EngineConfig
from kvlife.lifecycle.engine.core import Engine
from kvlife.lifecycle.engine.events import Arrival, FreeBlocks, StartLoad, StepOutput, Tick, TransferReport
from kvlife.policies.stack import PolicyStack
from kvlife.specs.invariants import InvariantObserver
from kvlife.specs.model_check import check_policy, make_test_case, run_check


def test_correct_engine_passes_default_stack() -> None:
    result = run_check((), examples=30, steps=40)
    assert result.ok, result.report()


def test_correct_engine_passes_async_and_sharing_stack() -> None:
    result = run_check(("kvlife.specs.model_check:AsyncLookups", "kvlife.specs.model_check:ShareLoads"),
                       examples=30, steps=40)
    assert result.ok, result.report()


def test_check_policy_one_liner_raises_with_counterexample(tmp_path: Path) -> None:
    policy = tmp_path / "bad_policy.py"
    policy.write_text(
        "from kvlife.policies.base import Decision\n"
        "class StoreEverything:\n"
        "    def store_limit(self, req, engine):\n"
        "        return Decision(req.computed_tokens + req.block_tokens, 'store ahead')\n"
    )
    with pytest.raises(AssertionError, match="invariant 5") as info:
        check_policy(f"{policy}:StoreEverything", examples=50, steps=30)
    assert "counterexample" in str(info.value)
    check_policy("baseline", examples=10, steps=20)  # a correct stack passes silently


def test_make_test_case_gives_a_unittest_class() -> None:
    case = make_test_case("kvlife.specs.model_check:ShareLoads", examples=5, steps=10)
    case("runTest").runTest()


def test_observer_flags_free_under_inflight_load_live() -> None:
    config = EngineConfig(block_tokens=4, device_blocks=8, ranks=2, tiers=())
    observer = InvariantObserver(2, 4)
    engine = Engine(config, PolicyStack([]), recorder=observer.feed_record)
    engine.handle(Arrival(0.0, "a", 5, (1, 2)))
    observer.end_input()
    # A load the engine never started, fed as if it had: freeing its block is a finding.
    from kvlife.lifecycle.engine.events import BlockMove

    observer.feed_commands([StartLoad(99, "a", (BlockMove(1, 3, "host", 0),))])
    observer.feed_commands([FreeBlocks((3,))])
    assert [v.invariant for v in observer.violations] == [2]
    # Once both ranks report, the block is no longer under a transfer.
    observer.jobs[99].reported = {0}
    engine.handle(Tick(1.0))
    observer.end_input()
    engine.handle(StepOutput(2.0, 0))
    observer.end_input()
    engine.handle(TransferReport(3.0, 99, 1))
    observer.end_input()
    observer.feed_commands([FreeBlocks((3,))])
    assert [v.invariant for v in observer.violations if v.invariant == 2] == [2]
    # ... and the engine never completing a job every rank reported is a finding too.
    assert any(v.invariant == 3 for v in observer.violations)


def test_cli_check_takes_a_comma_stack_and_reports_counterexamples(capsys: pytest.CaptureFixture[str]) -> None:
    from kvlife.lifecycle.cli.main import main

    assert main(["check", "--stack", "async-lookup,shared-loads", "--examples", "10", "--steps", "20"]) == 0
    out = capsys.readouterr().out
    assert "stack async-lookup, shared-loads:" in out and "invariants 1-8 hold" in out
    assert main(["check", "--stack", "naive-stores-unsafe"]) == 1
    out = capsys.readouterr().out
    assert "counterexample found" in out and "@reproduce_failure" in out
    assert "invariant 5 (stores cover only computed tokens)" in out
    assert main(["check", "--stack", "async-lookup,,shared-loads"]) == 2
