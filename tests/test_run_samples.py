"""The (arrival, TTFT) samples a summary's stability verdict reads: ``RequestTotals.samples``
(two arrays, in arrival order whatever order the requests were folded in) and
``check_stability`` (samples taken as they come when in arrival order, sorted otherwise)."""

from __future__ import annotations

import math
from array import array

from hypothesis import given
from hypothesis import strategies as st

from kvlife.lifecycle.fidelity.stability import check_stability
from kvlife.lifecycle.metrics import RequestTotals

TIMES = st.floats(0, 1e9, allow_nan=False)


@given(st.data())
def test_samples_are_in_arrival_order_whatever_the_fold_order(data: st.DataObject) -> None:
    n = data.draw(st.integers(0, 40))
    seqs = data.draw(st.lists(st.integers(0, 10_000), min_size=n, max_size=n, unique=True))
    arrivals = data.draw(st.lists(TIMES, min_size=n, max_size=n))
    ttfts = data.draw(st.lists(st.one_of(st.just(math.nan), TIMES), min_size=n, max_size=n))
    totals = RequestTotals()
    totals.seq, totals.arrival_ms, totals.ttft_ms = array("q", seqs), array("d", arrivals), array("d", ttfts)
    expected = [(arrivals[i], None if math.isnan(ttfts[i]) else ttfts[i])
                for i in sorted(range(n), key=seqs.__getitem__)]
    samples = totals.samples()
    assert len(samples) == n
    assert list(samples) == expected
    assert samples == expected and samples != expected + [(0.0, None)]
    assert samples[1:-1] == expected[1:-1]


@given(st.lists(st.tuples(st.floats(0, 1e4, allow_nan=False), st.one_of(st.none(), TIMES)), max_size=60))
def test_stability_reads_samples_in_arrival_order_whether_or_not_they_come_so(
        samples: list[tuple[float, float | None]]) -> None:
    """Samples out of order are sorted by arrival, ties kept in the order given: the verdict
    is that of the same samples handed over in that order (taken as they come)."""
    ordered = [samples[i] for i in sorted(range(len(samples)), key=lambda i: (samples[i][0], i))]
    assert check_stability(samples) == check_stability(ordered)
    assert check_stability(ordered).requests == len(samples)
