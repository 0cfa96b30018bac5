"""How arrival times are made: as recorded, with tied timestamps spread out, or drawn.

Mooncake's published traces round their timestamps: the conversation trace has 12,031
requests on 1,180 distinct timestamps, mostly 3 s apart, about 10 requests each. Replayed
as recorded, every such group lands on the scheduler in the same instant, so a single GPU
always sees bursts of ~80k prompt tokens however far the arrival rate is scaled down, and
the first-token latency of a group's last request never drops below the time to prefill
the whole group. ``spread`` undoes the rounding the simplest deterministic way: the ``n``
requests sharing timestamp ``t`` arrive evenly over ``[t, t_next)``, where ``t_next`` is the
next distinct timestamp (for the last group, ``t`` plus the gap before it). Order, prompts
and the mean rate are unchanged; only the within-group spacing is invented.

``poisson`` and ``gamma`` keep the requests and their order but draw the gaps between
arrivals (a renewal process, as ``vllm bench serve --request-rate R --burstiness B`` does):
independent gamma-distributed gaps with mean ``1 / rate`` and coefficient of variation
``cv`` (shape ``1 / cv^2``; vLLM's burstiness is that shape), exponential when ``cv`` is 1
(Poisson arrivals). ``cv`` above 1 is burstier than Poisson, below 1 more regular. The draws
come from their own ``random.Random`` seeded by the run's seed, so the same seed gives the
same arrivals, and the first request arrives at its recorded time.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator

import attrs

from kvlife.lifecycle.config import ARRIVALS
from kvlife.lifecycle.workloads.mooncake import WorkloadRequest

__all__ = ["ARRIVALS", "DRAWN", "apply_arrivals", "mean_rate", "renewal", "spread_ties"]

DRAWN = ("poisson", "gamma")  # arrivals whose gaps are drawn at a rate


def spread_ties(requests: Iterable[WorkloadRequest]) -> Iterator[WorkloadRequest]:
    """Yield ``requests`` (in non-decreasing arrival order) with each group of equal
    arrival times spread evenly up to the next distinct arrival time. Streams: holds one
    group at a time."""
    group: list[WorkloadRequest] = []
    last_gap = 0.0
    for request in requests:
        if group and request.arrival_ms != group[0].arrival_ms:
            last_gap = request.arrival_ms - group[0].arrival_ms
            yield from _spread(group, last_gap)
            group = []
        group.append(request)
    if group:
        yield from _spread(group, last_gap)


def _spread(group: list[WorkloadRequest], gap: float) -> Iterator[WorkloadRequest]:
    if len(group) == 1 or gap <= 0:
        yield from group
        return
    start, step = group[0].arrival_ms, gap / len(group)
    for index, request in enumerate(group):
        yield attrs.evolve(request, arrival_ms=start + index * step) if index else request


def renewal(requests: Iterable[WorkloadRequest], rate_per_s: float, cv: float = 1.0,
            seed: int = 0) -> Iterator[WorkloadRequest]:
    """``requests`` in their order, the first at its recorded time, each next one a gap
    later drawn from a gamma distribution of mean ``1000 / rate_per_s`` ms and coefficient
    of variation ``cv`` (exponential when ``cv`` is 1). Streams."""
    if not rate_per_s > 0 or not cv > 0:
        raise ValueError(f"arrivals: the rate ({rate_per_s!r}/s) and the CV ({cv!r}) must be positive")
    rng = random.Random(f"kvlife arrivals {seed}")
    mean_ms = 1000.0 / rate_per_s
    shape = 1.0 / (cv * cv)
    t: float | None = None
    for request in requests:
        if t is None:
            t = request.arrival_ms
        else:
            t += rng.expovariate(1.0 / mean_ms) if cv == 1.0 else rng.gammavariate(shape, mean_ms / shape)
        yield attrs.evolve(request, arrival_ms=t)


def mean_rate(requests: Iterable[WorkloadRequest]) -> float | None:
    """The mean arrival rate of ``requests`` (requests/s over the span from the first arrival
    to the last); None for fewer than two requests or all at one time."""
    count = 0
    first = last = 0.0
    for request in requests:
        if count == 0:
            first = request.arrival_ms
        last = request.arrival_ms
        count += 1
    if count < 2 or last <= first:
        return None
    return (count - 1) / ((last - first) / 1000.0)


def apply_arrivals(requests: Iterable[WorkloadRequest], arrivals: str, *, rate_per_s: float | None = None,
                   cv: float | None = None, seed: int = 0) -> Iterable[WorkloadRequest]:
    """The workload as ``sim.arrivals`` replays it: ``requests`` itself when recorded, else a
    stream over it (a list stays a list to the caller that wants one: ``list(...)``).
    ``poisson`` and ``gamma`` need the rate (``renewal``); ``cv`` is gamma's (default 1)."""
    if arrivals == "recorded":
        return requests
    if arrivals == "spread":
        return spread_ties(requests)
    if arrivals in DRAWN:
        if rate_per_s is None:
            raise ValueError(f"arrivals: {arrivals} arrivals need a rate")
        return renewal(requests, rate_per_s, (cv or 1.0) if arrivals == "gamma" else 1.0, seed)
    raise ValueError(f"arrivals: expected one of {', '.join(ARRIVALS)}, got {arrivals!r}")
