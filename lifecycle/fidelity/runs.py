"""How the report runs the simulator: workloads and tier sizes as the command line means them.

Every run goes through the stable entry points (``run_workload``, ``RunConfig``, the summary of
``kvlife.lifecycle.metrics``), and workloads and tier sizes go through the very functions that
``kvlife run --workload NAME --limit N --time-scale X --tier host=N`` uses, so a row of the
report is what a user gets from the same flags. ``RunFigures`` keeps what the tables need of
a run (its summary, its stability verdict, a few counters) and lets the engine go.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs

from kvlife.lifecycle.config import RunConfig
from kvlife.lifecycle.drivers.runner import RunOutcome, run_workload
from kvlife.lifecycle.fidelity.stability import Stability, check_stability, ttft_samples
from kvlife.lifecycle.workloads.mooncake import WorkloadRequest


def load(workload: str, limit: int | None, time_scale: float, config: RunConfig) -> list[WorkloadRequest]:
    """``--workload workload --limit limit --time-scale time_scale``: a bundled trace, a file or a
    named synthetic workload (``synthetic``, ``synthetic:burst``)."""
    from kvlife.lifecycle.cli.run_options import load_workload

    args = argparse.Namespace(workload=workload, limit=limit)
    requests, _ = load_workload(args, config, time_scale)
    return requests


def with_tiers(config: RunConfig, tiers: Mapping[str, int]) -> RunConfig:
    """``--tier name=blocks`` for each entry (0 drops the tier), over ``config``."""
    from kvlife.lifecycle.cli.run_options import apply_sizes

    args = argparse.Namespace(device_blocks=None, ranks=None, tier=[f"{name}={n}" for name, n in tiers.items()])
    return apply_sizes(args, config)


def with_engine(config: RunConfig, **changes: Any) -> RunConfig:
    """Engine config keys (``lookup_latency_ms``, ``async_scheduling``) over ``config``."""
    return attrs.evolve(config, engine=attrs.evolve(config.engine, **changes)) if changes else config


def device_blocks(config: RunConfig, summary: Mapping[str, Any]) -> int | None:
    """The device capacity a run used: the summary's own figure when it reports one, else the
    config's."""
    setup = summary.get("setup")
    reported = setup.get("device_blocks") if isinstance(setup, Mapping) else summary.get("device_blocks")
    if isinstance(reported, Mapping):
        reported = reported.get("blocks")
    if isinstance(reported, int) and not isinstance(reported, bool):
        return reported
    configured = getattr(config.engine, "device_blocks", None)
    return configured if isinstance(configured, int) else None


@attrs.frozen
class RunFigures:
    """What the report keeps of one simulated run."""

    requests: int
    summary: dict[str, Any]
    stability: Stability
    device_blocks: int | None
    extras: dict[str, Any] = attrs.field(factory=dict)

    def to_dict(self) -> dict[str, Any]:
        keep = ("ttft_ms", "tpot_ms", "throughput_tokens_per_s", "prefix_hit_rate", "stranded",
                "redundant_block_loads", "blocks_loaded", "blocks_stored", "critical_path_lookup_ms",
                "sync_lookups", "async_lookups", "preemptions", "simulated_s")
        return {"requests": self.requests, "device_blocks": self.device_blocks,
                "summary": {k: self.summary[k] for k in keep if k in self.summary},
                "stability": self.stability.to_dict(), **self.extras}


Extra = Callable[[RunOutcome, Path | None], Mapping[str, Any]]


def simulate(config: RunConfig, workload: list[WorkloadRequest], name: str, extra: Extra | None = None,
             trace: bool = False) -> RunFigures:
    """One run. ``extra(outcome, trace_path)`` adds counters (``trace``: the run writes a trace,
    in a temporary directory removed afterwards, for ``extra`` to read)."""
    with tempfile.TemporaryDirectory(prefix="kvlife-fidelity-") as tmp:
        path = Path(tmp) / "run.jsonl" if trace else None
        outcome = run_workload(config, workload, trace_path=path, workload_name=name)
        extras = dict(extra(outcome, path)) if extra is not None else {}
    summary = {k: v for k, v in outcome.summary.items() if k != "wall_s"}  # keep the report deterministic
    return RunFigures(len(workload), summary, check_stability(ttft_samples(outcome)),
                      device_blocks(config, summary), extras)
