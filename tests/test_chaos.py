"""The adversarial driver (``kvlife run --chaos``) and the online invariant check (``--check``).

A chaos run perturbs what reaches the engine within the protocol's rules; the observers of
``specs/invariants.py`` run beside it. These tests show that the perturbations happen, that
they are reproducible, that a correct engine and the safe stacks come out clean, and that
broken engines of ``tests/bug_zoo.py`` a plain run lets through are caught.
"""

from __future__ import annotations

import json
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import attrs
import pytest

from kvlife.lifecycle.config import EngineConfig, RunConfig, TierConfig
from kvlife.lifecycle.drivers.chaos import PERTURBATIONS
from kvlife.lifecycle.drivers.runner import RunOutcome, run_workload
from kvlife.lifecycle.engine.core import Engine
from kvlife.lifecycle.traces.trace import read_trace
from kvlife.lifecycle.workloads.mooncake import WorkloadRequest
from kvlife.lifecycle.workloads.synthetic import synthetic_burst_workload, synthetic_workload
from kvlife.policies.loading import load_stack
from kvlife.policies.stack import PolicyStack

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bug_zoo import ZOO  # noqa: E402

# Two ranks, two failing tiers, a transfer deadline a dropped report overruns.
CONFIG = RunConfig(
    engine=EngineConfig(device_blocks=300, ranks=2, transfer_deadline_ms=30.0,
                        tiers=(TierConfig("host", 600, failure_rate=0.02),
                               TierConfig("disk", 4000, failure_rate=0.02))),
)
ASYNC = attrs.evolve(CONFIG, engine=attrs.evolve(CONFIG.engine, async_scheduling=True))


def chaos(config: RunConfig, seed: int | None, check: bool = True) -> RunConfig:
    return attrs.evolve(config, sim=attrs.evolve(config.sim, chaos=seed, check=check))


def burst(n: int = 200) -> list[WorkloadRequest]:
    return synthetic_burst_workload(seed=0, num_requests=n)


def run(config: RunConfig, workload: list[WorkloadRequest], stack: str | PolicyStack = "",
        trace: Path | None = None, engine_factory: Callable[..., Engine] = Engine) -> RunOutcome:
    if isinstance(stack, str):  # named in the config too, so the trace header replays
        config = attrs.evolve(config, policies=tuple(s for s in stack.split(",") if s))
    policies = stack if isinstance(stack, PolicyStack) else load_stack(config.policies)
    return run_workload(config, workload, stack=policies, trace_path=trace, engine_factory=engine_factory)


def kvlife(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvlife.lifecycle.cli.main", *args], capture_output=True,
                          text=True, timeout=600)


# ---- the perturbations ---------------------------------------------------------------------------
def test_every_perturbation_happens_and_the_engine_comes_out_clean() -> None:
    """Sync scheduling (step outputs may be delayed), async lookups (answers to perturb), a
    burst workload whose requests fail loads and so look up again (old-epoch answers)."""
    outcome = run(chaos(CONFIG, 1), burst(), "async-lookup,shared-loads")
    counts = outcome.summary["chaos"]
    assert counts["seed"] == 1
    assert all(counts[p] > 0 for p in PERTURBATIONS), counts
    # Dropped reports were recovered through the deadline, their late reports released the blocks.
    assert outcome.summary["warnings"]["rank_timeout"] > 0
    assert outcome.summary["quarantined_jobs"] == 0
    # Duplicates reached the engine and were ignored as such.
    assert outcome.summary["warnings"]["unknown_step"] > 0
    assert outcome.summary["stale_lookup_answers"] >= counts["answers_old_epoch"]
    assert outcome.summary["check"] == {"violations": 0, "by_invariant": {}, "first": [], "unchecked": []}
    assert outcome.summary["stranded"] == 0 and outcome.exit_code == 0


def test_same_chaos_seed_same_trace_byte_for_byte(tmp_path: Path) -> None:
    paths = [tmp_path / f"{name}.jsonl" for name in ("a", "b", "c")]
    workload = burst(120)
    run(chaos(CONFIG, 7), workload, "async-lookup", paths[0])
    run(chaos(CONFIG, 7), workload, "async-lookup", paths[1])
    run(chaos(CONFIG, 8), workload, "async-lookup", paths[2])
    assert paths[0].read_bytes() == paths[1].read_bytes()
    assert paths[0].read_bytes() != paths[2].read_bytes()
    # What the engine did under chaos is a valid trace, and replays exactly.
    from kvlife.lifecycle.traces.replay import replay
    from kvlife.lifecycle.traces.validate import validate

    report = validate(paths[0])
    assert report.ok and report.findings == ()
    assert replay(paths[0]).identical


def test_the_check_alone_changes_nothing_the_engine_does(tmp_path: Path) -> None:
    plain, checked = tmp_path / "plain.jsonl", tmp_path / "checked.jsonl"
    workload = synthetic_workload(seed=3, num_requests=80)
    first = run(CONFIG, workload, "async-lookup", plain)
    second = run(chaos(CONFIG, None, check=True), workload, "async-lookup", checked)
    assert "check" not in first.summary and "chaos" not in first.summary
    assert second.summary["check"]["violations"] == 0
    assert plain.read_bytes().splitlines()[1:] == checked.read_bytes().splitlines()[1:]


def test_step_outputs_are_delayed_only_when_they_cannot_overtake_each_other() -> None:
    outcome = run(chaos(ASYNC, 2), burst(80))
    assert outcome.summary["chaos"]["step_outputs_delayed"] == 0
    assert outcome.summary["chaos"]["step_outputs_duplicated"] > 0
    assert outcome.summary["check"]["violations"] == 0


def test_shared_loads_burst_joins_loads_that_time_out(tmp_path: Path) -> None:
    """The burst workload's shared prefixes sit in a tier, not on the device, when a burst
    comes: its requests join the first one's load. Under chaos some of those joined loads are
    given up at the deadline (a dropped report) and their late reports still come."""
    path = tmp_path / "burst.jsonl"
    outcome = run(chaos(CONFIG, 3), burst(), "shared-loads", path)
    records = [r for _, r in read_trace(path)]
    joined_jobs = {r["after"] for r in records if r["kind"] == "job" and r.get("after") is not None}
    timed_out = {r["job"] for r in records if r["kind"] == "warning" and r.get("what") == "rank_timeout"}
    assert len(joined_jobs) >= 5
    assert joined_jobs & timed_out, "no joined load was given up at its deadline"
    late = {r["job"] for r in records if r["kind"] == "job_done" and r["late"]}
    assert joined_jobs & timed_out <= late
    assert outcome.exit_code == 0 and outcome.summary["check"]["violations"] == 0


# ---- the online check -------------------------------------------------------------------------------
@pytest.mark.parametrize("stack", ["baseline", "async-lookup,shared-loads", "early-prefetch,prefetch-timeout",
                                   "keep-lookup-answers,async-lookup", "defer-while-loading"])
def test_safe_stacks_are_clean_under_chaos(stack: str) -> None:
    outcome = run(chaos(ASYNC, 5), burst(100), stack)
    assert outcome.summary["check"]["violations"] == 0, outcome.summary["check"]["first"]
    assert outcome.exit_code == 0


def test_unsafe_stores_are_flagged_by_the_simulated_run_check() -> None:
    # The engine clamps naive-stores-unsafe's limit to the confirmed tokens; an engine that
    # does not (the zoo's) stores placeholders, which the check flags.
    bug = ZOO_BY_NAME["store_covers_placeholders"]
    small = attrs.evolve(ASYNC, engine=attrs.evolve(ASYNC.engine, block_tokens=16))  # blocks fill often
    outcome = run(chaos(small, None, check=True), synthetic_workload(seed=1, num_requests=40, block_tokens=16),
                  "naive-stores-unsafe", engine_factory=bug.engine_factory)
    check = outcome.summary["check"]
    assert set(check["by_invariant"]) <= {"5", "10"} and check["by_invariant"].get("5", 0) > 0, check
    assert outcome.exit_code == 1
    assert any(p.startswith("invariant check: ") for p in outcome.problems())


ZOO_BY_NAME = {bug.name: bug for bug in ZOO}


CHAOS_SEEDS = (1, 2, 3)


def _tracebacks(tb: TracebackType | None) -> Iterator[TracebackType]:
    while tb is not None:
        yield tb
        tb = tb.tb_next


@pytest.mark.parametrize("name", ["duplicate_report_counted_twice", "stale_lookup_applied"])
def test_a_chaos_run_catches_a_broken_engine_a_plain_run_does_not(name: str) -> None:
    """The same config, workload and checks: the plain run sees nothing wrong; a chaos run
    (duplicate rank reports, old-epoch answers) makes the bug show as a violation of the
    variant's own invariant, with the run's exit code 1. The correct engine is clean under
    the seed that caught it."""
    bug = ZOO_BY_NAME[name]
    workload = burst()
    plain = run(chaos(ASYNC, None, check=True), workload, bug.stack(), engine_factory=bug.engine_factory)
    assert plain.summary["check"]["violations"] == 0 and plain.exit_code == 0
    for seed in CHAOS_SEEDS:
        outcome = run(chaos(ASYNC, seed), workload, bug.stack(), engine_factory=bug.engine_factory)
        if outcome.summary["check"]["violations"]:
            break
    else:
        pytest.fail(f"{name}: no chaos seed of {CHAOS_SEEDS} made the bug show")
    check = outcome.summary["check"]
    assert check["by_invariant"].get(str(bug.invariant), 0) > 0, (bug.invariant, check)
    assert check["first"][0].split(" ", 1)[1].startswith(f"invariant {bug.invariant} "), check["first"]
    assert outcome.exit_code == 1
    correct = run(chaos(ASYNC, seed), workload, bug.stack())
    assert correct.summary["check"]["violations"] == 0 and correct.exit_code == 0, correct.summary["check"]


def test_a_completion_reported_twice_is_refused_where_the_store_completes() -> None:
    """``completion_per_rank_handle`` (vllm#54518) can only crash under chaos: a duplicated
    rank report completes a finished store job a second time, and the tier refuses to
    complete a store that is no longer in flight (``TierIndex.complete_store``) in the same
    call, before any checker sees a record. The crash is asserted where it happens and for
    that job: the one completed again is a job that had already finished. A plain run and
    the correct engine under the same chaos seed run clean."""
    bug = ZOO_BY_NAME["completion_per_rank_handle"]
    workload = burst()
    plain = run(chaos(ASYNC, None, check=True), workload, bug.stack(), engine_factory=bug.engine_factory)
    assert plain.summary["check"]["violations"] == 0 and plain.exit_code == 0
    engines: list[Engine] = []

    def keep(*args: Any, **kwargs: Any) -> Engine:
        engines.append(bug.engine_factory(*args, **kwargs))
        return engines[-1]

    with pytest.raises(KeyError, match=r"tier '\w+': block \d+ has no store in flight") as raised:
        run(chaos(ASYNC, 1), workload, bug.stack(), engine_factory=keep)
    frames = [(Path(f.filename).name, f.name) for f in traceback.extract_tb(raised.tb)]
    assert frames[-1] == ("index.py", "complete_store"), frames
    # The report being handled (the engine's own handler's frame) is for a job that had
    # already completed: the variant keeps completed jobs in ``finished``.
    handling = [tb.tb_frame.f_locals["event"] for tb in _tracebacks(raised.tb)
                if tb.tb_frame.f_code.co_name == "on_transfer_report"
                and Path(tb.tb_frame.f_code.co_filename).name == "jobs.py"]
    assert len(handling) == 1, frames
    assert handling[0].job_id in engines[-1].core.transfers.finished  # type: ignore[attr-defined]
    correct = run(chaos(ASYNC, 1), workload, bug.stack())
    assert correct.summary["check"]["violations"] == 0 and correct.exit_code == 0, correct.summary["check"]


def test_the_correct_engine_is_clean_where_the_zoo_is_caught() -> None:
    outcome = run(chaos(ASYNC, 1), burst(), ZOO_BY_NAME["stale_lookup_applied"].stack())
    assert outcome.summary["check"]["violations"] == 0
    assert outcome.summary["chaos"]["answers_old_epoch"] > 0


# ---- the command line ---------------------------------------------------------------------------
def test_cli_chaos_needs_a_transfer_deadline(tmp_path: Path) -> None:
    outcome = kvlife("run", "--limit", "3", "--chaos", "1")
    assert outcome.returncode == 2
    assert outcome.stderr.strip() == (
        "kvlife run: error: argument --chaos: a chaos run drops rank reports, which only a transfer deadline "
        "recovers: set engine.transfer_deadline_ms (--transfer-deadline MS)")
    config = tmp_path / "chaos.toml"
    config.write_text("[sim]\nseed = 1\nchaos = 4\n")
    outcome = kvlife("run", "--limit", "3", "--config", str(config))
    assert outcome.returncode == 2
    assert outcome.stderr.strip().startswith(f"kvlife: error: {config}:3: field 'sim.chaos': a chaos run drops")
    outcome = kvlife("run", "--live", "--chaos", "1")
    assert outcome.returncode == 2 and "--chaos applies to simulated runs" in outcome.stderr
    assert "Traceback" not in outcome.stderr


def test_cli_chaos_json_and_text() -> None:
    outcome = kvlife("run", "--limit", "30", "--stack", "async-lookup", "--chaos", "3", "--transfer-deadline", "20",
                     "--json")
    assert outcome.returncode == 0, outcome.stderr
    data = json.loads(outcome.stdout)
    assert data["kind"] == "run" and data["summary"]["chaos"]["seed"] == 3
    assert set(PERTURBATIONS) <= set(data["summary"]["chaos"])
    assert data["summary"]["check"]["violations"] == 0
    assert data["summary"]["setup"] is not None
    text = kvlife("run", "--limit", "30", "--chaos", "3", "--transfer-deadline", "20")
    assert text.returncode == 0
    assert "chaos (seed 3)" in text.stdout and "invariant check              clean" in text.stdout


def test_cli_check_exits_1_on_a_violation(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvlife.lifecycle.cli.main import main

    config = tmp_path / "small.toml"
    config.write_text("[engine]\nblock_tokens = 16\nasync_scheduling = true\n")
    argv = ["run", "--limit", "20", "--check", "--config", str(config), "--stack"]
    assert main([*argv, "baseline"]) == 0
    capsys.readouterr()
    # naive-stores-unsafe stores tokens a step is still computing (vLLM #27644).
    assert main([*argv, "naive-stores-unsafe"]) == 1
    err = capsys.readouterr().err
    assert "kvlife run: invariant check: " in err and "invariant 5" in err and "Traceback" not in err


# ---- provenance in simulated runs -----------------------------------------------------------------
@pytest.mark.parametrize(("name", "stack", "workload"), [
    ("failed_load_published", "", lambda: burst(300)),
    ("failed_store_visible", "", lambda: synthetic_workload(seed=1, num_requests=300)),
    ("failed_prefetch_landed", "early-prefetch", lambda: burst(300)),
])
def test_provenance_bugs_are_caught_in_a_checked_simulated_run(
        name: str, stack: str, workload: Callable[[], list[WorkloadRequest]]) -> None:
    """Issue 11, item 3: a failed load's blocks published, a failed store left visible and
    a failed prefetch marked landed are invariant 10 findings of an ordinary simulated run
    with ``--check`` (tiers that fail now and then), not only of live byte checks; the
    correct engine is clean on the same run."""
    bug = ZOO_BY_NAME[name]
    assert bug.invariant == 10
    broken = run(chaos(CONFIG, None, check=True), workload(), stack, engine_factory=bug.engine_factory)
    assert broken.summary["check"]["by_invariant"].get("10", 0) > 0 and broken.exit_code == 1, broken.summary["check"]
    correct = run(chaos(CONFIG, None, check=True), workload(), stack)
    assert correct.summary["check"]["violations"] == 0 and correct.exit_code == 0
