"""A sweep end to end: the points not yet in the results file run, their rows are appended as
they finish, and the finished file is put in grid order.

Rows of points already in the file (same key) are kept and not run again. Rows in the file
that the grid does not hold (an earlier, larger grid) are kept after the grid's rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from kvlife.lifecycle.sweeps.executors import Executor
from kvlife.lifecycle.sweeps.points import Point
from kvlife.lifecycle.sweeps.results import ResultsFile

RowHook = Callable[[int, int], None]  # (rows done, rows in the grid)


@attrs.frozen
class SweepReport:
    out: str
    points: int  # points in the grid (distinct inputs)
    resumed: int  # rows already in the file
    ran: tuple[str, ...]  # keys run now, in the order they finished
    other_rows: int  # rows of the file the grid does not hold

    def to_dict(self) -> dict[str, Any]:
        return {"out": self.out, "points": self.points, "resumed": self.resumed, "ran": len(self.ran),
                "ran_keys": list(self.ran), "other_rows": self.other_rows}


def run_sweep(points: Sequence[Point], out: str | Path, executor: Executor,
              on_row: RowHook | None = None) -> SweepReport:
    results = ResultsFile(out)
    done = results.load()
    keys = [p.key() for p in points]
    todo = [(i, p) for i, p in enumerate(points) if keys[i] not in done]
    resumed = len(points) - len(todo)
    finished = resumed
    ran: list[str] = []
    try:
        for i, point in todo:
            executor.submit(i, point)
        if on_row is not None:
            on_row(finished, len(points))
        for _ in todo:
            _, row = executor.wait()
            results.append(row)
            done[row["key"]] = row
            ran.append(row["key"])
            finished += 1
            if on_row is not None:
                on_row(finished, len(points))
    finally:
        executor.close()
    in_grid = set(keys)
    others = [row for key, row in done.items() if key not in in_grid]
    results.rewrite([done[k] for k in keys] + others)
    return SweepReport(str(out), len(points), resumed, tuple(ran), len(others))
