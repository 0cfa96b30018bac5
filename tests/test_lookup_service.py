"""Lookups queue behind a bounded number of workers (Mooncake's connector runs one)."""

from __future__ import annotations

import pytest

from kvlife.lifecycle.drivers.lookup_service import LookupService, needs_lookup


def test_a_burst_queues_behind_one_worker() -> None:
    service = LookupService(workers=1, base_ms=1.5, per_key_ms=0.0)
    answers = [service.submit(i, keys=4, now=0.0) for i in range(256)]
    assert answers[0] == pytest.approx(1.5)
    assert answers[-1] == pytest.approx(256 * 1.5)
    assert answers == sorted(answers)
    assert service.pending(100.0) == 256 - 66
    assert service.max_wait_ms == pytest.approx(255 * 1.5)


def test_two_workers_halve_the_burst() -> None:
    one = LookupService(workers=1, base_ms=2.0, per_key_ms=0.0)
    two = LookupService(workers=2, base_ms=2.0, per_key_ms=0.0)
    last_one = max(one.submit(i, 1, 0.0) for i in range(100))
    last_two = max(two.submit(i, 1, 0.0) for i in range(100))
    assert last_two == pytest.approx(last_one / 2)


def test_latency_grows_with_keys_and_idle_workers_start_at_once() -> None:
    service = LookupService(workers=1, base_ms=1.0, per_key_ms=0.01)
    assert service.submit("a", keys=100, now=5.0) == pytest.approx(5.0 + 1.0 + 1.0)
    # Arrives while "a" is served: waits for it (FIFO).
    assert service.submit("b", keys=0, now=6.0) == pytest.approx(7.0 + 1.0)
    # Arrives after the queue drained: served at once.
    assert service.submit("c", keys=0, now=50.0) == pytest.approx(51.0)


def test_submissions_must_come_in_time_order() -> None:
    service = LookupService()
    service.submit("a", 1, 10.0)
    with pytest.raises(ValueError, match="submitted at 5.0 after one at 10.0"):
        service.submit("b", 1, 5.0)
    with pytest.raises(ValueError, match="workers must be a positive integer"):
        LookupService(workers=0)


def test_a_prompt_without_a_full_block_needs_no_lookup() -> None:
    assert not needs_lookup(511, 512)
    assert needs_lookup(512, 512)
