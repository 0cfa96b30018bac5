"""Does a run's trace replay exactly? The model checker's determinism check.

The product's promise is that every run's JSON-lines trace replays byte for byte.
``replays_exactly`` holds a run to it with the project's own code, end to end: the
records the engine gave its recorder are written by ``TraceWriter`` after a header built
as a run builds it (``RunConfig.to_dict()``, the stack's names, the seed), and the file
goes through ``kvlife replay``'s path (``kvlife.lifecycle.traces.replay.replay``): the
header's config is read back through the config-file validator, every input record is
parsed and checked (``traces.inputs.read_input``) and re-fed to a fresh engine, and each
record that engine makes is compared with the written line, then the ends of the two
runs. Nothing here writes, reads or compares a trace on its own.

The engine to re-feed is the caller's to build (``build_engine``, from the config the
header gave back): what the model checker runs on is more than a header says (its
explorer policy, tiers warmed before the run, retention, a broken engine of the bug zoo).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvlife.lifecycle.config import EngineConfig, RunConfig
from kvlife.lifecycle.traces.replay import replay
from kvlife.lifecycle.traces.trace import TraceError, TraceWriter

if TYPE_CHECKING:
    from kvlife.lifecycle.engine.state import Recorder

# (the engine config the trace header gave back, the recorder) -> a fresh engine.
Rebuild = Callable[[EngineConfig, "Recorder"], Any]


def replays_exactly(records: Sequence[dict[str, Any]], config: EngineConfig, stack_names: Sequence[str],
                    build_engine: Rebuild, seed: int = 0) -> str | None:
    """None when the trace of ``records`` (as the engine recorded them, inputs included)
    replays exactly into the engine ``build_engine`` makes; else one line: where the
    replay first differs, and both texts. ``stack_names``: the stack's ``names``, the
    baseline last, as a run's header lists them."""
    policies = list(stack_names)
    run = RunConfig(engine=config, policies=tuple(policies[:-1]))
    with tempfile.TemporaryDirectory(prefix="kvlife-replay-check-") as folder:
        path = Path(folder) / "run.jsonl"
        with TraceWriter(path) as writer:
            writer.write_header(run.to_dict(), policies, seed)
            for record in records:
                writer.record(record)
        try:
            result = replay(path, build_engine=lambda header_config, recorder: build_engine(header_config.engine,
                                                                                            recorder))
        except TraceError as exc:  # the reader refuses what the writer wrote
            where = f"{path}:{exc.line}: " if exc.line is not None else f"{path}: "
            return f"the run's trace does not read back: line {exc.line}: {str(exc).removeprefix(where)}"
    d = result.divergence
    if d is None:
        return None
    where = f"at the end (after line {d.line - 1})" if d.end else f"at line {d.line}"
    return f"the run's trace does not replay exactly: {where}, written {d.expected} ; replayed {d.got}"
