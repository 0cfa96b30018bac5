"""The vLLM peer suite's comparison (scripts/vllm_peer/suite.py), and its exclusion list kept
honest against the sets it explains. No vLLM needed: the outcomes here are written by hand."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from vllm_peer import suite  # noqa: E402

CORE = suite.SETS["core"]
T = "tests/v1/core/test_scheduler.py::"


def run(outcomes: dict[str, str], connectors: tuple[str, ...] = ()) -> dict[str, dict[str, Any]]:
    return {test_id: {"outcome": outcome, "connectors": list(connectors)} for test_id, outcome in outcomes.items()}


EXCLUSIONS = {
    "environmental": {T + "test_needs_a_model[*": "the model's config is not available offline",
                      "tests/v1/kv_connector/unit/test_other.py": "another set's entry"},
    "core": {T + "test_scripted_hit": "asserts MockKVConnector's scripted hit", T + "test_never_run": "unused"},
}


def test_differences_are_explained_by_the_list_or_fail_the_suite() -> None:
    baseline = run({T + "test_agnostic": "passed", T + "test_scripted_hit": "passed",
                    T + "test_needs_a_model[a]": "failed", T + "test_broken": "passed"}, ("MockKVConnector",))
    peer = run({T + "test_agnostic": "passed", T + "test_scripted_hit": "failed",
                T + "test_needs_a_model[a]": "error", T + "test_broken": "failed"}, ("KVLifeConnector",))
    comparison = suite.compare(CORE, baseline, peer, EXCLUSIONS)
    assert set(comparison.excluded) == {T + "test_scripted_hit", T + "test_needs_a_model[a]"}
    assert comparison.excluded[T + "test_scripted_hit"][2] == "asserts MockKVConnector's scripted hit"
    assert comparison.unexpected == {T + "test_broken": ("passed", "failed")}
    assert not comparison.unlisted_failures
    assert comparison.unused == [T + "test_never_run"]  # the other set's environmental entry is not this set's
    assert comparison.kvlife_tests == 4
    assert not comparison.ok
    del peer[T + "test_broken"], baseline[T + "test_broken"]
    assert suite.compare(CORE, baseline, peer, EXCLUSIONS).ok


def test_a_baseline_failure_must_be_listed_as_environmental() -> None:
    outcomes = {T + "test_scripted_hit": "failed"}  # listed for (a), but only as a legitimate difference
    comparison = suite.compare(CORE, run(outcomes), run(outcomes, ("KVLifeConnector",)), EXCLUSIONS)
    assert comparison.unlisted_failures == {T + "test_scripted_hit": "failed"}
    assert not comparison.ok


def test_a_peer_run_that_built_no_kvlife_connector_fails() -> None:
    outcomes = {T + "test_agnostic": "passed"}
    comparison = suite.compare(CORE, run(outcomes), run(outcomes, ("MockKVConnector",)), EXCLUSIONS)
    assert not comparison.unexpected and comparison.kvlife_tests == 0
    assert not comparison.ok


def test_a_prefix_entry_covers_parameters_and_an_exact_one_only_itself() -> None:
    entries = {T + "test_a[*": "a", T + "test_b": "b"}
    assert suite.matching(T + "test_a[x-1]", entries) == T + "test_a[*"
    assert suite.matching(T + "test_b", entries) == T + "test_b"
    assert suite.matching(T + "test_b[x]", entries) is None
    assert suite.matching(T + "test_ab", entries) is None


def test_every_exclusion_explains_a_test_of_the_sets() -> None:
    selected = {name: suite.read_selection(peer_set) for name, peer_set in suite.SETS.items()}
    for name, peer_set in suite.SETS.items():
        assert selected[name] and all(t.startswith(peer_set.folder + "/") for t in selected[name]), name
    exclusions = suite.read_exclusions()
    assert set(exclusions) <= {"environmental", *suite.SETS}
    for section, entries in exclusions.items():
        ids = [t for tests in selected.values() for t in tests] if section == "environmental" else selected[section]
        for key, reason in entries.items():
            assert reason.strip(), f"[{section}] {key}: no reason"
            assert any(suite.matching(t, {key: reason}) for t in ids), f"[{section}] {key} names no test of the set"
