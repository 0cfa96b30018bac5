"""A lookup service with bounded concurrency: K workers serving a FIFO queue.

Mooncake's vLLM connector answers lookups (which of a request's block hashes does the store
hold?) on one worker thread, so a burst of lookups queues: the k-th of a burst of N on one
worker answers after k x the single-lookup latency. This models that: ``workers`` servers
(default 1), first come first served, each lookup taking ``base_ms + per_key_ms x keys``.

Because service times are known at submission and the queue is FIFO, a lookup's completion is
decided the moment it is submitted: it starts when the earliest-free worker frees up (or at
once) and runs for its latency. ``submit`` returns that time, so the simulator pushes one event
per lookup and needs no wake-ups from here. Deterministic: ties go to the lowest worker index.

A request with no full prompt block has nothing to look up; vLLM's Mooncake connector answers
it ``(0, False)`` at once, without the round trip: ``needs_lookup`` says so.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable

# kvlife's previous fixed lookup latency (an estimate of one RPC to the store's master, not a
# measurement); the per-key cost is an estimate too (a hash probe and its serialization). Set
# both from your store's measurements.
DEFAULT_BASE_MS = 1.5
DEFAULT_PER_KEY_MS = 0.005


def needs_lookup(prompt_tokens: int, block_tokens: int) -> bool:
    """True when the prompt has at least one full block to look up."""
    return prompt_tokens // block_tokens > 0


class LookupService:
    """``workers`` servers, FIFO, latency ``base_ms + per_key_ms x keys`` per lookup."""

    def __init__(self, workers: int = 1, base_ms: float = DEFAULT_BASE_MS,
                 per_key_ms: float = DEFAULT_PER_KEY_MS) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be a positive integer, got {workers!r}")
        if not base_ms >= 0 or not per_key_ms >= 0:
            raise ValueError("lookup latencies must be non-negative")
        self.workers = workers
        self.base_ms = base_ms
        self.per_key_ms = per_key_ms
        self._free: list[tuple[float, int]] = [(0.0, w) for w in range(workers)]  # (free at, worker)
        self._finishes: list[float] = []  # completion times of submitted lookups (heap)
        self._last_submit = 0.0
        self.submitted = 0
        self.max_wait_ms = 0.0

    def latency_ms(self, keys: int) -> float:
        return self.base_ms + self.per_key_ms * keys

    def submit(self, lookup_id: Hashable, keys: int, now: float) -> float:
        """Queue a lookup of ``keys`` block hashes at ``now``; return when it answers.
        Submissions must come in time order."""
        if now < self._last_submit:
            raise ValueError(f"lookup {lookup_id!r} submitted at {now} after one at {self._last_submit}")
        if keys < 0:
            raise ValueError(f"lookup {lookup_id!r}: negative key count {keys}")
        self._last_submit = now
        free_at, worker = heapq.heappop(self._free)
        begin = max(now, free_at)
        done = begin + self.latency_ms(keys)
        heapq.heappush(self._free, (done, worker))
        finishes = self._finishes
        while finishes and finishes[0] <= now:  # answered already: kept no longer (memory stays flat)
            heapq.heappop(finishes)
        heapq.heappush(finishes, done)
        self.submitted += 1
        self.max_wait_ms = max(self.max_wait_ms, begin - now)
        return done

    def pending(self, now: float) -> int:
        """Lookups submitted and not yet answered at ``now`` (queued or being served);
        ``now`` no earlier than the last submission or the last call."""
        while self._finishes and self._finishes[0] <= now:
            heapq.heappop(self._finishes)
        return len(self._finishes)
