"""Every bug of the zoo is caught by the model checker within its default budget, and the
finding names the one invariant that bug breaks."""

from __future__ import annotations

import pytest
from bug_zoo import ZOO, LeaksPreemptedScheduler, ZooBug, _with_scheduler

from kvlife.specs.model_check import DEFAULT_EXAMPLES, DEFAULT_STEPS, run_check


@pytest.mark.parametrize("bug", ZOO, ids=[b.name for b in ZOO])
def test_checker_catches(bug: ZooBug) -> None:
    # Deterministic (derandomized) and unshrunk: finding the bug is what is asserted here;
    # shrinking only makes the counterexample shorter.
    result = run_check(bug.stack, engine_factory=bug.engine_factory,
                       examples=DEFAULT_EXAMPLES, steps=DEFAULT_STEPS, shrink=False)
    assert not result.ok, f"{bug.what}: not caught"
    assert result.violation is not None, result.error
    assert result.violation.invariant == bug.invariant, str(result.violation)
    assert result.events, "a counterexample lists its events"


def test_zoo_has_every_bug_of_the_issue() -> None:
    assert len(ZOO) >= 17
    assert len({b.name for b in ZOO}) == len(ZOO)
    sources = {b.source for b in ZOO}
    for issue in ("vllm#57841", "vllm#49829", "vllm#54518", "vllm#56194", "vllm#54193", "vllm#36752",
                  "vllm#28585", "LMCache#4991"):
        assert issue in sources, issue


def test_shrunk_counterexample_is_short_and_reproducible() -> None:
    bug = next(b for b in ZOO if b.name == "abort_frees_loading_blocks")
    result = run_check(bug.stack, engine_factory=bug.engine_factory)
    assert result.violation is not None and result.violation.invariant == 2
    assert len(result.events) <= 8
    assert any("abort" in e for e in result.events)
    assert result.reproduce is not None and "@reproduce_failure" in result.reproduce
    assert "invariant 2" in result.report()


def test_unreleased_preempted_blocks_are_reported_stranded_with_exit_1(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 11's survivor: preemption forgets the blocks without releasing them, the
    device shrinks, and requests wait forever while the run looks idle. `kvlife check`
    (the CLI, on the variant engine) exits 1 and says what is stranded."""
    import kvlife.lifecycle.engine.core as core
    from kvlife.lifecycle.cli.main import main

    monkeypatch.setattr(core, "Engine", _with_scheduler(LeaksPreemptedScheduler))
    assert main(["check"]) == 1
    out = capsys.readouterr().out
    assert "counterexample found" in out
    assert "invariant 7 (every transfer ends; every request finishes (liveness)): stranded" in out
    assert "Traceback" not in out
