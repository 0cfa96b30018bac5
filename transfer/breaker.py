"""A circuit breaker for a remote tier: stop waiting on a server that does not answer.

After ``failures`` consecutive timeouts or connection errors the breaker opens: for
``backoff_s`` every request is refused at once (the tier answers a miss, a failed store)
instead of paying one more socket timeout each. When the back-off has passed, one request
is let through (half-open): an answer closes the breaker, a failure opens it for another
back-off. A frozen server therefore costs ``failures`` timeouts once, then one per
back-off period, however many requests come.

One breaker is shared by every client of one server in a run (the ranks' tiers and the
lookup probe), so the server is judged once, not once per thread; it is thread-safe.
Transitions are returned to the caller, who reports them (``redis_breaker_open``,
``redis_breaker_closed``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

CLOSED = "closed"
OPEN = "open"
HALF_OPEN = "half_open"


class CircuitBreaker:
    def __init__(self, failures: int = 3, backoff_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if isinstance(failures, bool) or not isinstance(failures, int) or failures < 1:
            raise ValueError(f"failures must be a positive int, got {failures!r}")
        if not backoff_s > 0:
            raise ValueError(f"backoff_s must be positive, got {backoff_s!r}")
        self.failures = failures
        self.backoff_s = float(backoff_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._consecutive = 0
        self._open_until: float | None = None  # None: closed
        self._probing = False
        self.skipped = 0  # requests refused since the breaker last opened
        self.times_opened = 0

    @property
    def state(self) -> str:
        with self._lock:
            if self._open_until is None:
                return CLOSED
            return HALF_OPEN if self._probing else OPEN

    def allow(self) -> bool:
        """May a request go to the server now? False: treat it as down, without waiting."""
        with self._lock:
            if self._open_until is None:
                return True
            if not self._probing and self._clock() >= self._open_until:
                self._probing = True  # this request is the probe; the others keep skipping
                return True
            self.skipped += 1
            return False

    def success(self) -> int | None:
        """The server answered. Returns the number of requests skipped while it was open
        when this answer closes the breaker, else None."""
        with self._lock:
            self._consecutive = 0
            if self._open_until is None:
                return None
            skipped, self.skipped = self.skipped, 0
            self._open_until = None
            self._probing = False
            return skipped

    def failure(self) -> bool:
        """A timeout or connection error. True when this failure opened the breaker."""
        with self._lock:
            self._consecutive += 1
            if self._open_until is not None and not self._probing:
                return False  # already open (a request that started before it opened)
            if self._probing or self._consecutive >= self.failures:
                self._open_until = self._clock() + self.backoff_s
                reopened = self._probing
                self._probing = False
                if not reopened:
                    self.times_opened += 1
                    self.skipped = 0
                return not reopened
            return False
