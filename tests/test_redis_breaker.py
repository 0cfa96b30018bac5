"""The Redis circuit breaker: after K consecutive timeouts the tier is down for a back-off,
and requests are misses without waiting; one probe after the back-off closes it again."""

from __future__ import annotations

import threading
import time

import pytest

from kvlife.transfer.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from kvlife.transfer.content import expected_bytes
from kvlife.transfer.layout import SMALL_SHAPE, BlockGeometry
from kvlife.transfer.redis_tier import RedisTier
from tests.redis_server import RedisServer

GEO = BlockGeometry(SMALL_SHAPE)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_opens_after_k_consecutive_failures_and_closes_after_a_good_probe() -> None:
    clock = Clock()
    breaker = CircuitBreaker(failures=3, backoff_s=5.0, clock=clock)
    assert breaker.allow() and not breaker.failure()
    assert breaker.allow() and breaker.success() is None  # a success resets the count
    assert [breaker.failure(), breaker.failure(), breaker.failure()] == [False, False, True]
    assert breaker.state == OPEN and breaker.times_opened == 1
    assert [breaker.allow() for _ in range(4)] == [False] * 4  # no waiting: refused at once
    clock.now += 5.0
    assert breaker.allow() and breaker.state == HALF_OPEN  # one probe...
    assert not breaker.allow()  # ...and only one
    assert breaker.failure() is False and breaker.state == OPEN  # probe failed: another back-off
    assert not breaker.allow()
    clock.now += 5.0
    assert breaker.allow()
    assert breaker.success() == 6  # closed; it says how many requests it refused meanwhile
    assert breaker.state == CLOSED and breaker.allow() and breaker.times_opened == 1


def test_bad_settings_are_refused() -> None:
    for failures in (0, -1, 1.5, True):
        with pytest.raises(ValueError):
            CircuitBreaker(failures=failures)  # type: ignore[arg-type]
    for backoff in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError):
            CircuitBreaker(backoff_s=backoff)


def test_is_shared_safely_across_threads() -> None:
    breaker = CircuitBreaker(failures=50, backoff_s=60.0)
    opened: list[bool] = []

    def fail() -> None:
        for _ in range(100):
            if breaker.allow():
                opened.append(breaker.failure())

    threads = [threading.Thread(target=fail) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert opened.count(True) == 1 and breaker.times_opened == 1 and breaker.state == OPEN


# ---- against a frozen server ------------------------------------------------------------------
def test_a_frozen_server_costs_k_timeouts_then_nothing(server: RedisServer) -> None:
    """SIGSTOP: connections stay open, nothing answers. Three timeouts open the breaker;
    after that every call is a miss (or a failed store) at once, until the back-off ends
    and one probe finds the server back."""
    breaker = CircuitBreaker(failures=3, backoff_s=1.0)
    tier = RedisTier(server.url, GEO, socket_timeout=0.2, connect_timeout=0.2, breaker=breaker)
    payload = expected_bytes(GEO, 1)
    assert tier.put_many([(1, payload)]) == [True]
    server.freeze()
    try:
        started = time.monotonic()
        for _ in range(3):
            assert tier.get_many([1]) == [None]
        spent = time.monotonic() - started
        assert 0.5 < spent < 1.5 and breaker.state == OPEN
        started = time.monotonic()
        for _ in range(50):
            assert tier.get_many([1]) == [None]
            assert tier.exists_many([1]) == [False]
            assert tier.put_many([(2, payload)]) == [False]
        assert time.monotonic() - started < 0.2  # 150 calls, no waiting
        events = tier.drain_events()
        assert [e["event"] for e in events] == ["redis_unavailable", "redis_unavailable",
                                                "redis_breaker_open", "redis_unavailable"]
        assert events[2]["failures"] == 3 and events[2]["backoff_s"] == 1.0
    finally:
        server.thaw()
    time.sleep(1.05)
    assert tier.get_many([1]) == [payload.numpy().tobytes()]  # the probe: answered, closed
    (closed,) = tier.drain_events()
    assert closed["event"] == "redis_breaker_closed" and closed["skipped"] == 150
    assert breaker.state == CLOSED
    tier.close()
