"""A trace header is data: its config is checked as a config file is, and its stack names no code to run.

Every command that reads a trace (``replay``, ``plot``, ``explain``, ``export``,
``validate``) goes through here before it allocates anything:

* ``header_config``: the header's ``config`` (``RunConfig.to_dict()``) rebuilt through
  ``kvlife.lifecycle.config.config_from_dict``, the validator a config file goes through:
  types, NaN and infinities, unknown keys and the size bounds (``engine.device_blocks``,
  ``engine.block_tokens``, ``engine.ranks``, a tier's ``capacity_blocks``). A bad value is
  one ``TraceError`` naming the file, the header's line and the header field:
  ``t.jsonl:1: field 'config.engine.device_blocks': must be at most 4,194,304 (...)``.
* ``trace_stack``: the header's policy stack as a ``PolicyStack``. Built-in names come
  from the registry (``kvlife.policies.loading.load_builtin_stack``, which imports
  nothing). A ``pkg.mod:Class``, a ``file.py:Class`` or an installed entry-point name
  would run code the trace's author chose: it is refused unless the user said so on the
  command line, with ``--allow-code`` or by naming that policy in ``--stack``.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from typing import Any

from kvlife.lifecycle.config import RETIRED_SIM_KEYS, ConfigError, RunConfig, config_from_dict
from kvlife.lifecycle.traces.trace import TraceError
from kvlife.policies.base import PolicyError
from kvlife.policies.loading import entry_point_policies, is_builtin, load_builtin_stack, load_stack
from kvlife.policies.stack import DEFAULT_HOOK_BUDGET_S, PolicyStack

# The header's config sections (RunConfig.to_dict()); tiers sit inside ``engine``.
_SECTIONS = ("engine", "sim", "live", "policies", "hook_budget_s")
STACK_FIELD = "config.policies"


def header_field(config_field: str | None) -> str:
    """A config-file field (what ``ConfigError`` names) as the header spells it:
    ``tiers[0].name`` -> ``config.engine.tiers[0].name``, ``policies.stack`` -> ``config.policies``."""
    if not config_field:
        return "config"
    if config_field == "tiers" or config_field.startswith("tiers["):
        return f"config.engine.{config_field}"
    if config_field == "policies.hook_budget_s":
        return "config.hook_budget_s"
    if config_field == "policies" or config_field.startswith("policies."):
        return STACK_FIELD
    return f"config.{config_field}"


def header_config(header: dict[str, Any], path: str = "trace", line: int = 1,
                  required: bool = True) -> RunConfig | None:
    """The RunConfig a trace was recorded with, checked by the config-file rules; None
    when the header has no ``config`` and ``required`` is False (another tool's trace)."""
    config = header.get("config")
    if config is None and not required:
        return None
    if not isinstance(config, dict):
        what = "missing from the header" if config is None else f"must be an object, got {_describe(config)}"
        raise TraceError(path, line, f"field 'config': {what}")
    for key in config:
        if key not in _SECTIONS:
            raise TraceError(path, line, f"field 'config.{key}': unknown section (known: {', '.join(_SECTIONS)})")
    data: dict[str, Any] = {}
    engine = config.get("engine", {})
    if isinstance(engine, dict):
        engine = dict(engine)
        if "tiers" in engine:
            data["tiers"] = engine.pop("tiers")
    data["engine"] = engine
    sim = config.get("sim", {})
    if isinstance(sim, dict):  # a trace recorded before the step cost came from profiles
        sim = {k: v for k, v in sim.items() if k not in RETIRED_SIM_KEYS}
    data["sim"] = sim
    if "live" in config:
        data["live"] = config["live"]
    data["policies"] = {"stack": config.get("policies", [])}
    if "hook_budget_s" in config:
        data["policies"]["hook_budget_s"] = config["hook_budget_s"]
    try:
        # The profiles are loaded only when a run is simulated again (what-if), not to replay.
        return config_from_dict(data, check_profiles=False)
    except ConfigError as exc:
        raise TraceError(path, line, f"field '{header_field(exc.field)}': {exc.message}") from None


# What rebuilding a trace's engine may allocate (its device pool and tier indexes, at the
# simulator's measured bytes per item): at most this many bytes per byte of the trace file,
# and this much whatever its size. A header is data: 30 KB saying device_blocks=24,000,000
# would otherwise take 3.4 GB to replay.
ENGINE_BYTES_PER_TRACE_BYTE = 1000
ENGINE_BYTES_FLOOR = 256 << 20


def allocation_problem(config: RunConfig, trace_bytes: int) -> tuple[str, str] | None:
    """(header field, message) when the engine ``config`` describes would take more memory
    than a trace of ``trace_bytes`` justifies (see ``ENGINE_BYTES_PER_TRACE_BYTE``)."""
    from kvlife.lifecycle.config import SIM_DEVICE_BLOCK_BYTES, SIM_TIER_BLOCK_BYTES

    engine = config.engine
    parts = [("config.engine.device_blocks", int(engine.device_blocks) * SIM_DEVICE_BLOCK_BYTES,
              f"{int(engine.device_blocks):,} device blocks")]
    parts += [(f"config.engine.tiers[{i}].capacity_blocks", t.capacity_blocks * SIM_TIER_BLOCK_BYTES,
               f"a {t.name} tier of {t.capacity_blocks:,} blocks") for i, t in enumerate(engine.tiers)]
    total = sum(size for _, size, _ in parts)
    limit = max(ENGINE_BYTES_FLOOR, ENGINE_BYTES_PER_TRACE_BYTE * trace_bytes)
    if total <= limit:
        return None
    field, _, what = max(parts, key=lambda part: part[1])
    return field, (f"{what} take {_mib(total)} of memory to rebuild the engine, more than this {_mib(trace_bytes)} "
                   f"trace justifies (at most {ENGINE_BYTES_PER_TRACE_BYTE:,}x its size, and "
                   f"{_mib(ENGINE_BYTES_FLOOR)} for any trace): a header is data, not a request for memory")


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.1f} MiB" if n >= 1 << 20 else f"{n / 1024:,.1f} KiB"


def workload_size(header: dict[str, Any], path: str = "trace", line: int = 1) -> int | None:
    """``workload.requests`` of the header (the drivers write how many requests they were
    given), None when the header does not say."""
    workload = header.get("workload")
    if workload is None:
        return None
    requests = workload.get("requests") if isinstance(workload, dict) else None
    if not isinstance(requests, int) or isinstance(requests, bool) or requests < 0:
        shown = _describe(requests) if isinstance(workload, dict) else _describe(workload)
        field = "workload.requests" if isinstance(workload, dict) else "workload"
        raise TraceError(path, line, f"field '{field}': must hold a non-negative integer 'requests', got {shown}")
    return requests


def recovered_slots(header: dict[str, Any], config: RunConfig, path: str = "trace",
                    line: int = 1) -> dict[str, list[tuple[int, int]]]:
    """``recovered`` of the header: per tier, the (block hash, slot) pairs a live run's kept
    disk tier recovered from an earlier run, in the order they were indexed (a replay
    builds the same index from them). Checked: a tier of the config, each pair a hash
    (0..2^64-1) and a distinct slot within the tier's capacity. Empty when absent."""
    recovered = header.get("recovered")
    if recovered is None:
        return {}
    capacities = {t.name: t.capacity_blocks for t in config.engine.tiers}
    if not isinstance(recovered, dict):
        raise TraceError(path, line, f"field 'recovered': must be an object of tier: [[block, slot], ...], "
                                     f"got {_describe(recovered)}")
    out: dict[str, list[tuple[int, int]]] = {}
    for tier, pairs in recovered.items():
        field = f"recovered.{tier}"
        if tier not in capacities:
            raise TraceError(path, line, f"field '{field}': the config has no {tier!r} tier")
        if not isinstance(pairs, list) or len(pairs) > capacities[tier]:
            raise TraceError(path, line, f"field '{field}': must be a list of at most {capacities[tier]:,} "
                                         f"[block, slot] pairs (the tier's capacity_blocks)")
        seen_blocks: set[int] = set()
        seen_slots: set[int] = set()
        for i, pair in enumerate(pairs):
            ok = (isinstance(pair, list) and len(pair) == 2
                  and all(isinstance(v, int) and not isinstance(v, bool) for v in pair)
                  and 0 <= pair[0] < 1 << 64 and 0 <= pair[1] < capacities[tier]
                  and pair[0] not in seen_blocks and pair[1] not in seen_slots)
            if not ok:
                raise TraceError(path, line, f"field '{field}[{i}]': must be a [block, slot] pair of a block hash "
                                             f"and a slot below {capacities[tier]:,}, each once; got "
                                             f"{_describe(pair)}")
            seen_blocks.add(pair[0])
            seen_slots.add(pair[1])
        out[tier] = [(block, slot) for block, slot in pairs]
    return out


def code_specs(specs: Sequence[str]) -> list[str]:
    """The entries of a stack that are not built-in names: loading them runs code."""
    return [s for s in specs if not is_builtin(s)]


def trace_stack(specs: Sequence[str], path: str, line: int, *, allow_code: bool = False,
                named: Collection[str] = (), budget_s: float = DEFAULT_HOOK_BUDGET_S) -> PolicyStack:
    """The recorded stack as policies, importing no code unless the user allowed it:
    ``allow_code`` (``--allow-code``) or the policy named on the command line (``named``)."""
    installed: dict[str, str] | None = None
    for spec in code_specs(specs):
        if allow_code or spec in named:
            continue
        if ":" not in spec:
            installed = entry_point_policies() if installed is None else installed  # metadata only
            if spec not in installed:
                raise TraceError(path, line, f"field '{STACK_FIELD}': unknown policy {spec!r} "
                                             f"(built-ins: see kvlife policies)")
            raise TraceError(path, line, f"field '{STACK_FIELD}': trace names policy {spec!r} of an installed "
                                         f"package ({installed[spec]}); pass --allow-code to import it")
        raise TraceError(path, line, f"field '{STACK_FIELD}': trace names code {spec!r}; "
                                     f"pass --allow-code to import it")
    try:
        return load_builtin_stack(specs, budget_s) if not code_specs(specs) else load_stack(specs, budget_s)
    except PolicyError as exc:
        raise TraceError(path, line, f"field '{STACK_FIELD}': {exc}") from None


_SPACE = re.compile(r"\s+")


def _describe(value: Any) -> str:
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    if value is None:
        return "null"
    text = _SPACE.sub(" ", repr(value))
    return text if len(text) <= 60 else text[:57] + "..."
