"""A sweep's grid: a TOML spec and/or flags, expanded into points (``kvlife sweep run``).

The spec (docs/sweeps.md)::

    workload = "synthetic"            # a name or a file; a list of them is an axis
    limit = 200                       # first N requests (optional)
    config = "base.toml"              # a config file the points start from (optional)

    [set]                             # config keys set once, over the config
    engine.lookup_latency_ms = 5.0

    [grid]                            # config keys, each with the list of values it takes
    "policies.stack" = ["baseline", "async-lookup,shared-loads"]
    sim.time_scale = [0.5, 1, 2]
    tiers.host.capacity_blocks = [2000, 8000]

Keys are the config file's, dotted: ``engine.*``, ``sim.*``, ``tiers.NAME.*`` (host, disk,
remote; ``capacity_blocks = 0`` drops the tier) and ``policies.stack`` (``"a,b"`` or
``["a", "b"]``). The grid is every combination, the first axis varying slowest. Flags add to
the spec and win over it: ``--stack`` (repeated) is the ``policies.stack`` axis, ``--vary
KEY=V1,V2`` an axis, ``--set KEY=V`` a single value; ``--workload``, ``--limit``,
``--config`` and ``--seed`` as in ``kvlife run``.

Every bad value is refused before any run starts: ``FILE:LINE: field 'grid.sim.time_scale[2]':
must be ...`` (a ConfigError), or for a flag one line naming it (a UsageError).
"""

from __future__ import annotations

import difflib
import itertools
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from kvlife.lifecycle.cli.parsing import UsageError
from kvlife.lifecycle.config import (
    DEFAULT_MAX_POINTS,
    MAX_POINTS,
    PROFILE_ERROR_KEYS,
    REQUESTS,
    ConfigError,
    KeyLines,
    RunConfig,
    chaos_problem,
    describe,
    load_config,
    read_toml,
    size_problem,
)
from kvlife.lifecycle.sweeps.points import CONFIG_KEYS, Point, apply, known_key, order_for_apply, problem, stack_names

TOP_LEVEL = ("workload", "limit", "config", "max_points", "set", "grid")


@attrs.frozen
class Axis:
    key: str  # "workload", "limit" or a config key
    values: tuple[Any, ...]
    origin: str  # "grid" (the spec's [grid]), "spec" (a top-level key) or the flag ("--vary")


@attrs.frozen
class Grid:
    """What a spec and the flags say: fixed values, axes, and where each was written."""

    path: str | None = None
    text: str | None = None
    workload: str = "synthetic"
    limit: int | None = None
    config: RunConfig = attrs.field(factory=RunConfig)
    fixed: dict[str, Any] = attrs.field(factory=dict)  # config key -> value ([set], --set, --seed)
    fixed_origin: dict[str, str] = attrs.field(factory=dict)  # config key -> "set" or the flag
    axes: tuple[Axis, ...] = ()
    max_points: int = DEFAULT_MAX_POINTS
    max_points_origin: str = "default"  # "spec" (the spec's max_points), "--max-points" or "default"

    def size(self) -> int:
        total = 1
        for axis in self.axes:
            total *= len(axis.values)
        return total


# ---- reading a spec ---------------------------------------------------------------------------
def _flatten(table: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"sim": {"time_scale": [1]}}`` -> ``{"sim.time_scale": [1]}``; a table whose keys are
    all dotted config keys already stays as written."""
    out: dict[str, Any] = {}
    for key, value in table.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and not known_key(name):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


class _Where:
    """Lines of a spec's keys (``KeyLines``), for error messages."""

    def __init__(self, path: str | None, text: str | None) -> None:
        self.path = path
        self.lines = KeyLines(text) if text is not None else None

    def line(self, section: str, key: str | None = None) -> int | None:
        if self.lines is None:
            return None
        if key is None:
            found = self.lines.keys.get(("", 0, section))
            return found if found is not None else self.lines.tables.get((section, 0))
        parts = key.split(".")
        for cut in range(len(parts) - 1, -1, -1):  # [grid.sim] time_scale, [grid] sim.time_scale, ...
            table = ".".join([section, *parts[:cut]])
            found = self.lines.keys.get((table, 0, ".".join(parts[cut:])))
            if found is not None:
                return found
        quoted = self.lines.keys.get((section, 0, f"{key}"))
        return quoted if quoted is not None else self.lines.line(section)

    def error(self, field: str, message: str, section: str, key: str | None = None) -> ConfigError:
        return ConfigError(field, message, self.path, self.line(section, key))


def _did_you_mean(name: str, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    if close:
        return f" (did you mean '{close[0]}'?)"
    return " (config keys: engine.*, sim.*, tiers.NAME.*, policies.stack)"


def read_spec(path: str | Path) -> Grid:
    """A grid spec file, checked: a ConfigError with file, line and field on any bad value."""
    data, text = read_toml(path, "grid spec")
    return spec_from_dict(data, str(Path(path)), text)


def spec_from_dict(data: Mapping[str, Any], path: str | None = None, text: str | None = None) -> Grid:
    where = _Where(path, text)
    for key in data:
        if key not in TOP_LEVEL:
            close = difflib.get_close_matches(key, TOP_LEVEL, n=1, cutoff=0.6)
            hint = f" (did you mean '{close[0]}'?)" if close else f" (known: {', '.join(TOP_LEVEL)})"
            raise where.error(key, f"unknown key{hint}", key)
    axes: list[Axis] = []
    workload = data.get("workload", "synthetic")
    if isinstance(workload, list) and workload and all(isinstance(w, str) and w for w in workload):
        axes.append(Axis("workload", tuple(workload), "spec"))
        workload = workload[0]
    elif not isinstance(workload, str) or not workload:
        raise where.error("workload", f"must be a workload name or file, or a list of them; got {describe(workload)}",
                          "workload")
    limit = data.get("limit")
    if limit is not None:
        message = REQUESTS.problem(limit)
        if message is not None:
            raise where.error("limit", message, "limit")
    config = RunConfig()
    config_path = data.get("config")
    if config_path is not None:
        if not isinstance(config_path, str) or not config_path:
            raise where.error("config", f"must be the path of a config file, got {describe(config_path)}", "config")
        if path is not None and not Path(config_path).is_absolute():
            config_path = str(Path(path).parent / config_path)
        config = load_config(config_path)
    max_points = data.get("max_points", DEFAULT_MAX_POINTS)
    message = MAX_POINTS.problem(max_points)
    if message is not None:
        raise where.error("max_points", message, "max_points")
    fixed: dict[str, Any] = {}
    for section in ("set", "grid"):
        table = data.get(section, {})
        if not isinstance(table, dict):
            raise where.error(section, f"must be a table ([{section}]), got {describe(table)}", section)
        for key, value in _flatten(table).items():
            field = f"{section}.{key}"
            if not known_key(key):
                raise where.error(field, f"unknown config key{_did_you_mean(key, CONFIG_KEYS)}", section, key)
            if section == "set":
                message = problem(key, value)
                if message is not None:
                    raise where.error(field, message, section, key)
                fixed[key] = value
                continue
            if not isinstance(value, list) or not value:
                raise where.error(field, f"must be a non-empty array of values, got {describe(value)}", section, key)
            for i, element in enumerate(value):
                message = problem(key, element)
                if message is not None:
                    raise where.error(f"{field}[{i}]", message, section, key)
            axes.append(Axis(key, tuple(value), "grid"))
    return Grid(path, text, workload, limit, config, fixed, {k: "set" for k in fixed}, tuple(axes), max_points,
                "spec" if "max_points" in data else "default")


# ---- flags ----------------------------------------------------------------------------------------
def _flag_value(text: str) -> Any:
    """A flag's word as a TOML value: ``2`` an integer, ``1.5`` a float, ``true`` a boolean,
    anything else the string itself."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except (ValueError, RecursionError):  # not TOML (a TOMLDecodeError is a ValueError), too long, too deep:
        return text


def parse_assignment(text: str, flag: str, many: bool) -> tuple[str, list[Any]]:
    """``KEY=V1,V2`` (``--vary``) or ``KEY=V`` (``--set``): the key and its values, checked."""
    key, sep, values = text.partition("=")
    key = key.strip()
    if not sep or not key or not values.strip():
        raise UsageError(f"argument {flag}: expected KEY={'V1,V2,...' if many else 'VALUE'}, got {text!r}")
    if not known_key(key):
        raise UsageError(f"argument {flag}: {key}: unknown config key{_did_you_mean(key, CONFIG_KEYS)}")
    if key == "policies.stack" and many:
        raise UsageError(f"argument {flag}: vary stacks with --stack (repeated), one stack each")
    parsed = [_flag_value(v.strip()) for v in values.split(",")] if many else [_flag_value(values.strip())]
    if key == "policies.stack":
        parsed = [values.strip()]
    for value in parsed:
        message = problem(key, value)
        if message is not None:
            shown = value if isinstance(value, str) and len(value) <= 60 else describe(value)
            raise UsageError(f"argument {flag}: {key}={shown}: {message}")
    return key, parsed


def with_flags(grid: Grid, *, workload: str | None = None, limit: int | None = None, config: str | None = None,
               seed: int | None = None, stacks: Sequence[str] | None = None, vary: Sequence[str] = (),
               sets: Sequence[str] = (), max_points: int | None = None) -> Grid:
    """The flags over the spec: each replaces what the spec says of the same thing."""
    axes = list(grid.axes)
    fixed = dict(grid.fixed)
    origin = dict(grid.fixed_origin)
    changes: dict[str, Any] = {}

    def replace_axis(axis: Axis) -> None:
        nonlocal axes
        fixed.pop(axis.key, None)
        kept = [a for a in axes if a.key != axis.key]
        axes = kept + [axis]

    if workload is not None:
        axes = [a for a in axes if a.key != "workload"]
        changes["workload"] = workload
    if limit is not None:
        changes["limit"] = limit
    if max_points is not None:
        changes["max_points"] = max_points
        changes["max_points_origin"] = "--max-points"
    if config is not None:
        changes["config"] = load_config(config)
    if seed is not None:
        axes = [a for a in axes if a.key != "sim.seed"]
        fixed["sim.seed"] = seed
        origin["sim.seed"] = "--seed"
    for text in sets:
        key, (value,) = parse_assignment(text, "--set", many=False)
        axes = [a for a in axes if a.key != key]
        fixed[key] = value
        origin[key] = "--set"
    for text in vary:
        key, values = parse_assignment(text, "--vary", many=True)
        replace_axis(Axis(key, tuple(values), "--vary"))
    if stacks:
        for text in stacks:
            try:
                stack_names(text)
            except ValueError as exc:
                raise UsageError(f"argument --stack: {exc}") from None
        replace_axis(Axis("policies.stack", tuple(stacks), "--stack"))
    return attrs.evolve(grid, fixed=fixed, fixed_origin=origin, axes=tuple(axes), **changes)


# ---- expanding -------------------------------------------------------------------------------------
def _blame(grid: Grid, key: str, index: int | None) -> ConfigError | UsageError:
    """Where ``key`` was given: the spec's line, or the flag."""
    axis = next((a for a in grid.axes if a.key == key), None)
    source = axis.origin if axis is not None else grid.fixed_origin.get(key)
    if source in ("grid", "set", "spec"):
        where = _Where(grid.path, grid.text)
        section = "grid" if source == "grid" else "set"
        field = f"{section}.{key}" + (f"[{index}]" if index is not None and source == "grid" else "")
        return where.error(field, "", section, key)
    if source is not None:
        return UsageError(f"argument {source}: {key}")
    return ConfigError(key, "", grid.path)


def _fail(grid: Grid, key: str, index: int | None, message: str) -> ConfigError | UsageError:
    blamed = _blame(grid, key, index)
    if isinstance(blamed, UsageError):
        return UsageError(f"{blamed}: {message}")
    return ConfigError(blamed.field, message, blamed.path, blamed.line)


def expand(grid: Grid) -> list[Point]:
    """Every combination of the axes, first axis slowest, as points (duplicates dropped: two
    combinations with the same inputs are one run). Each point's config is checked: a value
    the combination refuses (a tier field without the tier, a TP degree the model refuses, a
    size beyond this machine's memory) is blamed on the key that set it."""
    from kvlife.lifecycle.drivers.physics import resolve
    from kvlife.lifecycle.profiles import ProfileError

    check_size(grid)
    base = grid.config
    for key in order_for_apply(list(grid.fixed)):
        try:
            base = apply(base, key, grid.fixed[key])
        except ConfigError as exc:
            raise _fail(grid, key, None, exc.message) from None
    points: list[Point] = []
    seen: set[str] = set()
    checked: set[Any] = set()
    choices = [list(enumerate(axis.values)) for axis in grid.axes]
    for combination in itertools.product(*choices):
        workload, limit, config = grid.workload, grid.limit, base
        chosen = {axis.key: (i, v) for axis, (i, v) in zip(grid.axes, combination, strict=True)}
        config_keys = [k for k in chosen if k not in ("workload", "limit")]
        for key in order_for_apply(config_keys):
            i, value = chosen[key]
            try:
                config = apply(config, key, value)
            except ConfigError as exc:
                raise _fail(grid, key, i, exc.message) from None
        if "workload" in chosen:
            workload = chosen["workload"][1]
        point = Point(workload, limit, config)
        physics_key = (config.sim.hardware, config.sim.model, config.sim.tp, config.sim.gpu_memory_utilization,
                       config.sim.efficiency, config.engine)
        if physics_key not in checked:
            checked.add(physics_key)
            try:
                resolved, _ = resolve(config)
            except ProfileError as exc:
                key = f"sim.{PROFILE_ERROR_KEYS.get(exc.field, exc.field)}"
                if exc.path and exc.path != "-":
                    raise ConfigError(None, str(exc)) from None
                raise _fail(grid, key, chosen.get(key, (None,))[0], exc.message) from None
            too_big = size_problem(resolved)
            if too_big is not None:
                field, message = too_big
                key = field if field in CONFIG_KEYS else next(
                    (k for k in chosen if k.endswith(".capacity_blocks")), "engine.device_blocks")
                raise _fail(grid, key, chosen.get(key, (None,))[0], message)
        chaos = chaos_problem(config)
        if chaos is not None:
            raise _fail(grid, "sim.chaos", chosen.get("sim.chaos", (None,))[0], chaos)
        key = point.key()
        if key not in seen:
            seen.add(key)
            points.append(point)
    return points


def check_size(grid: Grid) -> None:
    """A grid of more points than its cap is refused before a point is made (the product of
    the axes' lengths, computed, not expanded)."""
    size = grid.size()
    if size <= grid.max_points:
        return
    shape = " x ".join(f"{len(a.values):,} {a.key}" for a in grid.axes)
    how = {"spec": "the spec's max_points", "--max-points": "--max-points"}.get(grid.max_points_origin,
                                                                                "the default cap")
    message = (f"the grid has {size:,} points ({shape}), more than {how} of {grid.max_points:,}: narrow an axis, "
               f"or raise the cap with --max-points N (or max_points in the spec)")
    if grid.max_points_origin == "spec":
        raise _Where(grid.path, grid.text).error("max_points", message, "max_points")
    if grid.path is not None and any(a.origin in ("grid", "spec") for a in grid.axes):
        raise _Where(grid.path, grid.text).error("grid", message, "grid")  # the spec's axes made it
    raise UsageError(message)


def check_stacks(grid: Grid, points: Sequence[Point], imports: bool = True) -> None:
    """Load every stack the points use: a bad policy name fails before any run. Without
    ``imports`` (``--dry-run``), check the names only: no policy module is imported."""
    from kvlife.policies.base import PolicyError
    from kvlife.policies.loading import check_spec, load_stack

    axis = next((a for a in grid.axes if a.key == "policies.stack"), None)
    checked: set[tuple[str, ...]] = set()
    for point in points:
        if point.config.policies in checked:
            continue
        checked.add(point.config.policies)
        try:
            if imports:
                load_stack(point.config.policies)
            else:
                for spec in point.config.policies:
                    check_spec(spec)
        except PolicyError as exc:
            index = None
            if axis is not None:
                names = [stack_names(v) for v in axis.values]
                index = names.index(point.config.policies) if point.config.policies in names else None
            raise _fail(grid, "policies.stack", index, str(exc)) from None
