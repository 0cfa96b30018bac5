"""Redis tier: raw block bytes keyed by block hash, on a real Redis server.

Each value is a 24-byte header (magic, crc32 of the payload, payload length, 64-bit
fingerprint of the block hash) followed by the raw payload; never pickle. Reads check all
of it, so a truncated, foreign or corrupted value is a miss, never served.

Redis is a shared, remote, best-effort cache: a dead or slow server must not take the
serving engine down with it. Every public call therefore catches connection and timeout
errors, returns misses / failed stores, and records a warning event the caller drains.
Socket timeouts are small and redis-py's retries are off, so a dead server costs one
failed round trip per call rather than a stall. Batches use non-transactional pipelines:
one round trip per call.

Keys live under a prefix (the live runtime uses one per run) and, with ``ttl_seconds``,
expire on their own; ``delete_all`` removes a rank's keys at the end of a run (SCAN on the
prefix, then UNLINK in batches), so a run leaves nothing behind in a shared server.
"""

from __future__ import annotations

import contextlib
import struct
import zlib
from collections.abc import Sequence
from typing import Any

import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvlife.transfer.content import stable_mix
from kvlife.transfer.layout import BlockGeometry, Buffer, cpu_byte_view

_MAGIC = b"KVR1"
_HEAD = struct.Struct("<4sIQQ")  # magic, payload crc32, payload length, hash fingerprint
HEADER_BYTES = _HEAD.size

# What a dead, slow or confused server raises through redis-py.
_DEGRADED = (redis.RedisError, OSError)


class RedisTier:
    """Blocks of one rank in Redis under ``{key_prefix}:{rank}:{block_hash}``."""

    def __init__(
        self,
        url: str,
        geometry: BlockGeometry,
        rank: int = 0,
        key_prefix: str = "kvlife",
        ttl_seconds: int | None = None,
        socket_timeout: float = 0.5,
        connect_timeout: float = 0.25,
        name: str = "redis",
    ) -> None:
        if ttl_seconds is not None and ttl_seconds <= 0:
            raise ValueError(f"ttl_seconds must be positive or None, got {ttl_seconds!r}")
        self.name = name
        self.url = url
        self.geometry = geometry
        self.block_bytes = geometry.block_bytes
        self.rank = rank
        self.key_prefix = key_prefix
        self.ttl_seconds = ttl_seconds
        self.events: list[dict[str, Any]] = []
        self.client = redis.Redis.from_url(
            url,
            socket_timeout=socket_timeout,
            socket_connect_timeout=connect_timeout,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
        )

    def close(self) -> None:
        with contextlib.suppress(*_DEGRADED):
            self.client.close()

    def drain_events(self) -> list[dict[str, Any]]:
        events, self.events = self.events, []
        return events

    def key(self, block_hash: int) -> str:
        return f"{self.key_prefix}:{self.rank}:{block_hash}"

    def key_pattern(self) -> str:
        """The SCAN pattern of this rank's keys (glob characters in the prefix escaped)."""
        escaped = "".join(f"\\{c}" if c in "*?[]\\" else c for c in f"{self.key_prefix}:{self.rank}:")
        return f"{escaped}*"

    def delete_all(self, batch: int = 500) -> int:
        """Delete every key of this rank under the prefix; the number deleted. A dead
        server is a ``redis_unavailable`` event (the keys then expire by their TTL)."""
        deleted = 0
        try:
            keys: list[bytes] = []
            for key in self.client.scan_iter(match=self.key_pattern(), count=batch):
                keys.append(key)
                if len(keys) >= batch:
                    deleted += int(self.client.unlink(*keys))
                    keys = []
            if keys:
                deleted += int(self.client.unlink(*keys))
        except _DEGRADED as exc:
            self._degraded("cleanup", exc, 0)
        return deleted

    def _degraded(self, op: str, exc: BaseException, count: int) -> None:
        self.events.append(
            {
                "event": "redis_unavailable",
                "level": "warning",
                "tier": self.name,
                "op": op,
                "blocks": count,
                "error": f"{type(exc).__name__}: {exc}",
            }
        )

    # ---- lookups -------------------------------------------------------------------
    def exists_many(self, hashes: Sequence[int]) -> list[bool]:
        """Presence of each block, in one round trip; all False when Redis is down."""
        if not hashes:
            return []
        try:
            pipe = self.client.pipeline(transaction=False)
            for block_hash in hashes:
                pipe.exists(self.key(block_hash))
            replies = pipe.execute()
        except _DEGRADED as exc:
            self._degraded("exists", exc, len(hashes))
            return [False] * len(hashes)
        return [reply == 1 for reply in replies]

    def lookup(self, hashes: Sequence[int]) -> int:
        """Number of leading blocks present (one round trip)."""
        count = 0
        for present in self.exists_many(hashes):
            if not present:
                break
            count += 1
        return count

    # ---- bytes ---------------------------------------------------------------------
    def _pack(self, block_hash: int, payload: torch.Tensor | Buffer) -> bytes:
        view = cpu_byte_view(payload)
        if view.nbytes != self.block_bytes:
            raise ValueError(f"{self.name}: payload is {view.nbytes} bytes, blocks are {self.block_bytes}")
        head = _HEAD.pack(_MAGIC, zlib.crc32(view), view.nbytes, stable_mix(block_hash))
        return b"".join((head, view))

    def _payload(self, block_hash: int, value: object) -> memoryview | None:
        """The payload of a stored value, or None (with an event) when it is not valid."""
        if not isinstance(value, bytes) or len(value) != HEADER_BYTES + self.block_bytes:
            size = len(value) if isinstance(value, bytes) else None
            self.events.append({"event": "redis_bad_length", "tier": self.name, "block": block_hash, "size": size})
            return None
        magic, crc, length, fingerprint = _HEAD.unpack_from(value)
        payload = memoryview(value)[HEADER_BYTES:]
        if (
            magic != _MAGIC
            or length != self.block_bytes
            or fingerprint != stable_mix(block_hash)
            or crc != zlib.crc32(payload)
        ):
            self.events.append({"event": "redis_checksum_mismatch", "tier": self.name, "block": block_hash})
            return None
        return payload

    def put_many(self, items: Sequence[tuple[int, torch.Tensor | Buffer]]) -> list[bool]:
        """Store (block hash, payload) pairs in one round trip; per-item success."""
        if not items:
            return []
        try:
            pipe = self.client.pipeline(transaction=False)
            for block_hash, payload in items:
                pipe.set(self.key(block_hash), self._pack(block_hash, payload), ex=self.ttl_seconds)
            replies = pipe.execute(raise_on_error=False)
        except _DEGRADED as exc:
            self._degraded("put", exc, len(items))
            return [False] * len(items)
        ok = [reply is True for reply in replies]
        for (block_hash, _), reply in zip(items, replies, strict=True):
            if reply is not True:
                self.events.append(
                    {
                        "event": "redis_store_failed",
                        "tier": self.name,
                        "block": block_hash,
                        "error": repr(reply),
                    }
                )
        return ok

    def _fetch(self, hashes: Sequence[int]) -> list[memoryview | None]:
        """Validated payloads of blocks in one round trip; None for a miss or a bad value."""
        if not hashes:
            return []
        try:
            pipe = self.client.pipeline(transaction=False)
            for block_hash in hashes:
                pipe.get(self.key(block_hash))
            replies = pipe.execute(raise_on_error=False)
        except _DEGRADED as exc:
            self._degraded("get", exc, len(hashes))
            return [None] * len(hashes)
        return [
            None if reply is None else self._payload(block_hash, reply)
            for block_hash, reply in zip(hashes, replies, strict=True)
        ]

    def get_many(self, hashes: Sequence[int]) -> list[bytes | None]:
        """The payloads of blocks in one round trip; None for a miss or a bad value."""
        return [None if p is None else bytes(p) for p in self._fetch(hashes)]

    # ---- batches (the copy engine's interface) -------------------------------------
    def write_blocks(self, items: Sequence[tuple[int, int]], src: torch.Tensor) -> list[bool]:
        """Store row ``i`` of ``src`` as block ``items[i][0]`` (slots are unused here)."""
        return self.put_many([(block_hash, src[i]) for i, (block_hash, _) in enumerate(items)])

    def read_blocks(self, items: Sequence[tuple[int, int]], dst: torch.Tensor) -> list[bool]:
        """Read block ``items[i][0]`` into row ``i`` of ``dst``; per-item hit."""
        payloads = self._fetch([block_hash for block_hash, _ in items])
        for i, payload in enumerate(payloads):
            if payload is not None:
                cpu_byte_view(dst[i])[:] = payload
        return [payload is not None for payload in payloads]
