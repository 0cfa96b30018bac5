"""The policy protocol: decision points, read-only views, decisions with reasons, stacks.

A policy is a plain class with any subset of the hooks below. Hooks are pure: they read
the views they are given and return a ``Decision`` (a value plus a short human reason
that lands in the trace) or ``None`` to pass the decision down the stack. The engine
asks the stack top-down: the first policy that answers wins, and the baseline at the
bottom answers everything. The engine enforces safety whatever the answer is: a policy
chooses among legal options, it cannot free a block under a transfer.

Stack order: the stack is the ``--stack "a,b"`` value (or ``[policies] stack``) in the order
given, then ``Baseline``. Each hook is resolved on its own, so policies that answer
different hooks (``async-lookup`` answers ``lookup_mode``, ``shared-loads`` answers
``admission``) compose in any order; when two answer the same hook, put the more specific
one first (``prefetch-timeout`` before ``early-prefetch``, a user override before the
built-ins). A hook nobody answers falls back to ``FALLBACKS`` (only
``prefetch_patience``, which the baseline predates: wait for the prefetch to complete).

Decision points, in the order a request meets them: ``on_arrival`` (none, lookup, or
lookup plus a lower-tier prefetch into the host tier), ``lookup_mode`` (sync or async),
``lookup_reuse`` (consume an async answer at the admission it is used for, as vLLM does,
or keep it for later admissions), ``prefetch_patience`` (ms a request may wait for its
prefetch, counted from the start of the prefetch: 0 is best effort, ``math.inf`` waits
for completion), ``admission`` (go, defer, join an in-flight load), ``store_limit``
(tokens whose blocks may be stored), ``hold_at_finish`` and ``on_load_failure``.

This module is the protocol only and imports no policy: ``kvlife.policies.stack`` asks
a stack, ``kvlife.policies.loading`` loads one by name, and ``kvlife.policies.registry``
names the built-ins (each imports this module, never the other way round).
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Any, Generic, Literal, Protocol, TypeVar

import attrs

T = TypeVar("T")

LookupMode = Literal["sync", "async"]
LookupReuse = Literal["consume", "keep"]
ArrivalAction = Literal["none", "lookup", "prefetch"]
Admission = Literal["go", "defer", "join"]
LoadFailureAction = Literal["recompute", "fail"]


class Hook(StrEnum):
    """The decision points, in the order a request meets them."""

    ON_ARRIVAL = "on_arrival"
    LOOKUP_MODE = "lookup_mode"
    LOOKUP_REUSE = "lookup_reuse"
    PREFETCH_PATIENCE = "prefetch_patience"
    ADMISSION = "admission"
    STORE_LIMIT = "store_limit"
    HOLD_AT_FINISH = "hold_at_finish"
    ON_LOAD_FAILURE = "on_load_failure"


HOOKS: tuple[str, ...] = tuple(Hook)

HOOK_VALUES: dict[str, tuple[Any, ...] | type] = {
    "on_arrival": ("none", "lookup", "prefetch"),
    "lookup_mode": ("sync", "async"),
    "lookup_reuse": ("consume", "keep"),
    "prefetch_patience": float,  # ms, >= 0; ints accepted, math.inf means wait for completion
    "admission": ("go", "defer", "join"),
    "store_limit": int,
    "hold_at_finish": bool,
    "on_load_failure": ("recompute", "fail"),
}


@attrs.frozen(slots=True)
class Decision(Generic[T]):
    value: T
    reason: str


@attrs.frozen(slots=True)
class RequestView:
    """What a policy may know about one request."""

    request_id: str
    state: str
    arrival_ms: float
    prompt_tokens: int
    generated_tokens: int
    computed_tokens: int  # includes tokens of steps still in flight (placeholders)
    confirmed_tokens: int  # tokens whose step output has arrived
    placeholder_tokens: int
    block_tokens: int
    # Hashes of the request's full blocks known so far: its prompt's, then (derived) the
    # blocks its generated tokens filled.
    block_hashes: tuple[int, ...]
    stored_blocks: int  # leading blocks already sent to store
    resumable: bool
    preemptions: int


@attrs.frozen(slots=True)
class LoadView:
    """The admission question: what this request could take from where."""

    device_hit_blocks: int  # leading blocks already valid on the device
    external_hit_blocks: int  # further leading blocks available in a tier
    tiers: tuple[str, ...]  # tier of each external hit block
    in_flight: tuple[tuple[int, str], ...]  # (block hash, loading request) among the hits


@attrs.frozen(slots=True)
class PrefetchView:
    """A lower-tier to host-tier pull started for this request (early prefetch)."""

    blocks: int  # blocks being pulled into the host tier
    tokens: int  # tokens those blocks hold
    source_tiers: tuple[str, ...]  # tier each block is pulled from
    started_ms: float


@attrs.frozen(slots=True)
class EngineView:
    now_ms: float
    running: int
    waiting: int
    loading: int
    free_device_blocks: int
    device_blocks: int


class Policy(Protocol):
    """Documentation of the hooks; a policy implements any subset of them."""

    name: str

    def on_arrival(self, req: RequestView, engine: EngineView) -> Decision[ArrivalAction] | None: ...

    def lookup_mode(self, req: RequestView, engine: EngineView) -> Decision[LookupMode] | None: ...

    def lookup_reuse(self, req: RequestView, engine: EngineView) -> Decision[LookupReuse] | None: ...

    def prefetch_patience(
        self, req: RequestView, prefetch: PrefetchView, engine: EngineView
    ) -> Decision[float] | None: ...

    def admission(
        self, req: RequestView, load: LoadView, engine: EngineView
    ) -> Decision[Admission] | None: ...

    def store_limit(self, req: RequestView, engine: EngineView) -> Decision[int] | None: ...

    def hold_at_finish(
        self, req: RequestView, stores_in_flight: int, engine: EngineView
    ) -> Decision[bool] | None: ...

    def on_load_failure(
        self, req: RequestView, failed_blocks: int, engine: EngineView
    ) -> Decision[LoadFailureAction] | None: ...


class PolicyError(Exception):
    """A policy could not be loaded, or one of its hooks answered nonsense."""


@attrs.frozen
class Answer:
    policy: str
    value: Any
    reason: str


# Answers for hooks that no policy in the stack implements (the baseline predates them).
FALLBACKS: dict[str, Answer] = {
    "prefetch_patience": Answer("fallback", math.inf, "wait_complete: no policy set a prefetch patience"),
}
# Positional arguments each hook is called with (the request view first, the engine view last).
HOOK_ARITY: dict[str, int] = {
    "on_arrival": 2,
    "lookup_mode": 2,
    "lookup_reuse": 2,
    "prefetch_patience": 3,
    "admission": 3,
    "store_limit": 2,
    "hold_at_finish": 3,
    "on_load_failure": 3,
}
