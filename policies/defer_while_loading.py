"""defer-while-loading: vLLM OffloadingConnector's plain behaviour, for comparison.

When any hit block of a request is being loaded by another request, the whole request is
deferred (the connector answers "not ready yet") and reconsidered on later ticks, paying
the lookup again each time under sync lookups. No block is loaded twice, but requests
queue behind each other's loads: the convoy of vLLM #44294. Use ``shared-loads`` instead.
"""

from __future__ import annotations

from kvlife.policies.base import Admission, Decision, EngineView, LoadView, RequestView


class DeferWhileLoading:
    name = "defer-while-loading"

    def admission(self, req: RequestView, load: LoadView, engine: EngineView) -> Decision[Admission] | None:
        if not load.in_flight:
            return None
        owners = sorted({rid for _, rid in load.in_flight})
        return Decision(
            "defer",
            f"deferred: {len(load.in_flight)} of {load.external_hit_blocks} hit blocks are being "
            f"loaded by {', '.join(owners[:3])}{'...' if len(owners) > 3 else ''}",
        )
