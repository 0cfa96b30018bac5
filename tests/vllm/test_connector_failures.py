"""Failed loads and stores through KVLifeConnector, on vLLM 0.33's real Scheduler.

A load that fails on a worker reaches vLLM as ``invalid_block_ids`` (its
``_handle_invalid_blocks``; with ``kv_load_failure_policy`` "recompute" the request
recomputes from the first failed block, with "fail" it ends with an error) and kvlife as
the rank's report naming the failed blocks. A store has no failure channel in vLLM: the
connector keeps the failed blocks out of its tier and releases the request as usual; a
store that never ends is given up on after ``store_timeout_ms``.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Any

import pytest

try:
    importlib.metadata.version("vllm")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("vLLM is not installed: `bash scripts/install-vllm.sh`, then "
                "`.venv-vllm/bin/python -m pytest tests/vllm`", allow_module_level=True)

from vllm_scenarios import (  # noqa: E402
    BS,
    PREFIX,
    close,
    evict,
    finish,
    inner,
    kvlife_spec,
    records,
    run_until,
    transitions,
    warm_tier,
)

from kvlife.lifecycle.drivers.vllm.harness import VllmDriver, build_scheduler  # noqa: E402
from kvlife.lifecycle.drivers.vllm.worker import SimulatedWorker  # noqa: E402
from kvlife.lifecycle.traces.validate import validate  # noqa: E402

R1 = PREFIX + [200, 201]  # 66 tokens: hits the four prefix blocks


def fail_load_block(index: int, rank: int = 0, rid: str = "r1") -> Any:
    """A worker failure script: block ``index`` of ``rid``'s load fails on ``rank``."""

    def fail(worker_rank: int, kind: str, req_id: str, hashes: list[int]) -> list[int]:
        if kind == "load" and req_id == rid and worker_rank == rank:
            return [hashes[index]]
        return []

    return fail


def jobs(recs: list[dict[str, Any]], op: str, rid: str) -> list[dict[str, Any]]:
    return [r for r in recs if r["kind"] == "job" and r["op"] == op and r["req"] == rid]


def done_of(recs: list[dict[str, Any]], job: int) -> dict[str, Any]:
    return next(r for r in recs if r["kind"] == "job_done" and r["job"] == job)


@pytest.mark.parametrize(("index", "ranks"), [(2, 1), (0, 1), (1, 2)],
                         ids=["third-block", "first-block", "rank1-second-block"])
def test_failed_load_recomputes_from_the_first_failed_block(
    model_dir: Path, tmp_path: Path, index: int, ranks: int
) -> None:
    trace = tmp_path / "load-failed.jsonl"
    spec = kvlife_spec(trace, stack="", ranks=ranks, worker_ranks=ranks, kv_load_failure_policy="recompute")
    # Rank 1 (when there are two) reports two steps after rank 0: the failure comes last.
    workers = [SimulatedWorker(r, load_delay=1 + 2 * r, fail=fail_load_block(index, rank=ranks - 1))
               for r in range(ranks)]
    driver = VllmDriver(build_scheduler(model_dir, spec), workers)
    warm_tier(driver)
    driver.add("r1", R1, 2)
    obs = driver.step()
    assert obs.external_hits == {"r1": 64} and driver.status("r1") == "WAITING_FOR_REMOTE_KVS"
    failed_hash = inner(driver).core.state.requests["r1"].hashes[index]
    request = driver.scheduler.requests["r1"]
    run_until(driver, lambda: inner(driver).core.state.stats.failed_loads == 1)  # the last report came
    # vLLM cut the computed tokens at the failed block (its _handle_invalid_blocks) ...
    assert request.status.name == "WAITING_FOR_REMOTE_KVS" and request.num_computed_tokens == index * BS
    assert all("r1" not in o.scheduled for o in driver.observations)
    # ... and nothing of the failed load is published: the tier dropped the failed block.
    assert not inner(driver).core.state.tiers["host"].contains(failed_hash)
    assert inner(driver).core.state.stats.failed_loads == 1
    obs = driver.step()
    # The request runs again from the first failed block: it recomputes that block and the rest.
    assert obs.scheduled["r1"] == (index * BS, len(R1) - index * BS)
    run_until(driver, lambda: driver.status("r1") is None)
    # The recomputed block is stored again, so a later request hits all four blocks.
    evict(driver, "filler2")
    driver.add("r2", PREFIX + [300, 301], 2)
    run_until(driver, lambda: "r2" in driver.observations[-1].scheduled)
    assert sum(o.external_hits.get("r2", 0) for o in driver.observations) == 64
    finish(driver, trace)  # kvlife validate passes (invariant 4: no load of a failed block before its re-store)

    recs = records(trace)
    load = jobs(recs, "load", "r1")[0]
    assert load["moves"][index][0] == failed_hash
    assert done_of(recs, load["job"])["failed"] == 1
    warning = next(r for r in recs if r["kind"] == "warning" and r["what"] == "load_failed")
    assert warning["job"] == load["job"] and warning["blocks"] == [failed_hash]
    assert "recompute" in warning["note"]
    steps = transitions(trace, "r1")
    assert steps[:3] == ["load_started", "load_failed", "admitted"] and steps[-1] == "completed"
    restored = [m[0] for j in jobs(recs, "store", "r1") for m in j["moves"]]
    assert failed_hash in restored
    reports = [failed for r in recs if r["kind"] == "input" and r["type"] == "step_output"
               for job, _, failed in r.get("reports", []) if job == load["job"]]
    assert reports == [[]] * (ranks - 1) + [[failed_hash]]


def test_failed_load_under_fail_policy_ends_the_request_with_an_error(model_dir: Path, tmp_path: Path) -> None:
    trace = tmp_path / "load-failed-fail.jsonl"
    spec = kvlife_spec(trace, stack="", kv_load_failure_policy="fail")  # vLLM's default
    driver = VllmDriver(build_scheduler(model_dir, spec), [SimulatedWorker(0, load_delay=2, fail=fail_load_block(1))])
    warm_tier(driver)
    driver.add("r1", R1, 2)
    driver.step()
    assert driver.status("r1") == "WAITING_FOR_REMOTE_KVS"
    run_until(driver, lambda: driver.status("r1") is None)
    assert all("r1" not in o.scheduled for o in driver.observations)  # never computed
    finish(driver, trace)
    recs = records(trace)
    load = jobs(recs, "load", "r1")[0]
    assert transitions(trace, "r1") == ["load_started", "failed"]
    assert done_of(recs, load["job"])["failed"] == 1
    warning = next(r for r in recs if r["kind"] == "warning" and r["what"] == "load_failed")
    assert "'fail'" in warning["note"]
    # Its blocks are freed only after the load reported (vLLM waits for finished_recving).
    started = recs.index(load)
    done_at = next(i for i, r in enumerate(recs) if r["kind"] == "job_done" and r["job"] == load["job"])
    blocks = {m[1] for m in load["moves"]}
    frees = [i for i, r in enumerate(recs) if i > started and r["kind"] == "free" and blocks & set(r["blocks"])]
    assert frees and min(frees) > done_at


def fail_store_block(index: int, rid: str = "r0") -> Any:
    def fail(worker_rank: int, kind: str, req_id: str, hashes: list[int]) -> list[int]:
        return [hashes[index]] if kind == "store" and req_id == rid else []

    return fail


def test_failed_store_publishes_nothing_and_the_request_still_finishes(model_dir: Path, tmp_path: Path) -> None:
    trace = tmp_path / "store-failed.jsonl"
    driver = VllmDriver(build_scheduler(model_dir, kvlife_spec(trace, stack="")),
                        [SimulatedWorker(0, load_delay=1, store_delay=1, fail=fail_store_block(1))])
    warm_tier(driver)  # r0's store of the four prefix blocks fails on its second block
    failed_hash = inner(driver).core.state.requests["r0"].hashes[1]
    assert not inner(driver).core.state.tiers["host"].contains(failed_hash)
    assert inner(driver).core.state.stats.failed_stores == 1
    # The next request hits only the block before the failed one, and computes the rest.
    driver.add("r1", R1, 2)
    run_until(driver, lambda: "r1" in driver.observations[-1].scheduled)
    assert sum(o.external_hits.get("r1", 0) for o in driver.observations) == BS
    assert driver.observations[-1].scheduled["r1"] == (BS, len(R1) - BS)
    finish(driver, trace)
    recs = records(trace)
    store = jobs(recs, "store", "r0")[0]
    assert store["moves"][1][0] == failed_hash and done_of(recs, store["job"])["failed"] == 1
    warning = next(r for r in recs if r["kind"] == "warning" and r["what"] == "store_failed")
    assert warning["job"] == store["job"] and warning["blocks"] == [failed_hash]
    # Held while storing, released after the (failed) store reported.
    assert transitions(trace, "r0")[-2:] == ["send_started", "completed"]


@pytest.mark.parametrize("timeout", [3, None], ids=["timeout-3", "no-timeout"])
def test_a_store_that_never_ends(model_dir: Path, tmp_path: Path, timeout: int | None) -> None:
    trace = tmp_path / "store-hangs.jsonl"
    spec = kvlife_spec(trace, stack="", store_timeout_ms=timeout)  # the connector's clock: one ms a pass
    driver = VllmDriver(build_scheduler(model_dir, spec), [SimulatedWorker(0, store_delay=None)])
    driver.add("r0", PREFIX + [100, 101, 102], 2)
    run_until(driver, lambda: driver.scheduler.requests["r0"].is_finished())
    finished_at = driver.step_index
    if timeout is None:
        # vLLM keeps a held request's blocks until finished_sending: without a timeout
        # they stay held, and the trace says the request is stranded while sending.
        for _ in range(10):
            driver.step()
        assert "r0" in driver.scheduler.requests and driver.scheduler.kv_cache_manager.get_block_ids("r0")[0]
        close(driver)
        report = validate(trace)
        assert {f.invariant for f in report.findings} == {7}
        assert any("r0 stranded in sending" in f.message for f in report.findings)
        assert any("never reported" in f.message for f in report.findings)
        return
    run_until(driver, lambda: driver.status("r0") is None)
    assert driver.step_index - finished_at <= timeout + 1  # released once the store was given up on
    evict(driver)
    driver.add("r1", R1, 2)
    run_until(driver, lambda: "r1" in driver.observations[-1].scheduled)
    assert sum(o.external_hits.get("r1", 0) for o in driver.observations) == 0  # nothing was published
    finish(driver, trace)
    recs = records(trace)
    store = jobs(recs, "store", "r0")[0]
    abandoned = next(r for r in recs if r["kind"] == "warning" and r["what"] == "rank_timeout")
    assert abandoned["job"] == store["job"] and abandoned["ranks"] == [0]
    assert done_of(recs, store["job"])["failed"] == len(store["moves"])
    assert transitions(trace, "r0")[-2:] == ["send_started", "completed"]
