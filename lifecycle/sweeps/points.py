"""One run of a sweep or a capacity search: its inputs, its key and the row it gives.

A ``Point`` is a workload (a bundled name, a file or a synthetic name), an optional request
limit and a ``RunConfig``. Config keys are set by the dotted names the config file and the
flags use (``apply``): ``engine.lookup_latency_ms``, ``sim.time_scale`` (the arrival rate
multiplier, ``--time-scale``), ``sim.hardware``, ``policies.stack``, and per tier
``tiers.host.capacity_blocks`` (0 drops the tier, as ``--tier host=0`` does).

``execute`` runs a point through the same entry points as ``kvlife run`` (the workload via
``fidelity.runs.load``, the run via ``drivers.runner.run_workload``) and returns one flat row:
every input (``inputs``) and every output (``OUTPUT_COLUMNS``) as a column. Rows hold no
wall-clock figure, so the same point gives the same row in any process, on any executor.
The key of a point is a hash of its inputs (``key``): a results file is resumed by key.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import orjson

from kvlife.lifecycle.config import (
    FLOAT_MAX_INT,
    TIER_ORDER,
    ConfigError,
    EngineConfig,
    Rule,
    RunConfig,
    SimConfig,
    TierConfig,
    describe,
    field_rule,
    with_tier,
)
from kvlife.lifecycle.workloads.mooncake import WorkloadRequest

# The [sim] keys of a run's inputs; [live] is for live runs only and is not a sweep input.
# (column, attribute): device_blocks and ranks are None until resolved (EngineConfig).
_ENGINE_KEYS = tuple((f.alias or f.name, f.name) for f in attrs.fields(EngineConfig) if f.name != "tiers")
_SIM_KEYS = tuple(f.name for f in attrs.fields(SimConfig))
_TIER_KEYS = tuple(f.name for f in attrs.fields(TierConfig) if f.name != "name")

# Every config key a sweep may vary, in column order.
CONFIG_KEYS: tuple[str, ...] = (
    ("policies.stack",)
    + tuple(f"engine.{k}" for k, _ in _ENGINE_KEYS)
    + tuple(f"tiers.{t}.{k}" for t in TIER_ORDER for k in _TIER_KEYS)
    + tuple(f"sim.{k}" for k in _SIM_KEYS)
)
# Inputs that are not config keys.
POINT_KEYS = ("workload", "limit")
INPUT_COLUMNS: tuple[str, ...] = ("key", *POINT_KEYS, *CONFIG_KEYS)

# Outputs of every row, in column order (``execute``). Fixed, so every row of every sweep has
# the same columns: a tier a run does not have gives null in its hit-rate column.
PERCENTILES = (50, 90, 99)
OUTPUT_COLUMNS: tuple[str, ...] = (
    "device_blocks", "block_bytes", "requests", "finished", "stranded",
    *(f"ttft_p{q}_ms" for q in PERCENTILES), *(f"tpot_p{q}_ms" for q in PERCENTILES),
    "throughput_tokens_per_s", "output_tokens", "simulated_s",
    *(f"hit_rate_{t}" for t in ("device", *TIER_ORDER)),
    "blocks_loaded", "bytes_loaded", "blocks_stored", "bytes_stored", "redundant_block_loads", "failed_blocks",
    "preemptions", "deferrals", "sync_lookups", "async_lookups", "critical_path_lookup_ms",
    "stale_lookup_answers", "steps", "events",
    "policies",  # the stack by its policies' own names (plots label stacks with them)
    "first_decile_ttft_ms", "last_decile_ttft_ms", "decile_ttft_ratio", "stable",
)

# The stability rule of the ``stable`` column (``fidelity.stability``, without its p50 limit):
# the last arrival decile's mean TTFT within RATIO x the first's, or at most SLACK ms above it.
STABILITY_RATIO = 1.5
STABILITY_SLACK_MS = 100.0


def stack_text(stack: Sequence[str]) -> str:
    """A stack as ``--stack`` writes it: ``"async-lookup,shared-loads"``, or ``"baseline"``."""
    return ",".join(stack) or "baseline"


@attrs.frozen
class Point:
    """The inputs of one simulated run."""

    workload: str = "synthetic"
    limit: int | None = None
    config: RunConfig = attrs.field(factory=RunConfig)

    def inputs(self) -> dict[str, Any]:
        """Every input as a column (``INPUT_COLUMNS`` without ``key``): a derived size (device
        blocks, ranks) the user did not set is null here; ``device_blocks`` among the outputs
        says what the run used."""
        config = self.config
        row: dict[str, Any] = {"workload": self.workload, "limit": self.limit,
                               "policies.stack": stack_text(config.policies)}
        for key, attribute in _ENGINE_KEYS:
            row[f"engine.{key}"] = getattr(config.engine, attribute)
        tiers = {t.name: t for t in config.engine.tiers}
        for name in TIER_ORDER:
            for key in _TIER_KEYS:
                row[f"tiers.{name}.{key}"] = getattr(tiers[name], key) if name in tiers else None
        for key in _SIM_KEYS:
            row[f"sim.{key}"] = getattr(config.sim, key)
        return row

    def key(self) -> str:
        """A stable hash of the inputs: the same inputs give the same key in every process and
        every kvlife version that has the same config keys."""
        blob = orjson.dumps(self.inputs(), option=orjson.OPT_SORT_KEYS)
        return hashlib.sha256(blob).hexdigest()[:16]

    def label(self) -> str:
        """A short description for progress and errors."""
        return f"{self.workload} x {self.config.sim.time_scale:g} {stack_text(self.config.policies)}"


# ---- setting config keys by name -----------------------------------------------------------
def known_key(key: str) -> bool:
    return key in CONFIG_KEYS


def _rule(key: str) -> Rule | None:
    """The rule of a config key (``config.field_rule``; a tier's key names its tier:
    ``tiers.host.capacity_blocks``), None for a field without a rule of its own."""
    section, _, name = key.partition(".")
    try:
        return field_rule(f"tiers.{name.partition('.')[2]}" if section == "tiers" else key)
    except KeyError:
        return None


def normalize(key: str, value: Any) -> Any:
    """A value as the config holds it: an integer given for a number field is a float (so
    ``1`` and ``1.0`` are one input with one key); a stack is its tuple of policy names."""
    if key == "policies.stack":
        return stack_names(value)
    rule = _rule(key)
    if rule is not None and rule.kind == "number" and isinstance(value, int) and not isinstance(value, bool) \
            and abs(value) <= FLOAT_MAX_INT:  # (a larger one stays an int: the rule refuses it in words)
        return float(value)
    return value


def stack_names(value: Any) -> tuple[str, ...]:
    """``"async-lookup,shared-loads"`` or ``["async-lookup", "shared-loads"]`` -> the names
    (``"baseline"`` alone: the empty stack). ValueError on anything else."""
    if isinstance(value, str):
        names = [s.strip() for s in value.split(",")]
    elif isinstance(value, list | tuple) and all(isinstance(s, str) for s in value):
        names = [s.strip() for s in value]
    else:
        raise ValueError(f"must be a stack, \"a,b\" or [\"a\", \"b\"], got {describe(value)}")
    if any(not s for s in names) and names != [""]:
        raise ValueError(f"stack {value!r}: empty policy name")
    return tuple(s for s in names if s and s != "baseline")


def problem(key: str, value: Any) -> str | None:
    """What is wrong with ``value`` for config key ``key`` on its own, None if nothing."""
    if key == "policies.stack":
        try:
            stack_names(value)
        except ValueError as exc:
            return str(exc)
        return None
    if key.startswith("tiers.") and key.endswith(".capacity_blocks") and value == 0 and not isinstance(value, bool):
        return None  # 0 drops the tier
    rule = _rule(key)
    return rule.problem(normalize(key, value)) if rule is not None else None


def apply(config: RunConfig, key: str, value: Any) -> RunConfig:
    """``config`` with config key ``key`` set to ``value``; ConfigError(key, message) when the
    value or the combination is refused."""
    value = normalize(key, value)
    if key == "policies.stack":
        return attrs.evolve(config, policies=value)
    section, _, name = key.partition(".")
    try:
        if section == "engine":
            return attrs.evolve(config, engine=attrs.evolve(config.engine, **{name: value}))
        if section == "sim":
            return attrs.evolve(config, sim=attrs.evolve(config.sim, **{name: value}))
        if section == "tiers":
            tier, _, field = name.partition(".")
            return attrs.evolve(config, engine=with_tier(config.engine, tier, field, value))
    except ConfigError as exc:
        raise ConfigError(key, exc.message) from None
    raise ConfigError(key, "not a config key a sweep can set")


def order_for_apply(keys: Sequence[str]) -> list[str]:
    """Keys in the order they are applied: a tier's size before its other fields."""
    return sorted(keys, key=lambda k: (0 if k.endswith(".capacity_blocks") else 1, keys.index(k)))


def with_values(config: RunConfig, values: Mapping[str, Any]) -> RunConfig:
    for key in order_for_apply(list(values)):
        config = apply(config, key, values[key])
    return config


# ---- running a point -------------------------------------------------------------------------
@functools.lru_cache(maxsize=4)
def _workload(workload: str, limit: int | None, scale: float, block_tokens: int, arrivals: str,
              seed: int, arrival_cv: float | None = None, request_rate: float | None = None,
              ) -> tuple[WorkloadRequest, ...]:
    """The requests of a point, read once per process for the points that share them."""
    from kvlife.lifecycle.fidelity.runs import load

    sim = SimConfig(seed=seed, arrivals=arrivals, arrival_cv=arrival_cv, request_rate=request_rate)
    config = RunConfig(engine=EngineConfig(block_tokens=block_tokens), sim=sim)
    return tuple(load(workload, limit, scale, config))


def requests_of(point: Point) -> list[WorkloadRequest]:
    """The point's workload as ``kvlife run --workload W --limit N --time-scale X`` reads it."""
    config = point.config
    return list(_workload(point.workload, point.limit, config.sim.time_scale, config.engine.block_tokens,
                          config.sim.arrivals, config.sim.seed, config.sim.arrival_cv, config.sim.request_rate))


Percentile = tuple[str, float]  # ("ttft" or "tpot", q): an extra column ttft_p95_ms


def percentile_column(metric: str, q: float) -> str:
    return f"{metric}_p{q:g}_ms"


def _finite(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def execute(point: Point, extra: Sequence[Percentile] = ()) -> dict[str, Any]:
    """Run ``point`` and return its row: ``key``, the inputs, ``OUTPUT_COLUMNS`` and one
    column per ``extra`` percentile. Deterministic: no wall-clock figure is in it."""
    from kvlife.lifecycle.drivers.runner import run_workload
    from kvlife.lifecycle.fidelity.stability import check_stability
    from kvlife.lifecycle.metrics import RequestTotals, percentile
    from kvlife.lifecycle.native.choice import choose

    workload = requests_of(point)
    # The native engine where it covers the point: it gives the Python engine's summary,
    # byte for byte (tests/test_native_runs.py), in a fraction of the time.
    outcome = run_workload(point.config, workload, workload_name=point.workload,
                           engine=choose(None, point.config).engine)
    summary = outcome.summary
    totals = RequestTotals.of(outcome.result)
    stability = check_stability(totals.samples(), p50_limit_ms=math.inf, ratio_limit=STABILITY_RATIO,
                                slack_ms=STABILITY_SLACK_MS)
    setup = summary["setup"]
    hit = summary["prefix_hit_rate"]
    row: dict[str, Any] = {"key": point.key(), **point.inputs()}
    row.update({
        "device_blocks": setup["device_blocks"],
        "block_bytes": setup["block_bytes"],
        "requests": summary["requests"],
        "finished": sum(summary["finished"].values()),
        "stranded": summary["stranded"],
        **{f"ttft_p{q}_ms": summary["ttft_ms"][f"p{q}"] for q in PERCENTILES},
        **{f"tpot_p{q}_ms": summary["tpot_ms"][f"p{q}"] for q in PERCENTILES},
        "throughput_tokens_per_s": summary["throughput_tokens_per_s"],
        "output_tokens": summary["output_tokens"],
        "simulated_s": summary["simulated_s"],
        **{f"hit_rate_{t}": hit.get(t) for t in ("device", *TIER_ORDER)},
        **{k: summary[k] for k in ("blocks_loaded", "bytes_loaded", "blocks_stored", "bytes_stored",
                                   "redundant_block_loads", "failed_blocks", "preemptions")},
        "deferrals": sum(summary["deferrals"].values()),
        **{k: summary[k] for k in ("sync_lookups", "async_lookups", "critical_path_lookup_ms",
                                   "stale_lookup_answers", "steps", "events")},
        "policies": ",".join(outcome.policies) or "baseline",
        "first_decile_ttft_ms": stability.first_decile_ms,
        "last_decile_ttft_ms": stability.last_decile_ms,
        "decile_ttft_ratio": stability.ratio,
        "stable": stability.stable,
    })
    for metric, q in extra:
        values = totals.ttfts() if metric == "ttft" else list(totals.tpot_ms)
        row[percentile_column(metric, q)] = percentile(values, q)
    return {k: _finite(v) for k, v in row.items()}
