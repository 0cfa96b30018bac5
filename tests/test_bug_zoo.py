"""Every bug of the zoo is caught by the model checker within its default budget."""

from __future__ import annotations

import pytest
from bug_zoo import ZOO, ZooBug

from kvlife.specs.model_check import DEFAULT_EXAMPLES, DEFAULT_STEPS, run_check


@pytest.mark.parametrize("bug", ZOO, ids=[b.name for b in ZOO])
def test_checker_catches(bug: ZooBug) -> None:
    # Deterministic (derandomized) and unshrunk: finding the bug is what is asserted here;
    # shrinking only makes the counterexample shorter.
    result = run_check(bug.stack, engine_factory=bug.engine_factory,
                       examples=DEFAULT_EXAMPLES, steps=DEFAULT_STEPS, shrink=False)
    assert not result.ok, f"{bug.what}: not caught"
    assert result.violation is not None, result.error
    assert result.violation.invariant in bug.invariants, str(result.violation)
    assert result.events, "a counterexample lists its events"


def test_zoo_has_every_bug_of_the_issue() -> None:
    assert len(ZOO) >= 8
    assert len({b.name for b in ZOO}) == len(ZOO)


def test_shrunk_counterexample_is_short_and_reproducible() -> None:
    bug = next(b for b in ZOO if b.name == "abort_frees_loading_blocks")
    result = run_check(bug.stack, engine_factory=bug.engine_factory)
    assert result.violation is not None and result.violation.invariant == 2
    assert len(result.events) <= 8
    assert any("abort" in e for e in result.events)
    assert result.reproduce is not None and "@reproduce_failure" in result.reproduce
    assert "invariant 2" in result.report()
