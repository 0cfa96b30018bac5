"""Replay a trace: exactly (same config, same stack) or as a what-if (another stack).

Exact replay rebuilds the run configuration from the trace header, feeds every recorded
input to a fresh engine and compares every record the engine produces with the recorded
line, byte for byte (``render_record``). Inputs are self-contained (lookup answers carry
their tiers, step outputs their finishes), so no simulator runs.

After the last line it compares the ends too (``end_divergence``): an input whose
handling records nothing (the output of a step that finished nobody, an idle tick) leaves
no line to compare, so dropping it changes only the engine's state. The trace still says
how the run ended: the output of a later step vouches that every earlier step ended
(steps end in plan order), a run that was not interrupted delivered every step's output
and every request of the header's workload, and an ``interrupted`` record counts the work
open at the cut. The first of these the replayed engine contradicts is the divergence.

The header is data (``kvlife.lifecycle.traces.header``): its config goes through the
config-file validator before the engine is built, and a stack naming anything but
built-in policies is refused unless the caller allows code (``allow_code``, or the
policy is one the user ``named`` on the command line).

A what-if cannot re-feed inputs: job and step ids depend on the policies. It takes the
workload from the recorded arrivals instead (output lengths from what each request
generated in an exact replay) and simulates it under both stacks.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import orjson

from kvlife.lifecycle.config import RunConfig
from kvlife.lifecycle.engine.events import BadEvent, StepOutput
from kvlife.lifecycle.metrics import format_value
from kvlife.lifecycle.traces.header import (
    allocation_problem,
    header_config,
    recovered_slots,
    trace_stack,
    workload_size,
)
from kvlife.lifecycle.traces.inputs import read_input
from kvlife.lifecycle.traces.trace import TraceError, is_driver_record, parse_record, read_header, render_record
from kvlife.lifecycle.workloads.mooncake import WorkloadRequest

if TYPE_CHECKING:
    from kvlife.lifecycle.engine.state import Recorder


def config_from_header(header: dict[str, Any], path: str = "trace", line: int = 1) -> RunConfig:
    """Rebuild the RunConfig a trace was recorded with (header ``config`` = RunConfig.to_dict()),
    checked as a config file is (``kvlife.lifecycle.traces.header.header_config``), and
    refused when the engine it describes would take more memory than the trace justifies
    (``header.allocation_problem``)."""
    config = header_config(header, path, line)
    assert config is not None  # required: a missing config is a TraceError
    try:
        size = os.path.getsize(path)
    except OSError:
        size = 0
    problem = allocation_problem(config, size)
    if problem is not None:
        raise TraceError(path, line, f"field '{problem[0]}': {problem[1]}")
    return config


@attrs.frozen
class Divergence:
    line: int
    expected: str
    got: str
    end: bool = False  # found by the end-of-trace check, after every line matched

    def as_dict(self) -> dict[str, Any]:
        return {"line": self.line, "expected": self.expected, "got": self.got, "end": self.end}


@attrs.frozen
class ReplayResult:
    lines: int
    inputs: int
    divergence: Divergence | None
    engine: Any = attrs.field(repr=False, eq=False, default=None)

    @property
    def identical(self) -> bool:
        return self.divergence is None


# Builds the engine an exact replay re-feeds: (the header's config, the recorder) -> Engine.
EngineBuilder = Callable[[RunConfig, "Recorder"], Any]


def replay(path: str | Path, stop_at_divergence: bool = True, *, allow_code: bool = False,
           named: Collection[str] = (), stack: Sequence[str] | None = None,
           build_engine: EngineBuilder | None = None) -> ReplayResult:
    """Re-feed the recorded inputs; the first record that differs is the divergence, and
    when every line matched, the first difference between the engine's end and the trace's.

    The recorded stack is loaded from the registry; code it names needs ``allow_code`` or
    its name in ``named``. ``stack`` replays under a stack the user named instead.
    ``build_engine``: the caller builds the engine from the header's config (the model
    checker, whose explorer policy and warmed tiers are not data a header carries); the
    header's stack and recovered slots are then not read."""
    p = str(path)
    header, header_line, lines = read_header(path)
    config = config_from_header(header, p, header_line)
    expected_requests = workload_size(header, p, header_line)
    produced: deque[bytes] = deque()

    def recorder(record: dict[str, Any]) -> None:
        produced.append(render_record(record))

    if build_engine is None:
        engine = _header_engine(header, header_line, config, p, recorder, allow_code, named, stack)
    else:
        engine = build_engine(config, recorder)
    inputs = 0
    number = header_line
    divergence: Divergence | None = None
    last_output: tuple[int, int] | None = None  # (highest step id with an output, its line)
    cut: tuple[dict[str, Any], int] | None = None  # the interrupted record and its line
    for number, raw in lines:
        if not produced:
            record = parse_record(p, number, raw)
            if is_driver_record(record):
                if record["kind"] == "interrupted":
                    cut = (record, number)
                continue  # a tier warning or the interrupted record: no engine call makes them
            if record["kind"] == "input":
                try:
                    event = read_input(record)
                except BadEvent as exc:
                    raise TraceError(p, number, str(exc)) from None
                inputs += 1
                try:
                    engine.handle(event)
                except ValueError as exc:  # the engine refuses time going backwards
                    field = "field 't': " if str(exc).startswith("time went backwards") else ""
                    raise TraceError(p, number, f"{field}{exc}") from None
                if isinstance(event, StepOutput) and (last_output is None or event.step_id > last_output[0]):
                    last_output = (event.step_id, number)
        got = produced.popleft() if produced else None
        if got != raw:
            parse_record(p, number, raw)  # a broken line is bad input, not a divergence
            nothing = "<nothing: the engine produced no record here>"
            divergence = Divergence(number, raw.decode(errors="replace"),
                                    got.decode() if got is not None else nothing)
            break
    if divergence is None and produced:
        divergence = Divergence(number + 1, "<end of trace>", produced[0].decode())
    if divergence is None:
        divergence = end_divergence(engine, number + 1, last_output, cut, expected_requests)
    return ReplayResult(number, inputs, divergence, engine)


def _header_engine(header: dict[str, Any], header_line: int, config: RunConfig, path: str, recorder: Recorder,
                   allow_code: bool, named: Collection[str], stack: Sequence[str] | None) -> Any:
    """The engine the header describes: its stack (or ``stack``) and its recovered tier slots."""
    from kvlife.lifecycle.engine.core import Engine
    from kvlife.policies.loading import load_stack
    from kvlife.transfer.index import TierIndex

    policies = load_stack(stack, config.hook_budget_s) if stack is not None else trace_stack(
        config.policies, path, header_line, allow_code=allow_code, named=named, budget_s=config.hook_budget_s)
    # A live run's kept disk tier starts with the blocks it recovered (the header lists them).
    recovered = recovered_slots(header, config, path, header_line)
    tiers = [TierIndex.adopting(t.name, t.capacity_blocks, t.eviction, recovered.get(t.name, ()))
             for t in config.engine.tiers] if recovered else None
    return Engine(config.engine, policies, tiers=tiers, recorder=recorder)


# ---- the end of the trace -----------------------------------------------------------------
def end_divergence(engine: Any, after: int, last_output: tuple[int, int] | None,
                   cut: tuple[dict[str, Any], int] | None, expected_requests: int | None) -> Divergence | None:
    """What the trace says about its end against the replayed engine's end (see the module
    docstring); ``after`` is the line number past the last line."""
    state = engine.state
    in_flight = sorted(step_id for step_id, _ in state.steps)
    if in_flight and last_output is not None and in_flight[0] < last_output[0]:
        lost = [s for s in in_flight if s < last_output[0]]
        return Divergence(
            after,
            f"{_steps(lost)} ended: the trace has the output of step {last_output[0]} (line {last_output[1]}), "
            f"and steps end in plan order",
            f"the engine ends with {_steps(lost)} in flight, no step_output for {'it' if len(lost) == 1 else 'them'}: "
            f"{_step_effect(state, lost)}",
            end=True,
        )
    if cut is None:
        if in_flight:
            return Divergence(
                after, "no step in flight: the trace has no interrupted record, so the run ended and every "
                       "step's output came",
                f"the engine ends with {_steps(in_flight)} in flight: {_step_effect(state, in_flight)}", end=True)
        if expected_requests is not None and len(state.requests) != expected_requests:
            return Divergence(
                after, f"{expected_requests:,} requests arrived (the header's workload.requests; the trace has "
                       f"no interrupted record, so the run ended)",
                f"{len(state.requests):,} arrived: the trace ends early, or lost arrivals", end=True)
        return None
    record, line = cut
    if record.get("clean") is False:
        return None  # cut inside an engine call: its records may be partial (the lines say so)
    for key, value in _open_work(engine, expected_requests).items():
        if key in record and record[key] != value:
            return Divergence(after, f"{key} {_show(record[key])} (the interrupted record, line {line})",
                              f"the engine ends with {key} {_show(value)}", end=True)
    return None


def _open_work(engine: Any, expected_requests: int | None) -> dict[str, Any]:
    """The engine's side of the counts an ``interrupted`` record holds
    (``kvlife.lifecycle.drivers.simulator.cut_record``)."""
    state = engine.state
    work: dict[str, Any] = {
        "requests": {s: n for s, n in state.state_counts.items() if n and s != "finished"},
        "finished": state.state_counts["finished"],
        "jobs": sum(1 for job in state.jobs.values() if not job.timed_out),
        "quarantined_jobs": sum(1 for job in state.jobs.values() if job.timed_out),
        "prefetches": len(state.prefetches),
        "steps": len(state.steps),
    }
    if expected_requests is not None:
        work["not_arrived"] = max(0, expected_requests - len(state.requests))
    return work


def _steps(ids: Sequence[int]) -> str:
    shown = ", ".join(str(s) for s in ids[:5]) + (f" and {len(ids) - 5} more" if len(ids) > 5 else "")
    return f"step{'s' if len(ids) > 1 else ''} {shown}"


def _step_effect(state: Any, ids: Sequence[int]) -> str:
    """Per request, the tokens those steps computed and sampled that no output confirmed."""
    unconfirmed: dict[str, list[int]] = {}  # request -> [tokens, sampled]
    entries = dict(state.steps)
    for step_id in ids:
        for req, _epoch, _before, n, samples in entries[step_id]:
            entry = unconfirmed.setdefault(req.request_id, [0, 0])
            entry[0] += n
            entry[1] += int(samples)
    if not unconfirmed:
        return "it scheduled no request"
    parts = []
    for rid, (tokens, sampled) in list(unconfirmed.items())[:5]:
        req = state.requests[rid]
        parts.append(f"{rid} ({req.state}, {req.generated} tokens generated) has {tokens} computed token(s) "
                     f"never confirmed and {sampled} sampled token(s) never generated")
    more = f"; and {len(unconfirmed) - 5} more requests" if len(unconfirmed) > 5 else ""
    return "; ".join(parts) + more


def _show(value: Any) -> str:
    return orjson.dumps(value).decode() if isinstance(value, (dict, list)) else repr(value)


# ---- what-if ---------------------------------------------------------------------------------
def workload_from_trace(path: str | Path, *, allow_code: bool = False,
                        named: Collection[str] = ()) -> tuple[RunConfig, list[WorkloadRequest]]:
    """The recorded config and the workload its arrivals describe (output lengths: the tokens
    each request generated; aborted or failed requests keep what they had produced, at least 1)."""
    result = replay(path, allow_code=allow_code, named=named)
    p = str(path)
    if not result.identical:
        assert result.divergence is not None
        raise TraceError(p, result.divergence.line,
                         "the trace does not replay exactly with this engine; cannot recover its workload")
    header, header_line, lines = read_header(path)
    config = config_from_header(header, p, header_line)
    workload = []
    for _number, raw in lines:
        if b'"type":"arrival"' not in raw:
            continue
        record = orjson.loads(raw)
        if record.get("kind") != "input":
            continue
        rid = record["request_id"]
        req = result.engine.requests.get(rid)
        generated = req.generated if req is not None else 0
        workload.append(WorkloadRequest(rid, float(record["t"]), int(record["prompt_tokens"]),
                                        max(1, generated), tuple(record["block_hashes"])))
    return config, workload


def what_if(path: str | Path, stack: list[str], *,
            allow_code: bool = False) -> tuple[dict[str, Any], dict[str, Any], RunConfig]:
    """Simulate the trace's workload under its own stack and under ``stack``. The recorded
    stack may name code only with ``allow_code`` or when ``stack`` names it too; profile
    files the header names are read only with ``allow_code`` (bundled profiles always)."""
    from kvlife.lifecycle.config import PROFILE_PATH_KEYS, is_profile_path
    from kvlife.lifecycle.drivers.runner import run_workload
    from kvlife.policies.loading import load_stack

    p = str(path)
    header, header_line, _lines = read_header(path)
    config = config_from_header(header, p, header_line)
    if not allow_code:
        for key in PROFILE_PATH_KEYS:
            value = getattr(config.sim, key)
            if isinstance(value, str) and is_profile_path(value):
                raise TraceError(p, header_line, f"field 'config.sim.{key}': trace names the file {value!r}; "
                                                 f"pass --allow-code to read it")
    recorded_stack = trace_stack(config.policies, p, header_line, allow_code=allow_code, named=stack)
    config, workload = workload_from_trace(path, allow_code=allow_code, named=stack)
    recorded = run_workload(config, workload, recorded_stack).summary
    other_config = attrs.evolve(config, policies=tuple(stack))
    other = run_workload(other_config, workload, load_stack(stack)).summary
    return recorded, other, config


SIDE_BY_SIDE: tuple[tuple[str, str], ...] = (
    ("requests", "requests"),
    ("finished", "finished"),
    ("stranded", "stranded"),
    ("TTFT p50 (ms)", "ttft_ms.p50"),
    ("TTFT p90 (ms)", "ttft_ms.p90"),
    ("TTFT p99 (ms)", "ttft_ms.p99"),
    ("TPOT p50 (ms)", "tpot_ms.p50"),
    ("TPOT p99 (ms)", "tpot_ms.p99"),
    ("throughput (tok/s)", "throughput_tokens_per_s"),
    ("prefix hit rate", "prefix_hit_rate"),
    ("blocks loaded", "blocks_loaded"),
    ("blocks stored", "blocks_stored"),
    ("redundant block loads", "redundant_block_loads"),
    ("deferrals", "deferrals"),
    ("lookups sync", "sync_lookups"),
    ("lookups async", "async_lookups"),
    ("critical-path lookup ms", "critical_path_lookup_ms"),
    ("preemptions", "preemptions"),
    ("warnings", "warnings"),
)


def _get(summary: dict[str, Any], dotted: str) -> Any:
    value: Any = summary
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _fmt(value: Any) -> str:
    # Dicts of fractions here are hit rates: show them as percentages.
    if isinstance(value, dict):
        return format_value(value, fractions_as_percent=True)
    return format_value(value)


def format_side_by_side(left_name: str, left: dict[str, Any], right_name: str, right: dict[str, Any]) -> str:
    rows = [("", left_name, right_name)] + [(label, _fmt(_get(left, key)), _fmt(_get(right, key)))
                                            for label, key in SIDE_BY_SIDE]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    return "\n".join(f"{a:<{w0}}  {b:<{w1}}  {c}" for a, b, c in rows)
