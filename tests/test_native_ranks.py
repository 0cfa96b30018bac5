"""The native RankAggregator against the reference (``lifecycle/engine/ranks.py``): random
sequences of opens, closes and reports (duplicate, unknown, bad ranks, failures with repeats)
on several world sizes give the same outcomes, the same errors and the same jobs in flight,
with the same ranks missing, after every operation."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvlife.lifecycle.engine.ranks import RankAggregator, ReportOutcome, ReportStatus

core = pytest.importorskip("kvlife.lifecycle.native._core")

INT64 = (-(2**63), 2**63 - 1)
JOBS = [0, 1, 2, -1, *INT64]  # few, so that opens, reports and closes meet
job_ids = st.sampled_from([0, 0, 0, 1, 1, 1, 2, -1, *INT64])  # mostly the small ones
# A rank's failed blocks (unsorted, with repeats; the union over ranks is what must come out).
failed_blocks = st.sampled_from([(), (), (), (3,), (1, 3), (3, 1, 3), (0, 9), (INT64[1], 2, INT64[0])])


# Reports weigh most: jobs get to completion. (in_flight and missing_ranks are also asked of
# every job after every operation.)
KINDS = ["open", "open", "close", *["report"] * 7, "in_flight", "missing_ranks"]


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[int, list[tuple[Any, ...]]]:
    """A world size and operations on it: reports mostly from its ranks, some from just
    outside them (-1, world_size) or far outside."""
    world_size = draw(st.integers(1, 4))
    ranks = st.sampled_from([*range(world_size)] * 4 + [-1, world_size, *INT64])
    ops = draw(st.lists(st.tuples(st.sampled_from(KINDS), job_ids, ranks, failed_blocks), min_size=20, max_size=80))
    return world_size, [(kind, job) if kind != "report" else (kind, job, rank, failed)
                        for kind, job, rank, failed in ops]


def _outcome(value: Any) -> Any:
    """A report's outcome as comparable data (the other methods' results as they are)."""
    if isinstance(value, ReportOutcome | core.ReportOutcome):
        assert type(value.failed) is tuple
        return ("outcome", value.status.name, value.status.value, value.failed)
    return value


def _call(agg: Any, name: str, *args: Any) -> Any:
    try:
        return ("returned", _outcome(getattr(agg, name)(*args)))
    except Exception as exc:  # the reference's own error: the native one must be the same
        return ("raised", type(exc), exc.args, str(exc))


def _observe(agg: Any) -> Any:
    """Everything a caller can see: the world size, and each job's being in flight and the
    ranks it still waits for (KeyError where it is not in flight)."""
    return (agg.world_size, [(job, agg.in_flight(job), _call(agg, "missing_ranks", job)) for job in JOBS])


@settings(max_examples=300, deadline=None)
@given(scenarios())
# A rank just past the last; a closed job's failures must not reach the next job (in C++ the
# next job may reuse the closed one's slot).
@example((2, [("open", 0), ("report", 0, 2, (1,)), ("report", 0, 1, (2,)), ("report", 0, 0, ())]))
@example((2, [("open", 0), ("report", 0, 0, (5,)), ("close", 0), ("open", 1), ("report", 1, 0, ()),
              ("report", 1, 1, (3,))]))
def test_random_reports_fold_the_same_natively(scenario: tuple[int, list[tuple[Any, ...]]]) -> None:
    world_size, ops = scenario
    ref, native = RankAggregator(world_size), core.RankAggregator(world_size)
    for name, *args in ops:
        want = _call(ref, name, *args)
        assert _call(native, name, *args) == want, (name, args)
        assert _observe(native) == _observe(ref), (name, args)


@given(st.integers(-3, 4) | st.sampled_from(INT64[:1]))
def test_a_bad_world_size_raises_the_same_error(world_size: int) -> None:
    def build(cls: Any) -> Any:
        try:
            return ("built", cls(world_size).world_size)
        except ValueError as exc:
            return ("raised", str(exc))

    assert build(core.RankAggregator) == build(RankAggregator)


def test_the_statuses_are_the_references() -> None:
    assert [(name, s.value) for name, s in core.ReportStatus.__members__.items()] == [
        (s.name, s.value) for s in ReportStatus]


def test_an_outcome_compares_and_shows_its_status_and_failures() -> None:
    agg = core.RankAggregator(1)
    agg.open(5)
    done = agg.report(5, 0, (3, 1, 3))
    assert (done.status, done.failed) == (core.ReportStatus.DONE, (1, 3))
    assert done != agg.report(5, 0, ())  # now UNKNOWN_JOB
    assert repr(done) == "ReportOutcome(status=DONE, failed=(1, 3))"
