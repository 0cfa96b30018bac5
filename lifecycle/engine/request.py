"""One request as the engine sees it: a record over the compiled transition table."""

from __future__ import annotations

import attrs

from kvlife.policies.base import RequestView


@attrs.define(slots=True, eq=False)
class Request:
    request_id: str
    seq: int  # arrival order: the FIFO key, kept across preemption
    arrival_ms: float
    prompt_tokens: int
    # Block hashes: the full prompt blocks' from the arrival, then derived ones
    # (``blocks.derived_block_hash``) appended as blocks of generated tokens fill.
    hashes: tuple[int, ...]
    resumable: bool
    block_tokens: int
    max_tokens: int | None = None  # the request's output limit, when the arrival says
    state: str = "waiting"
    # Bumped on preemption, abort, failed load and lookup expiry: a lookup answer for an older epoch
    # is stale and never applied (invariant 4).
    epoch: int = 0
    generated: int = 0
    placeholders: int = 0  # sampled tokens whose step output has not arrived
    computed: int = 0  # tokens computed or scheduled in a step still in flight
    confirmed: int = 0  # tokens whose step output arrived
    block_table: list[int] = attrs.Factory(list)
    lookup: tuple[str, ...] | None = None  # tier of each leading hit block, this epoch
    lookup_async: bool = False  # ``lookup`` is an async answer (consumed at admission)
    lookup_answered_ms: float = 0.0  # when that answer arrived
    lookup_uses: int = 0  # admissions that answer has been considered for
    async_lookups: int = 0  # async lookups submitted over the request's life (bounded: engine.max_async_lookups)
    lookup_submitted_ms: float = 0.0  # when its last async lookup went out (its deadline counts from it)
    stored_blocks: int = 0  # leading blocks already handed to a store
    registered_blocks: int = 0  # leading blocks published in the device cache
    # Known tokens when last admitted (or when its load was started): the prefill runs
    # while ``computed`` is below it (vLLM's in-flight prefills, whose remaining blocks
    # an async load's admission must leave free).
    admitted_tokens: int = 0
    load_jobs: list[int] = attrs.Factory(list)  # loads this request waits for
    load_failed: list[int] = attrs.Factory(list)  # block hashes that failed in those loads
    external_hit_limit: int = 1 << 30  # lowered to the first failed block after a bad load
    hit_tokens_pending: int = 0  # tokens the pending loads will make valid
    # Its loads landed and a tick reached it but it did not fit yet (vLLM has then moved
    # it out of WAITING_FOR_REMOTE_KVS, to WAITING with its blocks).
    landed_seen: bool = False
    store_jobs: int = 0  # stores still reading this request's blocks
    # When it went to ``sending``: the tick count, and the id of the next step planned
    # (the first whose worker output can carry vLLM's finished_sending for it).
    sending_tick: int = 0
    sending_step: int = 0
    finish_reason: str | None = None
    first_token_ms: float | None = None
    finish_ms: float | None = None
    preemptions: int = 0
    device_hit_blocks: int = 0
    tier_hit_blocks: dict[str, int] = attrs.Factory(dict)
    last_decisions: dict[str, tuple[str, object, str]] = attrs.Factory(dict)

    @property
    def known_tokens(self) -> int:
        return self.prompt_tokens + self.generated + self.placeholders

    def view(self) -> RequestView:
        return RequestView(
            request_id=self.request_id,
            state=self.state,
            arrival_ms=self.arrival_ms,
            prompt_tokens=self.prompt_tokens,
            generated_tokens=self.generated,
            computed_tokens=self.computed,
            confirmed_tokens=self.confirmed,
            placeholder_tokens=self.placeholders,
            block_tokens=self.block_tokens,
            block_hashes=self.hashes,
            stored_blocks=self.stored_blocks,
            resumable=self.resumable,
            preemptions=self.preemptions,
        )
