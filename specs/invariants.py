"""The invariants of docs/design.md ("Invariants"), checked by an independent observer.

The observer never asks the engine what happened: it rebuilds its own picture of a run
from the stream the run produces (input events, trace records and, beside a live engine,
the commands the engine issues) and checks that picture against the spec. It is a
pipeline of small observers, one per invariant family (``kvlife.specs.observers``), that
``kvlife validate`` (a trace: ``Settings(live=False)``), ``kvlife run --check`` and
``kvlife check`` share. What only a live engine can tell (its counters, its prefix
cache, its tiers, its block accounting) comes through one adapter,
``kvlife.specs.engine_probe.EngineProbe``.

``InvariantObserver(settings, probe=None)`` is that pipeline: feed it every record
(``feed_record``), live the engine's commands as it issues them (``feed_commands`` /
``feed_new_commands``), ``end_input`` after each handling and ``finish`` when inputs stop;
``violations`` lists the findings in order.
"""

from __future__ import annotations

from kvlife.specs.findings import INVARIANTS, InvariantViolation, Violation
from kvlife.specs.observers.base import Settings
from kvlife.specs.observers.pipeline import Pipeline as InvariantObserver

# The states in which a request waits on IO (a lookup, a load, its stores).
IO_WAIT_STATES = ("lookup_pending", "loading", "sending")

__all__ = ["INVARIANTS", "IO_WAIT_STATES", "InvariantObserver", "InvariantViolation", "Settings", "Violation"]
