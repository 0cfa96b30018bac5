"""One simulated run end to end: workload + config + policy stack → trace + summary.

Ctrl-C and SIGTERM are held while a run records (``interrupts.held``): the driver stops
between two engine calls, writes the ``interrupted`` record, the trace is closed here and
the interrupt goes on up (the command line exits 130 or 143).

Memory stays flat however long the workload: it may be a stream (``mooncake.iter_mooncake``),
read as the run goes, and finished requests leave the engine once folded into the summary's
totals (``Simulator(keep_requests=False)``). ``keep_requests=True`` keeps every request in
``outcome.result.engine.requests`` for callers that inspect them.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from kvlife.lifecycle.breakdown import PhaseClock, RequestRow, in_arrival_order
from kvlife.lifecycle.config import RunConfig
from kvlife.lifecycle.drivers import interrupts
from kvlife.lifecycle.drivers.physics import resolve
from kvlife.lifecycle.drivers.simulator import Progress, SimResult, Simulator
from kvlife.lifecycle.engine.core import Engine, Recorder
from kvlife.lifecycle.metrics import RequestTotals, summarize
from kvlife.lifecycle.traces.trace import TraceWriter
from kvlife.lifecycle.workloads.mooncake import WorkloadError, WorkloadRequest
from kvlife.policies.loading import load_stack
from kvlife.policies.stack import PolicyStack


@attrs.define
class RunOutcome:
    result: SimResult
    summary: dict[str, Any]
    trace_lines: int
    # One row per request in arrival order (``run_workload(breakdown=True)``), else None.
    rows: list[RequestRow] | None = None
    # The policies' own names, top of the stack first, the baseline left out.
    policies: tuple[str, ...] = ()

    def problems(self) -> list[str]:
        """What makes the run a failure (exit code 1), one line each (as ``LiveOutcome``)."""
        problems = []
        stranded = self.summary["stranded"]
        if stranded:
            problems.append(f"{stranded} request(s) never finished (stranded); see the summary and the trace")
        check = self.summary.get("check")
        if check is not None and check["violations"]:
            from kvlife.lifecycle.drivers.online_check import describe as describe_check

            problems.append(f"invariant check: {describe_check(check)}")
            problems += [f"  {line}" for line in check["first"]]
            if check["violations"] > len(check["first"]):
                problems.append(f"  ... and {check['violations'] - len(check['first'])} more")
        return problems

    @property
    def exit_code(self) -> int:
        return 1 if self.problems() else 0


@contextlib.contextmanager
def recording(
    trace_path: str | Path | None, config: RunConfig, stack: PolicyStack,
    inputs: Iterable[str | Path | None] = (), **header: Any
) -> Iterator[TraceWriter | None]:
    """A trace writer with its header written (None without a path), closed on the way
    out whatever happens (an error, Ctrl-C, SIGTERM), so what was recorded stays valid.

    The trace becomes ``trace_path`` when the run completes or is interrupted cleanly
    (``TraceWriter``). A run refused part-way (a bad workload line, a policy error, a hook
    past its time budget) ends its trace with an ``interrupted`` record that names the
    error instead of a signal (``error_record``), so the trace so far validates; it is
    kept only where no file was: an existing trace is never replaced by a refused run.
    ``inputs``: the run's input files (a workload, a config), which the trace may not be."""
    if trace_path is None:
        yield None
        return
    with TraceWriter(trace_path, inputs) as writer:
        writer.write_header(config.to_dict(), list(stack.names), config.sim.seed, **header)
        try:
            yield writer
        except Exception as exc:
            writer.record(error_record(writer.last_t(), exc))
            raise


def error_record(t: float, exc: BaseException) -> dict[str, Any]:
    """The last record of a trace whose run an error ended part-way: an ``interrupted``
    record with ``error`` (the one-line message) where a signal's name would be; its
    handling may have been cut inside an engine call (``clean`` false)."""
    message = " ".join(str(exc).split()) or type(exc).__name__
    return {"kind": "interrupted", "t": t, "signal": None, "error": message[:2000], "clean": False}


def require_requests(workload: Iterable[WorkloadRequest], name: str) -> Iterable[WorkloadRequest]:
    """An empty workload (an empty file, a filter that kept nothing) is bad input: a
    WorkloadError naming it (``FILE: no requests``), not an empty run. Returns the
    workload (a stream with its first request taken and put back)."""
    if isinstance(workload, Sequence):
        if not workload:
            raise WorkloadError(name, None, None, "no requests")
        return workload
    stream = iter(workload)
    first = next(stream, None)
    if first is None:
        raise WorkloadError(name, None, None, "no requests")
    return itertools.chain((first,), stream)


def run_workload(
    config: RunConfig,
    workload: Iterable[WorkloadRequest],
    stack: PolicyStack | None = None,
    trace_path: str | Path | None = None,
    progress: Progress | None = None,
    workload_name: str = "synthetic",
    device_blocks_origin: str | None = None,
    *,
    size: int | None = None,
    keep_requests: bool = False,
    engine_factory: Callable[..., Engine] | None = None,
    breakdown: bool = False,
    goodput: Mapping[str, float] | None = None,
    inputs: Iterable[str | Path | None] = (),
    engine: str = "python",
) -> RunOutcome:
    """Simulate ``workload`` (a list, or a stream in arrival order whose length ``size`` is
    given when known: the trace header and progress report it). The trace header holds the
    config with its derived values filled in (device blocks, ranks) and a ``setup`` object
    saying what was derived and how; so does the summary. ``device_blocks_origin`` names
    where a set device size came from (``"--device-blocks"``), for those two descriptions.
    Finished requests leave the engine as the run goes unless ``keep_requests``.
    ``sim.chaos`` and ``sim.check`` (``drivers.chaos``, ``drivers.online_check``) add
    ``chaos`` (perturbation counts) and ``check`` (violations per invariant) to the summary;
    ``engine_factory`` (tests: a broken engine of ``tests/bug_zoo.py``) keeps requests.
    ``breakdown``: keep a row per request (``outcome.rows``,
    ``kvlife.lifecycle.breakdown``; its phases come from the records, so the engine records
    even without a trace: about 10 % more time) and add ``latency_breakdown_ms`` to the
    summary; ``goodput``: the per-request SLO of the summary's ``goodput`` field;
    ``inputs``: the files the run reads (the workload, the config), which ``trace_path``
    may not be. ``engine``: ``"python"`` (the reference) or ``"native"``
    (``kvlife.lifecycle.native.run``: the same summary but ``wall_s``, rows and trace bytes);
    native where ``native.choice.uncovered`` names a reason, or with ``keep_requests`` or
    ``engine_factory`` (callers that read the Python engine's objects): ValueError."""
    if engine not in ("python", "native"):
        raise ValueError(f"engine must be python or native, got {engine!r}")
    if engine == "native":
        from kvlife.lifecycle.native.choice import uncovered

        why = "keep_requests and engine_factory read the python engine's objects" \
            if keep_requests or engine_factory is not None else uncovered(config)
        if why is not None:
            raise ValueError(f"the native engine cannot run this: {why}")
    if size is None and isinstance(workload, Sequence):
        size = len(workload)
    workload = require_requests(workload, workload_name)
    stack = stack if stack is not None else load_stack(config.policies, config.hook_budget_s)
    config, physics = resolve(config)
    setup = physics.summary(device_blocks_origin)
    setup["completions"] = config.sim.completions
    setup["lookup_workers"] = config.sim.lookup_workers
    started = time.perf_counter()  # wall time of the run, reported, never fed to the core
    meta = {"name": workload_name, "requests": size}
    clock = PhaseClock() if breakdown and engine == "python" else None
    with interrupts.held(), recording(trace_path, config, stack, inputs, workload=meta, setup=setup) as writer:
        if engine == "native":
            from kvlife.lifecycle.native import run as native_run

            result, phases = native_run.simulate(config, workload, stack, writer, progress, size, breakdown)
        else:
            recorder = both(writer.record if writer else None, clock.record if clock else None)
            sim = Simulator(config, workload, stack, recorder, progress, size=size,
                            keep_requests=keep_requests or engine_factory is not None, engine_factory=engine_factory)
            if clock is not None and sim.retired is not None:
                sim.retired.collect(clock)
            result = sim.run()
            phases = clock
    wall = time.perf_counter() - started
    totals = RequestTotals.of(result, phases)
    summary = summarize(result, wall, physics.block_bytes, totals=totals, goodput=goodput)
    summary["setup"] = setup
    if result.chaos is not None:
        summary["chaos"] = result.chaos
    if result.check is not None:
        summary["check"] = result.check
    rows = in_arrival_order(totals.rows) if totals.rows is not None else None
    return RunOutcome(result, summary, writer.lines if writer else 0, rows, stack.names[:-1])


def both(first: Recorder | None, second: Recorder | None) -> Recorder | None:
    """A recorder that hands each record to ``first`` then ``second`` (either may be None)."""
    if first is None or second is None:
        return first or second

    def record(rec: dict[str, Any]) -> None:
        first(rec)
        second(rec)

    return record
