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
