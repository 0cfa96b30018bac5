"""Is a run at a stable operating point?

A policy's effect measured on an overloaded run says little: the queue grows without bound,
so TTFT depends on how long the slice is, and a small change in service time moves it by any
amount. A run is called *stable* when

- its TTFT p50 is under ``p50_limit_ms`` (2 s by default: an interactive service), and
- the mean TTFT of its last arrival decile is within ``ratio_limit`` (1.5x) of the first
  decile's, or at most ``slack_ms`` (100 ms) above it: the queue does not grow over the slice.
  (The slack keeps a light load stable: between TTFTs of 20 and 35 ms the ratio is noise.)

Deciles are taken over requests sorted by arrival, ``max(1, n // 10)`` requests each. A request
without a first token (the run was cut, or it failed before one) counts as unbounded: a run
with one in its first or last decile, or without any TTFT at all, is not stable.

``check_stability`` works on plain (arrival ms, TTFT ms or None) pairs so that any search over
load (the fidelity report's operating point, a capacity search) can use it; ``ttft_samples``
takes them from a simulated run.
"""

from __future__ import annotations

import itertools
import math
import operator
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from kvlife.lifecycle.metrics import RequestTotals, percentile

if TYPE_CHECKING:  # (the summary uses the rule: runner imports metrics, which imports this lazily)
    from kvlife.lifecycle.drivers.runner import RunOutcome

P50_LIMIT_MS = 2000.0
RATIO_LIMIT = 1.5
SLACK_MS = 100.0

Sample = tuple[float, float | None]  # (arrival ms, TTFT ms; None: no first token)


@attrs.frozen
class Stability:
    requests: int
    ttft_p50_ms: float | None  # over the requests that got a first token
    first_decile_ms: float  # mean TTFT of the earliest arrivals (inf: one never got a token)
    last_decile_ms: float
    decile_requests: int
    p50_limit_ms: float = P50_LIMIT_MS
    ratio_limit: float = RATIO_LIMIT
    slack_ms: float = SLACK_MS

    @property
    def ratio(self) -> float:
        """Last decile's mean TTFT over the first's (inf when either is unbounded)."""
        if not (math.isfinite(self.first_decile_ms) and math.isfinite(self.last_decile_ms)):
            return math.inf
        if self.first_decile_ms <= 0:
            return 1.0 if self.last_decile_ms <= 0 else math.inf
        return self.last_decile_ms / self.first_decile_ms

    @property
    def p50_ok(self) -> bool:
        return self.ttft_p50_ms is not None and self.ttft_p50_ms < self.p50_limit_ms

    @property
    def growth_ms(self) -> float:
        """Last decile's mean TTFT minus the first's (inf when either is unbounded)."""
        if not (math.isfinite(self.first_decile_ms) and math.isfinite(self.last_decile_ms)):
            return math.inf
        return self.last_decile_ms - self.first_decile_ms

    @property
    def ratio_ok(self) -> bool:
        return self.ratio <= self.ratio_limit or self.growth_ms <= self.slack_ms

    @property
    def stable(self) -> bool:
        return self.p50_ok and self.ratio_ok

    def describe(self) -> str:
        """One line: the two criteria with their numbers, e.g. ``TTFT p50 1,388 ms < 2,000 ms;
        last arrival decile 1.10x the first (+159 ms) within 1.5x or +100 ms: stable``."""
        p50 = "no TTFT" if self.ttft_p50_ms is None else f"TTFT p50 {self.ttft_p50_ms:,.0f} ms"
        growth = f"{self.ratio:.2f}x the first ({self.growth_ms:+,.0f} ms)"
        ratio = "unbounded" if math.isinf(self.ratio) else growth
        limit = f"{self.ratio_limit:g}x or +{self.slack_ms:g} ms"
        return (f"{p50} {'<' if self.p50_ok else '>='} {self.p50_limit_ms:,.0f} ms; "
                f"last arrival decile {ratio} {'within' if self.ratio_ok else 'beyond'} {limit}: "
                f"{'stable' if self.stable else 'not stable'}")

    def to_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "ttft_p50_ms": self.ttft_p50_ms, "first_decile_ms": self.first_decile_ms,
                "last_decile_ms": self.last_decile_ms, "decile_requests": self.decile_requests,
                "ratio": self.ratio, "growth_ms": self.growth_ms, "p50_limit_ms": self.p50_limit_ms,
                "ratio_limit": self.ratio_limit, "slack_ms": self.slack_ms, "stable": self.stable}


def _mean(values: Sequence[float | None]) -> float:
    if any(v is None for v in values):
        return math.inf
    return sum(v for v in values if v is not None) / len(values)


def check_stability(samples: Sequence[Sample], p50_limit_ms: float = P50_LIMIT_MS,
                    ratio_limit: float = RATIO_LIMIT, slack_ms: float = SLACK_MS) -> Stability:
    """The stability verdict of one run from its (arrival ms, TTFT ms or None) per request."""
    # By arrival, ties in sample order (sorted is stable: no (arrival, index) key tuple per
    # sample); samples already in that order (as a run's are) are taken as they come. The
    # columns are read and the order checked in C (the arrivals as 8-byte doubles).
    arrivals = array("d", map(operator.itemgetter(0), samples))
    ttfts = list(map(operator.itemgetter(1), samples))
    if not all(map(operator.le, arrivals, itertools.islice(arrivals, 1, None))):
        ttfts = [ttfts[i] for i in sorted(range(len(arrivals)), key=arrivals.__getitem__)]
    k = max(1, len(ttfts) // 10)
    answered = [t for t in ttfts if t is not None]
    return Stability(
        requests=len(ttfts),
        ttft_p50_ms=percentile(answered, 50),
        first_decile_ms=_mean(ttfts[:k]) if ttfts else math.inf,
        last_decile_ms=_mean(ttfts[-k:]) if ttfts else math.inf,
        decile_requests=k if ttfts else 0,
        p50_limit_ms=p50_limit_ms,
        ratio_limit=ratio_limit,
        slack_ms=slack_ms,
    )


def ttft_samples(outcome: RunOutcome) -> Sequence[Sample]:
    """(arrival ms, TTFT ms or None) of every request of a simulated run, in arrival order:
    from the run's folded totals, so it works whether the requests left the engine or not."""
    return RequestTotals.of(outcome.result).samples()
