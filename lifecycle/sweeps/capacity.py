"""Effective request capacity: the highest arrival rate at which a stack still meets an SLO.

A run at arrival-rate scale ``s`` (``sim.time_scale``, ``--time-scale``: arrivals ``s`` times
as fast as recorded) *meets* the target when

- every latency objective of the SLO holds (``--slo ttft_p90=2000ms,tpot_p90=100ms``: the
  90th percentile TTFT at most 2 s, the 90th percentile TPOT at most 100 ms; any percentile
  of ``ttft`` or ``tpot``), an objective without samples (no request produced a second token,
  so no TPOT) being vacuous;
- the queue does not grow (the stability rule of ``fidelity.stability`` without its p50
  limit): the last arrival decile's mean TTFT is within ``ratio`` (1.5) times the first
  decile's, or at most ``slack_ms`` (100 ms) above it. A request without a first token makes
  a decile unbounded: the run does not meet it;
- no request is stranded.

``Search`` finds the highest scale that meets it, assuming that meeting it is monotone in load
(a faster arrival rate never makes latencies shorter): it gallops by factors of 2 from
``start`` until one scale meets and another fails, then bisects geometrically until the
highest meeting scale ``low`` and the lowest failing one ``high`` are within ``precision``:
``high <= low x (1 + precision)``. The threshold lies in [low, high). When every scale up to
``max_scale`` meets, the capacity is reported as at least ``max_scale``; when ``min_scale``
already fails, as below it. Runs are deterministic, so a search is too.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from kvlife.lifecycle.cli.output import columns
from kvlife.lifecycle.sweeps.executors import Executor
from kvlife.lifecycle.sweeps.points import Percentile, Point, percentile_column, stack_text

METRICS = ("ttft", "tpot")
# (re.ASCII: \d would match any Unicode digit, and float() would read "٣" as 3.)
_OBJECTIVE = re.compile(r"(?P<metric>[a-z][a-z0-9]*)_p(?P<q>\d+(?:\.\d+)?)", re.ASCII)
_VALUE = re.compile(r"(?P<number>\d+(?:\.\d+)?(?:e[+-]?\d+)?)\s*(?P<unit>ms|s)", re.IGNORECASE | re.ASCII)

# Exact: the threshold is within the precision; at_least: every scale tried up to the maximum
# met the SLO; below: the minimum scale already failed.
EXACT, AT_LEAST, BELOW = "exact", "at_least", "below"


@attrs.frozen
class Objective:
    metric: str  # "ttft" or "tpot"
    q: float  # percentile, (0, 100]
    limit_ms: float

    @property
    def column(self) -> str:
        return percentile_column(self.metric, self.q)

    @property
    def name(self) -> str:
        return f"{self.metric}_p{self.q:g}"

    def text(self) -> str:
        return f"{self.name}={self.limit_ms:g}ms"


def parse_slo(text: str) -> tuple[Objective, ...]:
    """``ttft_p90=2000ms,tpot_p90=100ms`` -> its objectives; ValueError with a one-line
    message on anything else (a metric other than ttft or tpot, a percentile outside (0, 100],
    a value without ms or s, a metric given twice)."""
    objectives: list[Objective] = []
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or any(not p for p in parts):
        raise ValueError(f"expected METRIC_pQ=VALUE[ms|s],... (e.g. ttft_p90=2000ms,tpot_p90=100ms), got {text!r}")
    for part in parts:
        name, sep, value = part.partition("=")
        match = _OBJECTIVE.fullmatch(name.strip())
        if not sep or match is None:
            raise ValueError(f"{part!r}: expected METRIC_pQ=VALUE with METRIC one of {', '.join(METRICS)} "
                             "(e.g. ttft_p90=2000ms)")
        metric, q = match["metric"], float(match["q"])
        if metric not in METRICS:
            raise ValueError(f"{part!r}: unknown metric {metric!r}; expected one of {', '.join(METRICS)}")
        if not 0 < q <= 100:
            raise ValueError(f"{part!r}: percentile must be in (0, 100], got {q:g}")
        amount = _VALUE.fullmatch(value.strip())
        if amount is None:
            raise ValueError(f"{part!r}: expected a duration with its unit, e.g. 2000ms or 2s")
        limit = float(amount["number"]) * (1000.0 if amount["unit"].lower() == "s" else 1.0)
        if not math.isfinite(limit) or limit <= 0:
            raise ValueError(f"{part!r}: the limit must be a positive finite duration")
        objective = Objective(metric, q, limit)
        if any(o.name == objective.name for o in objectives):
            raise ValueError(f"{objective.name} given twice")
        objectives.append(objective)
    return tuple(objectives)


GOODPUT_METRICS = ("ttft", "tpot", "e2e")


def parse_goodput(text: str) -> dict[str, float]:
    """``ttft=2s,tpot=100ms,e2e=30s`` -> the per-request limits in ms by metric (the SLO a
    request must meet to count towards goodput); ValueError with a one-line message on
    anything else."""
    limits: dict[str, float] = {}
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or any(not p for p in parts):
        raise ValueError(f"expected METRIC=VALUE[ms|s],... with METRIC one of {', '.join(GOODPUT_METRICS)} "
                         f"(e.g. ttft=2s,tpot=100ms), got {text!r}")
    for part in parts:
        name, sep, value = part.partition("=")
        metric = name.strip()
        if not sep or metric not in GOODPUT_METRICS:
            raise ValueError(f"{part!r}: expected METRIC=VALUE with METRIC one of {', '.join(GOODPUT_METRICS)}")
        amount = _VALUE.fullmatch(value.strip())
        if amount is None:
            raise ValueError(f"{part!r}: expected a duration with its unit, e.g. 2000ms or 2s")
        limit = float(amount["number"]) * (1000.0 if amount["unit"].lower() == "s" else 1.0)
        if not math.isfinite(limit) or limit <= 0:
            raise ValueError(f"{part!r}: the limit must be a positive finite duration")
        if metric in limits:
            raise ValueError(f"{metric} given twice")
        limits[metric] = limit
    return limits


@attrs.frozen
class Target:
    """What a run must meet: the SLO, the stability rule, no stranded request."""

    objectives: tuple[Objective, ...]
    ratio: float = 1.5
    slack_ms: float = 100.0

    def extra(self) -> tuple[Percentile, ...]:
        return tuple((o.metric, o.q) for o in self.objectives)

    def describe(self) -> str:
        slo = ", ".join(f"{o.name} <= {o.limit_ms:,g} ms" for o in self.objectives)
        return (f"{slo}; last arrival decile's mean TTFT within {self.ratio:g}x the first's "
                f"(or +{self.slack_ms:g} ms); no request stranded")

    def judge(self, scale: float, row: Mapping[str, Any]) -> Probe:
        failed: list[str] = []
        values: dict[str, float | None] = {}
        for o in self.objectives:
            value = row.get(o.column)
            values[o.name] = value
            if value is not None and value > o.limit_ms:
                failed.append(f"{o.name} {value:,.0f} ms > {o.limit_ms:,g} ms")
        first, last = row.get("first_decile_ttft_ms"), row.get("last_decile_ttft_ms")
        if first is None or last is None:
            failed.append("a decile without a first token")
        elif not (last <= first * self.ratio or last - first <= self.slack_ms):
            failed.append(f"last decile {last:,.0f} ms vs first {first:,.0f} ms (> {self.ratio:g}x)")
        if row.get("stranded"):
            failed.append(f"{row['stranded']} stranded")
        return Probe(scale, values, first, last, row.get("stranded", 0), tuple(failed), row.get("key", ""))


@attrs.frozen
class Probe:
    """One run of a search and its verdict."""

    scale: float
    values: dict[str, float | None]  # objective name -> its value (ms)
    first_decile_ms: float | None
    last_decile_ms: float | None
    stranded: int
    failed: tuple[str, ...]  # what it missed, one phrase each; empty: it meets the target
    key: str

    @property
    def meets(self) -> bool:
        return not self.failed

    def to_dict(self) -> dict[str, Any]:
        return {"time_scale": self.scale, "meets": self.meets, **self.values,
                "first_decile_ttft_ms": self.first_decile_ms, "last_decile_ttft_ms": self.last_decile_ms,
                "stranded": self.stranded, "failed": list(self.failed), "key": self.key}


def _round(scale: float) -> float:
    """Scales tried are rounded to 6 significant digits (reproducible, readable)."""
    return float(f"{scale:.6g}")


class Search:
    """The highest scale that meets a target, for one stack (see the module docstring)."""

    def __init__(self, start: float = 1.0, min_scale: float = 1 / 64, max_scale: float = 64.0,
                 precision: float = 0.05) -> None:
        self.start = _round(min(max(start, min_scale), max_scale))
        self.min_scale = min_scale
        self.max_scale = max_scale
        self.precision = precision
        self.low: float | None = None  # highest scale known to meet
        self.high: float | None = None  # lowest scale known to fail
        self.probes: list[Probe] = []

    def next_scale(self) -> float | None:
        """The next scale to try, None when the search is over."""
        low, high = self.low, self.high
        if low is None and high is None:
            return self.start
        if high is None:
            assert low is not None
            return None if low >= self.max_scale else _round(min(low * 2, self.max_scale))
        if low is None:
            return None if high <= self.min_scale else _round(max(high / 2, self.min_scale))
        if high <= low * (1 + self.precision):
            return None
        middle = _round(math.sqrt(low * high))
        return middle if low < middle < high else None

    def record(self, probe: Probe) -> None:
        self.probes.append(probe)
        if probe.meets:
            self.low = probe.scale if self.low is None else max(self.low, probe.scale)
        else:
            self.high = probe.scale if self.high is None else min(self.high, probe.scale)

    @property
    def kind(self) -> str:
        if self.low is None:
            return BELOW
        return AT_LEAST if self.high is None else EXACT


@attrs.frozen
class Capacity:
    stack: str
    kind: str  # EXACT, AT_LEAST, BELOW
    scale: float | None  # the highest scale that met the target (None: BELOW)
    low: float | None
    high: float | None  # the lowest that failed (None: AT_LEAST)
    precision: float
    base_rate: float | None  # the workload's requests/s at scale 1
    probes: tuple[Probe, ...]

    @property
    def requests_per_s(self) -> float | None:
        """The capacity in requests/s (BELOW: the bound it is under)."""
        scale = self.high if self.kind == BELOW else self.scale
        return scale * self.base_rate if scale is not None and self.base_rate else None

    def to_dict(self) -> dict[str, Any]:
        return {"stack": self.stack, "kind": self.kind, "time_scale": self.scale, "low": self.low, "high": self.high,
                "requests_per_s": self.requests_per_s, "runs": len(self.probes),
                "probes": [p.to_dict() for p in sorted(self.probes, key=lambda p: p.scale)]}

    def text(self) -> str:
        """``0.2856``, ``>= 64`` or ``< 0.015625``."""
        if self.kind == BELOW:
            return f"< {self.high:.4g}"
        prefix = ">= " if self.kind == AT_LEAST else ""
        return f"{prefix}{self.scale:.4g}"


def relative(capacity: Capacity, reference: Capacity) -> tuple[float | None, str | None]:
    """``capacity`` over ``reference``: (value, kind) with kind "exact", "at_least", "at_most",
    "below" (the value is an upper bound it is under) or (None, None) when the bounds say nothing."""
    if reference.kind == EXACT and reference.scale:
        if capacity.kind == EXACT and capacity.scale is not None:
            return capacity.scale / reference.scale, EXACT
        if capacity.kind == AT_LEAST and capacity.scale is not None:
            return capacity.scale / reference.scale, AT_LEAST
        if capacity.kind == BELOW and capacity.high is not None:
            return capacity.high / reference.scale, BELOW
    if reference.kind == AT_LEAST and reference.scale and capacity.kind == EXACT and capacity.scale is not None:
        return capacity.scale / reference.scale, "at_most"
    if capacity is reference:
        return 1.0, EXACT
    return None, None


def relative_text(value: float | None, kind: str | None) -> str:
    if value is None:
        return "-"
    prefix = {EXACT: "", AT_LEAST: ">= ", "at_most": "<= ", BELOW: "< "}.get(kind or "", "")
    return f"{prefix}{value:.2f}x"


ProbeHook = Callable[[int, Probe], None]


def search_capacity(points: Sequence[Point], target: Target, executor: Executor, *, start: float = 1.0,
                    min_scale: float = 1 / 64, max_scale: float = 64.0, precision: float = 0.05,
                    base_rate: float | None = None, on_probe: ProbeHook | None = None) -> list[Capacity]:
    """One search per point (each a stack over the same workload; the point's time scale is
    replaced by the scales tried), run together on ``executor``: each search has at most one
    run in flight. ``base_rate``: the workload's requests/s at scale 1."""
    searches = [Search(start, min_scale, max_scale, precision) for _ in points]
    in_flight: dict[int, tuple[int, float]] = {}  # tag -> (search, scale)
    busy: set[int] = set()
    tags = 0
    extra = target.extra()
    while True:
        for i, search in enumerate(searches):
            if i in busy:
                continue
            scale = search.next_scale()
            if scale is None:
                continue
            point = points[i]
            config = attrs.evolve(point.config, sim=attrs.evolve(point.config.sim, time_scale=scale))
            executor.submit(tags, attrs.evolve(point, config=config), extra)
            in_flight[tags] = (i, scale)
            busy.add(i)
            tags += 1
        if not in_flight:
            break
        tag, row = executor.wait()
        i, scale = in_flight.pop(tag)
        busy.discard(i)
        probe = target.judge(scale, row)
        searches[i].record(probe)
        if on_probe is not None:
            on_probe(i, probe)
    results = []
    for point, search in zip(points, searches, strict=True):
        scale = search.low
        results.append(Capacity(stack_text(point.config.policies), search.kind, scale, search.low, search.high,
                                precision, base_rate, tuple(search.probes)))
    return results


def base_rate(arrivals_ms: Sequence[float]) -> float | None:
    """Requests per second of a workload at scale 1: (n - 1) arrivals over the span from the
    first to the last (None for fewer than two requests or no span)."""
    if len(arrivals_ms) < 2:
        return None
    span = max(arrivals_ms) - min(arrivals_ms)
    return (len(arrivals_ms) - 1) / (span / 1000.0) if span > 0 else None


# ---- output ---------------------------------------------------------------------------------
def table_rows(results: Sequence[Capacity]) -> list[list[str]]:
    header = ["stack", "capacity (x recorded rate)", "requests/s", "vs first", "bracket [meets, fails)", "runs"]
    rows = [header]
    for r in results:
        rel = relative_text(*relative(r, results[0]))
        bracket = f"[{'-' if r.low is None else f'{r.low:.4g}'}, {'-' if r.high is None else f'{r.high:.4g}'})"
        prefix = {AT_LEAST: ">= ", BELOW: "< "}.get(r.kind, "")
        rps = "-" if r.requests_per_s is None else f"{prefix}{r.requests_per_s:,.3g}"
        rows.append([r.stack, r.text(), rps, rel, bracket, str(len(r.probes))])
    return rows


def format_table(results: Sequence[Capacity], markdown: bool = False) -> str:
    rows = table_rows(results)
    if markdown:
        rows[1:] = [[f"`{r[0]}`", *r[1:]] for r in rows[1:]]
    return columns(rows, markdown)
