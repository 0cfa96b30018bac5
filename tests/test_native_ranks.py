"""The native RankAggregator against the reference (``lifecycle/engine/ranks.py``): random
sequences of opens, closes and reports (duplicate, unknown, bad ranks, failures with repeats)
on several world sizes give the same outcomes, the same errors and the same jobs in flight,
with the same ranks missing, after every operation."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlife.lifecycle.engine.ranks import RankAggregator, ReportOutcome, ReportStatus

core = pytest.importorskip("kvlife.lifecycle.native._core")

INT64 = (-(2**63), 2**63 - 1)
JOBS = [0, 1, 2, 3, -1, *INT64]  # few, so that opens, reports and closes meet
job_ids = st.sampled_from(JOBS)
ranks = st.integers(-2, 5) | st.sampled_from(INT64)  # 0..world_size-1 and around it
failed_blocks = st.lists(st.integers(0, 9) | st.sampled_from(INT64), max_size=4).map(tuple)

operations = st.lists(
    st.one_of(
        st.tuples(st.just("open"), job_ids),
        st.tuples(st.just("close"), job_ids),
        # Reports weigh three times as much: jobs get to completion.
        *[st.tuples(st.just("report"), job_ids, ranks, failed_blocks)] * 3,
        st.tuples(st.just("in_flight"), job_ids),
        st.tuples(st.just("missing_ranks"), job_ids),
    ),
    max_size=60,
)


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
@given(world_size=st.integers(1, 4), ops=operations)
def test_random_reports_fold_the_same_natively(world_size: int, ops: list[tuple[Any, ...]]) -> None:
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
