"""Simulated runs: determinism, accounting, the real conversation trace."""

from __future__ import annotations

from pathlib import Path

import attrs

from kvlife.lifecycle.config import EngineConfig, RunConfig, SimConfig, TierConfig
from kvlife.lifecycle.drivers.runner import run_workload
from kvlife.lifecycle.drivers.simulator import Simulator
from kvlife.lifecycle.traces.trace import read_trace
from kvlife.lifecycle.workloads.mooncake import load_mooncake
from kvlife.lifecycle.workloads.synthetic import synthetic_workload
from kvlife.policies.stack import PolicyStack

SMALL = RunConfig(
    engine=EngineConfig(device_blocks=120, max_running=32, ranks=2,
                        tiers=(TierConfig("host", capacity_blocks=200), TierConfig("disk", capacity_blocks=400,
                                                                                   bandwidth_gbps=3.0))),
    sim=SimConfig(seed=3, rank_jitter_ms=1.0),
)


def test_same_seed_same_trace_byte_for_byte(tmp_path: Path) -> None:
    workload = synthetic_workload(seed=5, num_requests=150, arrival_rate_per_s=20.0)
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    run_workload(SMALL, workload, trace_path=first)
    run_workload(SMALL, workload, trace_path=second)
    assert first.read_bytes() == second.read_bytes()
    assert len(first.read_bytes().splitlines()) > 1000


def test_other_seed_changes_the_trace(tmp_path: Path) -> None:
    workload = synthetic_workload(seed=5, num_requests=60, arrival_rate_per_s=20.0)
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    run_workload(SMALL, workload, trace_path=first)
    run_workload(attrs.evolve(SMALL, sim=attrs.evolve(SMALL.sim, seed=4)), workload, trace_path=second)
    assert first.read_bytes() != second.read_bytes()


def test_trace_has_header_inputs_transitions_with_reasons(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    run_workload(SMALL, synthetic_workload(seed=1, num_requests=40), trace_path=path)
    records = [r for _, r in read_trace(path)]
    header = records[0]
    assert header["kind"] == "header" and header["schema"] == 1 and header["seed"] == 3
    assert header["config"]["engine"]["ranks"] == 2
    kinds = {r["kind"] for r in records}
    assert {"input", "transition", "decision", "step", "job", "job_done"} <= kinds
    transitions = [r for r in records if r["kind"] == "transition"]
    assert all(r["reason"] and r["trigger"] for r in transitions)
    finished = {r["req"] for r in transitions if r["to"] == "finished"}
    assert len(finished) == 40


def test_reference_mode_agrees_with_the_table_on_a_whole_run() -> None:
    workload = synthetic_workload(seed=2, num_requests=80, arrival_rate_per_s=30.0)
    result = Simulator(SMALL, workload, PolicyStack([]), reference=True, check_every=50).run()
    assert result.engine.state_counts["finished"] == 80
    assert result.stranded == []


def test_tier_failures_degrade_to_recompute_and_nothing_strands() -> None:
    config = attrs.evolve(
        SMALL,
        engine=attrs.evolve(SMALL.engine, tiers=(TierConfig("host", capacity_blocks=200, failure_rate=0.2),)),
    )
    workload = synthetic_workload(seed=9, num_requests=150, arrival_rate_per_s=20.0)
    result = Simulator(config, workload, PolicyStack([]), check_every=25).run()
    assert result.engine.stats.failed_blocks > 0
    assert result.engine.state_counts["finished"] == 150
    assert all(r.finish_reason == "stopped" for r in result.engine.requests.values())
    assert result.stranded == []


def test_first_2000_requests_of_the_conversation_trace(conversation_trace: Path) -> None:
    workload = load_mooncake(conversation_trace, limit=2000)
    config = RunConfig(engine=EngineConfig(ranks=2), sim=SimConfig(rank_jitter_ms=0.5))
    result = Simulator(config, workload, PolicyStack([]), check_every=997).run()
    engine = result.engine
    assert len(engine.requests) == 2000
    assert all(r.state == "finished" and r.finish_reason == "stopped" for r in engine.requests.values())
    assert result.stranded == []
    assert not engine.jobs
    # block accounting balances in every tier, and nothing is held once all is done
    engine.check_invariants()
    assert engine.pool.free == engine.pool.capacity
    for tier in engine.tiers.values():
        assert tier.free + tier.used == tier.capacity
        assert tier.pinned() == 0
    assert engine.stats.blocks_loaded > 0 and engine.stats.blocks_stored > 0


def test_trace_does_not_depend_on_hash_randomisation(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    traces = []
    for seed in ("0", "12345"):
        path = tmp_path / f"hashseed-{seed}.jsonl"
        env = {**os.environ, "PYTHONHASHSEED": seed}
        subprocess.run(
            [sys.executable, "-m", "kvlife.lifecycle.cli.main", "run", "--limit", "80",
             "--stack", "shared-loads,async-lookup", "--trace", str(path)],
            check=True, capture_output=True, env=env, cwd=Path(__file__).resolve().parents[1],
        )
        traces.append(path.read_bytes())
    assert traces[0] == traces[1]
