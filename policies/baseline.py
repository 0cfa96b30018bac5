"""The baseline stack: what a connector does with no cleverness.

Synchronous lookup on the scheduler's critical path (an async answer, with an async
policy, is consumed by the admission it is used for), no early lookup, admit everything
(no load sharing: two requests with the same hit both load it), recompute after a failed
load. It sits at the bottom of every stack and answers every hook.

Two safe choices are the baseline's own (each was a policy of its own until issue 26 found
it changed nothing):

- Stores cover only blocks whose every token a step output confirmed: never a placeholder
  position of a step still in flight under async scheduling (vLLM #27644, LMCache #1898,
  vLLM #36052). ``naive-stores-unsafe`` (``policies/stores.py``) is the unsafe counterpart.
- A finished request whose stores are still in flight is held in ``sending`` until every
  rank reported them and ``finished_sending`` came with a step output (vLLM #19555). Its
  blocks are safe either way (transfer jobs hold their own references; the engine enforces
  it); holding keeps the lifecycle honest: a request is not reported finished while its KV
  is still leaving. The engine asks only when a store is in flight.
"""

from __future__ import annotations

from kvlife.policies.base import (
    Admission,
    ArrivalAction,
    Decision,
    EngineView,
    LoadFailureAction,
    LoadView,
    LookupMode,
    LookupReuse,
    RequestView,
)

# The answers that never change, made once (a Decision is frozen: one object serves every ask).
_NO_EARLY_LOOKUP: Decision[ArrivalAction] = Decision("none", "lookup waits until the scheduler considers the request")
_SYNC: Decision[LookupMode] = Decision("sync", "synchronous lookup on the scheduler path")
_CONSUME: Decision[LookupReuse] = Decision(
    "consume", "answer used by this admission; a new lookup if it is not admitted (vLLM)")
_ADMIT: Decision[Admission] = Decision("go", "admit")


class Baseline:
    name = "baseline"

    def on_arrival(self, req: RequestView, engine: EngineView) -> Decision[ArrivalAction]:
        return _NO_EARLY_LOOKUP

    def lookup_mode(self, req: RequestView, engine: EngineView) -> Decision[LookupMode]:
        return _SYNC

    def lookup_reuse(self, req: RequestView, engine: EngineView) -> Decision[LookupReuse]:
        return _CONSUME

    def admission(self, req: RequestView, load: LoadView, engine: EngineView) -> Decision[Admission]:
        if load.in_flight:
            return Decision("go", f"loading {len(load.in_flight)} blocks that are already in flight (no sharing)")
        return _ADMIT

    def store_limit(self, req: RequestView, engine: EngineView) -> Decision[int]:
        return Decision(req.confirmed_tokens, f"store blocks whose tokens a step output confirmed (up to token "
                                              f"{req.confirmed_tokens}; never a placeholder)")

    def hold_at_finish(self, req: RequestView, stores_in_flight: int, engine: EngineView) -> Decision[bool]:
        return Decision(True, f"hold blocks until {stores_in_flight} store jobs report")

    def on_load_failure(self, req: RequestView, failed_blocks: int, engine: EngineView) -> Decision[LoadFailureAction]:
        return Decision("recompute", f"{failed_blocks} blocks failed to load: recompute from the first")
