"""Plots of a trace (matplotlib, Agg backend): requests by state over time, the TTFT CDF,
and prefix hit rates per tier.

TTFT and hit rates are not trace records: they come from an exact replay of the trace
(the engine's request records), so a trace that does not replay gets the state panel
only, with a note in the other two.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from kvlife.lifecycle.output_files import atomic_output
from kvlife.lifecycle.traces.export import read_timeline
from kvlife.lifecycle.traces.trace import TraceError
from kvlife.specs.lifecycle import STATES


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


def save_figure(fig: Any, out: str | Path, inputs: Iterable[str | Path | None] = ()) -> None:
    """Write a matplotlib figure to ``out`` in the format its extension names, through a
    temporary file renamed over it (``kvlife.lifecycle.output_files``): a failed drawing
    leaves what was there. A value matplotlib cannot lay out (an axis range past a float's)
    is one line naming the image."""
    fmt = check_image(out, inputs)
    try:
        with atomic_output(out, inputs) as temp:
            fig.savefig(temp, format=fmt)
    except OSError as exc:
        raise TraceError(str(out), None, f"cannot write: {exc.strerror or exc}") from None
    except (ValueError, OverflowError) as exc:
        raise TraceError(str(out), None, f"cannot draw: {' '.join(str(exc).split())}") from None


def plot(trace: str | Path, out: str | Path, *, allow_code: bool = False,
         stack: Sequence[str] | None = None) -> None:
    """``allow_code``/``stack``: how the replay behind the TTFT and hit-rate panels may load
    policies (``kvlife.lifecycle.traces.replay.replay``)."""
    check_image(out, (trace,))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvlife.lifecycle.traces.replay import replay

    timeline = read_timeline(trace)
    result = replay(trace, allow_code=allow_code, stack=stack)
    fig, axes = plt.subplots(3, 1, figsize=(10, 11))
    times, counts = state_counts(timeline.segments)
    ax = axes[0]
    for state in STATES:
        if state != "finished" and any(counts[state]):
            ax.step(times, counts[state], where="post", label=state)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("requests")
    ax.set_title("requests by state")
    ax.legend(loc="upper right")
    if result.identical:
        requests = list(result.engine.requests.values())
        ttft = sorted(r.first_token_ms - r.arrival_ms for r in requests if r.first_token_ms is not None)
        ax = axes[1]
        if ttft:
            ax.plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))])
        ax.set_xscale("log" if ttft and ttft[0] > 0 else "linear")
        ax.set_xlabel("TTFT (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title("TTFT CDF")
        candidates = sum(max(0, (r.prompt_tokens - 1) // r.block_tokens) for r in requests)
        hits = {"device": sum(r.device_hit_blocks for r in requests)}
        for name in result.engine.tiers:
            hits[name] = sum(r.tier_hit_blocks.get(name, 0) for r in requests)
        ax = axes[2]
        names = list(hits)
        rates = [hits[n] / candidates if candidates else 0.0 for n in names]
        ax.bar(names, rates)
        for i, rate in enumerate(rates):
            ax.text(i, rate, f"{rate:.1%}", ha="center", va="bottom")
        ax.set_ylabel("prefix hit rate (of candidate blocks)")
        ax.set_title("hit rate by tier")
    else:
        for ax in axes[1:]:
            ax.text(0.5, 0.5, "trace does not replay exactly: TTFT and hit rates unavailable",
                    ha="center", va="center")
            ax.set_axis_off()
    fig.tight_layout()
    try:
        save_figure(fig, out, (trace,))
    finally:
        plt.close(fig)
