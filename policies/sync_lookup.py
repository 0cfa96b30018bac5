"""sync-lookup: the baseline lookup, paid on the scheduler's critical path.

Every time the scheduler considers a waiting request it asks the tiers which leading
blocks they hold and waits for the answer inside the tick, as vLLM does with a Mooncake
lookup (1-2 ms each). The simulator charges ``lookup_latency_ms`` per lookup to the step.
"""

from __future__ import annotations

from kvlife.policies.base import Decision, EngineView, LookupMode, RequestView


class SyncLookup:
    name = "sync-lookup"

    def lookup_mode(self, req: RequestView, engine: EngineView) -> Decision[LookupMode]:
        return Decision("sync", "lookup inline on the scheduler tick (critical path)")
