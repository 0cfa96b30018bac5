"""KVLifeConnector under call sequences of vLLM 0.33's scheduler that the peer suite found
(scripts/vllm_peer), on which the connector core used to raise ``IllegalTransition`` into
vLLM's scheduler: ``reset_prefix_cache(reset_running_requests=True)`` preempting running
requests outside ``schedule()``, and a resumable request (a streaming input session)
admitted again for its next input chunk. Each runs with KVLifeConnector writing its own
trace, and inside RecordingConnector (the recorder's core takes the same calls): the
request finishes, the trace validates, and the blocks and hits are the ones vLLM's
semantics mean."""

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

from vllm_scenarios import BS, PREFIX, kvlife_spec, records, run_until, transitions, warm_tier  # noqa: E402

from kvlife.lifecycle.drivers.vllm.connector import block_hash_int  # noqa: E402
from kvlife.lifecycle.drivers.vllm.harness import SchedulerSpec, VllmDriver, build_scheduler  # noqa: E402
from kvlife.lifecycle.engine.connector import ConnectorCore  # noqa: E402
from kvlife.lifecycle.traces.validate import validate  # noqa: E402

MODES = ("kvlife", "recorded")  # KVLifeConnector's own trace; RecordingConnector around it


def driver_for(model_dir: Path, trace: Path, mode: str) -> VllmDriver:
    if mode == "kvlife":
        spec = SchedulerSpec(block_size=BS, num_blocks=10,
                             extra={"clock": "steps", "host_blocks": 64, "trace": str(trace)})
    else:
        spec = kvlife_spec(trace, stack="", lookup_delay_steps=1)
    return VllmDriver(build_scheduler(model_dir, spec))


def kvlife_core(driver: VllmDriver) -> ConnectorCore:
    """The core of the KVLifeConnector that serves vLLM (inside the recorder, if any)."""
    connector = driver.scheduler.connector
    return getattr(connector, "inner", connector).core


def close_and_validate(driver: VllmDriver, trace: Path) -> list[dict[str, Any]]:
    run_until(driver, driver.idle)
    driver.drain()
    connector = driver.scheduler.connector
    connector.close() if hasattr(connector, "inner") else connector.shutdown()
    report = validate(trace)
    assert report.ok, report.format()
    recs = records(trace)
    assert not [r for r in recs if r["kind"] == "warning" and r["what"] == "recording_stopped"]
    return recs


def moves(recs: list[dict[str, Any]], op: str, rid: str) -> list[list[int]]:
    """The block hashes of each ``op`` job of ``rid``, in order."""
    return [[m[0] for m in r["moves"]] for r in recs if r["kind"] == "job" and r["op"] == op and r["req"] == rid]


@pytest.mark.parametrize("mode", MODES)
def test_reset_prefix_cache_preempting_running_requests(model_dir: Path, tmp_path: Path, mode: str) -> None:
    """``reset_prefix_cache(reset_running_requests=True)`` preempts the running requests
    outside ``schedule()``; the next pass admits them again before its
    ``build_connector_meta`` names them in ``preempted_req_ids``. The core takes each
    preemption when the request comes back (once: the later entry is not taken again)."""
    trace = tmp_path / "reset.jsonl"
    driver = driver_for(model_dir, trace, mode)
    warm_tier(driver)  # the tier holds PREFIX: the re-admission loads it again
    # (Short answers: no block of generated tokens fills, the trace names only prompt blocks.)
    driver.add("r1", PREFIX + [200], 10)
    driver.add("r2", list(range(300, 308)), 7)  # no full block: admitted again with nothing to load
    run_until(driver, lambda: driver.status("r1") == driver.status("r2") == "RUNNING")
    assert driver.scheduler.reset_prefix_cache(reset_running_requests=True)
    after = driver.step()  # the pass admits both again, then names them preempted
    assert after.preempted == ("r1", "r2") and "r2" in after.scheduled
    run_until(driver, lambda: driver.status("r1") is None and driver.status("r2") is None)
    recs = close_and_validate(driver, trace)

    ends = ("completed",), ("send_started", "completed")
    r1, r2 = transitions(trace, "r1"), transitions(trace, "r2")
    assert r1[:5] == ["load_started", "load_done", "preempted", "load_started", "load_done"] and tuple(r1[5:]) in ends
    assert r2[:3] == ["admitted", "preempted", "admitted"] and tuple(r2[3:]) in ends
    if mode == "kvlife":
        core = kvlife_core(driver)
        req1, req2 = core.requests["r1"], core.requests["r2"]
        assert (req1.preemptions, req2.preemptions, core.state.stats.preemptions) == (1, 1, 2)
        assert (req1.generated, req2.generated) == (10, 7)
        # Its hit is what it found when it came in, not counted again at the re-admission.
        assert req1.tier_hit_blocks == {"host": 4} and req2.tier_hit_blocks == {}
    # Both admissions of r1 load the prefix's four blocks from the tier.
    arrival = next(r for r in recs if r["kind"] == "input" and r["type"] == "arrival" and r["request_id"] == "r1")
    assert moves(recs, "load", "r1") == [arrival["block_hashes"][:4]] * 2


@pytest.mark.parametrize("mode", MODES)
def test_streaming_session_resumed_for_its_next_chunk(model_dir: Path, tmp_path: Path, mode: str) -> None:
    """A resumable request (a streaming input session) that stopped its turn is scheduled
    again for its next chunk with no ``request_finished`` between: its turn ends
    (``turn_ended``), and the chunk is a new admission of the same request on the blocks it
    kept, its prompt the last turn's kept output and the new input."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    trace = tmp_path / "session.jsonl"
    driver = driver_for(model_dir, trace, mode)
    driver.add("r0", [1, 2], 1)  # (the harness's request factory sets up vLLM's block hashing)
    run_until(driver, lambda: driver.status("r0") is None)
    hasher = get_request_block_hasher(BS, sha256)

    def chunk(tokens: list[int], resumable: bool = True) -> Request:
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        return Request(request_id="s", prompt_token_ids=tokens, sampling_params=params, pooling_params=None,
                       block_hasher=hasher, resumable=resumable)

    # 46 tokens and 2 answer tokens: the last (dropped when the turn ends) completes the
    # third block, which the next chunk's token fills anew (vLLM renames the block).
    driver.scheduler.add_request(chunk(list(range(10, 56))))
    run_until(driver, lambda: driver.status("s") == "WAITING_FOR_STREAMING_REQ")
    turn = [block_hash_int(h) for h in driver.scheduler.requests["s"].block_hashes]
    driver.scheduler.add_request(chunk([200]))
    session = driver.scheduler.requests["s"]
    hashes = [block_hash_int(h) for h in session.block_hashes]
    driver.scheduler.add_request(chunk([0], resumable=False))  # the session ends with this chunk's turn
    run_until(driver, lambda: driver.status("s") is None)
    # vLLM resumed it at the 47 tokens it kept (its 46 and the first answer token; the
    # last sampled token is dropped) and computed the chunk's token.
    assert any(o.scheduled.get("s") == (47, 1) for o in driver.observations)
    assert len(turn) == len(hashes) == 3 and turn[:2] == hashes[:2] and turn[2] != hashes[2]
    recs = close_and_validate(driver, trace)

    turns = transitions(trace, "s")
    assert turns[:3] == ["admitted", "turn_ended", "admitted"] and turns[-1] == "completed"
    # The chunk's arrival is in the trace: its prompt the 48 tokens vLLM computes from.
    arrivals = [r for r in recs if r["kind"] == "input" and r["type"] == "arrival" and r["request_id"] == "s"]
    assert [a["prompt_tokens"] for a in arrivals] == [46, 48] and arrivals[1]["block_hashes"] == hashes
    # Its 3 full blocks are stored once each, under vLLM's names of the session's tokens
    # (the third under its new name: the dropped token's is never stored).
    stored = [h for job in moves(recs, "store", "s") for h in job]
    assert stored == hashes
    if mode == "kvlife":
        req = kvlife_core(driver).requests["s"]
        assert (req.prompt_tokens, req.generated, req.confirmed, req.stored_blocks) == (48, 2, 49, 3)
        assert req.preemptions == 0 and req.device_hit_blocks == 0 and req.tier_hit_blocks == {}
