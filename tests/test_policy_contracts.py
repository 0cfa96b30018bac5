"""kvlife check first holds every built-in policy of the stack to its documented
properties (specs/policy_contracts.py): a built-in that stops doing what its name says
is a finding even though the engine's invariants still hold."""

from __future__ import annotations

from typing import Any

import pytest

from kvlife.policies.base import Decision
from kvlife.policies.loading import load_stack
from kvlife.policies.prefetch_patience import PrefetchTimeout
from kvlife.policies.registry import BUILTIN
from kvlife.specs.model_check import run_check
from kvlife.specs.policy_contracts import contract_problems


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_every_builtin_keeps_its_contract(name: str) -> None:
    assert contract_problems(load_stack([name])) == []


def test_a_baseline_that_stops_holding_is_a_finding(monkeypatch: pytest.MonkeyPatch) -> None:
    baseline = BUILTIN["baseline"]
    monkeypatch.setattr(baseline, "hold_at_finish", lambda self, req, n, engine: Decision(False, "finish now"))
    problems = contract_problems(load_stack([]))
    assert problems and "hold_at_finish does not hold" in problems[0]
    result = run_check((), examples=5, steps=5)
    assert not result.ok and result.error is not None and result.error.startswith("policy contract: policy baseline")


def test_a_timeout_that_does_not_grow_with_the_pull_is_a_finding(monkeypatch: pytest.MonkeyPatch) -> None:
    def floored(self: PrefetchTimeout, req: Any, prefetch: Any, engine: Any) -> Decision[float]:
        return Decision(min(self.base_ms + self.per_1k_tokens_ms * prefetch.tokens // 1000.0, self.cap_ms), "t")

    monkeypatch.setattr(PrefetchTimeout, "prefetch_patience", floored)
    problems = contract_problems(load_stack(["prefetch-timeout"]))
    assert problems and "prefetch_patience answered" in problems[0]


def test_a_timeout_off_its_documented_defaults_is_a_finding(monkeypatch: pytest.MonkeyPatch) -> None:
    # The formula still holds for its own parameters; the numbers `kvlife policies` gives do not.
    monkeypatch.setattr(PrefetchTimeout.__init__, "__defaults__", (1000.0, 250.0, 2000.0))
    problems = contract_problems(load_stack(["prefetch-timeout"]))
    assert problems and "capped at 2000 ms; it documents 1 s + 0.25 s per 1k tokens, capped at 3 s" in problems[0]


def test_a_user_policy_is_held_only_to_the_hooks_arguments() -> None:
    class Mine:
        name = "baseline"  # a built-in's name does not give it the built-in's contract

        def hold_at_finish(self, req: Any, stores: int, engine: Any) -> Decision[bool]:
            return Decision(False, "never hold")

    from kvlife.policies.stack import PolicyStack

    assert contract_problems(PolicyStack([Mine()])) == []

    class TooFew:
        name = "too-few"

        def admission(self, req: Any) -> Decision[str]:
            return Decision("go", "go")

    problems = contract_problems(PolicyStack([TooFew()]))
    assert problems and "cannot take the 3 arguments" in problems[0]


def test_a_stack_that_lets_a_nan_patience_through_is_a_finding(monkeypatch: pytest.MonkeyPatch) -> None:
    # The stack's own guard is checked too: a policy's malformed answer never reaches the engine.
    import kvlife.policies.stack as stack_module

    real = stack_module._check_decision

    def lenient(policy: str, hook: str, decision: object, *rest: Any) -> None:
        if hook == "prefetch_patience" and isinstance(decision, Decision) and decision.value != decision.value:
            return  # NaN let through
        real(policy, hook, decision, *rest)

    monkeypatch.setattr(stack_module, "_check_decision", lenient)
    problems = contract_problems(load_stack([]))
    assert problems and "accepted the malformed prefetch_patience answer Decision(value=nan" in problems[0]


def test_the_real_stack_refuses_every_malformed_answer() -> None:
    from kvlife.specs.policy_contracts import stack_guard_problems

    assert stack_guard_problems() == []
