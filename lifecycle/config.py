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
``engine.ranks`` (= ``sim.tp``). They are None until resolved, once, by what runs the engine
(``kvlife.lifecycle.drivers.physics.resolve`` for a simulated run, ``live_defaults`` for a
live one; see ``EngineConfig``); a tier's ``bandwidth_gbps`` and ``latency_ms`` default to its
link in the hardware profile.

Every bad value is a ``ConfigError`` naming the file, the line where the key is written
(in the right ``[[tiers]]`` table when there are several) and the dotted field:
``FILE:LINE: field 'sim.seed': must be an integer, got 'abc'``. Unknown keys are refused
with a did-you-mean; NaN and infinities are refused in every number field; a TOML syntax
error is ``FILE:LINE:COL: TOML syntax error: ...``.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import functools
import math
import os
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


# ---- field rules ----------------------------------------------------------------------------
# Every value a user gives goes through one ``Rule``: a config key (the Rule is the attrs
# validator of its field), the flag that mirrors the key (``flag_type``), a field of a
# workload line (``WORKLOAD_RULES``) and the synthetic generator's options. A Rule knows the
# type, the bounds, and why an upper bound is what it is; the refusal says all three.
Validator = Callable[[object, "attrs.Attribute[Any]", Any], None]

INT64_MIN = -(2**63)
# The largest integer a 64-bit float holds (any larger one, as a number, is out of range).
FLOAT_MAX_INT = int(float.fromhex("0x1.fffffffffffffp+1023"))
INT64_MAX = 2**63 - 1
GIB = 1 << 30


def describe(value: Any) -> str:
    """A value as a message shows it: TOML spelling for scalars, the type for the rest
    (a long string is cut, so one value cannot flood the line)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return repr(value if len(value) <= 60 else value[:57] + "...")
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, int):  # a huge one by its size (str() refuses past 4300 digits)
        return repr(value) if abs(value) < 10**30 else f"an integer of about {value.bit_length() * 0.30103:.0f} digits"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, (datetime, date, time)):
        return f"a date/time ({value.isoformat()})"
    return type(value).__name__


@attrs.frozen
class Limit:
    """A bound on a value and why it is there (the refusal quotes both)."""

    value: int | float
    why: str

    def text(self) -> str:
        return f"{self.value:,}" if isinstance(self.value, int) else f"{self.value:g}"


def _bytes_text(n: float) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


# The share of the memory available that sizes may take: the rest is for the workload, the
# requests in flight and the interpreter.
MEMORY_SHARE = 0.8


@functools.cache
def memory_limit() -> Limit:
    """The bytes a run's sizes may take, and where the figure comes from: ``MEMORY_SHARE`` of
    the least of the memory available now (MemAvailable, else physical memory), the cgroup's
    memory limit and the address-space rlimit. Computed once per process."""
    found: list[tuple[int, str]] = []
    try:
        for row in Path("/proc/meminfo").read_text().splitlines():
            name, _, value = row.partition(":")
            if name == "MemAvailable" and value.split()[0].isdigit():
                found.append((int(value.split()[0]) * 1024, "available (MemAvailable, /proc/meminfo)"))
    except OSError:
        pass
    if not found:
        with contextlib.suppress(AttributeError, ValueError, OSError):  # not a POSIX system
            found.append((os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "physical memory (os.sysconf)"))
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:  # "max" or a huge number: no limit
            found.append((int(text), f"allowed by the cgroup ({path})"))
    try:
        import resource

        for name in ("RLIMIT_AS", "RLIMIT_DATA"):
            soft = resource.getrlimit(getattr(resource, name))[0]
            if soft != resource.RLIM_INFINITY and soft > 0:
                found.append((soft, f"allowed by {name}"))
    except (ImportError, AttributeError, ValueError, OSError):
        pass
    size, source = min(found) if found else (16 * GIB, "assumed (this system does not say)")
    return Limit(int(size * MEMORY_SHARE), f"{MEMORY_SHARE:.0%} of the {_bytes_text(size)} of memory {source}")


# Memory each simulated item holds, measured with tracemalloc on CPython 3.11 (10^6 items):
# DeviceBlockPool 139 B per block, TierIndex 40 B per slot, LookupService 96 B per worker;
# a request, held from the workload to the summary, about 3 KB (issue 12's soak: 326 MB at
# 100k simulated requests).
SIM_DEVICE_BLOCK_BYTES = 140
SIM_TIER_BLOCK_BYTES = 40
SIM_LOOKUP_WORKER_BYTES = 100
SIM_REQUEST_BYTES = 3000


def memory_bound(per_item: int, item: str) -> Callable[[], Limit]:
    """An upper bound of ``memory_limit() / per_item`` items, computed when first needed."""

    def bound() -> Limit:
        budget = memory_limit()
        return Limit(int(budget.value) // per_item, f"{per_item:,} B per {item}, {budget.why}")

    return bound


# Bounds that come from the domain rather than from this machine.
SIGNED_64 = Limit(INT64_MAX, "the largest integer JSON traces hold exactly, signed 64-bit")
UNSIGNED_64 = Limit(2**64 - 1, "the largest integer orjson reads and writes, unsigned 64-bit")
SIGNED_64_LOW = Limit(INT64_MIN, "the smallest integer JSON traces hold exactly, signed 64-bit")
TOKENS = Limit(1 << 24, "2^24 tokens, above the longest context window of any released model "
                        "(Llama 4 Scout, 10M)")
RANKS = Limit(1024, "the ranks of one model instance: the largest NVLink domain, NVL576, has 576 GPUs")
DURATION_MS = Limit(1e9, "11.6 days in ms: no latency, deadline or step overhead is longer")
TIMESTAMP_MS = Limit(9e12, "2^53 microseconds in ms: past it the float64 ms clock cannot tell microseconds apart")
TIME_SCALE_MAX = Limit(1e6, "a million times the recorded arrival rate")
TIME_SCALE_MIN = Limit(1e-6, "a millionth of the recorded arrival rate; slower pushes arrivals past the clock's range")
BANDWIDTH_MAX = Limit(1e6, "GB/s: 1 PB/s, over 500x NVLink 5's 1.8 TB/s per GPU")
BANDWIDTH_MIN = Limit(1e-6, "GB/s: 1 kB/s, at which a 64 MiB block takes 18 hours")
EFFICIENCY_MIN = Limit(1e-3, "0.1% of peak: a step at a thousandth of the hardware's speed is no model of a GPU, "
                             "and smaller factors push the clock past its range")
REDIS_TTL_S = Limit(10**15, "seconds: Redis refuses an expiry whose milliseconds overflow a signed 64-bit integer")

Bound = Limit | Callable[[], Limit] | None


def _resolve(bound: Bound) -> Limit | None:
    return bound() if callable(bound) else bound


def _from_text(kind: str, text: str) -> Any:
    """A command-line word as the value a TOML file would give: ints, floats, booleans."""
    if kind in ("int", "number"):
        if not text.isascii():  # int() and float() read "٣" as 3; TOML, and kvlife, do not
            return text
        try:
            return int(text)
        except ValueError:
            digits = text.strip().lstrip("+-").replace("_", "")
            # More digits than int() converts: an integer that large.
            if digits.isdecimal():
                return (-1 if text.strip().startswith("-") else 1) * 10 ** (len(digits) - 1)
        try:
            return float(text)
        except ValueError:
            return text
    if kind == "bool":
        return {"true": True, "false": False}.get(text, text)
    return text


@attrs.frozen(eq=False)
class Rule:
    """One value's rule. ``kind`` is "int", "number", "bool", "choice", "text" or "url".

    ``low`` (with ``low_open`` for ">") and ``high`` are part of the type ("a number in
    (0, 1]"); ``minimum`` and ``maximum`` are limits with a reason ("at most 1,024 (...)"),
    a ``Limit`` or a function giving one (bounds derived from this machine's memory).
    """

    kind: str
    low: float | None = None
    low_open: bool = False
    high: float | None = None
    minimum: Bound = None
    maximum: Bound = None
    choices: tuple[str, ...] = ()
    optional: bool = False

    def want(self) -> str:
        """What the value must be, as a message says it: "a positive integer"."""
        if self.kind == "int":
            return {None: "an integer", 0: "a non-negative integer", 1: "a positive integer"}.get(
                self.low, f"an integer >= {self.low}")  # type: ignore[arg-type]
        if self.kind == "number":
            if self.high is not None and self.low is not None:
                if self.low_open:
                    return f"a number in ({self.low:g}, {self.high:g}]"
                return f"a number from {self.low:g} to {self.high:g}"
            if self.low is None:
                return "a number"
            if self.low == 0:
                return "a positive number" if self.low_open else "a non-negative number"
            return f"a number {'>' if self.low_open else '>='} {self.low:g}"
        if self.kind == "bool":
            return "true or false"
        if self.kind == "choice":
            return f"one of {', '.join(map(repr, self.choices))}"
        if self.kind == "url":
            return "a redis://, rediss:// or unix:// URL"
        return "a non-empty string"

    def problem(self, value: Any) -> str | None:
        """What is wrong with ``value`` (the part after the field's name), None if nothing."""
        if value is None and self.optional:
            return None
        kind = self.kind
        if kind == "bool":
            return None if isinstance(value, bool) else f"must be true or false, got {describe(value)}"
        if kind == "choice":
            if isinstance(value, str) and value in self.choices:
                return None
            return f"must be {self.want()}; got {describe(value)}"
        if kind in ("text", "url"):
            if not isinstance(value, str) or not value:
                return f"must be a non-empty string, got {describe(value)}"
            if "\x00" in value:
                return f"must not contain a NUL character, got {describe(value)}"
            if kind == "url" and not value.startswith(("redis://", "rediss://", "unix://")):
                return f"must be {self.want()}, got {describe(value)}"
            return None
        is_int = isinstance(value, int) and not isinstance(value, bool)
        if kind == "int" and not is_int:
            return f"must be {self.want()}, got {describe(value)}"
        if kind == "number":
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                return f"must be {self.want()}, got {describe(value)}"
            if isinstance(value, int) and not -FLOAT_MAX_INT <= value <= FLOAT_MAX_INT:
                # (past a float's range: comparing it with a float bound would raise OverflowError)
                return f"must be a finite number, got {describe(value)} (past a 64-bit float's range)"
            if not math.isfinite(value):
                return f"must be a finite number, got {value!r}"
        low, high = self.low, self.high
        if (low is not None and (value < low or (self.low_open and value == low))) or \
                (high is not None and value > high):
            return f"must be {self.want()}, got {describe(value)}"
        minimum = _resolve(self.minimum)
        if minimum is not None and value < minimum.value:
            return f"must be at least {minimum.text()} ({minimum.why}), got {describe(value)}"
        maximum = _resolve(self.maximum)
        if maximum is not None and value > maximum.value:
            return f"must be at most {maximum.text()} ({maximum.why}), got {describe(value)}"
        return None

    def plain_range(self) -> tuple[tuple[type, ...], int | float, int | float] | None:
        """Where ``problem`` is None without asking it: (exact types, low, high) such that
        every value whose type is one of the types and which lies in [low, high] is valid;
        None for a rule with no such range (not a number, or an open lower bound). A reader
        of a large file checks its common case with it and asks ``problem`` only outside it,
        so every refusal is still worded by ``problem``."""
        if self.kind not in ("int", "number"):
            return None
        minimum, maximum = _resolve(self.minimum), _resolve(self.maximum)
        if self.low_open and (minimum is None or self.low is None or minimum.value <= self.low):
            return None  # (an open end, unless a minimum above it closes the range)
        lows = [b for b in (self.low, None if minimum is None else minimum.value) if b is not None]
        highs = [b for b in (self.high, None if maximum is None else maximum.value) if b is not None]
        if self.kind == "int":
            return (int,), max(lows, default=-math.inf), min(highs, default=math.inf)
        # A number: also within a float's range (an int past it is refused; inf and NaN compare out).
        return (int, float), max([*lows, -FLOAT_MAX_INT]), min([*highs, FLOAT_MAX_INT])

    def __call__(self, instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        """The attrs validator: a ConfigError naming the attribute."""
        message = self.problem(value)
        if message is not None:
            raise ConfigError(attribute.alias or attribute.name, message)

    def parse(self, text: str) -> Any:
        """The argparse ``type`` of a flag under this rule: the word read as a TOML value,
        then checked, so a flag and its config key refuse the same values in the same words."""
        value = _from_text(self.kind, text)
        message = self.problem(value)
        if message is not None:
            raise argparse.ArgumentTypeError(message)
        return value


def _integer(minimum: int | None, maximum: Bound = SIGNED_64) -> Rule:
    return Rule("int", low=minimum, minimum=SIGNED_64_LOW if minimum is None else None, maximum=maximum)


def _number(low: float, strict: bool, high: float | None = None, maximum: Bound = None,
            minimum: Bound = None) -> Rule:
    return Rule("number", low=low, low_open=strict, high=high, minimum=minimum, maximum=maximum)


def _optional(rule: Rule) -> Rule:
    return attrs.evolve(rule, optional=True)


def _choice(*choices: str) -> Rule:
    return Rule("choice", choices=choices)


_boolean = Rule("bool")
_text = Rule("text")
_redis_url = Rule("url")
_positive_int = _integer(1)
_non_negative_int = _integer(0)

_positive = _number(0.0, strict=True)
_non_negative = _number(0.0, strict=False)
_fraction = _number(0.0, strict=True, high=1.0)  # (0, 1]
_efficiency = _number(0.0, strict=True, high=1.0, minimum=EFFICIENCY_MIN)
_probability = _number(0.0, strict=False, high=1.0)  # [0, 1]
_duration = _number(0.0, strict=False, maximum=DURATION_MS)
_tokens = _integer(1, TOKENS)
_seed = _integer(None)

# Values that are not config keys but go through the same rules.
TEXT = _text  # a name or a path: non-empty, no NUL character
POSITIVE_INT = _positive_int
NON_NEGATIVE_INT = _non_negative_int
POSITIVE_NUMBER = _number(0.0, strict=True)
# Requests a run holds in memory (--limit, the synthetic generator's num_requests).
REQUESTS = _integer(1, memory_bound(SIM_REQUEST_BYTES, "simulated request"))
# The points a sweep's grid may have (kvlife.lifecycle.sweeps.grid): its spec's max_points, --max-points.
MAX_POINTS = _integer(1, memory_bound(SIM_REQUEST_BYTES, "sweep point"))
# ...and unless it says otherwise: a grid is expanded, checked and listed before anything
# runs, and 8 axes of 40 values are 6.5 trillion points; 10,000 runs of a few seconds each
# are a day of one machine's time.
DEFAULT_MAX_POINTS = 10_000
# The options of the synthetic generators (kvlife.lifecycle.workloads.synthetic); a pair
# (low, high) has each element checked by its rule.
_per_workload = _integer(1, REQUESTS.maximum)
SYNTHETIC_RULES: dict[str, Rule] = {
    "seed": _seed,
    "num_requests": _integer(0, REQUESTS.maximum),
    "block_tokens": _tokens,
    "arrival_rate_per_s": _number(0.0, strict=True, minimum=Limit(1e-6, "one request in 11.6 days"),
                                  maximum=Limit(1e9, "a request every nanosecond")),
    "num_system_prompts": _integer(0, REQUESTS.maximum),
    "max_turns": _per_workload,
    "topics_between": _integer(0, REQUESTS.maximum),
    "burst_size": _per_workload,
    "session_probability": _probability,
    "system_prompt_blocks": _tokens,
    "prefix_blocks": _tokens,
    "user_tokens": _tokens,
    "own_tokens": _tokens,
    "output_tokens": _tokens,
    "think_time_s": _number(0.0, strict=False, maximum=Limit(1e6, "11.6 days in s")),
    "burst_spread_ms": _duration,
}
# A burst's spread in mean gaps between arrivals (spread x rate): past about 30 the burst
# generator's window (the first num_requests arrivals) stops closing, as later bursts keep
# landing in it (measured: 25 gaps take 0.05 s, 50 gaps 30 s and more).
BURST_SPREAD_ARRIVALS = Limit(20, "mean gaps between arrivals: a wider burst is no burst, and past about 30 the "
                                  "generator's window of the first num_requests arrivals stops closing")
# The fields of one Mooncake JSON line (kvlife.lifecycle.workloads.mooncake).
WORKLOAD_RULES: dict[str, Rule] = {
    "timestamp": _number(0.0, strict=False, maximum=TIMESTAMP_MS),
    "input_length": _tokens,
    "output_length": _tokens,
    "hash_ids": _integer(0, UNSIGNED_64),  # each element
}


# [policies] hook_budget_s (--hook-budget): a hook answers from a view in microseconds; one
# that takes seconds will not return. At most a day (a longer budget is no budget).
HOOK_BUDGET_S = _number(0.0, strict=True, maximum=Limit(86400.0, "s: a day"))


# ---- the configuration --------------------------------------------------------------------
def is_derived(engine: EngineConfig, field: str = "device_blocks") -> bool:
    """True when ``engine``'s ``device_blocks`` (or ``ranks``) is still to be derived: not
    set in a file, a flag or ``attrs.evolve`` (None until resolved, see ``EngineConfig``)."""
    return getattr(engine, f"{field}_set") is None


@functools.cache
def default_device_blocks(block_tokens: int, max_batched_tokens: int) -> int:
    """What a run with the default ``[sim]`` (h100-sxm, llama-3-8b, tp 1, 0.9 of the GPU)
    derives for a device of ``block_tokens``-token blocks: the one default of
    ``engine.device_blocks`` (``kvlife.lifecycle.drivers.physics.resolve`` derives it)."""
    from kvlife.lifecycle.drivers.physics import resolve

    engine = EngineConfig(block_tokens=block_tokens, max_batched_tokens=max_batched_tokens, tiers=())
    resolved, _ = resolve(RunConfig(engine=engine))
    assert resolved.engine.device_blocks_set is not None
    return resolved.engine.device_blocks_set


@attrs.frozen
class TierConfig:
    name: str = attrs.field(validator=_choice("host", "disk", "remote"))
    capacity_blocks: int = attrs.field(
        validator=_integer(1, memory_bound(SIM_TIER_BLOCK_BYTES, "simulated tier block")))
    eviction: str = attrs.field(default="lru", validator=_choice("lru", "arc"))
    # Cost model (simulator); the live runtime measures the real thing. None: the tier's link
    # in the hardware profile (host: the host link per direction; disk: the NVMe drive; remote:
    # the NIC). A number overrides the link's bandwidth (both directions; a disk's reads and
    # writes) or latency.
    bandwidth_gbps: float | None = attrs.field(
        default=None, validator=_optional(_number(0.0, strict=True, minimum=BANDWIDTH_MIN, maximum=BANDWIDTH_MAX)))
    latency_ms: float | None = attrs.field(default=None, validator=_optional(_duration))
    failure_rate: float = attrs.field(default=0.0, validator=_probability)


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
    block_tokens: int = attrs.field(default=512, validator=_tokens)
    # engine.device_blocks and engine.ranks: None until resolved, once, by what runs the
    # engine: a simulated run derives them from [sim] (kvlife.lifecycle.drivers.physics.resolve:
    # the device as vLLM sizes its KV cache; ranks = sim.tp), a live run from its own defaults
    # (drivers.live.live_defaults). The engine reads ``device_blocks`` and ``ranks`` (the
    # properties below): an EngineConfig built by hand and never resolved gets what a run with
    # the default [sim] derives, the one default of each.
    device_blocks_set: int | None = attrs.field(
        default=None, alias="device_blocks",
        validator=_optional(_integer(1, memory_bound(SIM_DEVICE_BLOCK_BYTES, "simulated device block"))))
    max_batched_tokens: int = attrs.field(default=8192, validator=_tokens)
    max_running: int = attrs.field(default=128, validator=_positive_int)
    ranks_set: int | None = attrs.field(default=None, alias="ranks", validator=_optional(_integer(1, RANKS)))
    async_scheduling: bool = attrs.field(default=False, validator=_boolean)
    # A rank that has not reported a job this long after it started is declared failed
    # for that job (its blocks stay quarantined until the report does come).
    transfer_deadline_ms: float | None = attrs.field(
        default=None, validator=_optional(_number(0.0, strict=True, maximum=DURATION_MS)))
    # Lookups against a tier are answered by their own latency (async) or paid inline (sync).
    lookup_latency_ms: float = attrs.field(default=1.5, validator=_duration)
    # An async lookup not answered this long after it was submitted expires: the request
    # goes back to ``waiting`` as a miss (trigger ``lookup_expired``) and the late answer is
    # stale. 5 s is the live driver's report deadline and ~3,000x the 1.5 ms lookup
    # latency: a lookup that old is lost, not slow (vLLM has no such deadline: vllm#49829).
    lookup_deadline_ms: float = attrs.field(
        default=5000.0, validator=_number(0.0, strict=True, maximum=DURATION_MS))
    # A job some rank has not reported this long after it started is given up (as at
    # ``transfer_deadline_ms``, if it was not already) and its device blocks and tier slots
    # are reclaimed: an abort during loading or sending never leaks them to a silent rank.
    # A report that comes later is recorded as late and ignored. vLLM's NIXL connector
    # frees an aborted request's blocks after VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 480 s by default.
    reclaim_deadline_ms: float = attrs.field(
        default=480_000.0, validator=_number(0.0, strict=True, maximum=DURATION_MS))
    # Async lookups a request may submit over its life: past this many, its last answer is
    # kept (as keep-lookup-answers would) and a ``lookup_limit`` warning is recorded; a
    # request deferred on every answer would otherwise look up for ever (vllm#49829: 1.27M
    # ``lookup()`` calls for one request). The checker draws small bounds to reach it.
    max_async_lookups: int = attrs.field(default=1024, validator=_positive_int)
    # vLLM's kv_load_failure_policy: a request whose load failed recomputes from its first
    # failed block, or fails with an error. The ``on_load_failure`` policy is asked either way;
    # an answer the deployment cannot carry out is refused (a ``decision_refused`` warning).
    kv_load_failure_policy: str = attrs.field(default="recompute", validator=_choice("recompute", "fail"))
    tiers: tuple[TierConfig, ...] = attrs.field(default=(TierConfig("host", capacity_blocks=8000),))

    @tiers.validator
    def _tiers(self, attribute: attrs.Attribute[Any], value: Any) -> None:
        problem = tier_order_problem([t.name for t in value])
        if problem is not None:
            raise ConfigError("tiers", problem[1])

    @property
    def device_blocks(self) -> int:
        """The device's size in blocks: as set or resolved, else the one default
        (``default_device_blocks``)."""
        if self.device_blocks_set is not None:
            return self.device_blocks_set
        return default_device_blocks(self.block_tokens, self.max_batched_tokens)

    @property
    def ranks(self) -> int:
        """Ranks reporting each transfer: as set or resolved, else 1 (the default sim.tp)."""
        return self.ranks_set if self.ranks_set is not None else 1

    def to_dict(self) -> dict[str, Any]:
        """As a config file and a trace header spell it (``device_blocks``, ``ranks``: null
        while unresolved)."""
        return {_key(f): _plain(getattr(self, f.name)) for f in attrs.fields(EngineConfig)}


def with_tier(engine: EngineConfig, name: str, field: str, value: Any) -> EngineConfig:
    """``engine`` with ``field`` of its tier ``name`` set to ``value`` (``--tier NAME=N``, a
    sweep's ``tiers.NAME.FIELD``): ``capacity_blocks`` 0 drops the tier, and sizing a tier the
    engine lacks adds it, its bandwidth and latency the tier's link in the hardware profile.
    Another field of a tier it lacks is a ConfigError without a field (the caller names it)."""
    tiers = {t.name: t for t in engine.tiers}
    if field == "capacity_blocks" and value == 0:
        tiers.pop(name, None)
    elif name in tiers:
        tiers[name] = attrs.evolve(tiers[name], **{field: value})
    elif field == "capacity_blocks":
        tiers[name] = TierConfig(name, capacity_blocks=value)
    else:
        raise ConfigError(None, f"the config has no {name} tier; set tiers.{name}.capacity_blocks first")
    return attrs.evolve(engine, tiers=tuple(tiers[n] for n in TIER_ORDER if n in tiers))


COMPLETIONS = ("step_boundary", "exact")
ARRIVALS = ("recorded", "spread", "poisson", "gamma")  # sim.arrivals: kvlife.lifecycle.workloads.arrivals
REQUEST_RATE_MAX = Limit(1e6, "requests/s: a million a second, over a thousand times what one GPU serves")
REQUEST_RATE_MIN = Limit(1e-3, "requests/s: one request every 17 minutes; slower pushes arrivals past the "
                               "clock's range")
ARRIVAL_CV_MAX = Limit(100.0, "a gamma shape of 1e-4: nearly every request in one burst")


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

    seed: int = attrs.field(default=0, validator=_seed)
    # A bundled profile name (``kvlife.lifecycle.profiles.list_profiles()``) or a TOML file.
    hardware: str = attrs.field(default="h100-sxm", validator=_text)
    model: str = attrs.field(default="llama-3-8b", validator=_text)
    tp: int = attrs.field(default=1, validator=_integer(1, RANKS))
    # vLLM's default share of device memory for weights, activations and KV (derives
    # engine.device_blocks).
    gpu_memory_utilization: float = attrs.field(default=0.9, validator=_fraction)
    # A file with an [efficiency] table (``kvlife calibrate -o``), over the hardware's own.
    efficiency: str | None = attrs.field(default=None, validator=_optional(_text))
    # Single efficiency factors, over both (None: keep).
    mfu: float | None = attrs.field(default=None, validator=_optional(_efficiency))
    attention_efficiency: float | None = attrs.field(default=None, validator=_optional(_efficiency))
    mbu: float | None = attrs.field(default=None, validator=_optional(_efficiency))
    step_overhead_ms: float | None = attrs.field(default=None, validator=_optional(_duration))
    # "step_boundary": a transfer report or lookup answer that completes while a step runs
    # reaches the engine right after that step's output (vLLM learns of finished transfers
    # from the next ModelRunnerOutput); "exact": at its completion time.
    completions: str = attrs.field(default="step_boundary", validator=_choice(*COMPLETIONS))
    # The lookup service: workers serving a FIFO queue (Mooncake's connector runs one).
    lookup_workers: int = attrs.field(
        default=1, validator=_integer(1, memory_bound(SIM_LOOKUP_WORKER_BYTES, "simulated lookup worker")))
    lookup_per_key_ms: float = attrs.field(default=0.005, validator=_duration)
    rank_jitter_ms: float = attrs.field(default=0.2, validator=_duration)
    max_output_tokens: int | None = attrs.field(default=None, validator=_optional(_tokens))
    # Arrival rate multiplier applied when a workload is read (--time-scale).
    time_scale: float = attrs.field(
        default=1.0, validator=_number(0.0, strict=True, minimum=TIME_SCALE_MIN, maximum=TIME_SCALE_MAX))
    # How arrival times are made (``kvlife.lifecycle.workloads.arrivals``): "recorded", or
    # "spread": requests sharing a timestamp arrive evenly up to the next one; "poisson" and
    # "gamma": the recorded order with gaps drawn (from sim.seed) at the mean rate, gamma's
    # gaps with the coefficient of variation ``arrival_cv`` (default 1: Poisson).
    arrivals: str = attrs.field(default="recorded", validator=_choice(*ARRIVALS))
    arrival_cv: float | None = attrs.field(
        default=None, validator=_optional(_number(0.0, strict=True, maximum=ARRIVAL_CV_MAX)))
    # The mean arrival rate, requests/s (--request-rate), instead of a time scale: recorded
    # or spread arrivals are scaled to it, poisson and gamma arrivals drawn at it.
    request_rate: float | None = attrs.field(
        default=None, validator=_optional(_number(0.0, strict=True, minimum=REQUEST_RATE_MIN,
                                                  maximum=REQUEST_RATE_MAX)))
    # An adversarial driver (``kvlife.lifecycle.drivers.chaos``): rank reports, lookup answers
    # and step outputs delayed, duplicated, reordered and dropped within the protocol's rules,
    # from this seed (None: a plain run). Needs engine.transfer_deadline_ms (``chaos_problem``).
    chaos: int | None = attrs.field(default=None, validator=_optional(_seed))
    # The invariant observer beside the engine (``kvlife.lifecycle.drivers.online_check``);
    # a chaos run always checks.
    check: bool = attrs.field(default=False, validator=_boolean)


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
    redis_ttl_s: int = attrs.field(default=3600, validator=_integer(0, REDIS_TTL_S))
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
    # [policies] hook_budget_s: how long one policy hook may run (kvlife.policies.watchdog);
    # past it the run stops with one line naming the policy, the hook and the request.
    hook_budget_s: float = attrs.field(default=5.0, validator=HOOK_BUDGET_S)

    def to_dict(self) -> dict[str, Any]:
        out = attrs.asdict(self)
        out["engine"] = self.engine.to_dict()
        return out


def _key(field: attrs.Attribute[Any]) -> str:
    """The name a config file uses for a field (its alias: ``device_blocks``, ``ranks``)."""
    return field.alias or field.name


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if attrs.has(type(value)):
        return attrs.asdict(value)
    return value


def config_keys(cls: type[Any]) -> tuple[str, ...]:
    """The keys of a config section's class, as a file spells them."""
    return tuple(_key(f) for f in attrs.fields(cls))


_SECTIONS: dict[str, type[Any]] = {"engine": EngineConfig, "sim": SimConfig, "live": LiveConfig}
_TOP_LEVEL = ("engine", "tiers", "sim", "live", "policies")
_POLICY_KEYS = ("stack", "hook_budget_s")


# ---- one rule per field, for files and flags alike ------------------------------------------
def field_rule(field: str) -> Rule:
    """The rule of a config key: ``"engine.device_blocks"``, ``"tiers.capacity_blocks"``."""
    section, _, name = field.partition(".")
    cls = TierConfig if section == "tiers" else _SECTIONS[section]
    rule = {_key(f): f for f in attrs.fields(cls)}[name].validator
    if not isinstance(rule, Rule):
        raise KeyError(f"{field} has no rule of its own")
    return rule


def flag_type(field: str) -> Callable[[str], Any]:
    """The argparse ``type`` of the flag that mirrors config key ``field`` (its rule's parse)."""
    return field_rule(field).parse


LIVE_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}


def live_block_bytes(config: RunConfig) -> int:
    """Bytes of one KV block of a live run, all ranks together: K and V x layers x KV heads x
    head dim x block tokens x dtype size (``kvlife.transfer.layout.BlockGeometry``)."""
    live = config.live
    return (2 * live.num_layers * live.num_kv_heads * live.head_dim * config.engine.block_tokens
            * LIVE_DTYPE_BYTES.get(live.dtype, 4))


def size_problem(config: RunConfig, live: bool = False) -> tuple[str, str] | None:
    """(field, message) when the sizes of ``config`` together need more memory than this
    machine can allocate (``memory_limit``): the simulator's device pool, tier indexes and
    lookup workers, and in a live run (``live``) the KV bytes of the device and host tier.
    The field blamed is the one that takes the most."""
    budget = memory_limit()
    engine = config.engine
    kv = live_block_bytes(config) if live else 0
    # (field, count, bytes each, what they are)
    parts: list[tuple[str, int, int, str]] = [
        ("engine.device_blocks", int(engine.device_blocks), SIM_DEVICE_BLOCK_BYTES + kv, "device blocks")]
    for i, tier in enumerate(engine.tiers):
        per = SIM_TIER_BLOCK_BYTES + (kv if tier.name == "host" else 0)
        parts.append((f"tiers[{i}].capacity_blocks", tier.capacity_blocks, per, f"{tier.name} tier blocks"))
    parts.append(("sim.lookup_workers", config.sim.lookup_workers, SIM_LOOKUP_WORKER_BYTES, "lookup workers"))
    total = sum(count * per for _, count, per, _ in parts)
    if total <= budget.value:
        return None
    field, count, per, what = max(parts, key=lambda part: part[1] * part[2])
    room = max(0, (int(budget.value) - (total - count * per)) // per)
    each = f"{_bytes_text(per)} each"
    if live and per > SIM_TIER_BLOCK_BYTES + SIM_DEVICE_BLOCK_BYTES:
        lv = config.live
        each = (f"{_bytes_text(per)} each (a live KV block: 2 x {lv.num_layers} layers x {lv.num_kv_heads} heads"
                f" x {lv.head_dim} head_dim x {engine.block_tokens} tokens x {lv.dtype})")
    return field, (f"{count:,} {what} of {each} need {_bytes_text(total)} with the rest of the config, more than "
                   f"{_bytes_text(budget.value)}, {budget.why}: at most {room:,} fit")


# The keys that shrink the room for KV blocks on the device, blamed (the first one set) for a
# "does not fit" profile error; none set: sim.tp, the usual remedy.
FIT_FIELDS = ("engine.block_tokens", "engine.max_batched_tokens", "sim.gpu_memory_utilization", "sim.tp")


def _split_field(field: str) -> tuple[str, int, str]:
    """``"tiers[1].capacity_blocks"`` -> ("tiers", 1, "capacity_blocks")."""
    table, _, key = field.rpartition(".")
    match = re.fullmatch(r"(.*)\[(\d+)\]", table)
    if match is not None:
        return match.group(1), int(match.group(2)), key
    return table, 0, key


def field_line(path: str | Path, field: str) -> int | None:
    """The line of a config file where ``field`` (``"tiers[1].capacity_blocks"``) is set."""
    lines = _key_lines(path)
    return lines.line(*_split_field(field)) if lines is not None else None


def _key_lines(path: str | Path) -> KeyLines | None:
    """Where the keys of a config file are written; None when it cannot be read (the
    reader that read it first said why)."""
    from kvlife.lifecycle.input_files import read_limited

    try:
        return KeyLines(read_limited(path).decode("utf-8"))
    except (OSError, UnicodeDecodeError):
        return None


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
        known = tuple(k for k in config_keys(cls) if k != "tiers")
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
    budget = policies.get("hook_budget_s", 5.0)
    budget_problem = HOOK_BUDGET_S.problem(budget)
    if budget_problem is not None:
        raise fail("policies.hook_budget_s", budget_problem, "policies", 0, "hook_budget_s")
    config = RunConfig(engine=engine, sim=sim, policies=tuple(stack), live=live, hook_budget_s=budget)
    chaos = chaos_problem(config)
    if chaos is not None:
        raise fail("sim.chaos", chaos, "sim", 0, "chaos")
    if check_profiles:
        from kvlife.lifecycle.drivers.physics import resolve
        from kvlife.lifecycle.profiles import ProfileError

        try:
            resolved, _ = resolve(config)
        except ProfileError as exc:
            if exc.path and exc.path != "-":  # a problem inside the profile file: it names itself
                raise ConfigError(None, str(exc)) from None
            field = f"sim.{PROFILE_ERROR_KEYS.get(exc.field, exc.field)}"
            if is_fit_error(exc.field, exc.message):
                field = next((f for f in FIT_FIELDS if _is_set(data, f)), field)
            raise fail(field, exc.message, *_split_field(field)) from None
        too_big = size_problem(resolved)
        if too_big is not None:
            field, message = too_big
            if field == "engine.device_blocks" and is_derived(engine):
                message += " (engine.device_blocks is derived from sim.model and sim.hardware; set it)"
            raise fail(field, message, *_split_field(field))
    return config


def chaos_problem(config: RunConfig) -> str | None:
    """What is wrong with a chaos run of ``config``: it drops rank reports, which only a
    transfer deadline recovers (``kvlife.lifecycle.drivers.chaos.check_config``)."""
    if config.sim.chaos is None:
        return None
    from kvlife.lifecycle.drivers.chaos import ChaosError, check_config

    try:
        check_config(config.engine.transfer_deadline_ms)
    except ChaosError as exc:
        return str(exc)
    return None


def is_fit_error(field: str, message: str) -> bool:
    """A profile error saying the model leaves no room for one KV block on the device: its
    cause may be any of ``FIT_FIELDS``."""
    return field == "tp" and "does not fit" in message


def _is_set(data: dict[str, Any], field: str) -> bool:
    table, _, key = field.partition(".")
    values = data.get(table)
    return isinstance(values, dict) and key in values


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


def read_toml(path: str | Path, what: str) -> tuple[dict[str, Any], str]:
    """A TOML file's table and its text (for ``KeyLines``); a ConfigError naming the file on
    anything unreadable: ``cannot read WHAT: ...``, a syntax error with its line and column,
    an integer too long to convert with its line."""
    from kvlife.lifecycle.input_files import read_limited

    p = Path(path)
    try:
        text = read_limited(p).decode("utf-8")
    except OSError as exc:
        raise ConfigError(None, f"cannot read {what}: {exc.strerror or exc}", str(p)) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(None, f"cannot read {what}: not UTF-8 text (byte {exc.start})", str(p)) from None
    try:
        return tomllib.loads(text), text
    except tomllib.TOMLDecodeError as exc:
        raise toml_syntax_error(str(p), text, exc) from None
    except RecursionError:  # arrays or tables nested thousands deep (tomllib recurses)
        raise ConfigError(None, "TOML syntax error: arrays or tables nested too deeply", str(p)) from None
    except ValueError:  # tomllib's int() of an integer of more than 4300 digits
        raise huge_integer_error(str(p), text) from None


def given_keys(path: str | Path) -> frozenset[str]:
    """The keys a config file sets, dotted (``engine.max_running``, ``sim.seed``), and
    ``tiers`` when it has ``[[tiers]]`` tables: what a run's own defaults must not override
    (``kvlife.lifecycle.drivers.live.live_defaults``)."""
    data, _ = read_toml(path, "config")
    keys = {f"{section}.{key}" for section, values in data.items() if isinstance(values, dict) for key in values}
    if "tiers" in data:
        keys.add("tiers")
    return frozenset(keys)


def load_config(path: str | Path) -> RunConfig:
    data, text = read_toml(path, "config")
    return config_from_dict(data, str(Path(path)), text)


def huge_integer_line(text: str) -> int | None:
    """The line of a TOML text with an integer of more digits than Python's int() converts
    (4300, ``sys.get_int_max_str_digits``): tomllib raises a plain ValueError for it."""
    for number, row in enumerate(text.splitlines(), 1):
        if re.search(r"\d{4300}", row.replace("_", "")):
            return number
    return None


def huge_integer_error(path: str, text: str) -> ConfigError:
    """The key whose integer has more digits than Python converts: file, line, field."""
    number = huge_integer_line(text)
    keys = [f"{table}.{key}".lstrip(".") for (table, _, key), at in KeyLines(text).keys.items() if at == number]
    return ConfigError(keys[0] if keys else None, "an integer of more than 4300 digits", path, number)


def key_line(path: str | Path, key: str) -> int | None:
    """The line of a config file where ``key`` is set: "section.key" (``policies.stack``)
    or a bare key in any table; None when it cannot be found."""
    lines = _key_lines(path)
    if lines is None:
        return None
    table, _, name = key.rpartition(".")
    if table:
        return lines.line(table, 0, name)
    matches = [line for (_t, _o, k), line in lines.keys.items() if k == key]
    return min(matches) if matches else None
