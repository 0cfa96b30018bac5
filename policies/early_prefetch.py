"""early-prefetch and early-lookup: start the lookup the moment a request arrives.

LMCache multi-process ``on_new_request`` and vLLM #42321: under queue saturation a request
may wait many ticks before the scheduler considers it, so the lookup (and, for
``early-prefetch``, the pull of its disk/remote hit blocks into the host tier) overlaps
that wait instead of following it. Streaming/resumable requests are skipped: their prompt
is not final at arrival. Opt-in: neither is in the baseline. How long an admission may
wait for the pull is the ``prefetch_patience`` decision (``kvlife.policies.prefetch_patience``).
"""

from __future__ import annotations

from kvlife.policies.base import ArrivalAction, Decision, EngineView, RequestView


class EarlyPrefetch:
    name = "early-prefetch"
    pull = True  # also pull lower-tier hits into the host tier

    def on_arrival(self, req: RequestView, engine: EngineView) -> Decision[ArrivalAction]:
        if req.resumable:
            return Decision("none", "streaming/resumable request: prompt not final, no early lookup")
        if not req.block_hashes:
            return Decision("none", "no full prompt block to look up")
        if self.pull:
            return Decision("prefetch", "lookup at arrival; pull lower-tier hits into the host tier")
        return Decision("lookup", "lookup at arrival")


class EarlyLookup(EarlyPrefetch):
    name = "early-lookup"
    pull = False
