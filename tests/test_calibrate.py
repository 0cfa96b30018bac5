"""calibrate recovers known efficiency factors; bad CSVs are one-line errors; profile-gpu on CPU."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from kvlife.lifecycle.profiles import Efficiency, ProfileError, load_efficiency, load_hardware, load_model
from kvlife.lifecycle.profiles.calibrate import calibrate, fit_efficiency, read_timings
from kvlife.lifecycle.profiles.catalog import Model
from kvlife.lifecycle.profiles.profile_gpu import NO_GPU, ProfileGpuError, measure, profile_gpu, write_csv
from kvlife.lifecycle.profiles.step_cost import StepCostModel, composition_of_row

GRID = (
    [(p, 0, c) for p in (512, 2048, 8192) for c in (0, 8192, 32768)]
    + [(0, d, c) for d in (1, 8, 32, 128) for c in (512, 4096, 32768)]
    + [(2048, 32, 2048), (512, 64, 8192)]
)


def synthetic_csv(path: Path, truth: Efficiency, model: str, hardware: str, tp: int, noise: float) -> Path:
    cost = StepCostModel(load_model(model), load_hardware(hardware), tp, truth)
    rng = random.Random(7)
    rows = []
    for p, d, c in GRID:
        ms = cost.step_ms(*composition_of_row(p, d, c)) * (1 + rng.uniform(-noise, noise))
        rows.append((p, d, c, ms))
    return write_csv(path, rows, "synthetic")


@pytest.mark.parametrize(
    ("model", "hardware", "tp", "truth"),
    [
        ("llama-3-8b", "h100-sxm", 1, Efficiency(mfu=0.42, attention=0.61, mbu=0.77, overhead_ms=1.3)),
        ("llama-3-70b", "h100-sxm", 4, Efficiency(mfu=0.55, attention=0.38, mbu=0.62, overhead_ms=0.4)),
        ("qwen2.5-7b", "a100-80gb", 1, Efficiency(mfu=0.66, attention=0.47, mbu=0.81, overhead_ms=2.0)),
    ],
)
def test_fit_recovers_known_factors(tmp_path: Path, model: str, hardware: str, tp: int, truth: Efficiency) -> None:
    csv = synthetic_csv(tmp_path / "t.csv", truth, model, hardware, tp, noise=0.01)
    out = tmp_path / "fit.toml"
    started = time.perf_counter()
    result = calibrate(csv, load_model(model), load_hardware(hardware), tp, out=out)
    assert time.perf_counter() - started < 5
    fitted = result.efficiency
    for name in ("mfu", "attention", "mbu"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=0.03), name
    # The overhead is a small share of every step: 1 % noise on a 20 ms step moves it ~0.2 ms.
    assert fitted.overhead_ms == pytest.approx(truth.overhead_ms, abs=0.3)
    assert result.rms_relative_error < 0.01 and result.fixed == ()
    # The written profile reads back and reproduces the fit.
    back = load_efficiency(out)
    assert back.mfu == pytest.approx(fitted.mfu, abs=1e-4)
    assert "[calibration]" in out.read_text() and f'model = "{model}"' in out.read_text()


def test_fit_is_deterministic_and_starts_anywhere(tmp_path: Path) -> None:
    truth = Efficiency(mfu=0.3, attention=0.8, mbu=0.5, overhead_ms=3.0)
    csv = synthetic_csv(tmp_path / "t.csv", truth, "llama-3-8b", "h100-sxm", 1, noise=0.0)
    rows = read_timings(csv)
    model, hw = load_model("llama-3-8b"), load_hardware("h100-sxm")
    a = fit_efficiency(rows, model, hw, start=Efficiency(0.9, 0.2, 0.95, 0.0))
    b = fit_efficiency(rows, model, hw, start=Efficiency(0.9, 0.2, 0.95, 0.0))
    assert a == b
    assert a.efficiency.mfu == pytest.approx(0.3, rel=0.01)
    assert a.efficiency.mbu == pytest.approx(0.5, rel=0.01)


def test_factors_the_data_cannot_see_keep_their_start(tmp_path: Path) -> None:
    # Decode rows only at short context: attention FLOPs never matter.
    path = tmp_path / "decode.csv"
    cost = StepCostModel(load_model("llama-3-8b"), load_hardware("h100-sxm"))
    write_csv(path, [(0, b, 256, cost.decode_ms(b, 256)) for b in (1, 2, 4, 8, 16)], "decode only")
    result = calibrate(path, load_model("llama-3-8b"), load_hardware("h100-sxm"))
    assert "attention" in result.fixed and "mfu" in result.fixed
    assert result.efficiency.attention == load_hardware("h100-sxm").efficiency.attention


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("prefill_tokens,decode_requests,context_tokens\n1,2,3\n", "1: field 'step_ms': missing column"),
        ("prefill_tokens,decode_requests,context_tokens,step_ms,gpu\n", "1: field 'gpu': unknown column"),
        ("# a comment\nprefill_tokens,decode_requests,context_tokens,step_ms\n10,0,0,abc\n",
         "3: field 'step_ms': must be a number of ms from 1e-06 (a nanosecond) to 1e+09 (11.6 days), got 'abc'"),
        ("prefill_tokens,decode_requests,context_tokens,step_ms\n10,0,0,5\n10,-1,0,5\n",
         "3: field 'decode_requests': must be an integer from 0 to 2^24 (the longest prompt), got '-1'"),
        ("prefill_tokens,decode_requests,context_tokens,step_ms\n1.5,0,0,5\n",
         "2: field 'prefill_tokens': must be an integer from 0 to 2^24 (the longest prompt), got '1.5'"),
        ("prefill_tokens,decode_requests,context_tokens,step_ms\n10,0,0,nan\n",
         "2: field 'step_ms': must be a number of ms from 1e-06 (a nanosecond) to 1e+09 (11.6 days), got 'nan'"),
        ("prefill_tokens,decode_requests,context_tokens,step_ms\n0,0,10,5\n",
         "2: field 'prefill_tokens': a step needs prefill tokens or decode requests"),
        ("prefill_tokens,decode_requests,context_tokens,step_ms\n10,0,5\n", "2: field '-': expected 4 columns, got 3"),
        ("step_ms,context_tokens,decode_requests,prefill_tokens\n", "field '-': no timing rows"),
    ],
)
def test_bad_csv_is_a_one_line_error(tmp_path: Path, content: str, expected: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(content)
    with pytest.raises(ProfileError) as info:
        read_timings(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{path}:{expected}") or message == f"{path}: {expected}", message


def test_columns_may_come_in_any_order(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("step_ms,context_tokens,decode_requests,prefill_tokens\n12.5,100,4,0\n")
    (row,) = read_timings(path)
    assert (row.prefill_tokens, row.decode_requests, row.context_tokens, row.step_ms) == (0, 4, 100, 12.5)


def test_profile_gpu_on_cpu_is_a_one_line_error(tmp_path: Path) -> None:
    with pytest.raises(ProfileGpuError) as info:
        profile_gpu(load_model("llama-3-8b"), tmp_path / "out.csv")
    assert str(info.value) == NO_GPU == "profile-gpu needs a CUDA GPU (none found)"
    assert not (tmp_path / "out.csv").exists()


def test_measure_times_every_shape_and_writes_a_calibratable_csv(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    tiny = Model(name="tiny", hf_id="test/tiny", num_layers=2, hidden_size=64, num_attention_heads=4,
                 num_kv_heads=2, head_dim=16, intermediate_size=128, vocab_size=100, dtype="float32")

    def timer(fn: object) -> float:
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        return (time.perf_counter() - start) * 1000

    points = [(16, 0, 0), (16, 0, 32), (0, 4, 32), (8, 2, 16)]
    rows = measure(tiny, 2, points, torch.device("cpu"), timer, repeats=1)
    assert [r[:3] for r in rows] == points
    assert all(r[3] > 0 for r in rows)
    path = write_csv(tmp_path / "cpu.csv", rows, "tiny on cpu")
    assert [(r.prefill_tokens, r.decode_requests, r.context_tokens) for r in read_timings(path)] == points
