"""The model checker itself: an engine without the engine bugs it found passes at the CLI's
default budget, the real engine does not yet (a strict xfail naming them), the one-liner
API checks what it is given, and the observers flag what they promise and nothing a legal
run does."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from kvlife.lifecycle.config import EngineConfig, TierConfig
from kvlife.lifecycle.engine.core import Engine
from kvlife.lifecycle.engine.events import Arrival, Scheduled, StepOutput, StepPlan, SubmitLookup, Tick
from kvlife.policies.base import Decision
from kvlife.policies.stack import PolicyStack
from kvlife.specs.invariants import INVARIANTS, InvariantObserver, Settings
from kvlife.specs.model_check import (
    DEFAULT_EXAMPLES,
    DEFAULT_STEPS,
    check_policy,
    make_test_case,
    run_check,
)

sys.path.insert(0, str(Path(__file__).parent))


# A store limit the engine cannot take (it clamps a number to the confirmed tokens, so no
# policy can make it store a placeholder; a limit that is no number is refused).
BROKEN_POLICY = (
    "from kvlife.policies.base import Decision\n"
    "class StoreEverything:\n"
    "    def store_limit(self, req, engine):\n"
    "        return Decision('everything', 'store ahead')\n"
)


def test_real_engine_passes_default_stack() -> None:
    result = run_check((), examples=DEFAULT_EXAMPLES, steps=DEFAULT_STEPS)
    assert result.ok, result.report()


class FinishBeforeStores:
    """Documented legal: a finished request does not wait in sending for its stores (their
    blocks are held all the same)."""

    name = "finish-before-stores"

    def hold_at_finish(self, req: Any, stores_in_flight: int, engine: Any) -> Decision[bool]:
        return Decision(False, "finish now; the blocks stay held until the stores are reported")


def test_hold_at_finish_false_stack_passes() -> None:
    result = run_check(lambda: PolicyStack([FinishBeforeStores()]), examples=DEFAULT_EXAMPLES, steps=DEFAULT_STEPS)
    assert result.ok, result.report()


CONFIG = EngineConfig(block_tokens=4, device_blocks=8, max_batched_tokens=16, ranks=2,
                      tiers=(TierConfig("host", capacity_blocks=8),))


class Run:
    """An engine and the observer beside it; each handling's commands are fed after it (as
    a driver without a command hook feeds them)."""

    def __init__(self, stack: PolicyStack) -> None:
        self.observer = InvariantObserver(Settings.of(CONFIG))
        self.engine = Engine(CONFIG, stack, recorder=self.observer.feed_record)

    def feed(self, event: Any) -> list[Any]:
        commands = self.engine.handle(event)
        self.observer.feed_commands(commands)
        self.observer.end_input()
        return commands

    def record(self, record: dict[str, Any]) -> None:
        self.observer.feed_record(record)


def _finish_with_store(stack: PolicyStack) -> tuple[Run, int]:
    """One request whose step output stores its first block and finishes it; then the tick
    that hands the store to the workers (with the hold). Returns the store's job id."""
    run = Run(stack)
    run.feed(Arrival(0.0, "r0", 5, (1,)))
    plan = next(c for c in run.feed(Tick(1.0)) if isinstance(c, StepPlan))
    run.feed(StepOutput(2.0, plan.step_id, (("r0", "stopped"),)))
    store = next(j for j in run.engine.jobs.values() if j.kind == "store")
    return run, store.job_id


def test_store_issued_with_the_finish_is_checked_against_its_issue_time() -> None:
    run, _ = _finish_with_store(PolicyStack([FinishBeforeStores()]))
    assert run.engine.requests["r0"].state == "finished"
    assert run.observer.violations == []


def test_completed_with_a_store_in_flight_only_when_hold_at_finish_said_not_to_hold() -> None:
    run, job = _finish_with_store(PolicyStack([]))
    assert run.engine.requests["r0"].state == "sending" and run.observer.violations == []
    # An engine that completed it from sending at a report, not a step output: 11.
    run.record({"kind": "input", "type": "transfer_report", "t": 3.0, "job_id": job, "rank": 0, "failed": []})
    run.record({"kind": "transition", "t": 3.0, "req": "r0", "from": "sending", "to": "finished",
                "trigger": "completed", "reason": "too early"})
    assert [v.invariant for v in run.observer.violations] == [11]
    assert "released only with a step output" in run.observer.violations[0].message


@pytest.mark.parametrize(("reported", "expected"), [((0,), "store job"), ((0, 1), None)])
def test_sending_ends_at_a_step_output_after_the_hold_once_every_rank_reported(
        reported: tuple[int, ...], expected: str | None) -> None:
    run, job = _finish_with_store(PolicyStack([]))
    plan = next(c for c in run.feed(Tick(3.0)) if isinstance(c, StepPlan))  # the hold goes with this step
    output = {"kind": "input", "type": "step_output", "t": 4.0, "step_id": plan.step_id, "finished": [],
              "reports": [[job, rank, []] for rank in reported]}
    run.record(output)
    if len(reported) == 2:
        run.record({"kind": "job_done", "t": 4.0, "job": job, "op": "store", "failed": 0, "late": False})
    run.record({"kind": "transition", "t": 4.0, "req": "r0", "from": "sending", "to": "finished",
                "trigger": "completed", "reason": "finished_sending"})
    run.observer.end_input()
    messages = [v.message for v in run.observer.violations]
    if expected is None:
        assert messages == []
    else:
        assert len(messages) == 1 and expected in messages[0] and "still in flight on ranks [1]" in messages[0]


def test_a_request_left_in_sending_after_it_may_be_released_is_invariant_11() -> None:
    run, job = _finish_with_store(PolicyStack([]))
    plan = next(c for c in run.feed(Tick(3.0)) if isinstance(c, StepPlan))
    # Every rank reported and the output of the step that carried the hold came, yet the
    # engine (here: nothing) kept it in sending.
    run.record({"kind": "input", "type": "step_output", "t": 4.0, "step_id": plan.step_id, "finished": [],
                "reports": [[job, 0, []], [job, 1, []]]})
    run.record({"kind": "job_done", "t": 4.0, "job": job, "op": "store", "failed": 0, "late": False})
    run.observer.end_input()
    assert [v.invariant for v in run.observer.violations] == [11]
    assert "stays in sending" in run.observer.violations[0].message


def test_budget_and_max_running_are_invariant_11() -> None:
    observer = InvariantObserver(Settings(1, 4, max_batched_tokens=16, max_running=1))
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


def test_a_step_past_the_tokens_a_request_has_is_invariant_11() -> None:
    # A preempted request that kept its output placeholders (issue 26): its step computes
    # one token past its prompt though no token was sampled for it.
    observer = InvariantObserver(Settings(1, 4))
    observer.feed_record({"kind": "input", "type": "arrival", "t": 0.0, "request_id": "a", "prompt_tokens": 8,
                          "block_hashes": [1, 2], "resumable": False})
    observer.feed_record({"kind": "transition", "t": 0.0, "req": "a", "from": "waiting", "to": "running",
                          "trigger": "admitted", "reason": "r"})
    observer.feed_commands([StepPlan(0, (Scheduled("a", 9, 0, True, (0, 1, 2), (1, 2)),), 0)])
    observer.end_input()
    assert [v.invariant for v in observer.violations] == [11]
    assert "past the 8 tokens it has" in observer.violations[0].message


def test_a_second_lookup_while_one_is_unanswered_is_invariant_12() -> None:
    observer = InvariantObserver(Settings(1, 4))
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
    observer = InvariantObserver(Settings(2, 4, live=False))
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


class _Probe:
    """What the observers read of a live engine (``EngineProbe``), as a test sets it."""

    def __init__(self, hits: dict[str, int]) -> None:
        self.hits = hits

    def recorded_hit(self, rid: str) -> int | None:
        return self.hits.get(rid)

    def published(self, block_hash: int) -> bool:
        return True

    def cached_blocks(self, block_hash: int) -> tuple[int, ...]:
        return ()

    def lookup(self, rid: str) -> tuple[tuple[str, ...], int]:
        return (), 0  # no lookup answer: no tier hit to take

    def next_wakeup(self) -> float | None:
        return None


def test_hit_recorded_differently_from_the_first_admission_is_invariant_13() -> None:
    observer = InvariantObserver(Settings(1, 4), probe=_Probe({"a": 2}))
    observer.feed_record({"kind": "input", "type": "arrival", "t": 0.0, "request_id": "a", "prompt_tokens": 13,
                          "block_hashes": [1, 2, 3], "resumable": False})
    observer.feed_record({"kind": "transition", "t": 0.0, "req": "a", "from": "waiting", "to": "running",
                          "trigger": "admitted", "reason": "r"})
    # Its first chunk starts at token 12: the admission skipped 3 blocks, not 2.
    observer.feed_commands([StepPlan(0, (Scheduled("a", 1, 12, True, (0, 1, 2, 3), (1, 2, 3)),), 0)])
    observer.end_input()
    hits = [v.message for v in observer.violations if v.invariant == 13]
    assert hits == ["a: the engine records a prefix hit of 2 blocks, its first admission skipped 3 (tokens 0..12 were "
                    "not computed)"]


def test_invariant_names_cover_the_documented_numbers() -> None:
    design = (Path(__file__).parent.parent / "docs" / "design.md").read_text()
    for number in range(1, 14):
        assert number in INVARIANTS
        assert f"\n{number}. " in design, f"invariant {number} is not in docs/design.md's list"


def test_check_policy_one_liner_checks_the_stack_it_is_given(tmp_path: Path) -> None:
    policy = tmp_path / "bad_policy.py"
    policy.write_text(BROKEN_POLICY)
    with pytest.raises(AssertionError, match="invariant 0") as info:
        check_policy(f"{policy}:StoreEverything")
    assert "counterexample" in str(info.value) and "StoreEverything" in str(info.value)
    # The same call on a correct stack returns quietly: it is the stack that decides.
    assert check_policy("baseline") is None


def test_make_test_case_gives_a_unittest_class_that_checks(tmp_path: Path) -> None:
    policy = tmp_path / "bad_policy.py"
    policy.write_text(BROKEN_POLICY)
    broken = make_test_case(f"{policy}:StoreEverything")
    with pytest.raises(AssertionError, match="StoreEverything"):
        broken("runTest").runTest()
    make_test_case("baseline")("runTest").runTest()


def test_observer_flags_a_free_under_an_inflight_load() -> None:
    observer = InvariantObserver(Settings(2, 4))
    records: list[dict[str, Any]] = [
        {"kind": "input", "type": "arrival", "t": 0.0, "request_id": "a", "prompt_tokens": 9,
         "block_hashes": [1, 2], "resumable": False},
        {"kind": "input", "type": "tick", "t": 1.0},
        {"kind": "job", "t": 1.0, "job": 0, "op": "load", "req": "a", "blocks": 1, "tiers": {"host": 1},
         "moves": [[1, 3, "host"]]},
        {"kind": "free", "t": 1.0, "blocks": [3]},
    ]
    for record in records:
        observer.feed_record(record)
    assert [v.invariant for v in observer.violations] == [2]
    assert "freed while load job 0 still moves it (ranks [0, 1] have not reported)" in observer.violations[0].message
    # Once both ranks reported, the block is no longer under a transfer; but a job every
    # rank reported that the engine never completed is 3.
    observer.feed_record({"kind": "input", "type": "transfer_report", "t": 2.0, "job_id": 0, "rank": 0,
                          "failed": []})
    observer.feed_record({"kind": "input", "type": "transfer_report", "t": 3.0, "job_id": 0, "rank": 1,
                          "failed": []})
    observer.feed_record({"kind": "free", "t": 3.0, "blocks": [3]})
    observer.end_input()
    assert [v.invariant for v in observer.violations] == [2, 3]
    assert "every rank reported, yet it was not completed" in observer.violations[1].message


def test_cli_check_takes_a_comma_stack_and_reports_counterexamples(capsys: pytest.CaptureFixture[str]) -> None:
    from kvlife.lifecycle.cli.main import main

    assert main(["check", "--stack", "defer-while-loading,keep-lookup-answers"]) == 0
    out = capsys.readouterr().out
    assert "stack defer-while-loading, keep-lookup-answers:" in out and "invariants 1-8 and 10-13 hold" in out
    assert f"{DEFAULT_EXAMPLES} examples x up to {DEFAULT_STEPS} steps" in out
    # naive-stores-unsafe stores tokens a step is still computing (vLLM #27644): caught.
    assert main(["check", "--stack", "naive-stores-unsafe"]) == 1
    out = capsys.readouterr().out
    assert "counterexample found" in out and "@reproduce_failure" not in out
    assert "replay: kvlife check --stack naive-stores-unsafe --examples 200 --steps 50" in out
    assert "invariant 5 (stores cover only computed tokens)" in out
    assert main(["check", "--stack", "async-lookup,,shared-loads"]) == 2


def test_builtin_stacks_load_for_the_checker() -> None:
    # Every built-in policy is a stack the checker can build (kvlife check --stack NAME).
    from kvlife.policies.loading import load_stack
    from kvlife.policies.registry import BUILTIN

    for name in BUILTIN:
        assert load_stack([name]).names[0] == name
