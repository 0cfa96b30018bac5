"""Redis tier against a real redis-server: round trips, pipelined lookups, TTL, and a
server that dies mid-sequence (misses, failed stores, warnings; nothing raises)."""

from __future__ import annotations

import pytest
import redis
import torch

from kvlife.transfer.breaker import CircuitBreaker
from kvlife.transfer.content import expected_bytes, fill_block, verify_block
from kvlife.transfer.copy_engine import CopyEngine, Move
from kvlife.transfer.layout import SMALL_SHAPE, BlockGeometry, DeviceKV
from kvlife.transfer.redis_tier import DEFAULT_TTL_S, HEADER_BYTES, RedisTier
from tests.redis_server import REDIS_SERVER, SKIP_REASON, RedisServer

pytestmark = pytest.mark.skipif(REDIS_SERVER is None, reason=SKIP_REASON)

GEO = BlockGeometry(SMALL_SHAPE)
GEO2 = BlockGeometry(SMALL_SHAPE, world_size=2)  # two tensor-parallel ranks


def _payload(h: int) -> bytes:
    return expected_bytes(GEO, h).numpy().tobytes()


def test_round_trip_and_pipelined_exists(server: RedisServer) -> None:
    tier = RedisTier(server.url, GEO2, rank=1, key_prefix="t")
    payload = {h: expected_bytes(GEO2, h, rank=1) for h in (1, 2, 2**80)}
    assert tier.put_many(list(payload.items())) == [True] * 3
    assert tier.exists_many([1, 3, 2**80, 2]) == [True, False, True, True]
    assert tier.lookup([1, 2, 3, 2**80]) == 2
    assert tier.get_many([2, 3, 2**80]) == [payload[2].numpy().tobytes(), None, payload[2**80].numpy().tobytes()]
    # Keys are per rank: rank 0 sees nothing of rank 1.
    assert RedisTier(server.url, GEO2, rank=0, key_prefix="t").exists_many([1]) == [False]
    # ...and per layout: the same rank of another model shape sees nothing either.
    assert RedisTier(server.url, BlockGeometry(SMALL_SHAPE, world_size=4), rank=1,
                     key_prefix="t").exists_many([1]) == [False]
    assert tier.key(7) == f"t:{tier.format.layout:016x}:1:7"
    assert tier.drain_events() == []
    tier.close()


def test_exists_is_one_round_trip(server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = RedisTier(server.url, GEO)
    executions = []
    original = redis.client.Pipeline.execute

    def counting(self: redis.client.Pipeline, raise_on_error: bool = True) -> list[object]:
        executions.append(len(self.command_stack))
        return original(self, raise_on_error)

    monkeypatch.setattr(redis.client.Pipeline, "execute", counting)
    assert tier.exists_many(list(range(50))) == [False] * 50
    assert executions == [50]


def test_ttl_is_set_by_default(server: RedisServer) -> None:
    tier = RedisTier(server.url, GEO, ttl_seconds=30)
    assert tier.put_many([(9, _payload(9))]) == [True]
    assert 0 < tier.client.ttl(tier.key(9)) <= 30
    default = RedisTier(server.url, GEO, key_prefix="default")
    assert default.put_many([(9, _payload(9))]) == [True]
    assert 3500 < default.client.ttl(default.key(9)) <= DEFAULT_TTL_S == 3600
    no_ttl = RedisTier(server.url, GEO, key_prefix="other", ttl_seconds=None)  # only when asked
    assert no_ttl.put_many([(9, _payload(9))]) == [True]
    assert no_ttl.client.ttl(no_ttl.key(9)) == -1
    with pytest.raises(ValueError):
        RedisTier(server.url, GEO, ttl_seconds=0)


def test_corrupt_or_foreign_values_are_misses(server: RedisServer) -> None:
    tier = RedisTier(server.url, GEO)
    assert tier.put_many([(1, _payload(1)), (2, _payload(2))]) == [True, True]
    stored = tier.client.get(tier.key(1))
    assert isinstance(stored, bytes)
    raw = bytearray(stored)
    raw[HEADER_BYTES + 3] ^= 0x10
    tier.client.set(tier.key(1), bytes(raw))
    tier.client.set(tier.key(2), b"short")
    # A value copied under another block's key is caught by the hash fingerprint.
    tier.client.set(tier.key(3), tier.client.get(tier.key(2)) or b"")
    assert tier.put_many([(4, _payload(4))]) == [True]
    tier.client.set(tier.key(3), tier.client.get(tier.key(4)) or b"")
    tier.client.rpush(tier.key(5), b"x")  # wrong type: an error reply, not bytes
    dst = torch.zeros((4, GEO.block_bytes), dtype=torch.uint8)
    assert tier.read_blocks([(1, -1), (2, -1), (3, -1), (5, -1)], dst) == [False] * 4
    assert not dst.any()
    events = [e["event"] for e in tier.drain_events()]
    assert events == [
        "redis_checksum_mismatch",
        "redis_bad_length",
        "redis_hash_mismatch",
        "redis_bad_length",
    ]


def test_copy_engine_round_trip_via_redis(server: RedisServer) -> None:
    kv = DeviceKV(GEO, 16, device="cpu")
    tier = RedisTier(server.url, GEO)
    engine = CopyEngine(kv, 0, {"redis": tier}, staging_bytes=4 * GEO.block_bytes)
    hashes = list(range(100, 110))
    for i, h in enumerate(hashes):
        fill_block(kv, i, h)
    engine.submit_store("s", [Move(h, i, "redis") for i, h in enumerate(hashes)])
    engine.flush()
    assert engine.poll()[0].failed_hashes == ()
    kv.data.zero_()
    engine.submit_load("l", [Move(h, 15 - i, "redis") for i, h in enumerate([*hashes[:5], 999])])
    engine.flush()
    assert engine.poll()[0].failed_hashes == (999,)
    for i, h in enumerate(hashes[:5]):
        assert verify_block(kv, 15 - i, h)
    assert not kv.flat[10].any()


def test_dead_server_degrades_without_raising() -> None:
    server = RedisServer().start()
    try:
        # A breaker that never opens: every call meets the dead server (test_redis_breaker.py
        # covers the breaker).
        tier = RedisTier(server.url, GEO, socket_timeout=0.2, connect_timeout=0.2,
                         breaker=CircuitBreaker(failures=1000))
        kv = DeviceKV(GEO, 8, device="cpu")
        engine = CopyEngine(kv, 0, {"redis": tier})
        assert tier.put_many([(1, _payload(1)), (2, _payload(2))]) == [True, True]
        assert tier.exists_many([1, 2]) == [True, True]
        server.stop()  # killed mid-sequence, like a crash
        assert not server.running
        assert tier.exists_many([1, 2]) == [False, False]
        assert tier.lookup([1, 2]) == 0
        assert tier.get_many([1, 2]) == [None, None]
        assert tier.put_many([(3, _payload(3))]) == [False]
        fill_block(kv, 0, 3)
        engine.submit_store("s", [Move(3, 0, "redis")])
        engine.submit_load("l", [Move(1, 5, "redis"), Move(2, 6, "redis")])
        engine.flush()
        done = engine.poll()
        assert [(c.job_id, c.failed_hashes) for c in done] == [("s", (3,)), ("l", (1, 2))]
        assert not kv.flat[5:7].any()  # nothing was served
        events = tier.drain_events()
        assert events and all(e["event"] == "redis_unavailable" for e in events)
        assert all(e["level"] == "warning" for e in events)
        assert {e["op"] for e in events} == {"exists", "get", "put"}
        tier.close()
    finally:
        server.stop()


def test_slow_server_times_out_into_misses(server: RedisServer) -> None:
    tier = RedisTier(server.url, GEO, socket_timeout=0.1)
    assert tier.put_many([(1, _payload(1))]) == [True]
    admin = redis.Redis.from_url(server.url)
    admin.execute_command("CLIENT", "PAUSE", 600, "ALL")  # every command stalls 0.6 s
    try:
        assert tier.exists_many([1]) == [False]
        assert tier.get_many([1]) == [None]
        (first, second) = tier.drain_events()
        assert first["event"] == second["event"] == "redis_unavailable"
        assert "Timeout" in first["error"]
    finally:
        admin.execute_command("CLIENT", "UNPAUSE")
        admin.close()
    # Once the server answers again the tier recovers on its own.
    assert tier.get_many([1]) == [_payload(1)]


def test_delete_all_removes_this_ranks_keys_and_nothing_else(server: RedisServer) -> None:
    admin = redis.Redis.from_url(server.url)
    try:
        mine = RedisTier(server.url, GEO, rank=0, key_prefix="kvlife:run1", ttl_seconds=60)
        other_rank = RedisTier(server.url, GEO2, rank=1, key_prefix="kvlife:run1")
        other_run = RedisTier(server.url, GEO, rank=0, key_prefix="kvlife:run2")
        assert mine.put_many([(h, _payload(h)) for h in range(1200)]) == [True] * 1200  # > one SCAN batch
        assert other_rank.put_many([(1, expected_bytes(GEO2, 1, rank=1))]) == [True]
        assert other_run.put_many([(1, _payload(1))]) == [True]
        assert 0 < admin.ttl(mine.key(5)) <= 60
        assert mine.delete_all(batch=500) == 1200
        assert sorted(admin.keys("*")) == sorted(k.encode() for k in (other_rank.key(1), other_run.key(1)))
        assert mine.delete_all() == 0
        # Glob characters in a prefix are matched literally.
        star = RedisTier(server.url, GEO, rank=0, key_prefix="kvlife:*")
        assert star.delete_all() == 0 and admin.dbsize() == 2
        assert mine.drain_events() == []
        for tier in (mine, other_rank, other_run, star):
            tier.close()
    finally:
        admin.close()


def test_delete_all_on_a_dead_server_is_an_event_not_an_error() -> None:
    server = RedisServer().start()
    tier = RedisTier(server.url, GEO, key_prefix="kvlife:gone", socket_timeout=0.2, connect_timeout=0.2)
    server.stop()
    assert tier.delete_all() == 0
    (event,) = tier.drain_events()
    assert event["event"] == "redis_unavailable" and event["op"] == "cleanup"
    tier.close()
