"""kvlife check checks the guards a stack runs under (specs/guards.py): hostile policies on
top of the stack, and what the watchdog and the stack must do with each. The real guards
pass; a watchdog or a stack broken the way a mutant breaks them fails the check."""

from __future__ import annotations

import json
import re
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvlife.lifecycle.cli.main import main
from kvlife.policies import stack as stack_module
from kvlife.policies.loading import load_stack
from kvlife.policies.watchdog import _WATCHDOG, SIGNAL, Watch
from kvlife.specs import guards
from kvlife.specs.guards import guard_problems
from kvlife.specs.model_check import check_policy

DOCS = Path(__file__).resolve().parent.parent / "docs"


@pytest.fixture
def short_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hostile hook gives up sooner: for a watchdog that never stops one (each hang ends
    at the bound whatever the machine's load; the real bound is 2 s)."""
    monkeypatch.setattr(guards, "BOUND_S", 0.3)
    monkeypatch.setattr(guards, "SLEEP_S", 0.1)


@pytest.mark.parametrize("stack", [[], ["async-lookup", "shared-loads"], ["prefetch-timeout", "early-prefetch"]])
def test_the_guards_hold_and_leave_the_watchdog_as_found(stack: list[str]) -> None:
    built = load_stack(stack)
    handler = signal.getsignal(SIGNAL)
    assert guard_problems(built) == []
    assert signal.getsignal(SIGNAL) == handler
    assert len(_WATCHDOG.pending) == 0


def test_the_guards_hold_where_the_watchdogs_signal_is_not_its_own() -> None:
    """Another handler of SIGUSR2: the watchdog stops a hook in the main thread with an
    asynchronous exception instead (a blocked hook once its blocking call returns)."""
    built = load_stack([])
    previous = signal.signal(SIGNAL, lambda signum, frame: None)
    try:
        assert guard_problems(built) == []
    finally:
        signal.signal(SIGNAL, previous)


def _fire_patched(monkeypatch: pytest.MonkeyPatch, before: Callable[[Watch, int], None]) -> None:
    fire = Watch._fire

    def patched(self: Watch, seq: int) -> None:
        before(self, seq)
        fire(self, seq)

    monkeypatch.setattr(Watch, "_fire", patched)


@pytest.mark.usefixtures("short_bound")
def test_a_watchdog_that_never_fires_fails_every_hang(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Watch, "_fire", lambda self, seq: None)
    problems = guard_problems(load_stack([]))
    hangs = [p for p in problems if "the watchdog did not stop it within 0.3 s (6 budgets" in p]
    assert len(hangs) == 5, problems
    assert any("sleeps, asked first in a fresh stack in the main thread" in p for p in hangs)
    assert any("spins, asked first in a fresh stack from another thread" in p for p in hangs)


@pytest.mark.usefixtures("short_bound")
def test_a_watchdog_that_times_only_a_stacks_first_call_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """As a stack that stops marking its calls after the first one does (``seq`` left odd)."""
    check = Watch._check

    def first_call_only(self: Watch, now: float) -> None:
        if self.seq <= 1:
            check(self, now)

    monkeypatch.setattr(Watch, "_check", first_call_only)
    problems = guard_problems(load_stack([]))
    assert len(problems) == 1, problems
    assert problems[0].startswith("a hook (admission) that spins, asked after 1 quick answer in a fresh stack in "
                                  "the main thread: the watchdog did not stop it within 0.3 s")


def test_a_watchdog_that_sends_the_uncatchable_error_first_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    def counted_once_already(watch: Watch, seq: int) -> None:
        if watch.fired != seq:
            watch.fired, watch.fires = seq, 1

    _fire_patched(monkeypatch, counted_once_already)
    problems = guard_problems(load_stack([]))
    assert len(problems) == 1 and "catches what it is sent" in problems[0] and "it caught nothing" in problems[0]


def test_a_watchdog_that_only_sends_the_catchable_error_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    def never_counted(watch: Watch, seq: int) -> None:
        watch.fires = 0

    _fire_patched(monkeypatch, never_counted)
    problems = guard_problems(load_stack([]))
    assert len(problems) == 1 and "catches what it is sent" in problems[0], problems
    assert re.search(r"it caught \d+ errors", problems[0])


def test_a_location_other_than_the_innermost_frame_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    import traceback

    def outermost_policy_frame(exc: BaseException) -> str:
        frame = traceback.extract_tb(exc.__traceback__)[1]  # the hook, not the helper that raised
        return f" (at {frame.filename}:{frame.lineno} in {frame.name}; --traceback shows the whole traceback)"

    monkeypatch.setattr(stack_module, "_where", outermost_policy_frame)
    problems = guard_problems(load_stack([]))
    assert len(problems) == 1 and "raises from a helper function" in problems[0]
    assert "in _helper)" in problems[0] and "in hold_at_finish;" in problems[0]


@pytest.mark.parametrize(("limit", "found"), [
    (4095, "a reason of 4,096 characters (the documented limit) was refused"),
    (4097, "a reason of 4,097 characters (the documented limit is 4,096) ended with Answer("),
])
def test_a_reason_limit_other_than_the_documented_one_fails(monkeypatch: pytest.MonkeyPatch, limit: int,
                                                            found: str) -> None:
    monkeypatch.setattr(stack_module, "REASON_MAX", limit)
    problems = guard_problems(load_stack([]))
    assert len(problems) == 1 and found in problems[0], problems


def test_the_guard_takes_its_reason_limit_from_the_docs() -> None:
    # The guard holds the stack to what docs/policies.md promises, not to the stack's own constant.
    documented = re.search(r"a reason longer than ([\d,]+) characters", (DOCS / "policies.md").read_text())
    assert documented is not None and int(documented.group(1).replace(",", "")) == guards.DOCUMENTED_REASON_MAX


def test_kvlife_check_reports_a_failed_guard_and_exits_1(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(stack_module, "REASON_MAX", 4095)
    assert main(["check", "--stack", "async-lookup", "--examples", "1", "--steps", "1"]) == 1
    out = capsys.readouterr().out
    assert "FAILED: policy guard: a reason of 4,096 characters (the documented limit) was refused" in out
    assert "replay: kvlife check --stack async-lookup --examples 1 --steps 1" in out
    assert main(["check", "--examples", "1", "--steps", "1", "--json"]) == 1
    report: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and report["violation"] is None
    assert report["error"].startswith("policy guard: a reason of 4,096 characters")


def test_check_policy_runs_the_guards(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stack_module, "REASON_MAX", 4095)
    with pytest.raises(AssertionError, match="policy guard: a reason of 4,096 characters"):
        check_policy("baseline", examples=1, steps=1)


def test_a_policy_of_the_stack_that_fails_is_left_to_the_model_checker(tmp_path: Path) -> None:
    """The one-request run of the reason check asks the stack's own policies too: one that
    answers nonsense is the model checker's finding (invariant 0, with a counterexample),
    not a guard's."""
    policy = tmp_path / "bad.py"
    policy.write_text("from kvlife import Decision\n\nclass Bad:\n"
                      "    def store_limit(self, req, engine):\n        return Decision('all', 'store it all')\n")
    assert guard_problems(load_stack([f"{policy}:Bad"])) == []
