"""Which tokens' blocks may be stored: placeholder-safe, and the naive unsafe boundary.

With async scheduling the engine schedules step N+1 before step N's output arrives, so a
request's computed-token count includes tokens of steps still in flight and the output
placeholders they will sample (vLLM #27644, LMCache #1898, vLLM #36052). Storing up to
that count copies KV that does not exist yet. ``placeholder-safe-stores`` stores only
blocks whose every token a step output confirmed, and only blocks with a hash (full
prompt blocks). ``naive-stores-unsafe`` uses the computed count: it is the bug, shipped
by name so tests and ``kvlife compare`` can show it.
"""

from __future__ import annotations

from kvlife.policies.base import Decision, EngineView, RequestView


class PlaceholderSafeStores:
    name = "placeholder-safe-stores"

    def store_limit(self, req: RequestView, engine: EngineView) -> Decision[int]:
        hashed = len(req.block_hashes) * req.block_tokens
        real = req.prompt_tokens + req.generated_tokens  # positions past this are placeholders
        limit = min(req.confirmed_tokens, real, hashed)
        return Decision(
            limit,
            f"store up to token {limit}: confirmed {req.confirmed_tokens}, "
            f"{req.computed_tokens - req.confirmed_tokens} in flight, {req.placeholder_tokens} placeholders",
        )


class NaiveStoresUnsafe:
    name = "naive-stores-unsafe"

    def store_limit(self, req: RequestView, engine: EngineView) -> Decision[int]:
        return Decision(
            req.computed_tokens,
            f"UNSAFE: store up to computed token {req.computed_tokens} "
            f"({req.computed_tokens - req.confirmed_tokens} not confirmed yet)",
        )
