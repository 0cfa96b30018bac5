"""Copy engine: coalescing and copy strategies give exact bytes; tier faults become
failed hashes of the right job."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlife.transfer.content import fill_block, verify_block
from kvlife.transfer.copy_engine import CopyEngine, Move, _runs
from kvlife.transfer.disk_tier import DiskTier
from kvlife.transfer.host_pool import HostPool
from kvlife.transfer.layout import SMALL_SHAPE, BlockGeometry, DeviceKV

GEO = BlockGeometry(SMALL_SHAPE)
NUM_DEVICE = 48
NUM_SLOTS = 40
# small_block_bytes above / below the 4 KB test block forces each CPU strategy.
SMALL_PATH = 1 << 30
LARGE_PATH = 1


def test_runs_coalesce_both_sides() -> None:
    pairs = [(1, 10), (2, 11), (3, 12), (4, 20), (6, 21), (7, 22)]
    assert _runs(pairs) == [(1, 10, 3), (4, 20, 1), (6, 21, 2)]


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    threshold=st.sampled_from([SMALL_PATH, LARGE_PATH]),
    count=st.integers(min_value=1, max_value=20),
)
def test_store_then_load_is_byte_exact_for_any_block_ids(data: st.DataObject, threshold: int, count: int) -> None:
    kv = DeviceKV(GEO, NUM_DEVICE, device="cpu")
    pool = HostPool(GEO, NUM_SLOTS, pin_memory=False)
    engine = CopyEngine(kv, 0, {"host": pool}, staging_bytes=5 * GEO.block_bytes, small_block_bytes=threshold)
    ids = st.lists(st.integers(0, NUM_DEVICE - 1), min_size=count, max_size=count, unique=True)
    sources = data.draw(ids, label="sources")
    slots = data.draw(
        st.lists(st.integers(0, NUM_SLOTS - 1), min_size=count, max_size=count, unique=True),
        label="slots",
    )
    hashes = [1000 + i for i in range(count)]
    for h, b in zip(hashes, sources, strict=True):
        fill_block(kv, b, h)
    engine.submit_store("s", [Move(h, b, "host", s) for h, b, s in zip(hashes, sources, slots, strict=True)])
    engine.flush()
    assert engine.poll()[0].failed_hashes == ()
    kv.data.zero_()
    targets = data.draw(ids, label="targets")
    engine.submit_load("l", [(h, t, "host", s) for h, t, s in zip(hashes, targets, slots, strict=True)])
    engine.flush()
    assert engine.poll()[0].failed_hashes == ()
    for h, t in zip(hashes, targets, strict=True):
        assert verify_block(kv, t, h)
    untouched = sorted(set(range(NUM_DEVICE)) - set(targets))
    assert not kv.flat[untouched].any()


@pytest.mark.parametrize("threshold", [SMALL_PATH, LARGE_PATH])
def test_disk_jobs_through_small_staging(tmp_path: Path, threshold: int) -> None:
    kv = DeviceKV(GEO, 32, device="cpu")
    disk = DiskTier(tmp_path / "tier.bin", GEO, 16)
    engine = CopyEngine(kv, 3, {"disk": disk}, staging_bytes=3 * GEO.block_bytes, small_block_bytes=threshold)
    assert engine.staging_blocks == 3
    sources = [9, 2, 3, 4, 17, 11, 12, 30, 0, 1]
    hashes = [500 + i for i in range(len(sources))]
    for h, b in zip(hashes, sources, strict=True):
        fill_block(kv, b, h, rank=0)
    plan = disk.index.prepare_store(hashes)
    slot = dict(plan.accepted)
    # Two jobs in one flush, split across staging chunks.
    moves = [Move(h, b, "disk", slot[h]) for h, b in zip(hashes, sources, strict=True)]
    engine.submit_store("a", moves[:4])
    engine.submit_store("b", moves[4:])
    engine.flush()
    done = engine.poll()
    assert [(c.job_id, c.rank, c.failed_hashes) for c in done] == [("a", 3, ()), ("b", 3, ())]
    disk.index.complete_store(hashes)

    # Corrupt the payload of one block on disk.
    bad = hashes[5]
    with open(tmp_path / "tier.bin", "r+b") as f:
        f.seek(slot[bad] * disk.slot_stride + 64 + 100)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    kv.data.zero_()
    targets = [20, 21, 22, 5, 6, 7, 8, 25, 27, 29]
    disk.index.prepare_load(hashes)
    moves = [Move(h, t, "disk", slot[h]) for h, t in zip(hashes, targets, strict=True)]
    engine.submit_load("x", moves[:5])
    engine.submit_load("y", moves[5:])
    engine.flush()
    done = engine.poll()
    assert [(c.job_id, c.kind, c.failed_hashes) for c in done] == [("x", "load", ()), ("y", "load", (bad,))]
    disk.index.complete_load(hashes)
    disk.index.discard([bad])
    for h, t in zip(hashes, targets, strict=True):
        if h == bad:
            assert not kv.flat[t].any()  # bad bytes never reach the device
        else:
            assert verify_block(kv, t, h)
    assert [e["event"] for e in disk.drain_events()] == ["disk_checksum_mismatch"]
    disk.index.check_accounting()
    disk.close()


def test_failed_disk_write_fails_only_that_block(tmp_path: Path) -> None:
    calls = []

    def flaky(fd: int, buffers: object, offset: int) -> int:
        calls.append(offset)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return os.pwritev(fd, buffers, offset)  # type: ignore[arg-type]

    kv = DeviceKV(GEO, 8, device="cpu")
    disk = DiskTier(tmp_path / "t.bin", GEO, 4, writer=flaky)
    engine = CopyEngine(kv, 0, {"disk": disk})
    for b in range(3):
        fill_block(kv, b, b + 1)
    engine.submit_store(7, [Move(b + 1, b, "disk", b) for b in range(3)])
    engine.flush()
    (done,) = engine.poll()
    assert done.failed_hashes == (2,)


def test_submission_errors_and_empty_poll() -> None:
    kv = DeviceKV(GEO, 8, device="cpu")
    pool = HostPool(GEO, 4, pin_memory=False)
    engine = CopyEngine(kv, 0, {"host": pool})
    assert engine.poll() == []
    engine.flush()  # nothing queued: a no-op
    with pytest.raises(ValueError, match="unknown tier"):
        engine.submit_load(1, [Move(1, 0, "disk", 0)])
    with pytest.raises(ValueError, match="slot"):
        engine.submit_load(1, [Move(1, 0, "host", 4)])
    with pytest.raises(ValueError, match="device block"):
        engine.submit_load(1, [Move(1, 8, "host", 0)])
    engine.submit_load(1, [Move(1, 0, "host", 0)])
    with pytest.raises(ValueError, match="under transfer"):
        engine.submit_load(2, [Move(2, 0, "host", 1)])
    with pytest.raises(ValueError, match="under transfer"):
        engine.submit_store(3, [Move(3, 0, "host", 2)])
    assert engine.pending_jobs == 1
    engine.flush()
    assert engine.pending_jobs == 1 and len(engine.poll()) == 1 and engine.pending_jobs == 0
    # After the flush the block is free for the next step's transfers.
    engine.submit_store(4, [Move(1, 0, "host", 1)])
    other = HostPool(BlockGeometry(SMALL_SHAPE, world_size=2), 4, pin_memory=False)
    with pytest.raises(ValueError, match="byte"):
        CopyEngine(kv, 0, {"host": other})


def test_bench_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvlife.transfer.transfer_bench import format_table, main, run_transfer_bench

    rows = run_transfer_bench(
        block_sizes=(16 * 1024,),
        batches=(1, 4),
        repeats=1,
        pool_bytes=1 << 20,
        disk_dir=str(tmp_path),
        lookup_samples=3,
    )
    assert [(r["tier"], r["batch"]) for r in rows] == [("host", 1), ("host", 4), ("disk", 1), ("disk", 4)]
    assert all(r["load_gbps"] > 0 and r["store_ratio"] > 0 for r in rows)
    assert "load/raw" in format_table(rows)
    argv = ["--block-sizes", "16K", "--batches", "2", "--repeats", "1", "--pool-mb", "1", "--tiers", "host"]
    assert main([*argv, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["kind"] == "bench-transfer" and result["schema"] == 1
    assert [(r["tier"], r["block_bytes"], r["batch"]) for r in result["rows"]] == [("host", 16 * 1024, 2)]
