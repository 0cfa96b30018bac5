"""Where the runs of a sweep or a capacity search execute: here, in local processes, on Ray.

All three take a point with a tag (``submit``) and hand back (tag, row) pairs as runs finish
(``wait``), in whatever order they finish; callers put rows in order by tag or key. A run is
``points.execute``: the row does not depend on where it ran.

- ``Serial``: in this process, one at a time (``--jobs 1``).
- ``Processes``: a pool of ``--jobs N`` worker processes (``multiprocessing``, spawned: a
  worker starts clean, whatever this process holds). Closing it on an interrupt terminates
  the workers; a run they had not finished is simply not in the results.
- ``RayCluster``: one Ray task per run (``--ray``: ``auto``, an address, or a local Ray started
  here). kvlife must be importable on the cluster's workers (the same version).
"""

from __future__ import annotations

import collections
import multiprocessing
import queue
from collections.abc import Sequence
from typing import Any, Protocol

from kvlife.lifecycle.sweeps.points import Percentile, Point, execute

Row = dict[str, Any]


def _run(tag: int, point: Point, extra: Sequence[Percentile]) -> tuple[int, Row]:
    """A worker's task (module level, so processes and Ray can import it)."""
    return tag, execute(point, extra)


class Executor(Protocol):
    def submit(self, tag: int, point: Point, extra: Sequence[Percentile] = ()) -> None: ...

    def wait(self) -> tuple[int, Row]:
        """The next run to finish (blocks); an exception a run raised is raised here."""
        ...

    def pending(self) -> int: ...

    def close(self) -> None:
        """Stop: runs not finished are dropped (workers terminated)."""
        ...

    def describe(self) -> str: ...


class Serial:
    def __init__(self) -> None:
        self._queue: collections.deque[tuple[int, Point, Sequence[Percentile]]] = collections.deque()

    def submit(self, tag: int, point: Point, extra: Sequence[Percentile] = ()) -> None:
        self._queue.append((tag, point, extra))

    def wait(self) -> tuple[int, Row]:
        tag, point, extra = self._queue.popleft()
        return _run(tag, point, extra)

    def pending(self) -> int:
        return len(self._queue)

    def close(self) -> None:
        self._queue.clear()

    def describe(self) -> str:
        return "this process"


class Processes:
    def __init__(self, jobs: int) -> None:
        self.jobs = jobs
        self._pool = multiprocessing.get_context("spawn").Pool(jobs)
        self._done: queue.Queue[tuple[int, Row] | BaseException] = queue.Queue()
        self._pending = 0

    def submit(self, tag: int, point: Point, extra: Sequence[Percentile] = ()) -> None:
        self._pending += 1
        self._pool.apply_async(_run, (tag, point, tuple(extra)), callback=self._done.put,
                               error_callback=self._done.put)

    def wait(self) -> tuple[int, Row]:
        got = self._done.get()
        self._pending -= 1
        if isinstance(got, BaseException):
            raise got
        return got

    def pending(self) -> int:
        return self._pending

    def close(self) -> None:
        self._pool.terminate()
        self._pool.join()

    def describe(self) -> str:
        return f"{self.jobs} local processes"


class ExecutorUnavailable(RuntimeError):
    """The executor could not start (Ray): one line, exit code 1, nothing run."""


class RayCluster:
    """Runs on Ray. ``address``: ``"auto"`` (a running cluster), ``"ray://..."`` or
    ``"HOST:PORT"``, or None: a Ray already initialized in this process, else a local one
    started here with ``num_cpus`` CPUs (None: all) and shut down on ``close``."""

    def __init__(self, address: str | None, num_cpus: int | None = None) -> None:
        import ray

        self._ray = ray
        self._started = False
        if not ray.is_initialized():
            options: dict[str, Any] = {"address": address, "include_dashboard": False, "log_to_driver": False,
                                       "configure_logging": False}
            if address is None and num_cpus is not None:
                options["num_cpus"] = num_cpus
            try:
                ray.init(**options)
            except Exception as exc:  # a node that timed out starting, a cluster not there
                raise ExecutorUnavailable(f"Ray did not start ({address or 'a local Ray'}): "
                                          f"{type(exc).__name__}: {exc}") from exc
            self._started = True
        self.address = address
        self._task = ray.remote(num_cpus=1)(_run)
        self._refs: list[Any] = []

    def submit(self, tag: int, point: Point, extra: Sequence[Percentile] = ()) -> None:
        self._refs.append(self._task.remote(tag, point, tuple(extra)))

    def wait(self) -> tuple[int, Row]:
        done, self._refs = self._ray.wait(self._refs, num_returns=1)
        result: tuple[int, Row] = self._ray.get(done[0])
        return result

    def pending(self) -> int:
        return len(self._refs)

    def close(self) -> None:
        for ref in self._refs:
            self._ray.cancel(ref, force=True)
        self._refs = []
        if self._started:
            self._ray.shutdown()

    def describe(self) -> str:
        resources = self._ray.cluster_resources()
        where = self.address or "a local Ray"
        return f"Ray ({where}, {resources.get('CPU', 0):g} CPUs)"


# ``--ray`` without an address: a local Ray (or the one already running in this process).
LOCAL_RAY = "local"


def make_executor(jobs: int, ray: str | None) -> Executor:
    """``--jobs N`` and ``--ray [ADDRESS]`` (None: not given; ``LOCAL_RAY``: given bare)."""
    if ray is not None:
        return RayCluster(None if ray == LOCAL_RAY else ray, num_cpus=jobs if ray == LOCAL_RAY and jobs > 1 else None)
    return Serial() if jobs <= 1 else Processes(jobs)
