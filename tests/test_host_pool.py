"""Host pool bytes, alone and through the copy engine with its index."""

from __future__ import annotations

import pytest
import torch

from kvlife.transfer.content import expected_bytes, fill_block, verify_block
from kvlife.transfer.copy_engine import CopyEngine, Move
from kvlife.transfer.host_pool import HostPool
from kvlife.transfer.layout import SMALL_SHAPE, BlockGeometry, DeviceKV

GEO = BlockGeometry(SMALL_SHAPE)


def test_write_read_single_and_batched() -> None:
    pool = HostPool(GEO, 8, pin_memory=False)
    pool.write(3, expected_bytes(GEO, 1))
    out = torch.empty(GEO.block_bytes, dtype=torch.uint8)
    pool.read(3, out)
    assert torch.equal(out, expected_bytes(GEO, 1))
    src = torch.stack([expected_bytes(GEO, h) for h in (10, 11, 12)])
    pool.write_many([7, 0, 4], src)
    dst = torch.empty_like(src)
    pool.read_many([0, 4, 7], dst)
    assert torch.equal(dst[0], src[1]) and torch.equal(dst[1], src[2]) and torch.equal(dst[2], src[0])
    with pytest.raises(IndexError):
        pool.write(8, src[0])


@pytest.mark.parametrize("eviction", ["lru", "arc"])
def test_round_trip_through_engine_with_eviction(eviction: str) -> None:
    kv = DeviceKV(GEO, 32, device="cpu")
    pool = HostPool(GEO, 6, eviction=eviction, pin_memory=False)
    engine = CopyEngine(kv, 0, {"host": pool})
    stored: dict[int, int] = {}
    for step in range(4):
        hashes = [100 * step + i for i in range(3)]
        device = [step * 3 + i for i in range(3)]
        for h, b in zip(hashes, device, strict=True):
            fill_block(kv, b, h)
        plan = pool.index.prepare_store(hashes)
        for victim in plan.evicted:
            stored.pop(victim)
        moves = [Move(h, device[hashes.index(h)], "host", slot) for h, slot in plan.accepted]
        engine.submit_store(f"store-{step}", moves)
        engine.flush()
        (done,) = engine.poll()
        assert done.failed_hashes == () and done.kind == "store"
        pool.index.complete_store([h for h, _ in plan.accepted])
        stored.update({h: s for h, s in plan.accepted})
        pool.index.check_accounting()
    assert pool.index.used == 6 and pool.index.evictions == 6
    # Load everything still held into fresh device blocks and check every byte.
    kv.data[24:].zero_()
    survivors = sorted(stored)
    slots = pool.index.prepare_load(survivors)
    targets = list(range(31, 31 - len(survivors), -1))
    moves = [Move(h, t, "host", s) for h, t, s in zip(survivors, targets, slots, strict=True)]
    engine.submit_load("load", moves)
    engine.flush()
    (done,) = engine.poll()
    pool.index.complete_load(survivors)
    assert done.failed_hashes == ()
    for h, t in zip(survivors, targets, strict=True):
        assert verify_block(kv, t, h)
    pool.index.check_accounting()
