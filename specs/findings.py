"""The invariants' numbers and names (docs/design.md, "Invariants"), and a finding.

The numbering is stable: traces, ``kvlife validate``, ``kvlife check`` and the tests
refer to these numbers. 0 is a malformed trace; 14 was the decode fast path's twin (gone
with the fast path, the number is not reused).
"""

from __future__ import annotations

import attrs

INVARIANTS: dict[int, str] = {
    0: "well-formed trace",
    1: "legal transitions; finished absorbs; a failed load leads where kv_load_failure_policy says",
    2: "no block freed or reused under an in-flight transfer",
    3: "a job is done only after every rank reported it exactly once; given up at its deadline",
    4: "inputs apply only to the epoch (and step) that asked",
    5: "stores cover only computed tokens",
    6: "no two in-flight loads read the same block from a tier (load sharing on)",
    7: "every transfer ends; every request finishes (liveness); a preemption makes room (progress)",
    8: "block accounting",
    9: "loaded bytes match what was computed (live runs)",
    10: "provenance: hits, loads, joins and stores read only complete blocks (stores: confirmed ones)",
    11: "scheduling: token budget, max_running, output limit, FIFO admission, promotion and release at step "
        "outputs; finished only after every store is reported",
    12: "bounded work: one lookup at a time, lookup_reuse obeyed, no retry of a copy that failed to load",
    13: "accounting: a request's recorded hit is what its first admission skipped; counters match the trace; "
        "stores offered",
    15: "replay: a run's trace replays exactly, byte for byte",
}


@attrs.frozen
class Violation:
    invariant: int
    message: str
    line: int | None = None
    t: float | None = None

    def __str__(self) -> str:
        where = f"line {self.line}: " if self.line is not None else ""
        when = f"t={self.t:g} " if self.t is not None else ""
        return f"{where}{when}invariant {self.invariant} ({INVARIANTS.get(self.invariant, '?')}): {self.message}"


class InvariantViolation(AssertionError):
    def __init__(self, violation: Violation) -> None:
        super().__init__(str(violation))
        self.violation = violation
