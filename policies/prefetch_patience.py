"""Prefetch patience (SGLang HiCache): how long an admission waits for its prefetch.

When early prefetch pulls a request's disk/remote hits into the host tier, the scheduler
may reach the request before the pull is done. It then either waits or computes the
blocks that have not landed (the pull goes on and serves later requests):

* ``prefetch-best-effort``: never wait; compute what has not landed.
* ``prefetch-wait-complete``: wait until the whole pull has landed.
* ``prefetch-timeout``: wait up to base + per_1k_tokens x (tokens pulled / 1000), capped.

The answer is a number of milliseconds counted from the start of the pull.
"""

from __future__ import annotations

import math

from kvlife.policies.base import Decision, EngineView, PrefetchView, RequestView


class PrefetchBestEffort:
    name = "prefetch-best-effort"

    def prefetch_patience(self, req: RequestView, prefetch: PrefetchView, engine: EngineView) -> Decision[float]:
        return Decision(0.0, "best_effort: compute whatever has not landed when scheduled")


class PrefetchWaitComplete:
    name = "prefetch-wait-complete"

    def prefetch_patience(self, req: RequestView, prefetch: PrefetchView, engine: EngineView) -> Decision[float]:
        return Decision(math.inf, f"wait_complete: wait for all {prefetch.blocks} blocks")


class PrefetchTimeout:
    """Defaults follow SGLang's prefetch_timeout_base (1 s) and _per_ki_token (0.25 s)."""

    name = "prefetch-timeout"

    def __init__(self, base_ms: float = 1000.0, per_1k_tokens_ms: float = 250.0, cap_ms: float = 3000.0) -> None:
        if min(base_ms, per_1k_tokens_ms, cap_ms) < 0:
            raise ValueError("prefetch timeout parameters must be >= 0")
        self.base_ms = base_ms
        self.per_1k_tokens_ms = per_1k_tokens_ms
        self.cap_ms = cap_ms

    def prefetch_patience(self, req: RequestView, prefetch: PrefetchView, engine: EngineView) -> Decision[float]:
        timeout = min(self.base_ms + self.per_1k_tokens_ms * prefetch.tokens / 1000.0, self.cap_ms)
        return Decision(
            timeout,
            f"timeout: wait up to {timeout:.0f} ms for {prefetch.tokens} tokens "
            f"({self.base_ms:.0f} + {self.per_1k_tokens_ms:.0f}/1k tokens, cap {self.cap_ms:.0f})",
        )
