"""KVLifeConnector's worker side with real bytes, on CPU: HostPoolWorker under vLLM's real Scheduler.

The worker-side connector is driven as vLLM's model runner drives it (``ConnectorWorker``);
a stand-in for the model writes each computed token's KV into a paged tensor in
FlashAttention's layout, ``(2, num_blocks, block_size, heads, head_size)``, as a function of
the token and its position. A second request that hits the host tier must find, in the
device blocks its load filled, exactly the bytes the first request computed.
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

import torch  # noqa: E402
from vllm_scenarios import BS, PREFIX, evict, finish, inner, kvlife_spec, records, run_until  # noqa: E402

from kvlife.lifecycle.drivers.vllm.harness import (  # noqa: E402
    ConnectorWorker,
    VllmDriver,
    build_scheduler,
    scheduled_chunks,
)
from kvlife.lifecycle.drivers.vllm.worker import HostPoolWorker  # noqa: E402

HEADS, HEAD_SIZE, NUM_BLOCKS = 2, 4, 10
POISON = -1.0  # what a block holds before a load or a computation writes it


def token_kv(token: int, position: int) -> torch.Tensor:
    """The K and V rows a token at a position gets: ``(2, heads, head_size)``, exact in float32."""
    base = float(token * 4096 + position)
    row = base + torch.arange(HEADS * HEAD_SIZE, dtype=torch.float32).reshape(HEADS, HEAD_SIZE) / 8
    return torch.stack([row, -row])


def expected_block(tokens: list[int], index: int) -> torch.Tensor:
    """Block ``index`` of a sequence: ``(2, block_size, heads, head_size)``."""
    return torch.stack([token_kv(tokens[p], p) for p in range(index * BS, (index + 1) * BS)], dim=1)


class Model:
    """Writes the KV of the tokens each step computes, into the blocks vLLM gave them."""

    def __init__(self, kv: torch.Tensor) -> None:
        self.kv = kv
        self.scheduler: Any = None
        self.blocks_of: dict[str, list[int]] = {}

    def forward(self, out: Any) -> None:
        for rid, (before, n) in scheduled_chunks(out).items():
            request = self.scheduler.requests[rid]
            blocks = list(self.scheduler.kv_cache_manager.get_block_ids(rid)[0])
            self.blocks_of[rid] = blocks
            for p in range(before, before + n):
                self.kv[:, blocks[p // BS], p % BS] = token_kv(request.all_token_ids[p], p)


def host_worker(driver: VllmDriver) -> HostPoolWorker:
    worker = driver.workers[0]
    assert isinstance(worker, ConnectorWorker)
    host = worker.connector.inner.worker  # RecordingConnector -> KVLifeConnector -> HostPoolWorker
    assert isinstance(host, HostPoolWorker)
    return host


def build(model_dir: Path, trace: Path) -> tuple[VllmDriver, Model]:
    spec = kvlife_spec(trace, stack="", num_blocks=NUM_BLOCKS, num_kv_heads=HEADS, head_size=HEAD_SIZE,
                       kv_load_failure_policy="recompute")
    kv = torch.full((2, NUM_BLOCKS, BS, HEADS, HEAD_SIZE), POISON)
    model = Model(kv)
    worker = ConnectorWorker.build(model_dir, spec, {"model.layers.0.self_attn.attn": kv}, forward=model.forward)
    driver = VllmDriver(build_scheduler(model_dir, spec), [worker])
    model.scheduler = driver.scheduler
    return driver, model


def fail_third_block(rank: int, kind: str, req_id: str, hashes: list[int]) -> list[int]:
    return [hashes[2]] if kind == "load" else []


@pytest.mark.parametrize("failure", [None, "third-block", "copy-error"])
def test_host_pool_worker_round_trips_real_bytes(model_dir: Path, tmp_path: Path, failure: str | None) -> None:
    trace = tmp_path / "bytes.jsonl"
    driver, model = build(model_dir, trace)
    host = host_worker(driver)
    first = PREFIX + [100, 101, 102]
    driver.add("r0", first, 2)
    run_until(driver, lambda: driver.status("r0") is None)
    r0_blocks = model.blocks_of["r0"][:4]
    # Stored to host: the tier's slot of each prefix block holds that block's bytes.
    core = inner(driver).core
    assert host.pool is not None
    for i, h in enumerate(core.state.requests["r0"].hashes[:4]):
        stored = host.pool.data[core.state.tiers["host"].slot_of(h)]
        assert torch.equal(stored, expected_block(first, i).reshape(-1).view(torch.uint8)), f"block {i}"
    evict(driver)
    model.kv.fill_(POISON)  # nothing runs: whatever a block holds from now on was loaded or computed
    # A request that holds the blocks r0 computed in (vLLM hands them out first), so r1's
    # load has to land elsewhere.
    driver.add("holder", list(range(2000, 2040)), 8)
    driver.step()
    assert set(model.blocks_of["holder"]) & set(r0_blocks)
    if failure == "third-block":
        host.fail = fail_third_block
    elif failure == "copy-error":
        def broken(slots: Any, dst: Any) -> None:
            raise RuntimeError("host pool read failed")

        host.pool.read_many = broken  # type: ignore[method-assign]
    second = PREFIX + [200, 201]
    driver.add("r1", second, 2)
    obs = driver.step()
    assert obs.external_hits == {"r1": 64}
    assert not set(driver.scheduler.kv_cache_manager.get_block_ids("r1")[0]) & set(model.blocks_of["holder"])
    # CPU copies are synchronous: the load landed in this step, into r1's own blocks.
    r1_blocks = list(driver.scheduler.kv_cache_manager.get_block_ids("r1")[0])[:4]
    landed = [torch.equal(model.kv[:, b], expected_block(second, i)) for i, b in enumerate(r1_blocks)]
    untouched = [bool((model.kv[:, b] == POISON).all()) for b in r1_blocks]
    if failure is None:
        assert landed == [True] * 4
    elif failure == "third-block":
        assert landed == [True, True, False, True] and untouched[2]  # the failed block was not copied
    else:
        assert untouched == [True] * 4 and host.copy_errors == 1
    obs = driver.step()
    assert "holder" in obs.scheduled  # both run side by side
    recompute_from = {None: 4, "third-block": 2, "copy-error": 0}[failure] * BS
    assert obs.scheduled["r1"] == (recompute_from, len(second) - recompute_from)
    run_until(driver, lambda: driver.status("r1") is None)
    # Loaded or recomputed, every block r1 used holds r1's KV.
    for i, b in enumerate(model.blocks_of["r1"][:4]):
        assert torch.equal(model.kv[:, b], expected_block(second, i)), f"block {i}"
    finish(driver, trace)
    recs = records(trace)
    load = next(r for r in recs if r["kind"] == "job" and r["op"] == "load" and r["req"] == "r1")
    assert [m[1] for m in load["moves"]] == r1_blocks
    failed = next(r["failed"] for r in recs if r["kind"] == "job_done" and r["job"] == load["job"])
    assert failed == {None: 0, "third-block": 1, "copy-error": 4}[failure]
