"""Each policy's effect at a stable operating point.

A *group* is one question (is async lookup worth it? does early prefetch help with a disk tier?)
asked on one workload and config. Its operating point is searched first (``operating_point``)
with the group's base variant: the highest arrival time scale where that run is stable
(``stability``). Then every variant of the group runs on the same slice at that scale, and each
*comparison* sets a treatment against its reference: TTFT p50 and p99, TPOT, throughput, the
group's own counters, and a verdict that says when an effect is small or goes the wrong way.

Groups (``GROUPS``):

- ``lookup``: sync (baseline) against ``async-lookup`` with 1.5, 5 and 10 ms lookups, on the
  conversation trace. The conversation groups replay it with ``sim.arrivals = "spread"``: its
  timestamps are rounded to ~3 s, so as recorded ~10 requests land in one instant at any load
  and no time scale keeps TTFT p50 under 2 s (``workloads.arrivals``).
- ``prefetch``: baseline against ``early-prefetch`` on the conversation trace with a small host
  tier in front of a large disk tier, so that hits come from disk.
- ``burst``: ``shared-loads`` and ``defer-while-loading`` against the baseline on
  ``synthetic:burst`` (concurrent requests for one prefix that the host tier holds and the
  device does not; the conversation trace has none).
- ``stores``: the baseline's safe stores against ``naive-stores-unsafe`` under async
  scheduling on the multi-turn synthetic workload, with ``kvlife validate``'s findings on each
  run's trace (invariant 5: a store covers tokens that are not computed).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from kvlife.lifecycle.config import RunConfig
from kvlife.lifecycle.drivers.runner import RunOutcome
from kvlife.lifecycle.fidelity import markdown as md
from kvlife.lifecycle.fidelity.operating_point import OperatingPoint, find_operating_point
from kvlife.lifecycle.fidelity.runs import RunFigures, load, simulate, with_engine, with_tiers

SMALL = 0.05  # a change under 5 % is called small


@attrs.frozen
class Variant:
    label: str
    stack: tuple[str, ...] = ()
    engine: tuple[tuple[str, Any], ...] = ()  # engine config keys over the group's

    @property
    def stack_text(self) -> str:
        return ",".join(self.stack) or "baseline"


@attrs.frozen
class Comparison:
    reference: Variant
    treatment: Variant
    expect: str | None = None  # "lower": the policy is meant to lower TTFT; None: no latency claim


@attrs.frozen
class Column:
    header: str
    value: Callable[[RunFigures], str]


@attrs.frozen
class Group:
    key: str
    title: str
    workload: str
    base: Variant
    comparisons: tuple[Comparison, ...]
    columns: tuple[Column, ...] = ()
    tiers: tuple[tuple[str, int], ...] = ()  # --tier name=blocks over the default config
    engine: tuple[tuple[str, Any], ...] = ()
    trace: bool = False  # run the rows with a trace, for kvlife validate
    sim: tuple[tuple[str, Any], ...] = ()  # sim config keys over the default config

    def config(self, base: RunConfig, variant: Variant) -> RunConfig:
        config = with_tiers(base, dict(self.tiers)) if self.tiers else base
        if self.sim:
            config = attrs.evolve(config, sim=attrs.evolve(config.sim, **dict(self.sim)))
        config = with_engine(config, **{**dict(self.engine), **dict(variant.engine)})
        return attrs.evolve(config, policies=variant.stack)

    def variants(self) -> list[tuple[Variant, Comparison | None]]:
        """Every variant once, in table order, with the comparison that puts it against a reference."""
        seen: list[Variant] = []
        out: list[tuple[Variant, Comparison | None]] = []
        for comparison in self.comparisons:
            for variant, against in ((comparison.reference, None), (comparison.treatment, comparison)):
                if variant not in seen:
                    seen.append(variant)
                    out.append((variant, against))
        return out


# ---- the groups ---------------------------------------------------------------------------
def _lookup_variant(latency_ms: float, asynchronous: bool) -> Variant:
    label = f"{'async' if asynchronous else 'sync'}, {latency_ms:g} ms lookups"
    return Variant(label, ("async-lookup",) if asynchronous else (), (("lookup_latency_ms", latency_ms),))


def _counter(key: str) -> Callable[[RunFigures], str]:
    def value(figures: RunFigures) -> str:
        found = figures.extras.get(key, figures.summary.get(key))
        return md.count(found) if isinstance(found, int | float) else "-"

    return value


def _lookup_seconds(figures: RunFigures) -> str:
    value = figures.summary.get("critical_path_lookup_ms")
    return f"{value / 1000:,.2f} s" if isinstance(value, int | float) else "-"


def _hits(*tiers: str) -> Callable[[RunFigures], str]:
    def value(figures: RunFigures) -> str:
        rates = figures.summary.get("prefix_hit_rate", {})
        return " / ".join(md.percent(rates.get(t, 0.0)) for t in tiers)

    return value


GROUPS: tuple[Group, ...] = (
    Group(
        "lookup", "Async against sync lookup", "mooncake-conversation",
        base=_lookup_variant(1.5, False),
        comparisons=tuple(Comparison(_lookup_variant(ms, False), _lookup_variant(ms, True), "lower")
                          for ms in (1.5, 5.0, 10.0)),
        columns=(Column("critical-path lookup", _lookup_seconds),),
        sim=(("arrivals", "spread"),),
    ),
    Group(
        "prefetch", "Early prefetch with a disk tier", "mooncake-conversation",
        base=Variant("baseline"),
        comparisons=(Comparison(Variant("baseline"), Variant("early-prefetch", ("early-prefetch",)), "lower"),),
        columns=(Column("hits host / disk", _hits("host", "disk")),
                 Column("blocks prefetched", _counter("blocks_prefetched"))),
        tiers=(("host", 2000), ("disk", 100_000)),
        sim=(("arrivals", "spread"),),
    ),
    Group(
        "burst", "Shared loads and defer-while-loading on bursts", "synthetic:burst",
        base=Variant("baseline"),
        comparisons=(Comparison(Variant("baseline"), Variant("shared-loads", ("shared-loads",)), "lower"),
                     Comparison(Variant("baseline"), Variant("defer-while-loading", ("defer-while-loading",)))),
        columns=(Column("redundant block loads", _counter("redundant_block_loads")),
                 Column("blocks loaded", _counter("blocks_loaded"))),
    ),
    Group(
        "stores", "Safe against naive stores under async scheduling", "synthetic",
        base=Variant("baseline"),
        comparisons=(Comparison(Variant("baseline"), Variant("naive-stores-unsafe", ("naive-stores-unsafe",))),),
        columns=(Column("blocks stored", _counter("blocks_stored")),
                 Column("validate findings (invariant 5)", _counter("store_findings"))),
        engine=(("async_scheduling", True),),
        trace=True,
    ),
)


def extra_figures(outcome: RunOutcome, trace: Path | None) -> Mapping[str, Any]:
    """Counters the summary lacks: prefetched blocks, and validate's findings on the trace."""
    extras: dict[str, Any] = {}
    prefetched = getattr(outcome.result.engine.stats, "blocks_prefetched", None)
    if isinstance(prefetched, int):
        extras["blocks_prefetched"] = prefetched
    if trace is not None:
        from kvlife.lifecycle.traces.validate import validate

        report = validate(trace)
        extras["validate_findings"] = len(report.findings)
        extras["store_findings"] = report.counts().get(5, 0)
    return extras


# ---- running a group ----------------------------------------------------------------------
@attrs.frozen
class Row:
    variant: Variant
    figures: RunFigures
    comparison: Comparison | None
    reference: RunFigures | None

    def change(self, key: str) -> float | None:
        if self.reference is None:
            return None
        new, old = self.figures.summary["ttft_ms"].get(key), self.reference.summary["ttft_ms"].get(key)
        if new is None or old is None or old == 0:
            return None
        return float(new) / float(old) - 1.0

    def verdict(self) -> str:
        if self.comparison is None:
            return "reference"
        p50, p99 = self.change("p50"), self.change("p99")
        if p50 is None or p99 is None:
            return "-"

        def kind(d: float) -> str:
            return "small" if abs(d) < SMALL else ("lower" if d < 0 else "higher")

        k50, k99 = kind(p50), kind(p99)
        if k50 == k99 == "small":
            word = f"small (under {SMALL * 100:g} %)"
        elif "higher" not in (k50, k99):
            word = "lower TTFT"
        elif "lower" not in (k50, k99):
            word = "higher TTFT"
        else:
            word = f"mixed (p50 {k50}, p99 {k99})"
        if self.comparison.expect == "lower" and "higher" in word:
            word += ": the expected gain reverses"
        return word


@attrs.frozen
class GroupResult:
    group: Group
    requests: int
    point: OperatingPoint
    rows: tuple[Row, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "group": self.group.key, "title": self.group.title, "workload": self.group.workload,
            "requests": self.requests, "operating_point": self.point.to_dict(),
            "tiers": dict(self.group.tiers), "engine": dict(self.group.engine), "sim": dict(self.group.sim),
            "rows": [{"variant": r.variant.label, "stack": r.variant.stack_text,
                      "engine": dict(r.variant.engine),
                      "reference": r.comparison.reference.label if r.comparison else None,
                      "ttft_p50_change": r.change("p50"), "ttft_p99_change": r.change("p99"),
                      "verdict": r.verdict(), **r.figures.to_dict()} for r in self.rows],
        }

    def render(self) -> str:
        g = self.group
        point = self.point
        tried = ", ".join(f"{s:g} {'stable' if v.stable else 'not stable'}" for s, v in point.tried)
        setup = [f"`{g.workload}`, first {self.requests:,} requests"]
        if g.tiers:
            setup.append("tiers " + ", ".join(f"{n}={b:,} blocks" for n, b in g.tiers))
        if g.engine:
            setup.append(", ".join(f"engine.{k} = {str(v).lower()}" for k, v in g.engine))
        if g.sim:
            setup.append(", ".join(f"sim.{k} = {v}" for k, v in g.sim))
        if not point.found:
            found = " No time scale tried was stable: the lowest tried is used."
        elif not point.bracketed:
            found = " The search used up its runs before narrowing to one grid step: a higher load may be stable too."
        else:
            found = ""
        caption = (f"**{g.title}.** {'; '.join(setup)}. Operating point: time scale {point.time_scale:g} "
                   f"({point.stability.describe()}; tried {tried}).{found}")
        headers = ["variant", "stack", "requests", "TTFT p50 (ms)", "TTFT p99 (ms)", "TPOT p50 (ms)",
                   "throughput (tok/s)", "p50 change", "p99 change", *(c.header for c in g.columns),
                   "last/first decile", "verdict"]
        rows = []
        for r in self.rows:
            s = r.figures.summary
            ratio = r.figures.stability.ratio
            rows.append([
                r.variant.label, f"`{r.variant.stack_text}`", f"{r.figures.requests:,}", md.ms(s["ttft_ms"]["p50"]),
                md.ms(s["ttft_ms"]["p99"]), md.ms(s["tpot_ms"]["p50"]), md.count(s["throughput_tokens_per_s"]),
                md.signed_percent(r.change("p50")), md.signed_percent(r.change("p99")),
                *(c.value(r.figures) for c in g.columns),
                "unbounded" if ratio == float("inf") else f"{ratio:.2f}x", r.verdict(),
            ])
        align = "ll" + "r" * (len(headers) - 3) + "l"
        return "\n".join([caption, "", md.table(headers, rows, align), "", *self.findings()])

    def findings(self) -> list[str]:
        """One line per comparison: the TTFT changes, the verdict, and the counters that moved."""
        lines = []
        for r in self.rows:
            if r.comparison is None or r.reference is None:
                continue
            moved = []
            for column in self.group.columns:
                before, after = column.value(r.reference), column.value(r.figures)
                if before != after:
                    moved.append(f"{column.header} {before} -> {after}")
            lines.append(f"- {r.variant.label} against {r.comparison.reference.label}: TTFT p50 "
                         f"{md.signed_percent(r.change('p50'))}, p99 {md.signed_percent(r.change('p99'))}: "
                         f"{r.verdict()}" + (f"; {', '.join(moved)}." if moved else "; no counter moved."))
        return lines


def run_group(group: Group, requests: int, base: RunConfig | None = None, max_search_runs: int = 10,
              on_run: Callable[[str], None] | None = None) -> GroupResult:
    base_config = base if base is not None else RunConfig()
    cache: dict[tuple[RunConfig, float, bool], RunFigures] = {}
    workloads: dict[float, Any] = {}

    def figures(variant: Variant, scale: float, trace: bool) -> RunFigures:
        config = group.config(base_config, variant)
        key = (config, scale, trace)
        if key not in cache:
            if on_run is not None:
                on_run(f"{group.key}: {variant.label} at time scale {scale:g}")
            if scale not in workloads:
                workloads[scale] = load(group.workload, requests, scale, config)
            cache[key] = simulate(config, workloads[scale], group.workload, extra_figures, trace)
        return cache[key]

    point = find_operating_point(lambda scale: figures(group.base, scale, False).stability,
                                 max_runs=max_search_runs)
    rows = []
    for variant, comparison in group.variants():
        reference = figures(comparison.reference, point.time_scale, group.trace) if comparison else None
        rows.append(Row(variant, figures(variant, point.time_scale, group.trace), comparison, reference))
    return GroupResult(group, len(workloads[point.time_scale]), point, tuple(rows))


def policy_effects(slices: Mapping[str, int], groups: Sequence[Group] = GROUPS, max_search_runs: int = 10,
                   on_run: Callable[[str], None] | None = None) -> list[GroupResult]:
    """Run every group on its workload's slice (``slices``: workload name -> requests)."""
    return [run_group(g, slices[g.workload], max_search_runs=max_search_runs, on_run=on_run) for g in groups]
