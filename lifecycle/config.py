"""Run configuration: engine limits, tiers, hardware and model, cost model, live runtime, policy stack.

A config file is TOML with sections ``[engine]``, ``[[tiers]]`` (one table per tier),
``[sim]``, ``[live]`` and ``[policies]`` (``stack = [...]``). Keys mirror the long flags of
``kvlife run``: ``--device-blocks`` is ``engine.device_blocks``, ``--ranks``
``engine.ranks``, ``--seed`` ``sim.seed``, ``--time-scale`` ``sim.time_scale``, ``--hardware``
``sim.hardware``, ``--model`` ``sim.model``, ``--tp`` ``sim.tp``, ``--efficiency``
``sim.efficiency``, ``--completions`` ``sim.completions``, ``--stack`` ``policies.stack``,
``--disk-path`` ``live.disk_path``, ``--redis-url`` ``live.redis_url``, ``--redis-ttl``
``live.redis_ttl_s``.

Two engine values are *derived* unless set: ``engine.device_blocks`` (from the model, the
hardware, ``sim.tp`` and ``sim.gpu_memory_utilization``, as vLLM sizes its KV cache) and
``engine.ranks`` (= ``sim.tp``). Their defaults are ``Derived`` ints, which the simulator
replaces (``kvlife.lifecycle.drivers.physics.resolve``); a tier's ``bandwidth_gbps`` and
``latency_ms`` default to its link in the hardware profile.

Every bad value is a ``ConfigError`` naming the file, the line where the key is written
(in the right ``[[tiers]]`` table when there are several) and the dotted field:
``FILE:LINE: field 'sim.seed': must be an integer, got 'abc'``. Unknown keys are refused
with a did-you-mean; NaN and infinities are refused in every number field; a TOML syntax
error is ``FILE:LINE:COL: TOML syntax error: ...``.
"""

from __future__ import annotations

import difflib
import math
import re
import tomllib
from collections.abc import Callable
from datetime import date, datetime, time
from pathlib import Path
from typing import Any

import attrs


class ConfigError(Exception):
    """A bad config value: ``FILE:LINE: field 'x.y': message`` (parts omitted when unknown)."""

    def __init__(
        self,
        field: str | None,
        message: str,
        path: str | None = None,
        line: int | None = None,
        column: int | None = None,
    ) -> None:
        parts = []
        if path:
            where = path
            if line:
                where += f":{line}"
                if column:
                    where += f":{column}"
            parts.append(where)
        if field:
            parts.append(f"field '{field}'")
        parts.append(message)
        super().__init__(": ".join(parts).replace("\r", " ").replace("\n", " "))
        self.field = field
        self.message = message
        self.path = path
        self.line = line
        self.column = column


# ---- value checks (attrs validators raising ConfigError with the attribute's name) --------
Validator = Callable[[object, "attrs.Attribute[Any]", Any], None]


def describe(value: Any) -> str:
    """A value as a message shows it: TOML spelling for scalars, the type for the rest."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)):
        return repr(value)
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, (datetime, date, time)):
        return f"a date/time ({value.isoformat()})"
    return type(value).__name__


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _integer(minimum: int | None, maximum: int | None = None, why: str = "") -> Validator:
    want = {None: "an integer", 0: "a non-negative integer", 1: "a positive integer"}.get(
        minimum, f"an integer >= {minimum}")

    def check(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        if not _is_int(value) or (minimum is not None and value < minimum):
            raise ConfigError(attribute.name, f"must be {want}, got {describe(value)}")
        if maximum is not None and value > maximum:
            raise ConfigError(attribute.name, f"must be at most {maximum:,} ({why}), got {value:,}")

    return check


def _number(low: float, strict: bool, high: float | None = None) -> Validator:
    if high is not None:
        want = f"a number in ({low:g}, {high:g}]" if strict else f"a number from {low:g} to {high:g}"
    elif low == 0:
        want = "a positive number" if strict else "a non-negative number"
    else:
        want = f"a number {'>' if strict else '>='} {low:g}"

    def check(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        if not _is_number(value):
            raise ConfigError(attribute.name, f"must be {want}, got {describe(value)}")
        if not math.isfinite(value):
            raise ConfigError(attribute.name, f"must be a finite number, got {value!r}")
        if value < low or (strict and value == low) or (high is not None and value > high):
            raise ConfigError(attribute.name, f"must be {want}, got {value!r}")

    return check


def _boolean(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(attribute.name, f"must be true or false, got {describe(value)}")


def _choice(*choices: str) -> Validator:
    def check(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value not in choices or not isinstance(value, str):
            raise ConfigError(attribute.name, f"must be one of {', '.join(map(repr, choices))}; got {describe(value)}")

    return check


def _text(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise ConfigError(attribute.name, f"must be a non-empty string, got {describe(value)}")


def _optional(check: Validator) -> Validator:
    def optional(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is not None:
            check(instance, attribute, value)

    return optional


def _redis_url(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    _text(instance, attribute, value)
    if not value.startswith(("redis://", "rediss://", "unix://")):
        raise ConfigError(attribute.name, f"must be a redis://, rediss:// or unix:// URL, got {value!r}")


_positive_int = _integer(1)
_non_negative_int = _integer(0)

# Upper bounds on the sizes the engine allocates bookkeeping for up front (a list entry per
# device block and per tier slot, a flag per rank per job): a value past them exhausts
# memory or hangs instead of running. Device pool: ~140 bytes per block, so the bound is
# ~0.6 GB; tier index: ~40 bytes per slot, ~0.7 GB.
MAX_BLOCK_TOKENS = 1 << 20  # tokens per block: past any model's context window
MAX_DEVICE_BLOCKS = 1 << 22
MAX_TIER_BLOCKS = 1 << 24
MAX_RANKS = 1 << 10
_block_tokens = _integer(1, MAX_BLOCK_TOKENS, "longer than any context window")
_device_blocks = _integer(1, MAX_DEVICE_BLOCKS, "the device pool keeps ~140 bytes per block")
_tier_blocks = _integer(1, MAX_TIER_BLOCKS, "a tier index keeps ~40 bytes per slot")
_ranks = _integer(1, MAX_RANKS, "one report flag per rank per transfer job")
_positive = _number(0.0, strict=True)
_non_negative = _number(0.0, strict=False)


# ---- the configuration --------------------------------------------------------------------
class Derived(int):
    """An int default that marks a value the user did not set.

    The simulator replaces it with the value derived from the hardware and model profiles
    (``engine.device_blocks``, ``engine.ranks``); code without profiles (a bare ``Engine``,
    the live runtime) uses it as the plain int it is. Any value given in a file, a flag or
    ``attrs.evolve`` is a plain int, hence "set".
    """

    def __repr__(self) -> str:
        return f"Derived({int(self)})"


def is_derived(value: int) -> bool:
    """True when ``value`` is a default still to be derived (see ``Derived``)."""
    return isinstance(value, Derived)


@attrs.frozen
class TierConfig:
    name: str = attrs.field(validator=_choice("host", "disk", "remote"))
    capacity_blocks: int = attrs.field(validator=_tier_blocks)
    eviction: str = attrs.field(default="lru", validator=_choice("lru", "arc"))
    # Cost model (simulator); the live runtime measures the real thing. None: the tier's link
    # in the hardware profile (host: the host link per direction; disk: the NVMe drive; remote:
    # the NIC). A number overrides the link's bandwidth (both directions; a disk's reads and
    # writes) or latency.
    bandwidth_gbps: float | None = attrs.field(default=None, validator=_optional(_positive))
    latency_ms: float | None = attrs.field(default=None, validator=_optional(_non_negative))
    failure_rate: float = attrs.field(default=0.0, validator=_number(0.0, strict=False, high=1.0))


TIER_ORDER = ("host", "disk", "remote")


def tier_order_problem(names: list[str]) -> tuple[int, str] | None:
    """(index of the offending tier, message) when tier names repeat or are out of order."""
    for i, name in enumerate(names):
        if name in names[:i]:
            return i, f"tier {name!r} is given twice; tier names must be unique"
        if i and name in TIER_ORDER and names[i - 1] in TIER_ORDER \
                and TIER_ORDER.index(name) < TIER_ORDER.index(names[i - 1]):
            return i, f"tiers cascade host, disk, remote in that order; got {', '.join(names)}"
    return None


@attrs.frozen
class EngineConfig:
    block_tokens: int = attrs.field(default=512, validator=_block_tokens)
    # Derived by the simulator from the profiles unless set (the int is what code without
    # profiles uses: a bare Engine, the live runtime).
    device_blocks: int = attrs.field(default=Derived(2000), validator=_device_blocks)
    max_batched_tokens: int = attrs.field(default=8192, validator=_positive_int)
    max_running: int = attrs.field(default=128, validator=_positive_int)
    # = sim.tp in a simulated run unless set.
    ranks: int = attrs.field(default=Derived(1), validator=_ranks)
    async_scheduling: bool = attrs.field(default=False, validator=_boolean)
    # A rank that has not reported a job this long after it started is declared failed
    # for that job (its blocks stay quarantined until the report does come).
    transfer_deadline_ms: float | None = attrs.field(default=None, validator=_optional(_positive))
    # Lookups against a tier are answered by their own latency (async) or paid inline (sync).
    lookup_latency_ms: float = attrs.field(default=1.5, validator=_non_negative)
    tiers: tuple[TierConfig, ...] = attrs.field(default=(TierConfig("host", capacity_blocks=8000),))

    @tiers.validator
    def _tiers(self, attribute: attrs.Attribute[Any], value: Any) -> None:
        problem = tier_order_problem([t.name for t in value])
        if problem is not None:
            raise ConfigError("tiers", problem[1])


COMPLETIONS = ("step_boundary", "exact")
ARRIVALS = ("recorded", "spread")  # sim.arrivals: kvlife.lifecycle.workloads.arrivals


@attrs.frozen
class SimConfig:
    """The simulator: which hardware and model it times (``kvlife.lifecycle.profiles``), how
    transfers and lookups complete, and the run's randomness.

    A step costs what ``profiles.step_cost.StepCostModel`` says for its composition on
    ``model`` x ``hardware`` at tensor-parallel degree ``tp``, at the hardware profile's
    efficiency factors, or those of the ``efficiency`` file (what ``kvlife calibrate`` writes),
    or the single overrides below. Transfers share per-rank links (``drivers.links``); lookups
    queue for ``lookup_workers`` workers (``drivers.lookup_service``), each taking
    ``engine.lookup_latency_ms + lookup_per_key_ms x keys``.
    """

    seed: int = attrs.field(default=0, validator=_integer(None))
    # A bundled profile name (``kvlife.lifecycle.profiles.list_profiles()``) or a TOML file.
    hardware: str = attrs.field(default="h100-sxm", validator=_text)
    model: str = attrs.field(default="llama-3-8b", validator=_text)
    tp: int = attrs.field(default=1, validator=_positive_int)
    # vLLM's default share of device memory for weights, activations and KV (derives
    # engine.device_blocks).
    gpu_memory_utilization: float = attrs.field(default=0.9, validator=_number(0.0, strict=True, high=1.0))
    # A file with an [efficiency] table (``kvlife calibrate -o``), over the hardware's own.
    efficiency: str | None = attrs.field(default=None, validator=_optional(_text))
    # Single efficiency factors, over both (None: keep).
    mfu: float | None = attrs.field(default=None, validator=_optional(_number(0.0, strict=True, high=1.0)))
    attention_efficiency: float | None = attrs.field(
        default=None, validator=_optional(_number(0.0, strict=True, high=1.0)))
    mbu: float | None = attrs.field(default=None, validator=_optional(_number(0.0, strict=True, high=1.0)))
    step_overhead_ms: float | None = attrs.field(default=None, validator=_optional(_non_negative))
    # "step_boundary": a transfer report or lookup answer that completes while a step runs
    # reaches the engine right after that step's output (vLLM learns of finished transfers
    # from the next ModelRunnerOutput); "exact": at its completion time.
    completions: str = attrs.field(default="step_boundary", validator=_choice(*COMPLETIONS))
    # The lookup service: workers serving a FIFO queue (Mooncake's connector runs one).
    lookup_workers: int = attrs.field(default=1, validator=_positive_int)
    lookup_per_key_ms: float = attrs.field(default=0.005, validator=_non_negative)
    rank_jitter_ms: float = attrs.field(default=0.2, validator=_non_negative)
    max_output_tokens: int | None = attrs.field(default=None, validator=_optional(_positive_int))
    # Arrival rate multiplier applied when a workload is read (--time-scale).
    time_scale: float = attrs.field(default=1.0, validator=_positive)
    # How recorded arrival times are replayed: "recorded", or "spread": requests sharing a
    # timestamp arrive evenly up to the next one (``kvlife.lifecycle.workloads.arrivals``).
    arrivals: str = attrs.field(default="recorded", validator=_choice(*ARRIVALS))


# [sim] keys of the old linear cost model, and what replaced them (a config naming one gets
# this hint; a trace header holding one is read without it).
RETIRED_SIM_KEYS: dict[str, str] = {
    "prefill_tokens_per_s": "step costs come from sim.model and sim.hardware (profiles.step_cost)",
    "decode_step_ms": "step costs come from sim.model and sim.hardware (profiles.step_cost)",
    "decode_per_request_ms": "step costs come from sim.model and sim.hardware (profiles.step_cost)",
    "block_bytes": "KV bytes per block derive from sim.model, sim.tp and engine.block_tokens",
}


@attrs.frozen
class LiveConfig:
    """Live runs (``kvlife run --live``): the model shape of the real KV bytes and where
    the disk and Redis tiers keep them."""

    num_layers: int = attrs.field(default=2, validator=_positive_int)
    num_kv_heads: int = attrs.field(default=4, validator=_positive_int)
    head_dim: int = attrs.field(default=32, validator=_positive_int)
    dtype: str = attrs.field(default="float16", validator=_choice("float16", "bfloat16", "float32"))
    # A directory, kept (and its files recovered on the next run); default: a temporary
    # one, removed when the run ends.
    disk_path: str | None = attrs.field(default=None, validator=_optional(_text))
    redis_url: str | None = attrs.field(default=None, validator=_optional(_redis_url))
    # Every key a run writes expires after this long (0: never), and is deleted when the
    # run ends; an hour outlives any run the runtime is meant for.
    redis_ttl_s: int = attrs.field(default=3600, validator=_non_negative_int)
    verify: bool = attrs.field(default=True, validator=_boolean)
    # Robustness of the live driver (docs/design.md, "Live runtime"): how long one Redis reply
    # may take; after this many consecutive timeouts the Redis tier is treated as down
    # (misses, no waiting) for the back-off; a run with work but no progress for
    # stall_timeout_s of wall time is stopped, its unfinished requests reported as stranded.
    redis_timeout_s: float = attrs.field(default=0.5, validator=_number(0.0, strict=True, high=60.0))
    redis_breaker_failures: int = attrs.field(default=3, validator=_positive_int)
    redis_breaker_backoff_s: float = attrs.field(default=5.0, validator=_number(0.0, strict=True, high=3600.0))
    stall_timeout_s: float = attrs.field(default=30.0, validator=_number(0.0, strict=True, high=86400.0))


@attrs.frozen
class RunConfig:
    engine: EngineConfig = EngineConfig()
    sim: SimConfig = SimConfig()
    policies: tuple[str, ...] = ()
    live: LiveConfig = LiveConfig()

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


_SECTIONS: dict[str, type[Any]] = {"engine": EngineConfig, "sim": SimConfig, "live": LiveConfig}
_TOP_LEVEL = ("engine", "tiers", "sim", "live", "policies")
_POLICY_KEYS = ("stack",)


def _did_you_mean(name: str, known: tuple[str, ...] | list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    if close:
        return f" (did you mean '{close[0]}'?)"
    return f" (known: {', '.join(known)})"


# ---- where keys are written ---------------------------------------------------------------
_BARE = r"[A-Za-z0-9_-]+"
_KEY_PART = rf"(?:{_BARE}|\"(?:[^\"\\]|\\.)*\"|'[^']*')"
_KEY_RE = re.compile(rf"\s*({_KEY_PART}(?:\s*\.\s*{_KEY_PART})*)\s*=")
_TABLE_RE = re.compile(rf"\s*(\[\[?)\s*({_KEY_PART}(?:\s*\.\s*{_KEY_PART})*)\s*\]\]?")


def _key_path(raw: str) -> str:
    parts = re.findall(_KEY_PART, raw)
    return ".".join(p[1:-1] if p[:1] in "\"'" else p for p in parts)


class KeyLines:
    """Where each key of a TOML text is written: (table, occurrence, key) -> line. The
    occurrence counts ``[[array]]`` tables, so the second ``[[tiers]]`` is ("tiers", 1)."""

    def __init__(self, text: str) -> None:
        self.keys: dict[tuple[str, int, str], int] = {}
        self.tables: dict[tuple[str, int], int] = {}
        table, occurrence = "", 0
        counts: dict[str, int] = {}
        in_string: str | None = None  # the delimiter of an open multi-line string
        for number, line in enumerate(text.splitlines(), 1):
            if in_string is not None:
                if line.count(in_string) % 2 == 1:
                    in_string = None
                continue
            stripped = line.strip()
            if not stripped or stripped.startswith("#"):
                continue
            match = _TABLE_RE.match(line)
            if match is not None and not _KEY_RE.match(line):
                table = _key_path(match.group(2))
                if match.group(1) == "[[":
                    occurrence = counts.get(table, 0)
                    counts[table] = occurrence + 1
                else:
                    occurrence = 0
                self.tables.setdefault((table, occurrence), number)
                continue
            match = _KEY_RE.match(line)
            if match is None:
                continue
            self.keys.setdefault((table, occurrence, _key_path(match.group(1))), number)
            value = line[match.end():]
            for delimiter in ('"""', "'''"):
                if value.count(delimiter) % 2 == 1:
                    in_string = delimiter
                    break

    def line(self, table: str, occurrence: int = 0, key: str | None = None) -> int | None:
        """The line of ``key`` in that table (also as a dotted key at the top level or in a
        parent table), else the table's own line."""
        if key is not None:
            found = self.keys.get((table, occurrence, key))
            if found is not None:
                return found
            parts = table.split(".") if table else []
            for cut in range(len(parts) - 1, -1, -1):
                outer = ".".join(parts[:cut])
                dotted = ".".join([*parts[cut:], key])
                found = self.keys.get((outer, 0, dotted))
                if found is not None:
                    return found
        if table:
            found = self.tables.get((table, occurrence))
            if found is not None:
                return found
            # An inline table: the line of the key that holds it.
            parent, _, name = table.rpartition(".")
            return self.keys.get((parent, 0, name))
        return None


# ---- building a RunConfig from a TOML document -------------------------------------------
# [sim] keys that may name a file (relative to the config file's directory when they do).
PROFILE_PATH_KEYS = ("hardware", "model", "efficiency")
# A ProfileError's field -> the [sim] key that caused it.
PROFILE_ERROR_KEYS = {"tp": "tp", "hardware": "hardware", "model": "model", "efficiency": "efficiency",
                      "gpu_memory_utilization": "gpu_memory_utilization", "-": "model"}


def is_profile_path(value: str) -> bool:
    """A profile value names a file (rather than a bundled profile) when it has a ``/`` or ends ``.toml``."""
    return "/" in value or value.endswith(".toml")


def config_from_dict(data: dict[str, Any], path: str | None = None, text: str | None = None,
                     check_profiles: bool = True) -> RunConfig:
    """Build a RunConfig, raising ConfigError with file, line and field on bad input. With
    ``check_profiles`` the hardware and model profiles are loaded too, so a bad name, a bad
    profile file or a TP degree the model refuses is reported against the config."""
    lines = KeyLines(text) if text is not None else None

    def fail(field: str, message: str, table: str, occurrence: int = 0, key: str | None = None) -> ConfigError:
        line = lines.line(table, occurrence, key) if lines is not None else None
        return ConfigError(field, message, path, line)

    def build(cls: type[Any], values: dict[str, Any], field: str, table: str, occurrence: int = 0) -> Any:
        try:
            return cls(**values)
        except ConfigError as exc:
            name = exc.field or ""
            raise fail(f"{field}.{name}" if name else field, exc.message, table, occurrence, name or None) from None
        except (TypeError, ValueError) as exc:  # not expected: every field has its own check
            raise fail(field, str(exc), table, occurrence) from None

    def check_keys(values: dict[str, Any], known: tuple[str, ...], field: str, table: str, occurrence: int = 0,
                   hint: dict[str, str] | None = None) -> None:
        for key in values:
            if key not in known:
                extra = (hint or {}).get(key) or _did_you_mean(key, known)
                raise fail(f"{field}.{key}", f"unknown key{extra}", table, occurrence, key)

    for key in data:
        if key not in _TOP_LEVEL:
            raise fail(key, f"unknown section{_did_you_mean(key, _TOP_LEVEL)}", key)
    sections: dict[str, dict[str, Any]] = {}
    for section, cls in _SECTIONS.items():
        values = data.get(section, {})
        if not isinstance(values, dict):
            raise fail(section, f"must be a table ([{section}]), got {describe(values)}", section)
        known = tuple(f.name for f in attrs.fields(cls) if f.name != "tiers")
        hint = {"tiers": " (tiers are [[tiers]] tables of their own)"} if section == "engine" else None
        if section == "sim":
            hint = {key: f" (removed: {why})" for key, why in RETIRED_SIM_KEYS.items()}
        check_keys(values, known, section, section, hint=hint)
        sections[section] = values

    engine_values = dict(sections["engine"])
    tiers = data.get("tiers")
    if tiers is not None:
        if not isinstance(tiers, list):
            raise fail("tiers", f"must be an array of tables ([[tiers]]), got {describe(tiers)}", "tiers", 0)
        known = tuple(f.name for f in attrs.fields(TierConfig))
        required = tuple(f.name for f in attrs.fields(TierConfig) if f.default is attrs.NOTHING)
        built = []
        for i, tier in enumerate(tiers):
            field = f"tiers[{i}]"
            if not isinstance(tier, dict):
                raise fail(field, f"must be a table ([[tiers]]), got {describe(tier)}", "tiers", i)
            check_keys(tier, known, field, "tiers", i)
            for key in required:
                if key not in tier:
                    raise fail(f"{field}.{key}", "missing (every [[tiers]] table needs name and capacity_blocks)",
                               "tiers", i)
            built.append(build(TierConfig, tier, field, "tiers", i))
        problem = tier_order_problem([t.name for t in built])
        if problem is not None:
            i, message = problem
            raise fail(f"tiers[{i}].name", message, "tiers", i, "name")
        engine_values["tiers"] = tuple(built)
    engine = build(EngineConfig, engine_values, "engine", "engine")
    sim_values = dict(sections["sim"])
    if path is not None:
        # A profile or efficiency file named in a config file is found beside the config.
        for key in PROFILE_PATH_KEYS:
            value = sim_values.get(key)
            if isinstance(value, str) and is_profile_path(value) and not Path(value).is_absolute():
                sim_values[key] = str(Path(path).parent / value)
    sim = build(SimConfig, sim_values, "sim", "sim")
    live = build(LiveConfig, sections["live"], "live", "live")

    policies = data.get("policies", {})
    if not isinstance(policies, dict):
        raise fail("policies", f"must be a table ([policies]), got {describe(policies)}", "policies")
    check_keys(policies, _POLICY_KEYS, "policies", "policies")
    stack = policies.get("stack", [])
    if not isinstance(stack, list) or not all(isinstance(s, str) and s for s in stack):
        raise fail("policies.stack", f"must be an array of policy names, got {describe(stack)}",
                   "policies", 0, "stack")
    config = RunConfig(engine=engine, sim=sim, policies=tuple(stack), live=live)
    if check_profiles:
        from kvlife.lifecycle.drivers.physics import resolve
        from kvlife.lifecycle.profiles import ProfileError

        try:
            resolve(config)
        except ProfileError as exc:
            if exc.path and exc.path != "-":  # a problem inside the profile file: it names itself
                raise ConfigError(None, str(exc)) from None
            key = PROFILE_ERROR_KEYS.get(exc.field, exc.field)
            raise fail(f"sim.{key}", exc.message, "sim", 0, key) from None
    return config


_TOML_WHERE = re.compile(r"\s*\(at line (\d+), column (\d+)\)\s*$")
_TOML_END = re.compile(r"\s*\(at end of document\)\s*$")


def toml_syntax_error(path: str, text: str, exc: tomllib.TOMLDecodeError) -> ConfigError:
    """``FILE:LINE:COL: TOML syntax error: ...`` from tomllib's message (line and column
    moved to the front, where editors and terminals pick them up)."""
    message = str(exc.args[0]) if exc.args else str(exc)
    line: int | None = None
    column: int | None = None
    where = _TOML_WHERE.search(message)
    if where is not None:
        line, column = int(where.group(1)), int(where.group(2))
        message = message[: where.start()]
    elif _TOML_END.search(message):
        message = _TOML_END.sub("", message) + " at the end of the file"
        rows = text.splitlines() or [""]
        line, column = len(rows), len(rows[-1]) + 1
    return ConfigError(None, f"TOML syntax error: {message}", path, line, column)


def load_config(path: str | Path) -> RunConfig:
    p = Path(path)
    try:
        text = p.read_bytes().decode("utf-8")
    except OSError as exc:
        raise ConfigError(None, f"cannot read config: {exc.strerror or exc}", str(p)) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(None, f"cannot read config: not UTF-8 text (byte {exc.start})", str(p)) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise toml_syntax_error(str(p), text, exc) from None
    return config_from_dict(data, str(p), text)


def key_line(path: str | Path, key: str) -> int | None:
    """The line of a config file where ``key`` is set: "section.key" (``policies.stack``)
    or a bare key in any table; None when it cannot be found."""
    try:
        lines = KeyLines(Path(path).read_text())
    except (OSError, UnicodeDecodeError):
        return None
    table, _, name = key.rpartition(".")
    if table:
        return lines.line(table, 0, name)
    matches = [line for (_t, _o, k), line in lines.keys.items() if k == key]
    return min(matches) if matches else None
