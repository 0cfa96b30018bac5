"""What every observer shares: the settings of the run it watches, the events it is fed,
the context it reports findings to, and the base class of an observer.

An observer is a small class for one invariant family (``kvlife.specs.observers``). It
never asks the engine anything: it is handed events (trace records, input events, the
commands a live engine issues, and the events the picture derives from them), each with
the picture (``picture.Picture``) as it stands, and reports what breaks its invariants
through ``Context.fail``. The pipeline (``pipeline.Pipeline``) calls ``on_<kind>(event)``
of every observer that has one, in order, as structlog calls its processors. What an
observer needs from a live engine (its counters, its prefix cache, ...) comes through
the one adapter, ``kvlife.specs.engine_probe.EngineProbe``, or not at all (a trace).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeGuard

import attrs

from kvlife.specs.findings import Violation

if TYPE_CHECKING:
    from kvlife.specs.engine_probe import EngineProbe
    from kvlife.specs.observers.picture import Job, Picture, Req, Step


@attrs.frozen
class Settings:
    """What the observers know of the run: the engine's limits (from its config or a
    trace's header) and what the stream they are fed can tell."""

    ranks: int
    block_tokens: int
    # Commands are fed (a live engine: step plans with block tables and every entry, lookup
    # submissions); False: a trace (records only: steps name their prompt chunks and fills).
    live: bool = True
    sharing: bool = False  # the stack joins in-flight loads (6)
    max_batched_tokens: int | None = None  # 11 (None: not checked)
    max_running: int | None = None
    device_blocks: int | None = None  # 1, 11: what can never fit (None: not checked)
    async_scheduling: bool = False
    tiers: tuple[str, ...] = ()  # the engine's tiers, in cascade order
    tier_content_known: bool = False  # 10: every tier copy was seen written (or seeded)
    finish_after_stores: bool = True  # 11: a trace of another connector has no hold decisions
    # 5: a recording of another connector, whose worker may start a store of a step's blocks
    # after that step's forward pass (OffloadingConnector): a store covers the tokens of the
    # steps planned so far, not only those a step output confirmed.
    stores_after_forward: bool = False
    lookup_deadline_ms: float | None = None
    transfer_deadline_ms: float | None = None
    reclaim_deadline_ms: float | None = None
    max_async_lookups: int | None = None
    store_rule: str | None = None  # 13: "confirmed" / "computed" (None: the limit is not known)
    fifo: bool = False  # 11: admission order (live)
    kv_load_failure_policy: str | None = None  # 1: what a failed load leads to (None: not checked)
    # 8: the engine's own block accounting after every handling (live; the model checker's
    # worlds are small enough; a long simulated run checks it at its end instead).
    accounting: bool = False

    @property
    def deferred_frees(self) -> bool:
        """vLLM's defer_block_free: under async scheduling with a connector, no block goes
        back while a step in flight writes it (2; needs the step's block tables)."""
        return self.async_scheduling and bool(self.tiers) and self.live

    @classmethod
    def of(cls, config: Any, **overrides: Any) -> Settings:
        """The settings of an engine config (``EngineConfig``); ``overrides`` win."""
        values: dict[str, Any] = {
            "ranks": config.ranks, "block_tokens": config.block_tokens,
            "max_batched_tokens": config.max_batched_tokens, "max_running": config.max_running,
            "device_blocks": config.device_blocks, "async_scheduling": config.async_scheduling,
            "tiers": tuple(t.name for t in config.tiers), "lookup_deadline_ms": config.lookup_deadline_ms,
            "transfer_deadline_ms": config.transfer_deadline_ms, "reclaim_deadline_ms": config.reclaim_deadline_ms,
            "max_async_lookups": config.max_async_lookups, "kv_load_failure_policy": config.kv_load_failure_policy,
        }
        values.update(overrides)
        return cls(**values)


@attrs.define(slots=True, eq=False)
class Event:
    """One thing an observer is told: a record, an input, a command, or an event the
    picture derives (a job completed, a step's output delivered, the end of a handling).
    ``data`` is the record (a dict), the input event or command (attrs objects), or the
    picture's object (a ``Job``, a ``Step``). The picture adds what it knows of the event
    before the observers see it: the request and job it names, the state the request was
    in (a transition)."""

    kind: str
    data: Any = None
    req: Req | None = None
    job: Job | None = None
    step: Step | None = None
    source: str | None = None  # a transition: the state the picture had the request in

    def get(self, key: str, default: Any = None) -> Any:
        """A field of a record (None: not a record)."""
        return self.data.get(key, default) if isinstance(self.data, dict) else default


class Context:
    """The observers' shared context: the settings, the picture, the probe, the findings
    and where in the stream they are (the line and time of the record being handled)."""

    def __init__(self, settings: Settings, picture: Picture, probe: EngineProbe | None = None) -> None:
        self.settings = settings
        self.picture = picture
        self.probe = probe
        self.violations: list[Violation] = []
        self.unchecked: list[str] = []  # what the records did not allow to check
        self.skipped: set[int] = set()  # invariants not (fully) checked for lack of records
        self.line: int | None = None
        self.t: float | None = None

    def fail(self, invariant: int, message: str, line: int | None = None) -> None:
        self.violations.append(Violation(invariant, message, self.line if line is None else line, self.t))

    def note(self, what: str, *invariants: int) -> None:
        """The stream lacks what ``invariants`` need: say so once."""
        self.skipped.update(invariants)
        if what not in self.unchecked:
            self.unchecked.append(what)


class Observer:
    """One invariant family. Subclasses define ``on_<kind>(event)`` for the kinds they
    watch (``pipeline.KINDS``) and report through ``fail``."""

    # The invariants this observer reports (docs/design.md's numbers).
    invariants: tuple[int, ...] = ()

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.settings = ctx.settings
        self.picture = ctx.picture
        self.bt = ctx.settings.block_tokens

    def fail(self, invariant: int, message: str, line: int | None = None) -> None:
        self.ctx.fail(invariant, message, line)


def is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> TypeGuard[float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def missing_ranks(ranks: int, reported: set[int]) -> list[int]:
    return sorted(set(range(ranks)) - reported)
