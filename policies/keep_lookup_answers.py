"""keep-lookup-answers: reuse an async lookup answer until the request is admitted.

vLLM asks the connector for a request's external hit each time the scheduler considers
it, and an async connector (Mooncake's) hands each answer out once: a request that is
not admitted in that pass looks up again (the baseline's ``lookup_reuse``: consume).
Keeping the answer saves those lookups but admits on an older picture of the tiers: the
engine re-validates every kept hit against the tiers (an evicted block ends the hit) and
writes a ``lookup_reuse`` record each time a kept answer is used again, with its age and
how many of its blocks were evicted since.
"""

from __future__ import annotations

from kvlife.policies.base import Decision, EngineView, LookupReuse, RequestView


class KeepLookupAnswers:
    name = "keep-lookup-answers"

    def lookup_reuse(self, req: RequestView, engine: EngineView) -> Decision[LookupReuse]:
        return Decision("keep", "keep the answer until admitted (re-validated; its age is traced)")
