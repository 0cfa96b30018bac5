"""The invariant observer beside a simulated run (``kvlife run --check``, ``sim.check``).

``specs.invariants.InvariantObserver`` rebuilds its own picture of the run from the inputs,
the records and the commands the engine issues, and checks it against the spec: the same
pipeline of observers ``kvlife validate`` and the model checker run, so a simulated run gets
the checks a trace cannot give: content provenance on the device and in the tiers (10),
the token budget and ``max_running`` (11), one lookup at a time (12), and what the engine's
counters, prefix cache and tiers hold (13, through ``specs.engine_probe``), besides 1-7.

It sits between the engine and its recorder (every record goes to the observer, then on
to the trace writer, if any), after the commands the engine issued before it in the same
handling (read from the engine's command list as it grows), and around ``Engine.handle``
(``attach``), which hands the observer the rest of a handling's commands (the step plan)
and closes the handling: the observer sees commands and records in the order the engine
produced them, as the model checker feeds it. Block accounting (8) is the engine's own
check, run after every handling.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from kvlife.lifecycle.config import EngineConfig
from kvlife.lifecycle.engine.core import Engine, Recorder
from kvlife.lifecycle.engine.events import Command, InputEvent
from kvlife.policies.stack import PolicyStack
from kvlife.specs.engine_probe import EngineProbe
from kvlife.specs.invariants import INVARIANTS, InvariantObserver, Settings, Violation

SHOWN = 10  # violations kept in full for the summary; the rest are counted


class OnlineCheck:
    def __init__(self, config: EngineConfig, stack: PolicyStack, downstream: Recorder | None = None) -> None:
        from kvlife.specs.model_check import detect_sharing, store_rule

        self.observer = InvariantObserver(Settings.of(
            config, sharing=detect_sharing(stack), tier_content_known=True, store_rule=store_rule(stack)))
        self.downstream = downstream
        self.probe: EngineProbe | None = None
        self.finished = False

    def attach(self, engine: Engine) -> None:
        """Watch ``engine``: its probe, and every ``handle`` call (the commands it returns)."""
        self.probe = EngineProbe(engine)
        self.observer.attach(self.probe)
        handle = engine.handle
        observer = self.observer

        def checked(event: InputEvent) -> list[Command]:
            commands = handle(event)
            observer.feed_new_commands(commands)  # the rest of them (the step plan)
            observer.end_input()
            return commands

        engine.handle = checked  # type: ignore[method-assign]

    def record(self, record: dict[str, Any]) -> None:
        """The engine's recorder: the commands issued so far, then the record."""
        commands = self.probe.commands() if self.probe is not None else None
        if commands is not None:
            self.observer.feed_new_commands(commands)
        self.observer.feed_record(record)
        if self.downstream is not None:
            self.downstream(record)

    def handled(self) -> None:
        """``Engine.handle`` returned (the handling was closed by ``attach``'s wrapper)."""

    def finish(self) -> None:
        """Inputs stopped: the end-of-run checks (7: every job ended, every request finished)."""
        if not self.finished:
            self.finished = True
            self.observer.finish()

    @property
    def violations(self) -> list[Violation]:
        return self.observer.violations

    def summary(self) -> dict[str, Any]:
        """Violations per invariant and the first few in full."""
        by = Counter(v.invariant for v in self.violations)
        return {
            "violations": len(self.violations),
            "by_invariant": {str(i): n for i, n in sorted(by.items())},
            "first": [str(v) for v in self.violations[:SHOWN]],
            "unchecked": list(self.observer.unchecked),
        }


def describe(summary: dict[str, Any]) -> str:
    """``3 violations (5 store covers..., 10 provenance...)`` for a summary row."""
    n = summary["violations"]
    if not n:
        return "clean"
    parts = ", ".join(f"invariant {i} x{c} ({INVARIANTS.get(int(i), '?')})" for i, c in summary["by_invariant"].items())
    return f"{n} violation(s): {parts}"
