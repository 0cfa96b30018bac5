"""One simulated run end to end: workload + config + policy stack → trace + summary."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import attrs

from lifecycle.config import RunConfig
from lifecycle.metrics import summarize
from lifecycle.simulator import Progress, SimResult, Simulator
from lifecycle.trace import TraceWriter
from lifecycle.workload import WorkloadRequest
from policies.base import PolicyStack, load_stack


@attrs.define
class RunOutcome:
    result: SimResult
    summary: dict[str, Any]
    trace_lines: int


def run_workload(
    config: RunConfig,
    workload: list[WorkloadRequest],
    stack: PolicyStack | None = None,
    trace_path: str | Path | None = None,
    progress: Progress | None = None,
    workload_name: str = "synthetic",
) -> RunOutcome:
    stack = stack if stack is not None else load_stack(config.policies)
    started = time.perf_counter()  # wall time of the run, reported, never fed to the core
    writer = TraceWriter(trace_path) if trace_path is not None else None
    try:
        if writer is not None:
            writer.write_header(
                config.to_dict(), list(stack.names), config.sim.seed,
                workload={"name": workload_name, "requests": len(workload)},
            )
        sim = Simulator(config, workload, stack, writer.record if writer else None, progress)
        result = sim.run()
    finally:
        if writer is not None:
            writer.close()
    wall = time.perf_counter() - started
    summary = summarize(result, wall, config.sim.block_bytes)
    return RunOutcome(result, summary, writer.lines if writer else 0)
