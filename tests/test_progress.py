"""Invariant 7's progress rule: a preemption makes room at once (vllm#49674).

A scheduler that takes a preemption victim whose blocks a step in flight still writes
(under async scheduling they are freed only at that step's output) makes no room: the
allocation fails again and the next victim is taken. The same stress run, with and without
tiers (async scheduling with no tier is plain vLLM's default), on the real engine and on the
zoo's ``preempts_fenced_victim``: ``--check`` finds the cascade only in the broken engine's
run, and the broken engine preempts several times as often. (``kvlife validate`` cannot judge
the rule: a trace's steps do not name every request they compute; it says so.)
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from kvlife.lifecycle.config import EngineConfig, RunConfig, SimConfig, TierConfig
from kvlife.lifecycle.drivers.runner import run_workload
from kvlife.lifecycle.engine.core import Engine
from kvlife.lifecycle.traces.validate import validate
from kvlife.lifecycle.workloads.synthetic import synthetic_workload
from kvlife.policies.loading import load_stack

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bug_zoo import ZOO  # noqa: E402

FENCED = next(b for b in ZOO if b.name == "preempts_fenced_victim")


def _stress(tmp_path: Path, tiers: tuple[TierConfig, ...], factory: Any) -> tuple[dict[str, Any], Path]:
    # 60 device blocks of 16 tokens for 60 requests arriving at 8/s with up to 200 output
    # tokens each: the running requests outgrow the device and preempt one another.
    config = RunConfig(engine=EngineConfig(device_blocks=60, async_scheduling=True, tiers=tiers),
                       sim=SimConfig(check=True, max_output_tokens=200))
    workload = synthetic_workload(seed=1, num_requests=60, arrival_rate_per_s=8.0)
    trace = tmp_path / f"{factory.__name__}-{len(tiers)}.jsonl"
    outcome = run_workload(config, workload, stack=load_stack([]), trace_path=trace, engine_factory=factory)
    return outcome.summary, trace


@pytest.mark.parametrize("tiers", [(TierConfig("host", 400),), ()], ids=["host-tier", "no-tier"])
def test_a_fenced_victim_cascade_is_found_by_check_and_validate(tmp_path: Path,
                                                                tiers: tuple[TierConfig, ...]) -> None:
    real, real_trace = _stress(tmp_path, tiers, Engine)
    assert real["preemptions"] > 0  # the run does preempt: the rule is exercised
    assert real["check"]["violations"] == 0, real["check"]["first"]
    assert validate(real_trace).ok

    broken, broken_trace = _stress(tmp_path, tiers, FENCED.engine_factory)
    assert broken["preemptions"] >= 3 * real["preemptions"]
    assert set(broken["check"]["by_invariant"]) == {"7"}, broken["check"]
    assert "zero-progress preemption cascade" in broken["check"]["first"][0]
    assert "7's progress rule" in validate(broken_trace).format()
