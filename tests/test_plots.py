"""Every plot fits its labels: rendered with 60-character policy names, the figure's tight
bounding box (every tick label, title, legend and colour bar, as matplotlib measures it)
lies inside the figure, no axes collapse to a sliver, and stacks are labelled by their
policies' names, not by the specs that load them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("matplotlib", reason="the plot extra is not installed")

from kvlife.lifecycle.cli.main import main  # noqa: E402

LONG = "a-policy-name-sixty-characters-long-that-the-plots-must-hold"
assert len(LONG) == 60
OTHER = "another-policy-name-sixty-characters-long-to-fill-the-legend"
assert len(OTHER) == 60


def _inside(fig: Any) -> None:
    fig.canvas.draw()
    tight = fig.get_tightbbox(fig.canvas.get_renderer())
    whole = fig.bbox_inches
    assert tight.x0 >= whole.x0 - 1e-6 and tight.y0 >= whole.y0 - 1e-6, (tight, whole)
    assert tight.x1 <= whole.x1 + 1e-6 and tight.y1 <= whole.y1 + 1e-6, (tight, whole)
    width, height = fig.get_size_inches()
    for ax in fig.axes:
        if ax.get_label() == "<colorbar>":
            continue
        box = ax.get_position()
        assert box.width * width >= 2.5 and box.height * height >= 1.6, "an axes collapsed to a sliver"


def _texts(fig: Any) -> str:
    found = []
    for ax in fig.axes:
        found += [t.get_text() for t in ax.get_xticklabels() + ax.get_yticklabels()]
        legend = ax.get_legend()
        if legend is not None:
            found += [t.get_text() for t in legend.get_texts()]
    for legend in fig.legends:
        found += [t.get_text() for t in legend.get_texts()]
    return "\n".join(found)


@pytest.fixture(scope="module")
def policy_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("policies")
    path = folder / "long_names.py"
    path.write_text(
        "from kvlife.policies.base import Decision\n"
        "class LongA:\n"
        f"    name = {LONG!r}\n"
        "    def lookup_mode(self, req, engine):\n"
        "        return Decision('async', 'long name, async lookups')\n"
        "class LongB:\n"
        f"    name = {OTHER!r}\n"
        "    def admission(self, req, load, engine):\n"
        "        return Decision('join', 'long name, joins') if load.in_flight else None\n"
    )
    return path


def test_trace_plot_overlays_runs_and_fits(policy_file: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    from kvlife.lifecycle.traces.plot import trace_figure

    traces = []
    for cls in ("LongA", "LongB"):
        trace = tmp_path / f"{cls}.jsonl"
        assert main(["run", "--limit", "30", "--device-blocks", "200", "--tier", "disk=2000",
                     "--stack", f"{policy_file}:{cls}", "--trace", str(trace)]) == 0
        traces.append(trace)
    capsys.readouterr()
    fig = trace_figure(traces, allow_code=True)
    try:
        from kvlife.lifecycle.traces.plot import fit

        fit(fig)
        _inside(fig)
        texts = _texts(fig)
        assert LONG in texts and OTHER in texts and "long_names.py" not in texts.replace("jsonl", "")
        assert "%" in fig.axes[2].get_yticklabels()[1].get_text()  # hit rates in percent on the axis too
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
    out = tmp_path / "both.png"
    assert main(["plot", *map(str, traces), str(out), "--allow-code"]) == 0
    assert out.stat().st_size > 0


def test_compare_plot_draws_cdfs_with_policy_names(policy_file: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from kvlife.lifecycle.cli.compare import compare_stacks
    from kvlife.lifecycle.config import RunConfig
    from kvlife.lifecycle.traces.plot import cdf_figure, fit, stack_names
    from kvlife.lifecycle.workloads.synthetic import synthetic_workload

    stacks = [(f"{policy_file}:LongA",), (f"{policy_file}:LongB", "async-lookup")]
    per_request: list[Any] = []
    compare_stacks(RunConfig(), synthetic_workload(seed=0, num_requests=30), stacks, keep_rows=per_request)
    assert [stack_names(s) for s in stacks] == [LONG, f"{OTHER},async-lookup"]
    fig = cdf_figure({stack_names(s): rows for s, rows in zip(stacks, per_request, strict=True)}, title="t")
    try:
        fit(fig)
        _inside(fig)
        assert LONG in _texts(fig)
        lines = fig.axes[0].get_lines()
        assert len(lines) == 2 and len(lines[0].get_xdata()) == 30  # one point per request's TTFT
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
    out = tmp_path / "cdf.png"
    assert main(["compare", "--limit", "20", "--stack", "baseline", "--stack", f"{policy_file}:LongA",
                 "--plot", str(out)]) == 0
    assert out.stat().st_size > 0 and f"wrote {out}" in capsys.readouterr().out


def _sweep_rows() -> list[dict[str, Any]]:
    rows = []
    for n, (stack, names) in enumerate([("baseline", "baseline"), ("x/long_names.py:LongA", LONG),
                                        ("x/long_names.py:LongB,async-lookup", f"{OTHER},async-lookup")]):
        for scale in (0.25, 0.5, 1.0, 2.0):
            rows.append({"key": f"{n}-{scale}", "policies.stack": stack, "policies": names,
                         "sim.time_scale": scale, "ttft_p90_ms": 100.0 * scale * (n + 1) + 12_500.0 * (scale > 1),
                         "throughput_tokens_per_s": 900.0 * scale})
    return rows


def test_sweep_heatmap_and_pareto_fit_long_names() -> None:
    from kvlife.lifecycle.sweeps.plots import figure_of, parse_heatmap, parse_pareto
    from kvlife.lifecycle.traces.plot import fit

    rows = _sweep_rows()
    fig = figure_of(rows, [parse_heatmap("x=sim.time_scale,y=policies.stack,value=ttft_p90_ms")],
                    [parse_pareto("x=ttft_p90_ms,y=max:throughput_tokens_per_s,label=policies.stack")])
    try:
        fit(fig)
        _inside(fig)
        texts = _texts(fig)
        assert LONG.replace("-", "") in texts.replace("\n", "").replace("-", "")  # wrapped, whole
        assert "long_names.py" not in texts
        # Cells and ticks in plain digits: never 1e+04 beside 2,000.
        cell_texts = [t.get_text() for t in fig.axes[0].texts]
        assert "12,700" in cell_texts and not any("e+" in t for t in cell_texts)
        # Pareto labels are numbers by the points, the names in the legend: none overlap.
        pareto = fig.axes[-1]
        assert all(t.get_text().isdigit() for t in pareto.texts)
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_capacity_plot_fits_and_says_met_or_missed() -> None:
    from types import SimpleNamespace

    from kvlife.lifecycle.sweeps.capacity import parse_slo
    from kvlife.lifecycle.sweeps.plots import capacity_figure
    from kvlife.lifecycle.traces.plot import fit

    objectives = parse_slo("ttft_p90=2s,tpot_p90=100ms")

    def probe(scale: float, meets: bool) -> Any:
        return SimpleNamespace(scale=scale, meets=meets, values={"ttft_p90": 900.0 * scale, "tpot_p90": 40.0 * scale})

    results = [SimpleNamespace(stack=s, scale=1.0, probes=[probe(0.5, True), probe(1.0, True), probe(2.0, False)])
               for s in ("baseline", "async-lookup,shared-loads")]
    fig = capacity_figure(results, objectives)
    try:
        fit(fig)
        _inside(fig)
        texts = _texts(fig)
        assert "met the target" in texts and "missed it" in texts
        assert not any("e+" in t.get_text() or "10^" in t.get_text() for t in fig.axes[0].get_yticklabels())
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_readable_numbers() -> None:
    from kvlife.lifecycle.traces.plot import readable

    assert [readable(v) for v in (12500.0, 2000.0, 250.0, 12.5, 0.26, 0.0)] == \
        ["12,500", "2,000", "250", "12.5", "0.26", "0"]


def test_miss_ratio_curve_plot_fits_a_long_name(tmp_path: Path) -> None:
    import gzip

    from kvlife.lifecycle.fidelity import mrc
    from kvlife.lifecycle.traces.plot import fit
    from kvlife.lifecycle.workloads.bundled import resolve_workload

    # The bundled trace's first 300 lines under a 60-character file name (the title).
    path = tmp_path / f"{LONG}.jsonl"
    with gzip.open(resolve_workload("mooncake-conversation"), "rt") as source:
        path.write_text("".join(line for _, line in zip(range(300), source, strict=False)))
    prompts = mrc.read_trace(path, 300)
    curve = mrc.miss_ratio_curve(prompts, [10, 100, 1000])
    fig = mrc.curve_figure(curve, marked=[100])
    try:
        fit(fig)
        _inside(fig)
        assert LONG in fig.axes[0].get_title()
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
