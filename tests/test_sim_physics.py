"""The simulator's physics, observed through whole simulated runs and their traces.

The modules have unit tests of their own (test_step_cost, test_links, test_lookup_service,
test_profiles); these check that the simulator actually charges them: a step costs what the
step-cost model says for the plan it runs, transfers share their links, lookups queue behind
the lookup service's workers, completions wait for the step boundary, and the default run
lands in the range published measurements give for Llama-3-8B on one H100.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from typing import Any

import attrs
import pytest

from kvlife.lifecycle.cli.main import main
from kvlife.lifecycle.config import EngineConfig, RunConfig, SimConfig, TierConfig
from kvlife.lifecycle.drivers.physics import resolve
from kvlife.lifecycle.drivers.simulator import Simulator
from kvlife.lifecycle.workloads.mooncake import WorkloadRequest
from kvlife.policies.loading import load_stack

BT = 512
MIB = 1 << 20
H100_HOST_LINK = 52.8e9  # bytes/s per direction, h100-sxm.toml (measured PCIe Gen5 copy-engine rate)
BLOCK = 64 * MIB  # Llama-3-8B, 512 tokens, TP 1


def request(rid: str, t: float, blocks: Sequence[int], extra_tokens: int = 10, output: int = 4) -> WorkloadRequest:
    """A prompt of ``len(blocks)`` full blocks plus ``extra_tokens`` (so every full block is a
    prefix-hit candidate), hashes ``blocks`` plus one for the partial block."""
    partial = (10_000_000 + zlib.crc32(rid.encode()) % 1_000_000,) if extra_tokens else ()
    hashes = (*blocks, *partial)
    return WorkloadRequest(rid, t, len(blocks) * BT + extra_tokens, output, hashes)


def simulate(config: RunConfig, workload: list[WorkloadRequest], stack: Sequence[str] = (),
             host_blocks: Sequence[int] = ()) -> list[dict[str, Any]]:
    """Run and return the trace records; ``host_blocks`` are in the host tier before the start."""
    records: list[dict[str, Any]] = []
    sim = Simulator(config, workload, load_stack(list(stack)), recorder=records.append)
    if host_blocks:
        host = sim.engine.tiers["host"]
        host.prepare_store(host_blocks)
        host.complete_store(host_blocks)
    result = sim.run()
    assert result.stranded == []
    assert sim.engine.state_counts["finished"] == len(workload)
    return records


def inputs(records: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [r for r in records if r["kind"] == "input" and r["type"] == kind]


def step_spans(records: list[dict[str, Any]]) -> dict[int, tuple[float, float, dict[str, Any]]]:
    """step id -> (planned at, output at, step record)."""
    planned = {r["step"]: r for r in records if r["kind"] == "step"}
    return {o["step_id"]: (planned[o["step_id"]]["t"], o["t"], planned[o["step_id"]])
            for o in inputs(records, "step_output")}


def job_times(records: list[dict[str, Any]], op: str) -> dict[int, tuple[float, float]]:
    """job id -> (started, done) for jobs of kind ``op``."""
    started = {r["job"]: r["t"] for r in records if r["kind"] == "job" and r["op"] == op}
    return {r["job"]: (started[r["job"]], r["t"]) for r in records if r["kind"] == "job_done" and r["job"] in started}


# Instant lookups and no rank jitter: every time below is the physics alone.
NO_LOOKUP_COST = SimConfig(rank_jitter_ms=0.0, lookup_per_key_ms=0.0, completions="exact")


def engine(**overrides: Any) -> EngineConfig:
    values: dict[str, Any] = {"lookup_latency_ms": 0.0, "tiers": (TierConfig("host", capacity_blocks=1000),)}
    values.update(overrides)
    return EngineConfig(**values)


# ---- step cost -------------------------------------------------------------------------------
def test_a_prefill_chunk_costs_more_the_longer_the_context_it_attends_to() -> None:
    """A 64k-token prompt in 8,192-token chunks: each chunk attends to everything before it,
    so each step takes longer than the last, exactly as the step-cost model prices it."""
    config = RunConfig(engine=engine(tiers=()), sim=NO_LOOKUP_COST)
    records = simulate(config, [request("long", 0.0, range(128), extra_tokens=1, output=2)])
    cost = resolve(config)[1].cost
    chunks = []
    for start, end, step in sorted(step_spans(records).values(), key=lambda s: s[0]):
        (rid, before, new), = step["prompt"] or [(None, None, None)]
        if rid is None:
            continue  # the decode step
        assert end - start == pytest.approx(cost.step_ms([(new, before)]), rel=1e-9)
        chunks.append((before, end - start))
    chunks = chunks[:8]  # then the prompt's last token
    assert [before for before, _ in chunks] == [8192 * k for k in range(8)]
    durations = [d for _, d in chunks]
    assert durations == sorted(durations) and len(set(durations)) == len(durations)
    # the last chunk attends to 57,344 cached tokens: ~2.8x the first chunk's 0.26 s
    assert durations[-1] > 2.5 * durations[0]
    assert 0.2e3 < durations[0] < 0.35e3


def test_a_prompt_after_a_long_cached_prefix_takes_longer_to_first_token() -> None:
    """The same 8,192 new tokens in one step: after a 57,344-token prefix hit on device they
    cost ~2.8x a fresh prompt's, because attention reads the whole context (the old linear
    model charged both the same)."""
    config = RunConfig(engine=engine(tiers=()), sim=NO_LOOKUP_COST)
    warm = request("warm", 0.0, range(112), extra_tokens=0, output=2)
    after_prefix = request("after-prefix", 60_000.0, [*range(112), *range(5000, 5016)], extra_tokens=0, output=2)
    fresh = request("fresh", 120_000.0, range(9000, 9016), extra_tokens=0, output=2)
    sim = Simulator(config, [warm, after_prefix, fresh], load_stack([]))
    requests = sim.run().engine.requests
    assert requests["after-prefix"].device_hit_blocks == 112
    ttft = {rid: requests[rid].first_token_ms - requests[rid].arrival_ms for rid in ("after-prefix", "fresh")}
    cost = sim.physics.cost
    assert ttft["fresh"] == pytest.approx(cost.step_ms([(8192, 0)]), rel=1e-9)
    assert ttft["after-prefix"] == pytest.approx(cost.step_ms([(8192, 57344)]), rel=1e-9)
    assert ttft["after-prefix"] > 2.5 * ttft["fresh"]


# ---- links ----------------------------------------------------------------------------------
def test_two_concurrent_loads_on_one_link_take_twice_as_long_as_one() -> None:
    """Processor sharing: two equal loads started together over the same host->device link
    each drain at half the bandwidth."""
    config = RunConfig(engine=engine(), sim=NO_LOOKUP_COST)
    a = request("a", 0.0, range(1, 25))
    b = request("b", 0.0, range(101, 125))
    host = [*range(1, 25), *range(101, 125)]
    alone = job_times(simulate(config, [a], host_blocks=host), "load")
    together = job_times(simulate(config, [a, b], host_blocks=host), "load")
    one = 24 * BLOCK / H100_HOST_LINK * 1000.0  # 30.5 ms
    (start, done), = alone.values()
    assert done - start == pytest.approx(one, rel=1e-9)
    assert len(together) == 2
    starts = {s for s, _ in together.values()}
    assert starts == {start}  # admitted in the same tick
    for s, d in together.values():
        assert d - s == pytest.approx(2 * one, rel=1e-9)


def test_a_burst_of_loads_ends_at_n_times_one() -> None:
    """Four equal loads started together all end at 4x one load's time."""
    config = RunConfig(engine=engine(), sim=NO_LOOKUP_COST)
    workload = [request(f"r{i}", 0.0, range(100 * i + 1, 100 * i + 9)) for i in range(4)]
    host = [h for w in workload for h in w.hash_ids[:-1]]
    records = simulate(config, workload, host_blocks=host)
    loads = job_times(records, "load")
    one = 8 * BLOCK / H100_HOST_LINK * 1000.0
    assert sorted(d - s for s, d in loads.values()) == pytest.approx([4 * one] * 4, rel=1e-9)


# ---- lookups --------------------------------------------------------------------------------
@pytest.mark.parametrize("workers", [1, 2])
def test_a_lookup_burst_queues_behind_the_lookup_workers(workers: int) -> None:
    """Six async lookups submitted in one tick: with one worker the k-th answers after k
    lookups' time (base + per-key x keys); two workers answer them in pairs."""
    sim = SimConfig(rank_jitter_ms=0.0, completions="exact", lookup_workers=workers, lookup_per_key_ms=0.01)
    config = RunConfig(engine=engine(lookup_latency_ms=2.0), sim=sim)
    workload = [request(f"r{i}", 0.0, range(100 * i + 1, 100 * i + 11)) for i in range(6)]
    records = simulate(config, workload, stack=["async-lookup"])
    answers = [a["t"] for a in inputs(records, "lookup_answer")]
    one = 2.0 + 0.01 * 10  # ten full blocks looked up each
    expected = [one * (k // workers + 1) for k in range(6)]
    assert answers[:6] == pytest.approx(expected, rel=1e-9)  # the burst (later ones: re-lookups)


def test_sync_lookups_delay_the_step_by_their_queueing() -> None:
    """Three sync lookups in one tick: the step starts when the third answers (3 x one lookup),
    and the summary charges that wait as critical-path lookup time."""
    config = RunConfig(engine=engine(lookup_latency_ms=2.0), sim=attrs.evolve(NO_LOOKUP_COST, lookup_per_key_ms=0.01))
    workload = [request(f"r{i}", 0.0, range(100 * i + 1, 100 * i + 4)) for i in range(3)]
    records: list[dict[str, Any]] = []
    sim = Simulator(config, workload, load_stack([]), recorder=records.append)
    result = sim.run()
    first_start, first_end, first = min(step_spans(records).values(), key=lambda s: s[0])
    assert first["sync_lookups"] == 3
    cost = sim.physics.cost
    compute = cost.step_ms([(new, before) for _, before, new in first["prompt"]])
    assert first_end - first_start == pytest.approx(3 * 2.03 + compute, rel=1e-9)
    assert result.critical_path_lookup_ms == pytest.approx(3 * 2.03, rel=1e-9)


# ---- completions ----------------------------------------------------------------------------
def _mid_step_load(completions: str) -> tuple[list[dict[str, Any]], float, int, dict[str, Any]]:
    """A decodes (steps of ~7 ms) while B's 8-block load (10.2 ms) runs: it finishes mid-step.
    Returns the records, the load's exact completion time, and the index and record of the
    input that delivers its report: a ``transfer_report``, or the ``step_output`` whose
    ``reports`` carry it."""
    config = RunConfig(engine=engine(), sim=attrs.evolve(NO_LOOKUP_COST, completions=completions))
    a = request("a", 0.0, range(1, 3), output=300)
    b = request("b", 50.0, range(101, 109))
    records = simulate(config, [a, b], host_blocks=range(101, 109))
    (job, (start, _)), = job_times(records, "load").items()
    index, report = next((i, r) for i, r in enumerate(records) if r["kind"] == "input" and (
        (r["type"] == "transfer_report" and r["job_id"] == job)
        or (r["type"] == "step_output" and any(j == job for j, _, _ in r.get("reports", ())))))
    return records, start + 8 * BLOCK / H100_HOST_LINK * 1000.0, index, report


def _load_done(records: list[dict[str, Any]]) -> float:
    """When B's load was taken back by the scheduler (its ``load_done`` transition)."""
    return next(r["t"] for r in records if r["kind"] == "transition" and r["req"] == "b"
                and r["trigger"] == "load_done")


def test_a_transfer_finishing_mid_step_is_seen_with_the_next_step_output() -> None:
    """A worker reports a finished load with the output of the step it finished during
    (vLLM's get_finished): the report comes inside that step_output, at its time, and the
    next pass takes the request back."""
    records, exact, index, report = _mid_step_load("step_boundary")
    spans = step_spans(records)
    assert any(start < exact < end for start, end, _ in spans.values())  # a step was in flight
    boundary = min(end for _, end, _ in spans.values() if end >= exact)
    assert report["type"] == "step_output" and report["t"] == boundary > exact
    assert not inputs(records, "transfer_report")
    job_done = next(r for r in records[index:] if r["kind"] == "job_done")
    assert job_done["t"] == boundary
    assert _load_done(records) == boundary


def test_with_exact_completions_the_transfer_is_seen_when_it_finishes() -> None:
    """``exact``: the report reaches the engine at the load's own completion time (the job is
    done then); the scheduler still takes the request back only once a step output brings
    finished_recving, so it runs at the same pass as with step-boundary completions."""
    records, exact, _, report = _mid_step_load("exact")
    assert report["type"] == "transfer_report"
    assert report["t"] == pytest.approx(exact, rel=1e-12)
    assert all(o["t"] != report["t"] for o in inputs(records, "step_output"))
    job_done = next(r for r in records if r["kind"] == "job_done" and r["op"] == "load")
    assert job_done["t"] == report["t"]
    boundary_records, _, _, boundary_report = _mid_step_load("step_boundary")
    assert report["t"] < boundary_report["t"]
    assert _load_done(records) == _load_done(boundary_records) == boundary_report["t"]


def test_step_boundary_completions_keep_the_run_deterministic() -> None:
    assert _mid_step_load("step_boundary")[0] == _mid_step_load("step_boundary")[0]


# ---- derived sizes and the default run --------------------------------------------------------
def test_device_blocks_and_ranks_derive_from_the_profiles_unless_set() -> None:
    config, physics = resolve(RunConfig())
    assert (config.engine.device_blocks, config.engine.ranks) == (821, 1)
    assert physics.device_blocks_derived and physics.block_bytes == 64 * MIB
    seventy = RunConfig(sim=SimConfig(model="llama-3-70b", tp=4))
    config, physics = resolve(seventy)
    assert (config.engine.device_blocks, config.engine.ranks) == (847, 4)
    assert physics.capacity.block_bytes == 40 * MIB and physics.rank_block_bytes == 40 * MIB
    config, physics = resolve(attrs.evolve(seventy, engine=EngineConfig(device_blocks=300, ranks=2)))
    assert (config.engine.device_blocks, config.engine.ranks) == (300, 2)
    assert not physics.device_blocks_derived
    assert physics.rank_block_bytes == 80 * MIB  # four ranks' KV reported by two
    assert physics.device_line() == "300 (engine.device_blocks; derived: 847) / 40 MiB per block per rank"
    assert resolve(config)[0] == config  # resolving twice changes nothing


def test_kvlife_run_on_defaults_is_llama_3_8b_on_one_h100_at_realistic_latencies(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Published figures compared against: Lambda's vLLM v0.6 benchmark of Llama-3-8B on one
    H100 SXM (github.com/LambdaLabsML/vllm-benchmark, results/prompt_10/1xH100-80GB-SXM/
    Meta-Llama-3-8B-Instruct_tp1_len2048.json): 10 concurrent requests, median TTFT 62.2 ms for
    prompts of 4-400 tokens (a client-side figure, ~20 ms of serving front end included), median
    TPOT 7.56 ms. The default synthetic workload runs ~15 requests at once with prompts of a few
    thousand tokens, so TPOT sits above that floor (a step reads the same 15 GB of weights plus
    more KV, and chunked prefills share the steps) and TTFT above a 137-token prefill; vLLM's own
    log of Llama-3.1-8B on one H100 gives 51.38 GiB of KV = 822 blocks of 64 MiB."""
    assert main(["run", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)["summary"]
    setup = summary["setup"]
    assert (setup["hardware"], setup["model"], setup["tp"], setup["ranks"]) == ("h100-sxm", "llama-3-8b", 1, 1)
    assert setup["device_blocks"] == 821 and setup["device_blocks_source"] == "derived"
    assert setup["device"].startswith("821 (derived: h100-sxm 79.2 GiB x 0.90 - weights 15.0 GiB")
    assert setup["block_bytes"] == 64 * MIB
    assert 7.56 <= summary["tpot_ms"]["p50"] <= 25.0
    assert 40.0 <= summary["ttft_ms"]["p50"] <= 500.0
    assert summary["finished"] == {"stopped": 400} and summary["stranded"] == 0


def test_kvlife_run_prints_what_it_ran_on(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--limit", "30", "--device-blocks", "400"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split()[0] == "engine"  # which engine ran (tests/test_engine_choice.py)
    assert out[2].split() == ["hardware", "/", "model", "/", "TP", "h100-sxm", "/", "llama-3-8b", "/", "TP", "1"]
    assert out[3].split(None, 2)[2] == "400 (--device-blocks; derived: 821) / 64 MiB per block"
