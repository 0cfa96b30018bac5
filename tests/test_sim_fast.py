"""The decode fast path (``scheduler.Scheduler._cohort_tick``) changes nothing but speed.

Each case runs a workload twice through ``run_workload``: with the fast path (the default)
and step by step (``fast=False``). The traces must be identical byte for byte and the
summaries equal but for the wall time. The cases cover every built-in policy (each alone
on the baseline, then stacks of several), device memory short enough to preempt, async
scheduling, exact completions, several ranks with jitter and failing tiers, transfer and
lookup deadlines, and ``--chaos`` runs. Where the fast path is on (sync scheduling, no
online check), the test also requires it to have planned steps, so a fast path that
silently never engages fails here too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest

from kvlife.lifecycle.config import EngineConfig, RunConfig, SimConfig, TierConfig
from kvlife.lifecycle.drivers.runner import RunOutcome, run_workload
from kvlife.lifecycle.workloads.mooncake import WorkloadRequest
from kvlife.lifecycle.workloads.synthetic import synthetic_workload
from kvlife.policies.loading import load_stack
from kvlife.policies.registry import BUILTIN

# Short of device memory (preemptions), a host tier and a slower disk tier behind it.
_ENGINE = EngineConfig(
    device_blocks=60,
    max_batched_tokens=4096,
    tiers=(TierConfig("host", 300), TierConfig("disk", 3000, bandwidth_gbps=4.0, latency_ms=1.0)),
)


def _workload(seed: int = 3, n: int = 120) -> list[WorkloadRequest]:
    return synthetic_workload(seed=seed, num_requests=n, arrival_rate_per_s=10.0, output_tokens=(20, 400))


def _both(config: RunConfig, workload: list[WorkloadRequest], tmp_path: Path) -> tuple[RunOutcome, RunOutcome]:
    outcomes = []
    for fast in (True, False):
        trace = tmp_path / f"{'fast' if fast else 'step'}.jsonl"
        outcomes.append(run_workload(config, workload, load_stack(config.policies), trace_path=trace,
                                     workload_name="fast-path", fast=fast))
    return outcomes[0], outcomes[1]


def _assert_same(fast: RunOutcome, step: RunOutcome, tmp_path: Path) -> None:
    a = (tmp_path / "fast.jsonl").read_bytes().splitlines()
    b = (tmp_path / "step.jsonl").read_bytes().splitlines()
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        assert x == y, f"trace line {i + 1} differs:\n fast: {x[:300]!r}\n step: {y[:300]!r}"
    assert len(a) == len(b), f"{len(a)} trace lines with the fast path, {len(b)} step by step"

    def without_wall(summary: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in summary.items() if k != "wall_s" and "wall" not in k}

    assert without_wall(fast.summary) == without_wall(step.summary)
    assert step.result.fast_steps == 0


@pytest.mark.parametrize("policy", sorted(BUILTIN))
def test_every_builtin_policy_alone(policy: str, tmp_path: Path) -> None:
    config = RunConfig(engine=_ENGINE, sim=SimConfig(seed=1), policies=(policy,))
    fast, step = _both(config, _workload(), tmp_path)
    _assert_same(fast, step, tmp_path)
    assert fast.summary["preemptions"] > 0, "the workload must preempt"
    assert fast.result.fast_steps > 0, "the fast path never planned a step"


STACKS: tuple[tuple[str, ...], ...] = (
    ("async-lookup", "shared-loads", "hold-while-sending"),
    ("keep-lookup-answers", "async-lookup", "defer-while-loading"),
    ("early-prefetch", "prefetch-timeout", "placeholder-safe-stores"),
    ("early-lookup", "prefetch-wait-complete", "naive-stores-unsafe", "sync-lookup"),
    ("early-prefetch", "prefetch-best-effort", "shared-loads"),
)

# (name, engine overrides, sim overrides, whether the fast path may plan steps)
VARIANTS: tuple[tuple[str, dict[str, Any], dict[str, Any], bool], ...] = (
    ("sync", {}, {}, True),
    ("async-scheduling", {"async_scheduling": True}, {}, False),
    ("exact-completions", {}, {"completions": "exact"}, True),
    ("ranks-jitter-failures-deadline",
     {"ranks": 2, "transfer_deadline_ms": 3.0, "lookup_deadline_ms": 2.0,
      "tiers": (TierConfig("host", 200, failure_rate=0.05), TierConfig("disk", 2000, failure_rate=0.05))},
     {"rank_jitter_ms": 4.0, "lookup_workers": 1, "lookup_per_key_ms": 0.5}, True),
    ("length-limit", {}, {"max_output_tokens": 90}, True),
    ("chaos", {"transfer_deadline_ms": 50.0}, {"chaos": 7}, False),
    ("check", {}, {"check": True}, False),
)


@pytest.mark.parametrize("stack", STACKS, ids=lambda s: ",".join(s))
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v[0])
def test_stacks_and_drivers(stack: tuple[str, ...], variant: tuple[str, dict[str, Any], dict[str, Any], bool],
                            tmp_path: Path) -> None:
    name, engine, sim, engaged = variant
    config = RunConfig(engine=attrs.evolve(_ENGINE, **engine), sim=SimConfig(seed=2, **sim), policies=stack)
    fast, step = _both(config, _workload(seed=4), tmp_path)
    _assert_same(fast, step, tmp_path)
    if engaged:
        assert fast.result.fast_steps > 0, "the fast path never planned a step"
    else:
        assert fast.result.fast_steps == 0


def test_long_decodes_take_the_fast_path(tmp_path: Path) -> None:
    """Most steps of a decode-heavy run are the fast path's, and the run is the same."""
    config = RunConfig(engine=attrs.evolve(_ENGINE, device_blocks=400), sim=SimConfig(seed=5))
    workload = synthetic_workload(seed=5, num_requests=80, arrival_rate_per_s=4.0, output_tokens=(300, 900))
    fast, step = _both(config, workload, tmp_path)
    _assert_same(fast, step, tmp_path)
    assert fast.result.fast_steps > fast.summary["steps"] // 2


def test_a_crowded_batch_stays_on_the_fast_path(tmp_path: Path) -> None:
    """Forty requests decode at once, so in most steps one of them is at a block boundary,
    stops or starts: the members go on as one while those few are planned the ordinary
    way, and the run is the same as step by step."""
    config = RunConfig(engine=attrs.evolve(_ENGINE, device_blocks=8000, max_running=64, block_tokens=16),
                       sim=SimConfig(seed=6))
    workload = synthetic_workload(seed=6, num_requests=120, arrival_rate_per_s=40.0, output_tokens=(200, 600))
    fast, step = _both(config, workload, tmp_path)
    _assert_same(fast, step, tmp_path)
    fills = sum(1 for line in (tmp_path / "fast.jsonl").read_bytes().splitlines() if b'"fills"' in line)
    assert fills > fast.summary["steps"] // 2, "the workload must fill a block in most steps"
    assert fast.result.fast_steps > 0.9 * fast.summary["steps"]
