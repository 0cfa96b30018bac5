"""Plots of sweep results (heatmaps, Pareto fronts) and of capacity searches (load-latency
curves). matplotlib (``kvlife[plot]``), Agg backend; the figures are files.

A heatmap ``x=COL,y=COL,value=COL`` puts one row per cell: when several rows fall in one cell
(another column varies too), ``--where COL=VALUE`` picks one slice, and the error names the
columns that still vary. A Pareto front ``x=COL,y=COL`` minimizes both columns; ``max:COL``
maximizes one (``x=ttft_p90_ms,y=max:throughput_tokens_per_s``); the front is the rows no
other row beats in both.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs

from kvlife.lifecycle.cli.parsing import UsageError

Row = dict[str, Any]
# The largest magnitude a plotted value may have: matplotlib takes differences of the
# values on an axis (its range, its margins), which overflow a float past about 1.8e308.
PLOTTABLE = 1e300


@attrs.frozen
class Heatmap:
    x: str
    y: str
    value: str


@attrs.frozen
class Pareto:
    x: str
    y: str
    x_max: bool = False
    y_max: bool = False
    label: str | None = None


def _pairs(text: str, flag: str, allowed: Sequence[str], required: Sequence[str]) -> dict[str, str]:
    pairs: dict[str, str] = {}
    for part in text.split(","):
        name, sep, value = part.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or not value or name not in allowed:
            raise UsageError(f"argument {flag}: expected {','.join(f'{k}=COLUMN' for k in required)}"
                             f"{''.join(f'[,{k}=COLUMN]' for k in allowed if k not in required)}, got {text!r}")
        pairs[name] = value
    missing = [k for k in required if k not in pairs]
    if missing:
        raise UsageError(f"argument {flag}: {text!r} lacks {', '.join(missing)}=COLUMN")
    return pairs


def parse_heatmap(text: str) -> Heatmap:
    p = _pairs(text, "--heatmap", ("x", "y", "value"), ("x", "y", "value"))
    return Heatmap(p["x"], p["y"], p["value"])


def parse_pareto(text: str) -> Pareto:
    p = _pairs(text, "--pareto", ("x", "y", "label"), ("x", "y"))
    x, y = p["x"], p["y"]
    return Pareto(x.removeprefix("max:"), y.removeprefix("max:"), x.startswith("max:"), y.startswith("max:"),
                  p.get("label"))


def parse_where(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise UsageError(f"argument --where: expected COLUMN=VALUE, got {text!r}")
    return name.strip(), value.strip()


def _check_column(rows: Sequence[Row], column: str, flag: str, plotted: bool = False) -> None:
    """``column`` is in the results; ``plotted``: its numbers are within ``PLOTTABLE``."""
    known = list(rows[0]) if rows else []
    if column not in known:
        close = difflib.get_close_matches(column, known, n=1, cutoff=0.6)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise UsageError(f"argument {flag}: no column {column!r} in the results{hint}")
    if plotted:
        for r in rows:
            value = _number(r.get(column))
            if value is not None and not abs(value) <= PLOTTABLE:
                raise UsageError(f"argument {flag}: {column} is {value:g} in row {r.get('key')}: too large to plot "
                                 f"(at most {PLOTTABLE:g} in magnitude)")


def _matches(value: Any, text: str) -> bool:
    if isinstance(value, bool):
        return text.lower() == str(value).lower()
    if isinstance(value, int | float):
        try:
            return float(text) == float(value)
        except ValueError:
            return False
    return str(value) == text


def select(rows: Sequence[Row], where: Sequence[tuple[str, str]]) -> list[Row]:
    for column, _ in where:
        _check_column(rows, column, "--where")
    kept = [r for r in rows if all(_matches(r.get(c), v) for c, v in where)]
    if not kept:
        raise UsageError("argument --where: no row matches " + ", ".join(f"{c}={v}" for c, v in where))
    return kept


def _order(values: Sequence[Any]) -> list[Any]:
    distinct = list(dict.fromkeys(values))
    if all(isinstance(v, int | float) and not isinstance(v, bool) for v in distinct):
        return sorted(distinct)
    return distinct


def heatmap_cells(rows: Sequence[Row], spec: Heatmap) -> tuple[list[Any], list[Any], list[list[float | None]]]:
    """(x values, y values, grid[y][x] of the value column); UsageError when a cell has two rows."""
    for column, name in ((spec.x, "x"), (spec.y, "y"), (spec.value, "value")):
        _check_column(rows, column, f"--heatmap {name}", plotted=name == "value")
    xs, ys = _order([r[spec.x] for r in rows]), _order([r[spec.y] for r in rows])
    cells: dict[tuple[Any, Any], Row] = {}
    for r in rows:
        cell = (r[spec.x], r[spec.y])
        if cell in cells:
            other = cells[cell]
            varying = [c for c in r if c not in ("key", spec.x, spec.y, spec.value)
                       and c.partition(".")[0] in ("workload", "limit", "engine", "tiers", "sim", "policies")
                       and r[c] != other[c]]
            raise UsageError(f"argument --heatmap: several rows for {spec.x}={cell[0]}, {spec.y}={cell[1]} "
                             f"(they differ in {', '.join(varying) or 'nothing but their key'}); pick one with "
                             f"--where COLUMN=VALUE")
        cells[cell] = r
    grid = [[_number(cells[(x, y)][spec.value]) if (x, y) in cells else None for x in xs] for y in ys]
    return xs, ys, grid


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int) and abs(value) > PLOTTABLE:
        return math.inf  # (float() of a larger int may overflow)
    return float(value) if isinstance(value, int | float) else None


def pareto_front(rows: Sequence[Row], spec: Pareto) -> list[Row]:
    """The rows no other row beats: at least as good in both columns, better in one (rows
    without both values are left out). Sorted by x."""
    for column, name in ((spec.x, "x"), (spec.y, "y")):
        _check_column(rows, column, f"--pareto {name}", plotted=True)

    def score(r: Row) -> tuple[float, float] | None:
        x, y = _number(r.get(spec.x)), _number(r.get(spec.y))
        if x is None or y is None:
            return None
        return (-x if spec.x_max else x, -y if spec.y_max else y)

    scored = [(s, r) for r in rows if (s := score(r)) is not None]
    front = [r for s, r in scored
             if not any(o[0] <= s[0] and o[1] <= s[1] and (o[0] < s[0] or o[1] < s[1]) for o, _ in scored)]
    return sorted(front, key=lambda r: (float(r[spec.x]), float(r[spec.y])))


def _label(value: Any) -> str:
    from kvlife.lifecycle.traces.plot import readable

    if isinstance(value, float):
        return readable(value)
    return str(value)


def _names(rows: Sequence[Row], column: str) -> dict[Any, str]:
    """How the values of ``column`` are shown: a stack (``policies.stack``) by its policies'
    names (the row's ``policies`` column, which a sweep row records), not by its specs."""
    if column != "policies.stack":
        return {}
    from kvlife.lifecycle.traces.plot import stack_names

    return {r[column]: str(r.get("policies") or stack_names(str(r[column]).split(","), allow_code=False))
            for r in rows}


def _wrapped(text: str, width: int = 40) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(text, width, break_on_hyphens=False)) or text


def figure_of(rows: Sequence[Row], heatmaps: Sequence[Heatmap], paretos: Sequence[Pareto]) -> Any:
    """One figure, a panel per heatmap and Pareto front (laid out to hold long labels)."""
    from kvlife.lifecycle.traces.plot import figure, outside_legend, plain_axes, readable

    panels = len(heatmaps) + len(paretos)
    fig, axes = figure(panels, rows=1, width=6.4, height=4.8)
    for ax, spec in zip(axes[0], heatmaps, strict=False):
        xs, ys, grid = heatmap_cells(rows, spec)
        xnames, ynames = _names(rows, spec.x), _names(rows, spec.y)
        data = [[math.nan if v is None else v for v in line] for line in grid]
        image = ax.imshow(data, origin="lower", aspect="auto", cmap="viridis")
        ax.set_xticks(range(len(xs)), [_wrapped(xnames.get(x, _label(x)), 24) for x in xs], rotation=30,
                      ha="right")
        ax.set_yticks(range(len(ys)), [_wrapped(ynames.get(y, _label(y))) for y in ys])
        for j, line in enumerate(grid):
            for i, v in enumerate(line):
                if v is not None:
                    ax.text(i, j, readable(v), ha="center", va="center", color="white", fontsize=8)
        ax.set_xlabel(spec.x)
        ax.set_ylabel(spec.y)
        ax.set_title(spec.value)
        colorbar = fig.colorbar(image, ax=ax)
        colorbar.formatter = _formatter()
        colorbar.update_ticks()
    for ax, pspec in zip(axes[0][len(heatmaps):], paretos, strict=False):
        front = pareto_front(rows, pspec)
        points = [(_number(r.get(pspec.x)), _number(r.get(pspec.y))) for r in rows]
        ax.scatter([p[0] for p in points if None not in p], [p[1] for p in points if None not in p],
                   color="0.6", s=18, label="runs")
        ax.plot([float(r[pspec.x]) for r in front], [float(r[pspec.y]) for r in front], "o-", color="C3",
                label="Pareto front")
        if pspec.label is not None:
            # Numbers beside the points, the names in the legend: labels never overlap.
            names = _names(rows, pspec.label)
            for n, r in enumerate(front, 1):
                ax.annotate(str(n), (float(r[pspec.x]), float(r[pspec.y])), fontsize=7, xytext=(4, 4),
                            textcoords="offset points")
                ax.plot([], [], " ", label=f"{n}: {names.get(r.get(pspec.label), _label(r.get(pspec.label)))}")
        ax.set_xlabel(f"{pspec.x} ({'higher' if pspec.x_max else 'lower'} is better)")
        ax.set_ylabel(f"{pspec.y} ({'higher' if pspec.y_max else 'lower'} is better)")
        plain_axes(ax)
        outside_legend(ax)
    return fig


def _formatter() -> Any:
    from matplotlib.ticker import FuncFormatter

    from kvlife.lifecycle.traces.plot import readable

    return FuncFormatter(lambda value, _: readable(value))


def draw(rows: Sequence[Row], heatmaps: Sequence[Heatmap], paretos: Sequence[Pareto], out: str | Path,
         inputs: Iterable[str | Path | None] = ()) -> None:
    """``figure_of`` written to ``out`` (``inputs``: the results file, which ``out`` may not be)."""
    from kvlife.lifecycle.traces.plot import save

    save(figure_of(rows, heatmaps, paretos), out, inputs)


def capacity_figure(results: Sequence[Any], objectives: Sequence[Any]) -> Any:
    """Load-latency curves of capacity searches: a panel per SLO objective, the value at each
    scale tried per stack (o: the run met the whole target; x: it did not), the SLO line,
    and a dotted line at each stack's capacity; the legend outside, says which is which."""
    from matplotlib.lines import Line2D

    from kvlife.lifecycle.traces.plot import figure, outside_legend, plain_axes, stack_names

    fig, axes = figure(len(objectives), rows=1, width=6.4, height=4.8)
    for ax, objective in zip(axes[0], objectives, strict=True):
        for n, result in enumerate(results):
            probes = sorted(result.probes, key=lambda p: p.scale)
            shown = [(p.scale, p.values[objective.name], p.meets) for p in probes
                     if p.values.get(objective.name) is not None]
            color = f"C{n % 10}"
            ax.plot([s for s, _, _ in shown], [v for _, v, _ in shown], "-", color=color,
                    label=stack_names(str(result.stack).split(",")))
            ax.scatter([s for s, _, ok in shown if ok], [v for _, v, ok in shown if ok], marker="o", color=color)
            ax.scatter([s for s, _, ok in shown if not ok], [v for _, v, ok in shown if not ok], marker="x",
                       color=color)
            if result.scale is not None:
                ax.axvline(result.scale, color=color, linestyle=":", linewidth=1)
        ax.axhline(objective.limit_ms, color="k", linestyle="--", linewidth=1, label=f"SLO {objective.text()}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        plain_axes(ax)
        ax.tick_params(axis="x", labelrotation=45, labelsize=7)
        ax.tick_params(axis="y", labelsize=7)
        ax.set_xlabel("arrival rate (x recorded)")
        ax.set_ylabel(f"{objective.name} (ms)")
        handles, labels = ax.get_legend_handles_labels()
        handles += [Line2D([], [], marker="o", linestyle="", color="0.3"),
                    Line2D([], [], marker="x", linestyle="", color="0.3"),
                    Line2D([], [], linestyle=":", color="0.3")]
        labels += ["met the target", "missed it", "capacity"]
        outside_legend(ax, handles=handles, labels=labels)
    return fig


def draw_capacity(results: Sequence[Any], objectives: Sequence[Any], out: str | Path,
                  inputs: Iterable[str | Path | None] = ()) -> None:
    """``capacity_figure`` written to ``out`` (``inputs``: the files the searches read)."""
    from kvlife.lifecycle.traces.plot import save

    save(capacity_figure(results, objectives), out, inputs)
