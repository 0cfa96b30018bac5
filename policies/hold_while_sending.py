"""hold-while-sending (vLLM #19555): a finished request keeps its blocks until every rank
reported every store or send that reads them.

The request waits in ``sending``; the engine's rank aggregator completes a job only once
each expected rank reported it, so the request reaches ``finished`` only then. (The device
blocks are safe either way: transfer jobs hold their own references. What holding buys is
an honest lifecycle: a request is not reported finished while its KV is still leaving.)
"""

from __future__ import annotations

from kvlife.policies.base import Decision, EngineView, RequestView


class HoldWhileSending:
    name = "hold-while-sending"

    def hold_at_finish(self, req: RequestView, stores_in_flight: int, engine: EngineView) -> Decision[bool]:
        if stores_in_flight <= 0:
            return Decision(False, "nothing in flight: finish now")
        return Decision(True, f"hold blocks in sending until every rank reports {stores_in_flight} stores")
