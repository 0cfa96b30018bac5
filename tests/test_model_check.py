"""The model checker itself: a correct engine passes at the CLI's default budget, the
one-liner API checks what it is given, and the observer's invariants (10-13 included)
flag what they promise and nothing a legal run does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvlife.lifecycle.config import EngineConfig, TierConfig
from kvlife.lifecycle.engine.core import Engine
from kvlife.lifecycle.engine.events import (
    Arrival,
    BlockMove,
    FreeBlocks,
    Scheduled,
    StartLoad,
    StartStore,
    StepOutput,
    StepPlan,
    SubmitLookup,
    Tick,
    TransferReport,
)
from kvlife.policies.base import Decision
from kvlife.policies.loading import load_stack
from kvlife.policies.stack import PolicyStack
from kvlife.specs.invariants import INVARIANTS, InvariantObserver
from kvlife.specs.model_check import (
    DEFAULT_EXAMPLES,
    DEFAULT_STEPS,
    check_policy,
    make_test_case,
    run_check,
)

BROKEN_POLICY = (
    "from kvlife.policies.base import Decision\n"
    "class StoreEverything:\n"
    "    def store_limit(self, req, engine):\n"
    "        return Decision(req.computed_tokens + req.block_tokens, 'store ahead')\n"
)


def test_correct_engine_passes_default_stack() -> None:
    result = run_check((), examples=DEFAULT_EXAMPLES, steps=DEFAULT_STEPS)
    assert result.ok, result.report()


def test_correct_engine_passes_async_and_sharing_stack() -> None:
    result = run_check(("kvlife.specs.model_check:AsyncLookups", "kvlife.specs.model_check:ShareLoads"),
                       examples=DEFAULT_EXAMPLES, steps=DEFAULT_STEPS)
    assert result.ok, result.report()


class FinishBeforeStores:
    """Documented legal: a finished request does not wait in sending for its stores (their
    jobs keep their own block references)."""

    name = "finish-before-stores"

    def hold_at_finish(self, req: Any, stores_in_flight: int, engine: Any) -> Decision[bool]:
        return Decision(False, "finish now; the stores hold their own blocks")


def test_hold_at_finish_false_stack_passes() -> None:
    # It used to fail with "invariant 5: store job 0 of r0 covers tokens up to 4, only 0
    # are computed": the observer applied `completed` before the StartStore issued in the
    # same handling. Invariant 11 (finished only after every store is reported) allows it:
    # the policy said not to hold.
    result = run_check(lambda: PolicyStack([FinishBeforeStores()]), examples=DEFAULT_EXAMPLES, steps=DEFAULT_STEPS)
    assert result.ok, result.report()


def _finish_with_store(stack: PolicyStack, observer: InvariantObserver) -> tuple[Engine, StartStore]:
    """One request whose last step output both stores its first block and finishes it;
    the observer gets each handling's commands after it (as a driver without a command
    hook would feed them)."""
    config = EngineConfig(block_tokens=4, device_blocks=8, max_batched_tokens=16, ranks=2,
                          tiers=(TierConfig("host", capacity_blocks=8),))
    engine = Engine(config, stack, recorder=observer.feed_record)

    def feed(event: Any) -> list[Any]:
        commands = engine.handle(event)
        observer.feed_commands(commands)
        observer.end_input()
        return commands

    feed(Arrival(0.0, "r0", 5, (1,)))
    plan = next(c for c in feed(Tick(1.0)) if isinstance(c, StepPlan))
    store = next(c for c in feed(StepOutput(2.0, plan.step_id, (("r0", "stopped"),))) if isinstance(c, StartStore))
    return engine, store


def test_store_issued_with_the_finish_is_checked_against_its_issue_time() -> None:
    observer = InvariantObserver(2, 4)
    engine, store = _finish_with_store(PolicyStack([FinishBeforeStores()]), observer)
    assert engine.requests["r0"].state == "finished"
    assert observer.violations == []
    assert [m.block_hash for m in store.moves] == [1]


def test_finished_only_after_every_store_unless_told_not_to_hold() -> None:
    # Held (the baseline): sending until both ranks reported, then finished; all legal.
    observer = InvariantObserver(2, 4)
    assert observer.finish_after_stores
    engine, store = _finish_with_store(PolicyStack([]), observer)
    assert engine.requests["r0"].state == "sending"
    observer.feed_record({"kind": "input", "type": "tick", "t": 2.5})  # sending may end from the next tick on
    observer.feed_record({"kind": "input", "type": "transfer_report", "t": 3.0, "job_id": store.job_id,
                          "rank": 0, "failed": []})
    # An engine that completed it now, with rank 1 still to report, breaks 11.
    observer.feed_record({"kind": "transition", "t": 3.0, "req": "r0", "from": "sending", "to": "finished",
                          "trigger": "completed", "reason": "too early"})
    assert [v.invariant for v in observer.violations] == [11]
    assert "still in flight" in observer.violations[0].message


def test_sending_ends_only_after_a_later_step_or_tick() -> None:
    # Every rank reported the store, but no tick ran and no later step's output came since
    # r0 entered sending (vLLM reports finished_sending with a step's output): too early.
    for tick_first, expected in ((False, [11]), (True, [])):
        observer = InvariantObserver(2, 4)
        _, store = _finish_with_store(PolicyStack([]), observer)
        if tick_first:
            observer.feed_record({"kind": "input", "type": "tick", "t": 2.5})
        for rank in (0, 1):
            observer.feed_record({"kind": "input", "type": "transfer_report", "t": 3.0 + rank,
                                  "job_id": store.job_id, "rank": rank, "failed": []})
        observer.feed_record({"kind": "transition", "t": 4.0, "req": "r0", "from": "sending", "to": "finished",
                              "trigger": "completed", "reason": "stores reported"})
        assert [v.invariant for v in observer.violations] == expected, observer.violations
        if expected:
            assert "completed from sending too early" in observer.violations[0].message


def test_budget_and_max_running_are_invariant_11() -> None:
    observer = InvariantObserver(1, 4, max_batched_tokens=16, max_running=1)
    for rid in ("a", "b"):
        observer.feed_record({"kind": "input", "type": "arrival", "t": 0.0, "request_id": rid,
                              "prompt_tokens": 12, "block_hashes": [], "resumable": False})
        observer.feed_record({"kind": "transition", "t": 0.0, "req": rid, "from": "waiting", "to": "running",
                              "trigger": "admitted", "reason": "r"})
    observer.feed_commands([StepPlan(0, (Scheduled("a", 12, 0, True, (0, 1, 2), (10, 11, 12)),
                                         Scheduled("b", 12, 0, True, (3, 4, 5), (20, 21, 22))), 0)])
    observer.end_input()
    assert sorted(v.invariant for v in observer.violations) == [11, 11]
    messages = " / ".join(v.message for v in observer.violations)
    assert "schedules 24 tokens, the budget is 16" in messages and "2 requests running, max_running is 1" in messages


def test_a_second_lookup_while_one_is_unanswered_is_invariant_12() -> None:
    observer = InvariantObserver(1, 4)
    observer.feed_record({"kind": "input", "type": "arrival", "t": 0.0, "request_id": "a", "prompt_tokens": 9,
                          "block_hashes": [1, 2], "resumable": False})
    observer.feed_commands([SubmitLookup("a", 0, (1, 2))])
    observer.feed_record({"kind": "transition", "t": 0.0, "req": "a", "from": "waiting", "to": "lookup_pending",
                          "trigger": "lookup_submitted", "reason": "r"})
    observer.feed_record({"kind": "input", "type": "tick", "t": 1.0})
    assert observer.violations == []
    observer.feed_commands([SubmitLookup("a", 0, (1, 2))])
    assert [v.invariant for v in observer.violations] == [12]


def test_load_of_a_copy_whose_store_failed_is_invariant_10_from_a_trace() -> None:
    """Provenance at the tiers needs no block tables: `kvlife validate` sees it too."""
    observer = InvariantObserver(2, 4, from_trace=True)
    records: list[dict[str, Any]] = [
        {"kind": "input", "type": "arrival", "t": 0.0, "request_id": "a", "prompt_tokens": 9,
         "block_hashes": [7, 8], "resumable": False},
        {"kind": "input", "type": "tick", "t": 1.0},
        {"kind": "transition", "t": 1.0, "req": "a", "from": "waiting", "to": "running", "trigger": "admitted",
         "reason": "r"},
        {"kind": "step", "t": 1.0, "step": 0, "requests": 1, "prefill_tokens": 9, "sync_lookups": 0,
         "prompt": [["a", 0, 9]]},
        {"kind": "input", "type": "step_output", "t": 2.0, "step_id": 0, "finished": []},
        {"kind": "job", "t": 2.0, "job": 0, "op": "store", "req": "a", "blocks": 1, "tiers": {"host": 1},
         "moves": [[7, 0, "host"]]},
        {"kind": "input", "type": "transfer_report", "t": 3.0, "job_id": 0, "rank": 0, "failed": [7]},
        {"kind": "input", "type": "transfer_report", "t": 3.0, "job_id": 0, "rank": 1, "failed": []},
        {"kind": "job_done", "t": 3.0, "job": 0, "op": "store", "failed": 1, "late": False},
        {"kind": "input", "type": "arrival", "t": 4.0, "request_id": "b", "prompt_tokens": 9,
         "block_hashes": [7, 8], "resumable": False},
        {"kind": "input", "type": "tick", "t": 5.0},
        {"kind": "job", "t": 5.0, "job": 1, "op": "load", "req": "b", "blocks": 1, "tiers": {"host": 1},
         "moves": [[7, 3, "host"]]},
    ]
    for record in records:
        observer.feed_record(record)
    assert [v.invariant for v in observer.violations] == [10]
    assert "store job 0 failed" in observer.violations[0].message


def test_hit_recorded_differently_from_the_first_admission_is_invariant_13() -> None:
    recorded = {"a": 2}
    observer = InvariantObserver(1, 4, hit_probe=recorded.get)
    observer.feed_record({"kind": "input", "type": "arrival", "t": 0.0, "request_id": "a", "prompt_tokens": 13,
                          "block_hashes": [1, 2, 3], "resumable": False})
    observer.feed_record({"kind": "transition", "t": 0.0, "req": "a", "from": "waiting", "to": "running",
                          "trigger": "admitted", "reason": "r"})
    # Its first chunk starts at token 12: the admission skipped 3 blocks, not 2.
    observer.feed_commands([StepPlan(0, (Scheduled("a", 1, 12, True, (0, 1, 2, 3), (1, 2, 3)),), 0)])
    observer.end_input()
    assert 13 in [v.invariant for v in observer.violations]


def test_invariant_names_cover_the_documented_numbers() -> None:
    design = (Path(__file__).parent.parent / "docs" / "design.md").read_text()
    for number in range(1, 14):
        assert number in INVARIANTS
        assert f"\n{number}. " in design, f"invariant {number} is not in docs/design.md's list"


def test_check_policy_one_liner_checks_the_stack_it_is_given(tmp_path: Path) -> None:
    policy = tmp_path / "bad_policy.py"
    policy.write_text(BROKEN_POLICY)
    with pytest.raises(AssertionError, match="invariant 5") as info:
        check_policy(f"{policy}:StoreEverything")
    assert "counterexample" in str(info.value)
    # The same call on a correct stack returns quietly: it is the stack that decides.
    assert check_policy("baseline") is None


def test_make_test_case_gives_a_unittest_class_that_checks(tmp_path: Path) -> None:
    policy = tmp_path / "bad_policy.py"
    policy.write_text(BROKEN_POLICY)
    broken = make_test_case(f"{policy}:StoreEverything")
    with pytest.raises(AssertionError, match="invariant 5"):
        broken("runTest").runTest()
    make_test_case("kvlife.specs.model_check:ShareLoads")("runTest").runTest()


def test_observer_flags_free_under_inflight_load_live() -> None:
    config = EngineConfig(block_tokens=4, device_blocks=8, ranks=2, tiers=())
    observer = InvariantObserver(2, 4)
    engine = Engine(config, PolicyStack([]), recorder=observer.feed_record)
    engine.handle(Arrival(0.0, "a", 5, (1, 2)))
    observer.end_input()
    # A load the engine never started, fed as if it had: freeing its block is a finding.
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

    assert main(["check", "--stack", "async-lookup,shared-loads"]) == 0
    out = capsys.readouterr().out
    assert "stack async-lookup, shared-loads:" in out and "invariants 1-8 and 10-14 hold" in out
    assert f"{DEFAULT_EXAMPLES} examples x up to {DEFAULT_STEPS} steps" in out
    assert main(["check", "--stack", "naive-stores-unsafe"]) == 1
    out = capsys.readouterr().out
    assert "counterexample found" in out and "@reproduce_failure" not in out
    assert "replay: kvlife check --stack naive-stores-unsafe --examples 200 --steps 50" in out
    assert "invariant 5 (stores cover only computed tokens)" in out
    assert main(["check", "--stack", "async-lookup,,shared-loads"]) == 2


def test_builtin_stacks_load_for_the_checker() -> None:
    # Every built-in policy is a stack the checker can build (kvlife check --stack NAME).
    from kvlife.policies.registry import BUILTIN

    for name in BUILTIN:
        assert load_stack([name]).names[0] == name
