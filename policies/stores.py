"""The unsafe store boundary, kept for the bug zoo: ``naive-stores-unsafe``.

Stores cover the whole token sequence: full blocks of the prompt and of the generated
tokens alike, so a later turn can hit a previous turn's answer. With async scheduling the
engine schedules step N+1 before step N's output arrives, so a request's computed-token
count includes tokens of steps still in flight, and the decode of step N+1 runs at a
position whose token step N has not returned yet: a placeholder (vLLM #27644, LMCache
#1898, vLLM #36052). Storing up to that count copies KV that does not exist yet, at
placeholder positions.

The safe boundary is the baseline's (``policies/baseline.py``): it stores only blocks whose
every token a step output confirmed (a confirmed token is never a placeholder). It was a
policy of its own, ``placeholder-safe-stores``, until issue 26 found that it changed
nothing the baseline did not already do. ``naive-stores-unsafe`` uses the computed count: it
is the bug, shipped by name so tests, ``kvlife validate``, ``kvlife check`` and ``kvlife
compare`` show it (invariant 5).
"""

from __future__ import annotations

from kvlife.policies.base import Decision, EngineView, RequestView


class NaiveStoresUnsafe:
    name = "naive-stores-unsafe"

    def store_limit(self, req: RequestView, engine: EngineView) -> Decision[int]:
        return Decision(
            req.computed_tokens,
            f"UNSAFE: store up to computed token {req.computed_tokens} "
            f"({req.computed_tokens - req.confirmed_tokens} not confirmed yet)",
        )
