"""Plots of runs (matplotlib, Agg backend): a trace's requests by state over time, its TTFT
CDF and prefix hit rates per tier, one or several traces overlaid (``kvlife plot``); and
the TTFT and TPOT CDFs of several stacks (``kvlife compare --plot``).

TTFT and hit rates are not trace records: they come from an exact replay of the trace
(the engine's request records), so a trace that does not replay gets the state panel
only, with a note in the other two.

Every figure is laid out to hold its labels, however long (``fit``): matplotlib's
constrained layout, legends outside the axes, and a figure that grows until its tight
bounding box lies inside it. Runs are labelled by their policies' names (``stack_names``),
not by the specs that loaded them; numbers on axes are plain (``readable``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvlife.lifecycle.output_files import atomic_output
from kvlife.lifecycle.traces.export import read_timeline
from kvlife.lifecycle.traces.trace import TraceError
from kvlife.specs.lifecycle import STATES

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from kvlife.lifecycle.breakdown import RequestRow


def state_counts(segments: dict[str, list[Any]]) -> tuple[list[float], dict[str, list[int]]]:
    """Step function: at each transition time, how many requests are in each state."""
    deltas: list[tuple[float, str, int]] = []
    for segs in segments.values():
        for seg in segs:
            deltas.append((seg.start, seg.state, +1))
            if seg.end is not None:
                deltas.append((seg.end, seg.state, -1))
    deltas.sort(key=lambda d: (d[0], d[2]))
    times: list[float] = []
    counts: dict[str, list[int]] = {s: [] for s in STATES}
    current = dict.fromkeys(STATES, 0)
    for i, (t, state, delta) in enumerate(deltas):
        current[state] = current.get(state, 0) + delta
        if i + 1 < len(deltas) and deltas[i + 1][0] == t:
            continue
        times.append(t / 1000.0)
        for s in STATES:
            counts[s].append(current.get(s, 0))
    return times, counts


def image_format(out: str | Path) -> str:
    """The image format ``out``'s extension names, checked against what matplotlib writes
    before any work is done: a TraceError naming the extension and the supported ones."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise TraceError(str(out), None, "writing images needs matplotlib: pip install 'kvlife[plot]'") from None
    supported = sorted(FigureCanvasBase.get_supported_filetypes())
    suffix = Path(out).suffix
    fmt = suffix[1:].lower()
    if fmt not in supported:
        what = f"unsupported image extension '{suffix}'" if suffix else "no image extension"
        raise TraceError(str(out), None, f"{what}; supported: {', '.join('.' + s for s in supported)}")
    return fmt


def check_image(out: str | Path, inputs: Iterable[str | Path | None] = ()) -> str:
    """Before any work: the image format of ``out`` (``image_format``), and ``out`` is not
    one of the command's ``inputs`` (``kvlife.lifecycle.output_files.check_output``)."""
    from kvlife.lifecycle.output_files import check_output

    fmt = image_format(out)
    check_output(out, inputs)
    return fmt


# ---- layout and labels shared by every figure ------------------------------------------------
def readable(value: float) -> str:
    """A tick or cell value in plain digits: ``12,500``, ``250``, ``12.5``, ``0.26`` (never
    ``1e+04`` beside ``2,000``)."""
    if not math.isfinite(value):
        return str(value)
    a = abs(value)
    if a == 0:
        return "0"
    if a >= 1000:
        return f"{value:,.0f}"
    if a >= 1:
        return f"{value:.4g}"
    if a >= 1e-3:
        return f"{value:.3g}"
    return f"{value:.2e}"


def plain_axes(ax: Any, x: bool = True, y: bool = True) -> None:
    """Major ticks in ``readable`` numbers, on a log axis at 1, 2 and 5 times each power of
    ten; minor tick labels off (a log axis would otherwise mix ``2x10^2`` with plain digits)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    formatter = FuncFormatter(lambda value, _: readable(value))
    for on, axis, scale in ((x, ax.xaxis, ax.get_xscale()), (y, ax.yaxis, ax.get_yscale())):
        if on:
            if scale == "log":
                axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            axis.set_major_formatter(formatter)
            axis.set_minor_formatter(NullFormatter())


def figure(panels: int, width: float = 7.0, height: float = 3.6, rows: int | None = None) -> tuple[Figure, Any]:
    """A figure of ``panels`` axes (one column, or ``rows`` x panels/rows) under constrained
    layout, which makes room for tick labels, titles, colour bars and outside legends."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nrows = rows if rows is not None else panels
    ncols = -(-panels // nrows)
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False,
                             layout="constrained")
    return fig, axes


def outside_legend(ax: Any, **kwargs: Any) -> Any:
    """The axes' legend to the right of it, outside the data."""
    return ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, fontsize=8, **kwargs)


def overflow(fig: Figure) -> tuple[float, float]:
    """How far (inches, horizontally and vertically) the figure's tight bounding box (every
    label, title, legend and colour bar) reaches past the figure's edges; (0, 0) when all
    of it is inside."""
    fig.canvas.draw()
    tight = fig.get_tightbbox(fig.canvas.get_renderer())  # type: ignore[attr-defined]  # (Agg)
    whole = fig.bbox_inches
    dx = max(0.0, whole.x0 - tight.x0) + max(0.0, tight.x1 - whole.x1)
    dy = max(0.0, whole.y0 - tight.y0) + max(0.0, tight.y1 - whole.y1)
    return dx, dy


def fit(fig: Figure, tries: int = 6) -> None:
    """Grow the figure until everything drawn lies inside it (``overflow``), and until its
    axes keep a usable share of it (constrained layout shrinks them to make room for long
    labels: a heatmap must not collapse to a sliver)."""
    for _ in range(tries):
        dx, dy = overflow(fig)
        width, height = fig.get_size_inches()
        small = [ax for ax in fig.axes if ax.get_label() != "<colorbar>"
                 and (ax.get_position().width * width < 2.5 or ax.get_position().height * height < 1.6)]
        if dx <= 0.0 and dy <= 0.0 and not small:
            return
        grow_w = dx + 0.2 + (2.0 if any(ax.get_position().width * width < 2.5 for ax in small) else 0.0)
        grow_h = dy + 0.2 + (1.2 if any(ax.get_position().height * height < 1.6 for ax in small) else 0.0)
        fig.set_size_inches(width + (grow_w if dx > 0.0 or grow_w > 2 else 0.0),
                            height + (grow_h if dy > 0.0 or grow_h > 1.2 else 0.0))


def save(fig: Figure, out: str | Path, inputs: Iterable[str | Path | None] = ()) -> None:
    """Fit, write and close ``fig``, in the format ``out``'s extension names, through a
    temporary file renamed over it (``kvlife.lifecycle.output_files``): a failed drawing
    leaves what was there. A file that cannot be written, or a value matplotlib cannot lay
    out (an axis range past a float's), is one line naming the image (a TraceError)."""
    import matplotlib.pyplot as plt

    try:
        fmt = check_image(out, inputs)
        fit(fig)
        with atomic_output(out, inputs) as temp:
            fig.savefig(temp, format=fmt)
    except OSError as exc:
        raise TraceError(str(out), None, f"cannot write: {exc.strerror or exc}") from None
    except (ValueError, OverflowError) as exc:
        raise TraceError(str(out), None, f"cannot draw: {' '.join(str(exc).split())}") from None
    finally:
        plt.close(fig)


def stack_names(specs: Sequence[str], *, allow_code: bool = True) -> str:
    """A stack as its policies name themselves (``long-prompts-async,shared-loads``), not as
    the specs that load them (``my_policies.py:LongPromptsAsync``): the policy's ``name``.
    Without ``allow_code`` (a trace's header), a spec that is code is shown by its class name."""
    from kvlife.policies.loading import is_builtin, load_stack

    if allow_code:
        try:
            return ",".join(load_stack(specs).names[:-1]) or "baseline"
        except Exception:  # noqa: BLE001 - a label only: fall back to the specs' own words
            pass
    names = [spec if is_builtin(spec) else spec.rpartition(":")[2] or spec for spec in specs]
    return ",".join(n for n in names if n != "baseline") or "baseline"


# ---- kvlife plot: one or several traces ------------------------------------------------------
def _run_label(path: Path, header: Mapping[str, Any], others: Sequence[Path]) -> str:
    policies = header.get("policies")
    specs = [p for p in policies if isinstance(p, str)] if isinstance(policies, list) else []
    label = stack_names([s for s in specs if s != "baseline"], allow_code=False)
    return f"{label} ({path.name})" if len(others) > 1 else label


def plot(traces: str | Path | Sequence[str | Path], out: str | Path, *, allow_code: bool = False,
         stack: Sequence[str] | None = None) -> None:
    """``trace_figure`` written to ``out`` (its format checked first, and that it is none of
    the traces)."""
    inputs = (traces,) if isinstance(traces, str | Path) else tuple(traces)
    check_image(out, inputs)
    save(trace_figure(traces, allow_code=allow_code, stack=stack), out, inputs)


def trace_figure(traces: str | Path | Sequence[str | Path], *, allow_code: bool = False,
                 stack: Sequence[str] | None = None) -> Figure:
    """Requests waiting and running over time, the TTFT CDF and the prefix hit rate per tier
    of each trace, overlaid (one colour per trace). ``allow_code``/``stack``: how the replay
    behind the TTFT and hit-rate panels may load policies
    (``kvlife.lifecycle.traces.replay.replay``)."""
    from kvlife.lifecycle.traces.replay import replay

    paths = [Path(traces)] if isinstance(traces, (str, Path)) else [Path(t) for t in traces]
    runs = []
    for path in paths:
        timeline = read_timeline(path)
        result = replay(path, allow_code=allow_code, stack=stack)
        runs.append((path, timeline, result))
    fig, axes = figure(3)
    ax_state, ax_ttft, ax_hits = axes[0][0], axes[1][0], axes[2][0]
    tiers: list[str] = []
    rates: list[tuple[str, dict[str, float]]] = []
    replayed = False
    for n, (path, timeline, result) in enumerate(runs):
        color = f"C{n % 10}"
        label = _run_label(path, timeline.header, paths)
        times, counts = state_counts(timeline.segments)
        queued = [sum(counts[s][i] for s in ("waiting", "lookup_pending", "loading")) for i in range(len(times))]
        ax_state.step(times, counts["running"], where="post", color=color, label=f"{label}: running")
        ax_state.step(times, queued, where="post", color=color, linestyle="--", label=f"{label}: waiting")
        if not result.identical:
            continue
        replayed = True
        requests = list(result.engine.requests.values())
        ttft = sorted(r.first_token_ms - r.arrival_ms for r in requests if r.first_token_ms is not None)
        if ttft:
            ax_ttft.plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], color=color, label=label)
        candidates = sum(max(0, (r.prompt_tokens - 1) // r.block_tokens) for r in requests)
        hits = {"device": sum(r.device_hit_blocks for r in requests)}
        for name in result.engine.tiers:
            hits[name] = sum(r.tier_hit_blocks.get(name, 0) for r in requests)
        tiers += [t for t in hits if t not in tiers]
        rates.append((label, {t: hits[t] / candidates if candidates else 0.0 for t in hits}))
    ax_state.set_xlabel("time (s)")
    ax_state.set_ylabel("requests")
    ax_state.set_title("requests running (solid) and waiting (dashed)")
    outside_legend(ax_state)
    plain_axes(ax_state)
    if not replayed:
        for ax in (ax_ttft, ax_hits):
            ax.text(0.5, 0.5, "trace does not replay exactly: TTFT and hit rates unavailable",
                    ha="center", va="center", wrap=True)
            ax.set_axis_off()
        return fig
    ax_ttft.set_xscale("log")
    ax_ttft.set_xlabel("TTFT (ms)")
    ax_ttft.set_ylabel("share of requests")
    ax_ttft.set_title("TTFT CDF")
    plain_axes(ax_ttft, y=False)
    outside_legend(ax_ttft)
    _hit_bars(ax_hits, tiers, rates)
    return fig


def _hit_bars(ax: Any, tiers: Sequence[str], rates: Sequence[tuple[str, Mapping[str, float]]]) -> None:
    """Grouped bars: per tier, one bar per run, percent on the axis and on each bar."""
    from matplotlib.ticker import PercentFormatter

    width = 0.8 / max(1, len(rates))
    for n, (label, by_tier) in enumerate(rates):
        xs = [i + (n - (len(rates) - 1) / 2) * width for i in range(len(tiers))]
        values = [100.0 * by_tier.get(t, 0.0) for t in tiers]
        ax.bar(xs, values, width, color=f"C{n % 10}", label=label)
        for x, v in zip(xs, values, strict=True):
            ax.text(x, v, f"{v:.1f}%", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(tiers)), list(tiers))
    ax.yaxis.set_major_formatter(PercentFormatter(decimals=0))
    ax.set_ylim(0, max([100.0 * v for _, r in rates for v in r.values()] + [1.0]) * 1.15)
    ax.set_ylabel("prefix hit rate (of candidate blocks)")
    ax.set_title("hit rate by tier")
    outside_legend(ax)


# ---- kvlife compare --plot: latency CDFs per stack -------------------------------------------
def cdf_figure(series: Mapping[str, Sequence[RequestRow]], title: str = "") -> Figure:
    """TTFT and TPOT CDFs, one line per stack (``series``: label -> its per-request rows)."""
    fig, axes = figure(2, rows=1, width=6.0, height=4.2)
    for ax, metric, name in ((axes[0][0], "ttft_ms", "TTFT"), (axes[0][1], "tpot_ms", "TPOT")):
        drawn = False
        for n, (label, rows) in enumerate(series.items()):
            values = sorted(v for r in rows if (v := getattr(r, metric)) is not None)
            if values:
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], color=f"C{n % 10}",
                        label=label)
                drawn = True
        if drawn and min(v for rows in series.values() for r in rows
                         if (v := getattr(r, metric)) is not None) > 0:
            ax.set_xscale("log")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("share of requests")
        ax.set_title(f"{name} CDF")
        ax.grid(True, which="major", alpha=0.3)
        plain_axes(ax, y=False)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", fontsize=8, ncols=1)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


def plot_cdfs(series: Mapping[str, Sequence[RequestRow]], out: str | Path, title: str = "") -> None:
    """``cdf_figure`` written to ``out`` (its format checked first)."""
    check_image(out)
    save(cdf_figure(series, title), out)
