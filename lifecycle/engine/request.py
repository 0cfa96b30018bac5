"""One request, twice: as the scheduler sees it and as the connector core sees it.

vLLM keeps a request's scheduling state in its ``Request`` (tokens computed, output
placeholders, status, block table) and a connector keeps its own record of the same request
(lookups, jobs, what it stored). kvlife does the same: ``SchedRequest`` is kvlife's model of
vLLM's ``Request``, owned by ``scheduler.Scheduler``; ``Request`` is the connector core's
record (``connector.ConnectorCore``), the one whose ``state`` is the spec's lifecycle state,
written only through the compiled table. The metrics read ``Request``.
"""

from __future__ import annotations

import enum

import attrs

from kvlife.lifecycle.engine.blocks import extend_hashes
from kvlife.policies.base import RequestView
from kvlife.specs.names import RequestState


class Status(enum.Enum):
    """vLLM's ``RequestStatus``, as far as kvlife's scheduler models it (the same names)."""

    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()
    FINISHED_IGNORED = enum.auto()  # it can never fit the device (kvlife's liveness rule; vLLM's too-long prompt)


# kvlife's finish reasons -> vLLM's status of a finished request.
FINISHED_STATUS = {
    "stopped": Status.FINISHED_STOPPED,
    "length": Status.FINISHED_LENGTH_CAPPED,
    "aborted": Status.FINISHED_ABORTED,
    "error": Status.FINISHED_ERROR,
}


@attrs.define(slots=True, eq=False)
class SchedRequest:
    """kvlife's model of vLLM's ``Request``: what ``schedule()`` and ``update_from_output``
    read and write (v1 ``request.py``; only full-attention, non-speculative fields), and
    what a connector reads of it, by vLLM's names (``num_prompt_tokens``, ``block_hashes``,
    ``status``, ``max_tokens``)."""

    request_id: str
    prompt_tokens: int
    max_tokens: int | None  # None: no limit known (the driver says when it stops)
    hashes: tuple[int, ...]  # full prompt blocks, then derived names as outputs fill blocks
    block_tokens: int
    resumable: bool = False
    status: Status = Status.WAITING
    output_tokens: int = 0
    num_computed_tokens: int = 0
    num_output_placeholders: int = 0
    num_in_flight_tokens: int = 0  # scheduled in steps whose output has not come yet
    num_stale_output_tokens: int = 0  # in-flight tokens of an epoch preempted since
    num_preemptions: int = 0
    blocks: list[int] = attrs.Factory(list)  # its block table
    table: tuple[int, ...] = ()  # ``blocks`` as a tuple, kept while its length is (a step's plan carries it)
    num_cached_blocks: int = 0  # leading blocks published in the prefix cache
    last_sched_seq: int = 0  # the last non-empty step that scheduled it (defer_block_free)
    is_prefill_chunk: bool = False
    finished: bool = False  # status FINISHED_*; its blocks may still be held
    free_on_recving: bool = False  # finished while its load was in flight: freed at finished_recving
    free_on_sending: bool = False  # held by the connector: freed at finished_sending
    finish_note: str | None = None  # why kvlife failed it (the connector's transition reason)
    # The most block names it derives: a prompt that can never fit fails at its arrival and
    # needs none past the device's size (2^63 tokens would derive names for ever).
    hash_cap: int = 1 << 62

    @property
    def num_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return self.prompt_tokens

    @property
    def block_hashes(self) -> tuple[int, ...]:
        """The hashes of its full blocks of known tokens (derived past the prompt)."""
        full = (self.prompt_tokens + self.output_tokens) // self.block_tokens
        if full > self.hash_cap:
            full = self.hash_cap
        if full > len(self.hashes):
            self.hashes = extend_hashes(self.hashes, self.request_id, full)
        return self.hashes


@attrs.define(slots=True, eq=False)
class Request:
    """The connector core's record of one request (see the module docstring)."""

    request_id: str
    seq: int  # arrival order
    arrival_ms: float
    prompt_tokens: int
    # Block hashes: the full prompt blocks' from the arrival, then derived ones
    # (``blocks.derived_block_hash``) appended as blocks of generated tokens fill.
    hashes: tuple[int, ...]
    resumable: bool
    block_tokens: int
    max_tokens: int | None = None
    state: str = RequestState.WAITING
    # Bumped on preemption, abort, finish, failed load and lookup expiry: a lookup answer or
    # a job outcome for an older epoch is stale and never applied (invariant 4).
    epoch: int = 0
    generated: int = 0
    placeholders: int = 0  # sampled tokens whose step output has not arrived
    computed: int = 0  # tokens computed or scheduled in a step still in flight
    confirmed: int = 0  # tokens whose step output arrived (or that a hit made valid)
    block_table: list[int] = attrs.Factory(list)  # the scheduler's blocks for it, as it was told
    local_tokens: int = 0  # the device prefix hit the scheduler found at the last match
    lookup: tuple[str, ...] | None = None  # tier of each leading hit block, this epoch
    lookup_async: bool = False  # ``lookup`` is an async answer
    lookup_answered_ms: float = 0.0
    lookup_uses: int = 0  # matches that answer has been used for
    async_lookups: int = 0  # async lookups submitted over its life (bounded: engine.max_async_lookups)
    lookup_submitted_ms: float = 0.0
    # The last match's external hit: (hash, tier) per block past the device hit, and the
    # in-flight loads it joins (hash -> job), taken by ``update_state_after_alloc``.
    plan: tuple[tuple[int, str], ...] = ()
    joins: dict[int, int] = attrs.Factory(dict)
    stored_blocks: int = 0  # leading blocks already handed to a store
    load_jobs: list[int] = attrs.Factory(list)  # loads it waits for
    load_failed: list[int] = attrs.Factory(list)  # block hashes that failed in those loads
    external_hit_limit: int = 1 << 30  # lowered to the first failed block after a bad load
    landed: bool = False  # its loads all reported; the scheduler promotes it at its next pass
    pending_hit_tokens: int = 0  # tokens valid once its loads land
    store_jobs: int = 0  # stores still reading its blocks
    hold: bool = False  # the scheduler holds its blocks until finished_sending (request_finished True)
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
