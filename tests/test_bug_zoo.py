"""Every bug of the zoo is caught by the model checker within its default budget, and the
finding names the one invariant that bug breaks."""

from __future__ import annotations

import pytest
from bug_zoo import ZOO, LeaksPreemptedScheduler, ZooBug, _with_scheduler

CHECK_IN_A_FRESH_PROCESS = """
import json, sys
sys.path.insert(0, sys.argv[1])
from bug_zoo import ZOO
from kvlife.specs.model_check import DEFAULT_EXAMPLES, DEFAULT_STEPS, run_check
bug = next(b for b in ZOO if b.name == sys.argv[2])
result = run_check(bug.stack, engine_factory=bug.engine_factory, examples=DEFAULT_EXAMPLES, steps=DEFAULT_STEPS,
                   shrink=False)
print(json.dumps({"ok": result.ok, "error": result.error, "events": len(result.events),
                  "invariant": result.violation.invariant if result.violation else None,
                  "violation": str(result.violation) if result.violation else None}))
"""


@pytest.mark.parametrize("bug", ZOO, ids=[b.name for b in ZOO])
def test_checker_catches(bug: ZooBug) -> None:
    # Deterministic (derandomized) and unshrunk: finding the bug is what is asserted here;
    # shrinking only makes the counterexample shorter. In a process of its own, as `kvlife
    # check` runs: in a process that has already run other checks, Hypothesis may reach
    # another first failure (of another invariant the bug also breaks).
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = subprocess.run([sys.executable, "-c", CHECK_IN_A_FRESH_PROCESS, str(Path(__file__).parent), bug.name],
                         capture_output=True, text=True, check=True, timeout=600).stdout
    result = json.loads(out.splitlines()[-1])
    assert not result["ok"], f"{bug.what}: not caught"
    assert result["violation"] is not None, result["error"]
    assert result["invariant"] == bug.invariant, result["violation"]
    assert result["events"], "a counterexample lists its events"


def test_zoo_has_every_bug_of_the_issue() -> None:
    assert len(ZOO) >= 17
    assert len({b.name for b in ZOO}) == len(ZOO)
    sources = {b.source for b in ZOO}
    for issue in ("vllm#49674", "vllm#57841", "vllm#49829", "vllm#54518", "vllm#56194", "vllm#54193", "vllm#36752",
                  "vllm#28585", "LMCache#4991"):
        assert issue in sources, issue


SHRINK_IN_A_FRESH_PROCESS = """
import json, sys
sys.path.insert(0, sys.argv[1])
from bug_zoo import ZOO
from kvlife.specs.model_check import run_check
bug = next(b for b in ZOO if b.name == "abort_frees_loading_blocks")
result = run_check(bug.stack, engine_factory=bug.engine_factory)
print(json.dumps({"invariant": result.violation.invariant if result.violation else None,
                  "events": list(result.events), "reproduce": result.reproduce, "report": result.report()}))
"""


def test_shrunk_counterexample_is_short_and_reproducible() -> None:
    # In a process of its own, as `kvlife check` runs: after most of the suite has run in
    # this process, Hypothesis starts from another first failure (a 27-event counterexample,
    # cause not found; see the issue 11 note), so the shrink is measured from a fresh start.
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = subprocess.run([sys.executable, "-c", SHRINK_IN_A_FRESH_PROCESS, str(Path(__file__).parent)],
                         capture_output=True, text=True, check=True, timeout=300).stdout
    result = json.loads(out.splitlines()[-1])
    assert result["invariant"] == 2
    # The world line and the inputs. How short Hypothesis gets it depends on where its search
    # first fails (any change to the actions or the world's draws moves that): from 3 inputs
    # to 16 (arrivals it could not delete one at a time, as each changes which request an
    # abort picks) in the rounds so far. A counterexample past 20 lines is no longer read.
    assert len(result["events"]) <= 20
    assert any("abort" in e for e in result["events"])
    assert result["reproduce"] is not None and "@reproduce_failure" in result["reproduce"]
    assert "invariant 2" in result["report"]


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
    assert ("invariant 7 (every transfer ends; every request finishes (liveness); a preemption makes room "
            "(progress)): stranded") in out
    assert "Traceback" not in out
