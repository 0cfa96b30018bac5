"""The pipeline: every event through the picture and the observers, in order.

``Pipeline`` is what ``kvlife validate`` (a trace), ``kvlife run --check`` (beside a
simulated run) and ``kvlife check`` (the model checker) feed. For each trace record or
engine command it builds an ``Event``; the picture's tracker reads it (``admit``: a
malformed record is a finding of 0 and goes no further), every observer that watches its
kind sees it (``on_<kind>``, in ``OBSERVERS`` order), then the tracker applies it and
yields the events it implies (a step planned, a step's output, a job completed), each
seen by the observers in turn. ``end_input`` closes a handling (the observers' ``on_end``:
what needs all of a handling's records) and ``finish`` the run (``on_finish``).

The kinds: an ``input`` record becomes its input's type (``arrival``, ``tick``, ``abort``,
``lookup_answer``, ``transfer_report``, ``step_output``); other records keep their kind
(``transition``, ``decision``, ``job``, ...); a command its ``picture.COMMAND_KINDS`` name;
derived: ``plan``, ``output``, ``job_complete``; and ``record`` (every record as written,
before it is read), ``end``, ``finish``.

Feed ``feed_record`` every record in order (an input record opens a handling and closes
the one before), ``feed_commands`` (or ``feed_new_commands``, a list the engine grows) what
a live engine issues, as it issues them, ``end_input`` after each handling of a live
engine and ``finish`` when inputs stop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvlife.specs.findings import Violation
from kvlife.specs.observers import OBSERVERS
from kvlife.specs.observers.base import Context, Event, Observer, Settings, is_number
from kvlife.specs.observers.picture import COMMAND_KINDS, Picture, Tracker

Handler = Callable[[Event], None]


class Pipeline:
    def __init__(self, settings: Settings, probe: Any = None,
                 observers: Sequence[type[Observer]] = OBSERVERS) -> None:
        self.ctx = Context(settings, Picture(), probe)
        self.tracker = Tracker(self.ctx)
        self.observers = [cls(self.ctx) for cls in observers]
        self._handlers: dict[str, list[Handler]] = {}
        self._command_list: Sequence[Any] | None = None  # the engine's command list being fed
        self._commands_fed: list[Any] = []  # what was fed from it (in order)
        self.outer: Any = None  # the input a nested one came in (``feed_record(nested=True)``)
        self.lines = 0

    @property
    def settings(self) -> Settings:
        return self.ctx.settings

    @property
    def picture(self) -> Picture:
        return self.ctx.picture

    @property
    def violations(self) -> list[Violation]:
        return self.ctx.violations

    @property
    def unchecked(self) -> list[str]:
        return self.ctx.unchecked

    @property
    def skipped(self) -> set[int]:
        return self.ctx.skipped

    def attach(self, probe: Any) -> None:
        """The adapter to the live engine (created after the engine, which records into this)."""
        self.ctx.probe = probe

    def observer(self, cls: type[Observer]) -> Observer | None:
        return next((o for o in self.observers if isinstance(o, cls)), None)

    def seed_tier(self, tier: str, hashes: Iterable[int]) -> None:
        """Copies a tier held before the run started (a warm tier)."""
        hashes = list(hashes)
        for observer in self.observers:
            seed = getattr(observer, "seed_tier", None)
            if seed is not None:
                seed(tier, hashes)

    def states(self) -> dict[str, str]:
        return {rid: req.state for rid, req in self.picture.requests.items()}

    # ---- feeding -------------------------------------------------------------------------------
    def feed_record(self, record: dict[str, Any], line: int | None = None, nested: bool = False) -> None:
        """``nested``: an input taken inside the handling under way, which goes on after it
        (live: a lookup answer the connector's own client hands it as a pass begins); its
        end comes with ``end_nested``."""
        kind = record.get("kind")
        self.lines += 1
        if self.picture.cut is not None:
            self.ctx.line = line if line is not None else self.ctx.line
            self.ctx.fail(0, f"{kind} record after the interrupted record: the run had ended")
            return
        if kind == "input" and nested and self.picture.input is not None and self.outer is None:
            self.outer = self.picture.input
        elif kind == "input":
            self.end_input()
        if line is not None:
            self.ctx.line = line
        t = record.get("t")
        if kind != "input" and is_number(t):
            self.ctx.t = float(t)
        self._run(Event("record", record))
        self._feed(Event(str(kind), record))

    def feed_commands(self, commands: Iterable[Any]) -> None:
        for command in commands:
            kind = COMMAND_KINDS.get(type(command).__name__)
            if kind is not None:
                self._feed(Event(kind, command))

    def feed_new_commands(self, commands: Sequence[Any]) -> None:
        """Feed what ``commands`` (the engine's list for the handling under way, replaced at
        each input) holds that was not fed from it already: a recorder sees commands before
        ``handle`` returns them (and the connector may take some out of the list meanwhile:
        the lookups its own client answers)."""
        if commands is not self._command_list:
            self._command_list, self._commands_fed = commands, []
        fed = self._commands_fed
        n = len(fed)
        if len(commands) >= n and (n == 0 or commands[n - 1] is fed[-1]):  # appended to only
            new = list(commands[n:])
        else:  # some were taken out (only ever taken out: what is left keeps its order)
            seen = {id(c) for c in fed}  # (fed keeps them alive: no id is reused meanwhile)
            new = [c for c in commands if id(c) not in seen]
        if new:
            fed.extend(new)
            self.feed_commands(new)

    def taken_out(self, commands: Sequence[Any]) -> list[Any]:
        """Commands fed from ``commands`` (the list a handling returned) that it no longer
        holds: issued, yet never handed to the driver."""
        if commands is not self._command_list:
            return []
        left = {id(c) for c in commands}
        return [c for c in self._commands_fed if id(c) not in left]

    def end_nested(self) -> None:
        """A nested input is applied: its checks, then the handling it came in goes on."""
        if self.outer is None:
            return
        self._run(Event("end"))
        self.picture.input, self.outer = self.outer, None

    def end_input(self) -> None:
        """Close the handling under way: the checks that need all of its records."""
        self.end_nested()
        if self.picture.input is None:
            return
        self._run(Event("end"))
        self.tracker.end()

    def finish(self) -> None:
        """Inputs stopped: the end-of-run checks."""
        self.end_input()
        self.ctx.line = None
        self._run(Event("finish"))

    def _feed(self, ev: Event) -> None:
        if not self.tracker.admit(ev):
            return
        self._run(ev)
        for derived in self.tracker.commit(ev):
            self._run(derived)

    def _run(self, ev: Event) -> None:
        handlers = self._handlers.get(ev.kind)
        if handlers is None:
            name = "on_" + ev.kind
            handlers = self._handlers[ev.kind] = [h for o in self.observers if (h := getattr(o, name, None))]
        for handler in handlers:
            handler(ev)
