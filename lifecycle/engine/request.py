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
    hashes: tuple[int, ...]  # full prompt blocks only: a partial block has no stable hash
    resumable: bool
    block_tokens: int
    state: str = "waiting"
    # Bumped on preemption, abort and failed load: a lookup answer for an older epoch
    # is stale and never applied (invariant 4).
    epoch: int = 0
    generated: int = 0
    placeholders: int = 0  # sampled tokens whose step output has not arrived
    computed: int = 0  # tokens computed or scheduled in a step still in flight
    confirmed: int = 0  # tokens whose step output arrived
    block_table: list[int] = attrs.Factory(list)
    lookup: tuple[str, ...] | None = None  # tier of each leading hit block, this epoch
    stored_blocks: int = 0  # leading prompt blocks already handed to a store
    registered_blocks: int = 0  # leading prompt blocks published in the device cache
    load_jobs: list[int] = attrs.Factory(list)  # loads this request waits for
    load_failed: list[int] = attrs.Factory(list)  # block hashes that failed in those loads
    external_hit_limit: int = 1 << 30  # lowered to the first failed block after a bad load
    hit_tokens_pending: int = 0  # tokens the pending loads will make valid
    store_jobs: int = 0  # stores still reading this request's blocks
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
