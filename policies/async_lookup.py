"""async-lookup: lookups go to a background worker (Mooncake connector, vLLM #45659).

The request parks in ``lookup_pending`` and is reconsidered when the answer comes; the
tick never waits. The engine makes the rest safe: submission is idempotent (one pending
lookup per request epoch), finish, abort and preemption bump the epoch so a stale answer
is dropped (``stale_lookup`` in the trace), and a failed lookup counts as a miss.
"""

from __future__ import annotations

from kvlife.policies.base import Decision, EngineView, LookupMode, RequestView


class AsyncLookup:
    name = "async-lookup"

    def lookup_mode(self, req: RequestView, engine: EngineView) -> Decision[LookupMode]:
        return Decision("async", "lookup on the background worker; reconsider when it answers")
