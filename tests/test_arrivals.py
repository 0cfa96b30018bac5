"""``sim.arrivals``: recorded timestamps replayed as recorded, or with ties spread out."""

from __future__ import annotations

import json

import pytest

from kvlife.lifecycle.cli.main import main
from kvlife.lifecycle.workloads.arrivals import apply_arrivals, spread_ties
from kvlife.lifecycle.workloads.mooncake import WorkloadRequest


def _requests(times: list[float]) -> list[WorkloadRequest]:
    return [WorkloadRequest(f"req-{i}", t, 512 + i, 3, (i,)) for i, t in enumerate(times)]


def test_ties_spread_evenly_up_to_the_next_timestamp() -> None:
    out = list(spread_ties(_requests([0, 0, 0, 3000, 6000, 6000])))
    # 3 requests over [0, 3000); a lone one stays; the last group uses the gap before it.
    assert [r.arrival_ms for r in out] == [0, 1000, 2000, 3000, 6000, 7500]
    assert [r.request_id for r in out] == [f"req-{i}" for i in range(6)]
    assert [r.input_length for r in out] == [512 + i for i in range(6)]


def test_spreading_keeps_order_and_never_reaches_the_next_group() -> None:
    times = [0, 0, 10, 10, 10, 10, 11, 40]
    out = [r.arrival_ms for r in spread_ties(_requests(times))]
    assert out == sorted(out)
    assert all(a < b for a, b in zip(out, out[1:], strict=False))  # no ties left
    assert out[5] < 11 and out[6] == 11


def test_recorded_is_unchanged_and_unknown_mode_is_refused() -> None:
    requests = _requests([0, 0, 5])
    assert apply_arrivals(requests, "recorded") == requests
    with pytest.raises(ValueError, match="arrivals"):
        apply_arrivals(requests, "jittered")


def _p50(capsys: pytest.CaptureFixture[str], *extra: str) -> float:
    assert main(["run", "--workload", "mooncake-conversation", "--limit", "120", "--time-scale", "0.05",
                 "--json", *extra]) == 0
    return float(json.loads(capsys.readouterr().out)["summary"]["ttft_ms"]["p50"])


def test_spread_arrivals_remove_the_trace_own_bursts(capsys: pytest.CaptureFixture[str]) -> None:
    # At a twentieth of the recorded rate nothing queues between groups; as recorded, ~10
    # requests still land in one instant and wait for each other's prefill.
    recorded = _p50(capsys)
    spread = _p50(capsys, "--arrivals", "spread")
    assert spread < 0.5 * recorded


# ---- drawn arrivals and request rates ---------------------------------------------------------
def _gaps(requests: list[WorkloadRequest]) -> list[float]:
    return [b.arrival_ms - a.arrival_ms for a, b in zip(requests, requests[1:], strict=False)]


@pytest.mark.parametrize(("arrivals", "cv"), [("poisson", 1.0), ("gamma", 0.5), ("gamma", 3.0)])
def test_drawn_arrivals_have_the_rate_and_cv_asked_for(arrivals: str, cv: float) -> None:
    base = _requests([0.0] * 20000)
    out = list(apply_arrivals(base, arrivals, rate_per_s=8.0, cv=cv if arrivals == "gamma" else None, seed=5))
    assert [r.request_id for r in out] == [r.request_id for r in base]  # order and requests kept
    assert [r.input_length for r in out] == [r.input_length for r in base]
    gaps = _gaps(out)
    mean = sum(gaps) / len(gaps)
    std = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5
    # 20,000 draws: the sample mean is within 3 standard errors (cv/sqrt(n) ~ 2 % at cv 3).
    assert mean == pytest.approx(125.0, rel=3 * cv / len(gaps) ** 0.5)
    assert std / mean == pytest.approx(cv, rel=0.1)
    assert out[0].arrival_ms == 0.0 and all(g >= 0 for g in gaps)


def test_drawn_arrivals_are_seeded() -> None:
    base = _requests([0.0] * 50)
    first = [r.arrival_ms for r in apply_arrivals(base, "gamma", rate_per_s=2.0, cv=2.0, seed=1)]
    assert first == [r.arrival_ms for r in apply_arrivals(base, "gamma", rate_per_s=2.0, cv=2.0, seed=1)]
    assert first != [r.arrival_ms for r in apply_arrivals(base, "gamma", rate_per_s=2.0, cv=2.0, seed=2)]


def _arrivals_of(trace: str) -> list[float]:
    with open(trace) as f:
        return [r["t"] for r in map(json.loads, f) if r.get("type") == "arrival"]


def test_request_rate_scales_recorded_arrivals_to_it(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = str(tmp_path / "t.jsonl")
    assert main(["run", "--workload", "mooncake-conversation", "--limit", "200", "--request-rate", "0.5",
                 "--trace", trace, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    times = _arrivals_of(trace)
    assert len(times) == 200
    assert (len(times) - 1) / ((times[-1] - times[0]) / 1000.0) == pytest.approx(0.5)
    assert report["request_rate"] == 0.5 and report["time_scale"] != 1.0
    # poisson at that rate: the same requests, drawn gaps, the run seeded.
    assert main(["run", "--workload", "mooncake-conversation", "--limit", "200", "--request-rate", "0.5",
                 "--arrivals", "poisson", "--trace", trace, "--json"]) == 0
    drawn = _arrivals_of(trace)
    assert json.loads(capsys.readouterr().out)["arrivals"] == "poisson"
    assert drawn != times and len(drawn) == 200
    assert (len(drawn) - 1) / ((drawn[-1] - drawn[0]) / 1000.0) == pytest.approx(0.5, rel=0.25)


def test_arrival_flags_refuse_nonsense(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, message in (
        (["--request-rate", "2", "--time-scale", "3"], "both set the arrival rate"),
        (["--arrivals", "gamma:0"], "gamma:CV: the CV must be"),
        (["--arrivals", "poisson:2"], "expected one of recorded, spread, poisson, gamma or gamma:CV"),
        (["--request-rate", "nan"], "--request-rate"),
    ):
        try:
            code = main(["run", "--limit", "5", *argv])
        except SystemExit as exc:  # argparse's own refusal
            code = exc.code
        assert code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err


def test_config_files_set_the_rate_once(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    both = tmp_path / "both.toml"
    both.write_text("[sim]\nrequest_rate = 2.0\ntime_scale = 3.0\n")
    assert main(["run", "--config", str(both), "--limit", "3"]) == 2
    assert capsys.readouterr().err == (f"kvlife: error: {both}:2: field 'sim.request_rate': sim.time_scale sets the "
                                       "arrival rate too: give one\n")
    # A flag wins over the file's key: --time-scale over sim.request_rate.
    assert main(["run", "--config", str(both), "--limit", "3", "--time-scale", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["time_scale"] == 2
    stray = tmp_path / "cv.toml"
    stray.write_text("[sim]\narrival_cv = 2.0\n")
    assert main(["run", "--config", str(stray), "--limit", "3"]) == 2
    assert "field 'sim.arrival_cv': sets the CV of gamma arrivals, but arrivals are 'recorded'" in \
        capsys.readouterr().err
