"""Run configuration: engine limits, tiers, cost model, policy stack.

A config file is TOML with sections ``[engine]``, ``[[tiers]]``, ``[sim]`` and
``[policies]`` (``stack = [...]``). Every bad value is a ``ConfigError`` naming the file,
the line where the key is written, and the dotted field.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import attrs


class ConfigError(Exception):
    def __init__(self, field: str, message: str, path: str | None = None, line: int | None = None):
        where = f"{path}:{line}: " if path and line else (f"{path}: " if path else "")
        super().__init__(f"{where}field '{field}': {message}")
        self.field = field
        self.message = message
        self.path = path
        self.line = line


def _positive(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(attribute.name, f"must be a positive number, got {value!r}")


def _non_negative(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ConfigError(attribute.name, f"must be a non-negative number, got {value!r}")


def _positive_int(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(attribute.name, f"must be a positive integer, got {value!r}")


def _optional_positive(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None:
        _positive(instance, attribute, value)


@attrs.frozen
class TierConfig:
    name: str = attrs.field()
    capacity_blocks: int = attrs.field(validator=_positive_int)
    eviction: str = attrs.field(default="lru", validator=attrs.validators.in_(("lru", "arc")))
    # Cost model (simulator); the live runtime measures the real thing.
    bandwidth_gbps: float = attrs.field(default=20.0, validator=_positive)
    latency_ms: float = attrs.field(default=0.05, validator=_non_negative)
    failure_rate: float = attrs.field(default=0.0, validator=_non_negative)

    @name.validator
    def _name(self, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value not in ("host", "disk", "remote"):
            raise ConfigError("name", f"must be one of host, disk, remote; got {value!r}")


@attrs.frozen
class EngineConfig:
    block_tokens: int = attrs.field(default=512, validator=_positive_int)
    device_blocks: int = attrs.field(default=2000, validator=_positive_int)
    max_batched_tokens: int = attrs.field(default=8192, validator=_positive_int)
    max_running: int = attrs.field(default=128, validator=_positive_int)
    ranks: int = attrs.field(default=1, validator=_positive_int)
    async_scheduling: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    # A rank that has not reported a job this long after it started is declared failed
    # for that job (its blocks stay quarantined until the report does come).
    transfer_deadline_ms: float | None = attrs.field(default=None, validator=_optional_positive)
    # Lookups against a tier are answered by their own latency (async) or paid inline (sync).
    lookup_latency_ms: float = attrs.field(default=1.5, validator=_non_negative)
    tiers: tuple[TierConfig, ...] = attrs.field(default=(TierConfig("host", capacity_blocks=8000),))

    @tiers.validator
    def _tiers(self, attribute: attrs.Attribute[Any], value: Any) -> None:
        names = [t.name for t in value]
        if len(set(names)) != len(names):
            raise ConfigError("tiers", f"tier names must be unique, got {names}")
        order = {"host": 0, "disk": 1, "remote": 2}
        if names != sorted(names, key=order.__getitem__):
            raise ConfigError("tiers", f"tiers cascade host, disk, remote in that order; got {names}")


@attrs.frozen
class SimConfig:
    """The simulator's cost model: what a step, a lookup and a transfer cost."""

    seed: int = 0
    prefill_tokens_per_s: float = attrs.field(default=60000.0, validator=_positive)
    decode_step_ms: float = attrs.field(default=12.0, validator=_positive)
    decode_per_request_ms: float = attrs.field(default=0.08, validator=_non_negative)
    block_bytes: int = attrs.field(default=64 * 1024 * 1024, validator=_positive_int)
    rank_jitter_ms: float = attrs.field(default=0.2, validator=_non_negative)
    max_output_tokens: int | None = None


@attrs.frozen
class LiveConfig:
    """Live runs (``kvlife run --live``): the model shape of the real KV bytes and where
    the disk and Redis tiers keep them."""

    num_layers: int = attrs.field(default=2, validator=_positive_int)
    num_kv_heads: int = attrs.field(default=4, validator=_positive_int)
    head_dim: int = attrs.field(default=32, validator=_positive_int)
    dtype: str = attrs.field(default="float16", validator=attrs.validators.in_(("float16", "bfloat16", "float32")))
    disk_path: str | None = None  # a directory; default: a temporary one
    redis_url: str | None = None
    redis_ttl_s: int | None = None
    verify: bool = True


@attrs.frozen
class RunConfig:
    engine: EngineConfig = EngineConfig()
    sim: SimConfig = SimConfig()
    policies: tuple[str, ...] = ()
    live: LiveConfig = LiveConfig()

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


_SECTIONS: dict[str, type[Any]] = {"engine": EngineConfig, "sim": SimConfig, "live": LiveConfig}


def config_from_dict(data: dict[str, Any], path: str | None = None, text: str | None = None) -> RunConfig:
    """Build a RunConfig, raising ConfigError with file, line and field on bad input."""

    def fail(field: str, message: str, key: str | None = None) -> ConfigError:
        return ConfigError(field, message, path, _line_of(text, key or field.split(".")[-1]))

    def build(prefix: str, cls: type[Any], values: dict[str, Any]) -> Any:
        try:
            return cls(**values)
        except ConfigError as exc:
            raise fail(f"{prefix}.{exc.field}", exc.message, exc.field) from None
        except (TypeError, ValueError) as exc:
            # attrs' own validators name the attribute in quotes: point at it when they do.
            message = exc.args[0] if exc.args and isinstance(exc.args[0], str) else str(exc)
            named = [f.name for f in attrs.fields(cls) if f"'{f.name}'" in message]
            if named:
                raise fail(f"{prefix}.{named[0]}", message, named[0]) from None
            raise fail(prefix, message) from None

    unknown = sorted(set(data) - {"engine", "sim", "tiers", "policies", "live"})
    if unknown:
        raise fail(unknown[0], "unknown section")
    kwargs: dict[str, Any] = {}
    for section, cls in _SECTIONS.items():
        values = data.get(section, {})
        if not isinstance(values, dict):
            raise fail(section, "must be a table")
        known = {f.name for f in attrs.fields(cls)} - {"tiers"}
        for key in values:
            if key not in known:
                raise fail(f"{section}.{key}", f"unknown key (known: {', '.join(sorted(known))})")
        kwargs[section] = values
    tiers = data.get("tiers")
    engine_kwargs = dict(kwargs.get("engine", {}))
    if tiers is not None:
        if not isinstance(tiers, list):
            raise fail("tiers", "must be an array of tables ([[tiers]])")
        built = []
        for i, tier in enumerate(tiers):
            if not isinstance(tier, dict):
                raise fail(f"tiers[{i}]", "must be a table")
            built.append(build(f"tiers[{i}]", TierConfig, tier))
        engine_kwargs["tiers"] = tuple(built)
    engine = build("engine", EngineConfig, engine_kwargs)
    sim = build("sim", SimConfig, kwargs.get("sim", {}))
    live = build("live", LiveConfig, kwargs.get("live", {}))
    policies = data.get("policies", {})
    stack = policies.get("stack", []) if isinstance(policies, dict) else None
    if not isinstance(stack, list) or not all(isinstance(s, str) for s in stack):
        raise fail("policies.stack", "must be a list of policy names", "stack")
    return RunConfig(engine=engine, sim=sim, policies=tuple(stack), live=live)


def load_config(path: str | Path) -> RunConfig:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError("-", f"cannot read config: {exc.strerror}", str(p)) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        line = getattr(exc, "lineno", None)
        raise ConfigError("-", f"not valid TOML: {exc}", str(p), line) from None
    return config_from_dict(data, str(p), text)


def key_line(path: str | Path, key: str) -> int | None:
    """The line of a config file where ``key`` is set (None when it cannot be found)."""
    try:
        return _line_of(Path(path).read_text(), key)
    except OSError:
        return None


def _line_of(text: str | None, key: str) -> int | None:
    if text is None:
        return None
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith(key) and stripped[len(key):].lstrip().startswith("="):
            return number
        if stripped in (f"[{key}]", f"[[{key}]]"):
            return number
    return None
