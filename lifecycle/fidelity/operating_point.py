"""The operating-point search: the highest arrival time scale at which a run is still stable.

The time scale multiplies a workload's arrival rate (``--time-scale``). Candidates lie on the
grid ``1.25**k`` (..., 0.64, 0.8, 1, 1.25, 1.5625, ...), so every search lands on one of a few
reproducible values. The search gallops along the grid, then bisects (``find_operating_point``).
It assumes stability is monotone in load (a faster arrival rate never makes a queue shorter);
the points it tried are kept, so a report can show the evidence.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from kvlife.lifecycle.fidelity.stability import Stability

GRID_BASE = 1.25


def grid_scale(step: int) -> float:
    """The time scale of grid step ``step``: ``1.25**step``, rounded to 4 decimals."""
    return round(GRID_BASE**step, 4)


@attrs.frozen
class OperatingPoint:
    time_scale: float
    stability: Stability
    tried: tuple[tuple[float, Stability], ...]  # (time scale, verdict) in the order run
    found: bool  # False: nothing tried was stable, and the lowest scale tried is used
    # True when the next grid point up was tried and not stable: the answer is the highest
    # stable grid point (if stability is monotone), not just a stable one the budget allowed.
    bracketed: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"time_scale": self.time_scale, "found": self.found, "bracketed": self.bracketed,
                "stability": self.stability.to_dict(),
                "tried": [{"time_scale": s, **v.to_dict()} for s, v in self.tried]}


def find_operating_point(check: Callable[[float], Stability], start_step: int = 0,
                         max_runs: int = 10) -> OperatingPoint:
    """The highest stable grid point, from ``1.25**start_step``; ``check(scale)`` runs the
    workload at that time scale and judges it. At most ``max_runs`` calls.

    Gallops first (grid steps +1, +2, +4, ... while stable; -1, -2, -4, ... while not) until
    the verdict changes, then bisects the grid steps between the highest stable and the lowest
    unstable point. When the runs are used up before an unstable point is seen, the highest
    stable point tried is the answer; when no point tried was stable, the lowest tried is
    returned with ``found`` False.
    """
    verdicts: dict[int, Stability] = {}
    tried: list[tuple[float, Stability]] = []

    def stable(step: int) -> bool:
        if step not in verdicts:
            verdicts[step] = check(grid_scale(step))
            tried.append((grid_scale(step), verdicts[step]))
        return verdicts[step].stable

    def budget() -> bool:
        return len(tried) < max_runs

    low: int | None = None  # highest step known stable
    high: int | None = None  # lowest step known not stable
    if stable(start_step):
        low, jump = start_step, 1
        while budget():
            if stable(low + jump):
                low, jump = low + jump, jump * 2
            else:
                high = low + jump
                break
    else:
        high, jump = start_step, 1
        while budget():
            if stable(high - jump):
                low = high - jump
                break
            high, jump = high - jump, jump * 2
    if low is None:
        lowest = min(verdicts)
        return OperatingPoint(grid_scale(lowest), verdicts[lowest], tuple(tried), False)
    while high is not None and high - low > 1 and budget():
        middle = (low + high) // 2
        if stable(middle):
            low = middle
        else:
            high = middle
    return OperatingPoint(grid_scale(low), verdicts[low], tuple(tried), True, high == low + 1)
