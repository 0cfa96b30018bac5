"""Progress bars: tqdm on stderr (rate and ETA), only when stderr is a terminal.

A bar never touches stdout, so ``--json`` output and pipes stay clean, and a run under CI
or with stderr redirected prints nothing extra. The callback a bar hands out is the
drivers' ``Progress`` type: ``(done, total) -> None``.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from kvlife.lifecycle.drivers.simulator import Progress


def enabled() -> bool:
    return sys.stderr.isatty()


@contextlib.contextmanager
def progress_bar(desc: str, unit: str = "req", total: int | None = None, position: int = 0) -> Iterator[Progress]:
    """A bar for one job; the yielded callback takes (done, total) and may change the total.
    Without a terminal the callback does nothing (and tqdm is not even imported)."""
    if not enabled():
        yield _nothing
        return
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, position=position,
               leave=False, dynamic_ncols=True, mininterval=0.2)

    def update(done: int, new_total: int) -> None:
        if bar.total != new_total:
            bar.total = new_total
        if done > bar.n:
            bar.update(done - bar.n)
        else:
            bar.refresh()

    try:
        yield update
    finally:
        bar.close()


def _nothing(done: int, total: int) -> None:
    """The progress callback of a run whose stderr is not a terminal."""
