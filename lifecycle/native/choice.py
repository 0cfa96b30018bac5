"""Which engine a simulated run uses: ``--engine python|native``.

The native engine is the default wherever it covers the run; elsewhere the run goes on
the Python engine (the reference) and says why, in one line of ``kvlife run``'s header
(``engine python (native core not built: REASON)``) and, when ``--engine native`` was
asked for, in a one-line notice on stderr. The choice never reaches the trace or the
summary: both engines must write the same bytes.

What the native engine does not cover stays on the Python engine: ``--chaos`` and
``--check`` (the adversary and the online observer work on the Python engine's objects),
and everything where the compiled core lacks the whole-run entry point
(``_core.NativeSimulator``, driven by ``lifecycle/native/run.py``). Callers of
``runner.run_workload`` that read the Python engine's objects (``keep_requests=True``,
``engine_factory``) stay on it too: ``run_workload(engine="native")`` refuses them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from kvlife.lifecycle import native

if TYPE_CHECKING:
    from kvlife.lifecycle.config import RunConfig

ENGINES = ("python", "native")
# The native core's entry point for a whole simulated run: where the compiled module
# has it, the native engine runs.
ENTRY_POINT = "NativeSimulator"


@attrs.frozen
class EngineChoice:
    engine: str  # the engine that runs: "python" or "native"
    requested: str | None  # --engine as given (None: the default)
    why_not_native: str | None  # why the native engine does not run (None when it does)

    def header(self) -> str:
        """The run header's ``engine`` line: which engine runs, and why not native."""
        if self.engine == "native":
            return "native"
        if self.requested == "python":
            return "python (--engine python)"
        return f"python ({self.why_not_native})"

    def notice(self) -> str | None:
        """A one-line notice when ``--engine native`` was asked for and cannot run."""
        if self.requested == "native" and self.engine != "native":
            return f"--engine native: running on the python engine: {self.why_not_native}"
        return None

    def to_dict(self) -> dict[str, str | None]:
        return {"engine": self.engine, "requested": self.requested, "why_not_native": self.why_not_native}


def uncovered(config: RunConfig) -> str | None:
    """Why the native engine cannot run ``config`` (one line), or None when it can."""
    reason = native.why_not()
    if reason is not None:
        return f"native core not built: {reason}"
    if not hasattr(native.load(), ENTRY_POINT):
        return ("native engine not complete: its connector core and simulator loop are still being "
                "mirrored (issue 23)")
    if config.sim.chaos is not None:
        return "native engine does not cover --chaos (sim.chaos): the adversary works on the python engine"
    if config.sim.check:
        return "native engine does not cover --check (sim.check): the observer reads the python engine"
    return None


def choose(requested: str | None, config: RunConfig) -> EngineChoice:
    """The engine for a simulated run of ``config``: ``requested`` (``--engine``) or, by
    default, native where it covers the run."""
    if requested is not None and requested not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {requested!r}")
    why = uncovered(config)
    if requested == "python":
        return EngineChoice("python", requested, why)
    return EngineChoice("python" if why is not None else "native", requested, why)
