"""The invariant observer beside a simulated run (``kvlife run --check``, ``sim.check``).

``specs.invariants.InvariantObserver`` rebuilds its own picture of the run from the inputs,
the records and the commands the engine issues, and checks it against the spec: the same
observer the model checker runs, so a simulated run gets the checks a trace cannot give —
content provenance on the device and in the tiers (10), the token budget and
``max_running`` (11), one lookup at a time (12) and hit accounting (13) — besides 1-7.

It sits between the engine and its recorder: every record goes to the observer (and then
on to the trace writer, if any), after the commands the engine issued before it in the same
handling (read from ``engine.state.commands`` as it grows), so the observer sees commands
and records in the order the engine produced them, as the model checker feeds it.
Block accounting (8) is left to ``engine.check_invariants`` (``Simulator(check_every=)``).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from kvlife.lifecycle.config import EngineConfig
from kvlife.lifecycle.engine.core import Engine, Recorder
from kvlife.policies.stack import PolicyStack
from kvlife.specs.invariants import INVARIANTS, InvariantObserver, Violation

SHOWN = 10  # violations kept in full for the summary; the rest are counted


class OnlineCheck:
    def __init__(self, config: EngineConfig, stack: PolicyStack, downstream: Recorder | None = None) -> None:
        from kvlife.specs.model_check import detect_sharing

        self.observer = InvariantObserver(
            config.ranks, config.block_tokens, sharing=detect_sharing(stack),
            max_batched_tokens=config.max_batched_tokens, max_running=config.max_running,
            tier_content_known=True, hit_probe=self._recorded_hit, max_async_lookups=config.max_async_lookups)
        self.downstream = downstream
        self.engine: Engine | None = None
        self.finished = False

    def attach(self, engine: Engine) -> None:
        self.engine = engine

    def record(self, record: dict[str, Any]) -> None:
        """The engine's recorder: the commands issued so far, then the record."""
        self._feed_new_commands()
        self.observer.feed_record(record)
        if self.downstream is not None:
            self.downstream(record)

    def _feed_new_commands(self) -> None:
        engine = self.engine
        if engine is None:
            return
        self.observer.feed_new_commands(engine.state.commands)

    def handled(self) -> None:
        """``Engine.handle`` returned: the rest of its commands, and close the handling."""
        self._feed_new_commands()
        self.observer.end_input()

    def finish(self) -> None:
        """Inputs stopped: the end-of-run checks (7: every job ended, every request finished)."""
        if not self.finished:
            self.finished = True
            self.observer.finish()

    def _recorded_hit(self, rid: str) -> int | None:
        req = self.engine.requests.get(rid) if self.engine is not None else None
        if req is None:
            return None  # retired: its totals are folded
        return int(req.device_hit_blocks + sum(req.tier_hit_blocks.values()))

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
