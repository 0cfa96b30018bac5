"""Stored KV bytes are bound to their writer (issue 12, item 2): a block from another rank,
another dtype or model of the same block size, or a well-formed value re-checksummed under
another layout fingerprint, is a miss plus a tier event, on disk and in Redis, with or
without ``live.verify``."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import attrs
import pytest
import redis
import torch

from kvlife.transfer.block_header import (
    FORMAT_VERSION,
    HEADER_BYTES,
    MAGIC,
    BlockFormat,
    Header,
    Mismatch,
    hash_fingerprint,
    layout_fingerprint,
    parse,
)
from kvlife.transfer.content import expected_bytes
from kvlife.transfer.disk_tier import DiskTier
from kvlife.transfer.layout import LLAMA3_8B_SHAPE, SMALL_SHAPE, BlockGeometry
from kvlife.transfer.redis_tier import RedisTier
from tests.redis_server import RedisServer

GEO = BlockGeometry(SMALL_SHAPE, world_size=2)  # two ranks, float16
# Same block size, other writers: bfloat16 (same itemsize), another model of the same shape.
BF16 = BlockGeometry(attrs.evolve(SMALL_SHAPE, dtype="bfloat16"), world_size=2)
OTHER_MODEL = BlockGeometry(attrs.evolve(SMALL_SHAPE, model="another-model"), world_size=2)
HASH = 0x5EED


def _payload(geometry: BlockGeometry, rank: int, block_hash: int = HASH) -> bytes:
    return expected_bytes(geometry, block_hash, rank).numpy().tobytes()


def _value(geometry: BlockGeometry, rank: int, block_hash: int = HASH) -> bytes:
    """What ``rank`` of ``geometry`` stores for ``block_hash``: header, then payload."""
    payload = _payload(geometry, rank, block_hash)
    return bytes(BlockFormat(geometry, rank).pack(block_hash, memoryview(payload))) + payload


def _rechecksummed(value: bytes, layout: int) -> bytes:
    """``value`` with its layout fingerprint replaced and the header checksum recomputed:
    well-formed, only not this reader's."""
    header = bytearray(value[:HEADER_BYTES])
    struct.pack_into("<Q", header, 8, layout)
    struct.pack_into("<I", header, HEADER_BYTES - 4, zlib.crc32(header[: HEADER_BYTES - 4]))
    return bytes(header) + value[HEADER_BYTES:]


# ---- the header itself --------------------------------------------------------------------
def test_header_layout_is_fixed_and_names_its_writer() -> None:
    value = _value(GEO, 1)
    assert value[:4] == MAGIC and len(value) == HEADER_BYTES + GEO.block_bytes == 64 + 2048
    parsed = parse(value[:HEADER_BYTES])
    assert parsed == Header(version=FORMAT_VERSION, layout=layout_fingerprint(GEO), rank=1, world_size=2,
                            length=GEO.block_bytes, payload_crc=zlib.crc32(value[HEADER_BYTES:]),
                            hash_fingerprint=hash_fingerprint(HASH), block_hash=HASH)
    # The fingerprint covers model, dtype, block tokens, layers, heads, head dim and TP degree.
    shapes = [SMALL_SHAPE, attrs.evolve(SMALL_SHAPE, dtype="bfloat16"), attrs.evolve(SMALL_SHAPE, model="m2"),
              attrs.evolve(SMALL_SHAPE, block_tokens=8), attrs.evolve(SMALL_SHAPE, num_layers=3),
              attrs.evolve(SMALL_SHAPE, num_kv_heads=8), attrs.evolve(SMALL_SHAPE, head_dim=64)]
    prints = {layout_fingerprint(BlockGeometry(s, 2)) for s in shapes}
    assert len(prints | {layout_fingerprint(BlockGeometry(SMALL_SHAPE))}) == len(shapes) + 1
    # Stable across processes and versions (blake2b, not Python's randomised hash()): a
    # changed value makes every stored block unreadable, so it is pinned here.
    assert layout_fingerprint(BlockGeometry(SMALL_SHAPE)) == 0xC6BC12711E588459
    assert layout_fingerprint(BlockGeometry(LLAMA3_8B_SHAPE, 4)) == 0x12D10B3C13EE3981


@pytest.mark.parametrize(
    ("value", "kind"),
    [
        (_value(GEO, 1), "foreign_rank"),  # the other rank's shard of the same block
        (_value(BF16, 0), "foreign_layout"),  # bfloat16, same block size
        (_value(OTHER_MODEL, 0), "foreign_layout"),  # another model, same shape
        (_rechecksummed(_value(GEO, 0), layout_fingerprint(BF16)), "foreign_layout"),
        (_value(GEO, 0, HASH + 1), "hash_mismatch"),  # another block's value
        (_value(GEO, 0)[:HEADER_BYTES] + bytes(GEO.block_bytes), "checksum_mismatch"),
        (b"\0" * 8 + _value(GEO, 0)[8:], "bad_header"),
    ],
    ids=["other-rank", "other-dtype", "other-model", "rechecksummed", "other-block", "corrupt", "no-magic"],
)
def test_a_block_not_this_readers_is_a_mismatch(value: bytes, kind: str) -> None:
    reader = BlockFormat(GEO, rank=0)
    got = reader.check(value[:HEADER_BYTES], HASH, value[HEADER_BYTES:])
    assert isinstance(got, Mismatch) and got.kind == kind, got
    assert isinstance(reader.check(_value(GEO, 0)[:HEADER_BYTES], HASH, _value(GEO, 0)[HEADER_BYTES:]), Header)


# ---- disk ---------------------------------------------------------------------------------
def _disk_value_in_slot(tmp_path: Path, value: bytes) -> tuple[DiskTier, int]:
    tier = DiskTier(tmp_path / "rank0.kvblocks", GEO, 4, rank=0)
    assert tier.write_block(HASH, 2, _payload(GEO, 0))
    with open(tier.path, "r+b") as f:  # someone else's bytes in the slot
        f.seek(2 * tier.slot_stride)
        f.write(value)
    return tier, 2


@pytest.mark.parametrize(
    ("value", "event"),
    [
        (_value(GEO, 1), "disk_foreign_rank"),
        (_value(BF16, 0), "disk_foreign_layout"),
        (_rechecksummed(_value(GEO, 0), layout_fingerprint(OTHER_MODEL)), "disk_foreign_layout"),
    ],
    ids=["other-rank", "other-dtype", "rechecksummed"],
)
def test_disk_serves_only_its_own_writers_blocks(tmp_path: Path, value: bytes, event: str) -> None:
    tier, slot = _disk_value_in_slot(tmp_path, value)
    dst = torch.full((GEO.block_bytes,), 7, dtype=torch.uint8)
    assert tier.read_into(HASH, slot, dst) is False
    (got,) = tier.drain_events()
    assert got["event"] == event and got["block"] == HASH and got["reason"]
    tier.close()
    # Reopened (a named disk path on restart): the foreign slot is dropped, never indexed.
    with DiskTier(tmp_path / "rank0.kvblocks", GEO, 4, rank=0) as again:
        assert again.recovered == {}
        (dropped,) = again.drain_events()
        assert dropped["event"] == "disk_slot_dropped" and dropped["slot"] == slot


def test_disk_file_of_the_other_rank_recovers_nothing(tmp_path: Path) -> None:
    with DiskTier(tmp_path / "kv.bin", GEO, 4, rank=1) as rank1:
        assert rank1.write_block(HASH, 0, _payload(GEO, 1))
    with DiskTier(tmp_path / "kv.bin", GEO, 4, rank=0) as rank0:
        assert rank0.recovered == {}
        assert [e["reason"].split(",")[0] for e in rank0.drain_events()] == ["written by rank 1 of 2"]


# ---- Redis --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "event"),
    [
        (_value(GEO, 1), "redis_foreign_rank"),
        (_value(BF16, 0), "redis_foreign_layout"),
        (_rechecksummed(_value(GEO, 0), layout_fingerprint(BF16)), "redis_foreign_layout"),
    ],
    ids=["other-rank", "other-dtype", "rechecksummed"],
)
def test_redis_serves_only_its_own_writers_values(server: RedisServer, value: bytes, event: str) -> None:
    tier = RedisTier(server.url, GEO, rank=0, key_prefix="kvlife:t")
    assert tier.put_many([(HASH, _payload(GEO, 0))]) == [True]
    assert tier.get_many([HASH]) == [_payload(GEO, 0)]
    tier.client.set(tier.key(HASH), value)  # someone else's bytes under this rank's key
    dst = torch.full((1, GEO.block_bytes), 7, dtype=torch.uint8)
    assert tier.read_blocks([(HASH, -1)], dst) == [False]
    assert (dst == 7).all(), "nothing of the foreign value reached the destination"
    (got,) = tier.drain_events()
    assert got["event"] == event and got["block"] == HASH and got["reason"]
    tier.close()


def test_redis_keys_are_namespaced_by_layout_and_rank(server: RedisServer) -> None:
    """Writers of another dtype, model or rank never even see this tier's keys."""
    admin = redis.Redis.from_url(server.url)
    tiers = [RedisTier(server.url, g, rank=r, key_prefix="kvlife:ns") for g, r in
             ((GEO, 0), (GEO, 1), (BF16, 0), (OTHER_MODEL, 0))]
    for tier in tiers:
        assert tier.put_many([(HASH, _payload(tier.geometry, tier.rank))]) == [True]
    assert len({t.key(HASH) for t in tiers}) == 4 and admin.dbsize() == 4
    for tier in tiers:
        assert tier.get_many([HASH]) == [_payload(tier.geometry, tier.rank)]
        assert tier.drain_events() == []
        assert 0 < admin.ttl(tier.key(HASH)) <= 3600  # a TTL by default
        tier.close()
    admin.close()


# ---- a live run, --no-verify ---------------------------------------------------------------
def test_live_run_without_verify_never_serves_foreign_values(server: RedisServer, tmp_path: Path) -> None:
    """Mid-run, every Redis value of the run is replaced by the other rank's value of the
    same block, a bfloat16 writer's, or one re-checksummed under another fingerprint. With
    verification off, each load of them is still a miss (the request recomputes), a tier
    event, a warning in the trace and a count in the summary."""
    from kvlife.lifecycle.config import EngineConfig, LiveConfig, RunConfig, SimConfig, TierConfig
    from kvlife.lifecycle.drivers.live import run_live
    from kvlife.lifecycle.traces.trace import read_trace
    from kvlife.lifecycle.traces.validate import validate
    from kvlife.lifecycle.workloads.synthetic import synthetic_workload

    config = RunConfig(
        engine=EngineConfig(device_blocks=48, max_running=12, ranks=2,
                            tiers=(TierConfig("host", 16), TierConfig("remote", 2000))),
        sim=SimConfig(max_output_tokens=12),
        live=LiveConfig(redis_url=server.url, verify=False),
    )
    admin = redis.Redis.from_url(server.url)
    swapped: list[int] = []

    def plant(done: int, total: int) -> None:
        if swapped or done < total // 4:
            return
        for key in admin.keys("kvlife:*"):
            prefix, run, layout, rank, block = key.decode().split(":")
            value = admin.get(key)
            assert isinstance(value, bytes)
            other = admin.get(f"{prefix}:{run}:{layout}:{1 - int(rank)}:{block}")
            choice = len(swapped) % 3
            if choice == 0 and isinstance(other, bytes):
                admin.set(key, other)  # the other rank's shard of the same block
            elif choice == 1:
                geometry = BlockGeometry(attrs.evolve(SMALL_SHAPE, dtype="bfloat16", block_tokens=512), 2)
                payload = value[HEADER_BYTES:]
                admin.set(key, bytes(BlockFormat(geometry, int(rank)).pack(int(block), memoryview(payload))) + payload)
            else:
                admin.set(key, _rechecksummed(value, 0xDEAD))
            swapped.append(int(block))

    trace = tmp_path / "t.jsonl"
    outcome = run_live(config, synthetic_workload(seed=11, num_requests=120, arrival_rate_per_s=4.0),
                       trace_path=trace, time_scale=40.0, progress=plant)
    admin.close()
    assert swapped
    foreign = {k: v for k, v in outcome.summary["warnings"].items() if k.startswith("redis_foreign_")}
    # Both kinds came back (timing decides how many): the swapped ranks' and the other layouts'.
    assert foreign.get("redis_foreign_layout", 0) > 0 and foreign.get("redis_foreign_rank", 0) > 0, foreign
    assert sum(foreign.values()) == sum(1 for e in outcome.stats.tier_events if e["event"] in foreign)
    assert outcome.summary["live"]["blocks_verified"] == 0  # verification really was off
    assert outcome.result.stranded == [] and sum(outcome.summary["finished"].values()) == 120
    traced = [r for _, r in read_trace(trace) if r["kind"] == "warning" and r["what"].startswith("redis_foreign_")]
    assert len(traced) == sum(foreign.values()) and all(r["reason"] for r in traced)
    # A miss is a failed block of its load: the request recomputes from there.
    assert any(r["kind"] == "transition" and r["trigger"] == "load_failed" for _, r in read_trace(trace))
    assert validate(trace).ok
