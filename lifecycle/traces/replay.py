"""Replay a trace: exactly (same config, same stack) or as a what-if (another stack).

Exact replay rebuilds the run configuration from the trace header, feeds every recorded
input to a fresh engine and compares every record the engine produces with the recorded
line, byte for byte (``render_record``). Inputs are self-contained (lookup answers carry
their tiers, step outputs their finishes), so no simulator runs.

A what-if cannot re-feed inputs: job and step ids depend on the policies. It takes the
workload from the recorded arrivals instead (output lengths from what each request
generated in an exact replay) and simulates it under both stacks.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import Any

import attrs
import orjson

from kvlife.lifecycle.config import RETIRED_SIM_KEYS, ConfigError, RunConfig, config_from_dict
from kvlife.lifecycle.engine.events import BadEvent, input_from_record
from kvlife.lifecycle.metrics import format_value
from kvlife.lifecycle.traces.trace import TraceError, is_driver_record, parse_record, read_header, render_record
from kvlife.lifecycle.workloads.mooncake import WorkloadRequest


def config_from_header(header: dict[str, Any], path: str = "trace", line: int = 1) -> RunConfig:
    """Rebuild the RunConfig a trace was recorded with (header ``config`` = RunConfig.to_dict())."""
    config = header.get("config")
    if not isinstance(config, dict):
        raise TraceError(path, line, "field 'config': missing from the header")
    engine = config.get("engine", {})
    if not isinstance(engine, dict):
        raise TraceError(path, line, "field 'config.engine': must be an object")
    engine = dict(engine)
    sim = config.get("sim", {})
    if isinstance(sim, dict):  # a trace recorded before the step cost came from profiles
        sim = {k: v for k, v in sim.items() if k not in RETIRED_SIM_KEYS}
    data: dict[str, Any] = {"engine": engine, "sim": sim,
                            "policies": {"stack": list(config.get("policies", []))}}
    if "tiers" in engine:
        data["tiers"] = engine.pop("tiers")
    try:
        # The profiles are loaded only when a run is simulated again (what-if), not to replay.
        return config_from_dict(data, check_profiles=False)
    except ConfigError as exc:
        raise TraceError(path, line, f"header config: {exc}") from None


@attrs.frozen
class Divergence:
    line: int
    expected: str
    got: str


@attrs.frozen
class ReplayResult:
    lines: int
    inputs: int
    divergence: Divergence | None
    engine: Any = attrs.field(repr=False, eq=False, default=None)

    @property
    def identical(self) -> bool:
        return self.divergence is None


def replay(path: str | Path, stop_at_divergence: bool = True) -> ReplayResult:
    """Re-feed the recorded inputs; the first record that differs is the divergence."""
    from kvlife.lifecycle.engine.core import Engine
    from kvlife.policies.loading import load_stack

    p = str(path)
    header, header_line, lines = read_header(path)
    config = config_from_header(header, p, header_line)
    produced: deque[bytes] = deque()
    engine = Engine(config.engine, load_stack(config.policies),
                    recorder=lambda record: produced.append(render_record(record)))
    inputs = 0
    number = header_line
    divergence: Divergence | None = None
    for number, raw in lines:
        if not produced:
            record = parse_record(p, number, raw)
            if is_driver_record(record):
                continue  # a tier warning or the interrupted record: no engine call makes them
            if record["kind"] == "input":
                try:
                    event = input_from_record(record)
                except BadEvent as exc:
                    raise TraceError(p, number, str(exc)) from None
                inputs += 1
                try:
                    engine.handle(event)
                except ValueError as exc:
                    raise TraceError(p, number, str(exc)) from None
        got = produced.popleft() if produced else None
        if got != raw:
            parse_record(p, number, raw)  # a broken line is bad input, not a divergence
            nothing = "<nothing: the engine produced no record here>"
            divergence = Divergence(number, raw.decode(errors="replace"),
                                    got.decode() if got is not None else nothing)
            break
    if divergence is None and produced:
        divergence = Divergence(number + 1, "<end of trace>", produced[0].decode())
    return ReplayResult(number, inputs, divergence, engine)


# ---- what-if ---------------------------------------------------------------------------------
def workload_from_trace(path: str | Path) -> tuple[RunConfig, list[WorkloadRequest]]:
    """The recorded config and the workload its arrivals describe (output lengths: the tokens
    each request generated; aborted or failed requests keep what they had produced, at least 1)."""
    result = replay(path)
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


def what_if(path: str | Path, stack: list[str]) -> tuple[dict[str, Any], dict[str, Any], RunConfig]:
    """Simulate the trace's workload under its own stack and under ``stack``."""
    from kvlife.lifecycle.drivers.runner import run_workload
    from kvlife.policies.loading import load_stack

    config, workload = workload_from_trace(path)
    recorded = run_workload(config, workload, load_stack(config.policies)).summary
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
