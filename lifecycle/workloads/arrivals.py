"""How recorded arrival times are replayed: as recorded, or with tied timestamps spread out.

Mooncake's published traces round their timestamps: the conversation trace has 12,031
requests on 1,180 distinct timestamps, mostly 3 s apart, about 10 requests each. Replayed
as recorded, every such group lands on the scheduler in the same instant, so a single GPU
always sees bursts of ~80k prompt tokens however far the arrival rate is scaled down, and
the first-token latency of a group's last request never drops below the time to prefill
the whole group. ``spread`` undoes the rounding the simplest deterministic way: the ``n``
requests sharing timestamp ``t`` arrive evenly over ``[t, t_next)``, where ``t_next`` is the
next distinct timestamp (for the last group, ``t`` plus the gap before it). Order, prompts
and the mean rate are unchanged; only the within-group spacing is invented.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import attrs

from kvlife.lifecycle.config import ARRIVALS
from kvlife.lifecycle.workloads.mooncake import WorkloadRequest

__all__ = ["ARRIVALS", "apply_arrivals", "spread_ties"]


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


def apply_arrivals(requests: Iterable[WorkloadRequest], arrivals: str) -> Iterable[WorkloadRequest]:
    """The workload as ``sim.arrivals`` replays it: ``requests`` itself when recorded, else a
    stream over it (a list stays a list to the caller that wants one: ``list(...)``)."""
    if arrivals == "recorded":
        return requests
    if arrivals == "spread":
        return spread_ties(requests)
    raise ValueError(f"arrivals: expected one of {', '.join(ARRIVALS)}, got {arrivals!r}")
