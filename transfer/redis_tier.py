"""Redis tier: raw block bytes keyed by layout, rank and block hash, on a real Redis server.

Each value is the 64-byte block header of ``kvlife.transfer.block_header`` (format
version, layout fingerprint of the model, rank, block hash, payload length, checksums)
followed by the raw payload; never pickle. Reads check all of it, so a truncated,
foreign (another rank's, another model's or dtype's, another block's) or corrupted value
is a miss with a ``redis_<kind>`` event, never served, whatever ``live.verify`` says.

Redis is a shared, remote, best-effort cache: a dead or slow server must not take the
serving engine down with it. Every public call therefore catches connection and timeout
errors, returns misses / failed stores, and records a warning event the caller drains.
Socket timeouts are small and redis-py's retries are off, so a dead server costs one
failed round trip per call rather than a stall; a ``CircuitBreaker`` (shared by every
client of the server) stops even that after a few consecutive timeouts: while it is open
calls answer at once, as misses. Batches use non-transactional pipelines: one round trip
per call.

Keys are ``{key_prefix}:{layout fingerprint, 16 hex digits}:{rank}:{block hash}`` (the
live runtime uses one prefix per run) and expire after ``ttl_seconds`` (an hour unless
told otherwise; None: never); ``delete_all`` removes a rank's keys at the end of a run
(SCAN on the prefix, then UNLINK in batches), so a run leaves nothing behind in a shared
server.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvlife.transfer.block_header import HEADER_BYTES, BlockFormat, Mismatch
from kvlife.transfer.breaker import CircuitBreaker
from kvlife.transfer.layout import BlockGeometry, Buffer, cpu_byte_view

__all__ = ["DEFAULT_TTL_S", "HEADER_BYTES", "RedisTier"]

# Keys outlive any run the runtime is meant for, and still go away on their own.
DEFAULT_TTL_S = 3600

# What a dead, slow or confused server raises through redis-py.
_DEGRADED = (redis.RedisError, OSError)
# What says the server is not answering (counted by the breaker); an error reply is not.
_UNANSWERED = (redis.ConnectionError, redis.TimeoutError, OSError)

T = TypeVar("T")


class RedisTier:
    """Blocks of one rank in Redis under ``{key_prefix}:{layout}:{rank}:{block_hash}``."""

    def __init__(
        self,
        url: str,
        geometry: BlockGeometry,
        rank: int = 0,
        key_prefix: str = "kvlife",
        ttl_seconds: int | None = DEFAULT_TTL_S,
        socket_timeout: float = 0.5,
        connect_timeout: float = 0.25,
        name: str = "redis",
        breaker: CircuitBreaker | None = None,
    ) -> None:
        if ttl_seconds is not None and ttl_seconds <= 0:
            raise ValueError(f"ttl_seconds must be positive or None, got {ttl_seconds!r}")
        self.name = name
        self.url = url
        self.geometry = geometry
        self.block_bytes = geometry.block_bytes
        self.rank = rank
        self.format = BlockFormat(geometry, rank)
        self.key_prefix = key_prefix
        self.ttl_seconds = ttl_seconds
        self.breaker = breaker if breaker is not None else CircuitBreaker()
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

    @property
    def namespace(self) -> str:
        """Where this rank's keys live: the prefix, the layout fingerprint, the rank."""
        return f"{self.key_prefix}:{self.format.layout:016x}:{self.rank}"

    def key(self, block_hash: int) -> str:
        return f"{self.namespace}:{block_hash}"

    def key_pattern(self) -> str:
        """The SCAN pattern of this rank's keys (glob characters in the prefix escaped)."""
        escaped = "".join(f"\\{c}" if c in "*?[]\\" else c for c in f"{self.namespace}:")
        return f"{escaped}*"

    def _call(self, op: str, count: int, request: Callable[[], T]) -> T | None:
        """``request()`` through the breaker; None (and an event) when the server is down
        or the breaker says it is, so the caller answers misses."""
        if not self.breaker.allow():
            return None  # counted by the breaker; reported when it opens and closes
        try:
            result = request()
        except _DEGRADED as exc:
            if isinstance(exc, _UNANSWERED) and self.breaker.failure():
                self.events.append({"event": "redis_breaker_open", "level": "warning", "tier": self.name,
                                    "op": op, "failures": self.breaker.failures,
                                    "backoff_s": self.breaker.backoff_s})
            self._degraded(op, exc, count)
            return None
        skipped = self.breaker.success()
        if skipped is not None:
            self.events.append({"event": "redis_breaker_closed", "level": "warning", "tier": self.name,
                                "op": op, "skipped": skipped})
        return result

    def delete_all(self, batch: int = 500) -> int:
        """Delete every key of this rank under the prefix; the number deleted. A dead
        server (or an open breaker) is a ``redis_unavailable`` event: the keys then expire
        by their TTL."""
        def scan_and_unlink() -> int:
            deleted = 0
            keys: list[bytes] = []
            for key in self.client.scan_iter(match=self.key_pattern(), count=batch):
                keys.append(key)
                if len(keys) >= batch:
                    deleted += int(self.client.unlink(*keys))
                    keys = []
            if keys:
                deleted += int(self.client.unlink(*keys))
            return deleted

        reported = len(self.events)
        deleted = self._call("cleanup", 0, scan_and_unlink)
        if deleted is None and len(self.events) == reported:  # refused by the open breaker
            self.events.append({"event": "redis_unavailable", "level": "warning", "tier": self.name,
                                "op": "cleanup", "blocks": 0, "error": "circuit breaker open: keys left to their TTL"})
        return deleted or 0

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

        def exists() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for block_hash in hashes:
                pipe.exists(self.key(block_hash))
            return list(pipe.execute())

        replies = self._call("exists", len(hashes), exists)
        if replies is None:
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
    def pack(self, block_hash: int, payload: torch.Tensor | Buffer) -> bytes:
        """The value stored for ``block_hash``: this rank's header, then the payload."""
        view = cpu_byte_view(payload)
        if view.nbytes != self.block_bytes:
            raise ValueError(f"{self.name}: payload is {view.nbytes} bytes, blocks are {self.block_bytes}")
        return b"".join((self.format.pack(block_hash, view), view))

    def _payload(self, block_hash: int, value: object) -> memoryview | None:
        """The payload of a stored value, or None (with an event) when it is not this
        rank's block in this layout, whole and intact."""
        if not isinstance(value, bytes) or len(value) != HEADER_BYTES + self.block_bytes:
            size = len(value) if isinstance(value, bytes) else None
            self.events.append({"event": "redis_bad_length", "level": "warning", "tier": self.name,
                                "block": block_hash, "size": size,
                                "reason": f"a value of {size} bytes, blocks are {HEADER_BYTES + self.block_bytes}"
                                          if size is not None else f"not a string value: {type(value).__name__}"})
            return None
        view = memoryview(value)
        payload = view[HEADER_BYTES:]
        checked = self.format.check(view[:HEADER_BYTES], block_hash, payload)
        if isinstance(checked, Mismatch):
            self.events.append({"event": f"redis_{checked.kind}", "level": "warning", "tier": self.name,
                                "block": block_hash, "reason": checked.reason})
            return None
        return payload

    def put_many(self, items: Sequence[tuple[int, torch.Tensor | Buffer]]) -> list[bool]:
        """Store (block hash, payload) pairs in one round trip; per-item success."""
        if not items:
            return []
        values = [(self.key(block_hash), self.pack(block_hash, payload)) for block_hash, payload in items]

        def put() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for key, value in values:
                pipe.set(key, value, ex=self.ttl_seconds)
            return list(pipe.execute(raise_on_error=False))

        replies = self._call("put", len(items), put)
        if replies is None:
            return [False] * len(items)
        ok = [reply is True for reply in replies]
        for (block_hash, _), reply in zip(items, replies, strict=True):
            if reply is not True:
                self.events.append(
                    {
                        "event": "redis_store_failed",
                        "level": "warning",
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

        def get() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for block_hash in hashes:
                pipe.get(self.key(block_hash))
            return list(pipe.execute(raise_on_error=False))

        replies = self._call("get", len(hashes), get)
        if replies is None:
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
