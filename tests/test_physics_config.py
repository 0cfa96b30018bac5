"""Choosing the physics of a simulated run: [sim] keys and their flags, derived device size and
ranks, one-line errors for bad profiles, and the calibrate / profile-gpu commands."""

from __future__ import annotations

import json
from pathlib import Path

import orjson
import pytest

from kvlife.lifecycle.cli.main import main
from kvlife.lifecycle.config import ConfigError, RunConfig, load_config
from kvlife.lifecycle.drivers.physics import resolve
from kvlife.lifecycle.profiles import Efficiency, load_hardware, load_model
from kvlife.lifecycle.profiles.profile_gpu import NO_GPU, write_csv
from kvlife.lifecycle.profiles.step_cost import StepCostModel, composition_of_row
from kvlife.lifecycle.traces.replay import config_from_header, replay

ROOT = Path(__file__).resolve().parents[1]
H100 = ROOT / "lifecycle" / "profiles" / "data" / "hardware" / "h100-sxm.toml"


def one_line_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """Exit code 2, exactly one line on stderr, no traceback."""
    try:
        code = main(list(args))
    except SystemExit as exc:  # argparse's own errors exit from the parser
        code = exc.code  # type: ignore[assignment]
    assert code == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    return lines[0]


# ---- config keys ---------------------------------------------------------------------------
def test_sim_keys_choose_the_physics(tmp_path: Path) -> None:
    path = tmp_path / "kvlife.toml"
    path.write_text('[sim]\nhardware = "h200"\nmodel = "llama-3-70b"\ntp = 2\ngpu_memory_utilization = 0.85\n'
                    'completions = "exact"\nlookup_workers = 3\nlookup_per_key_ms = 0.01\nmbu = 0.6\n'
                    'step_overhead_ms = 1.0\n')
    config, physics = resolve(load_config(path))
    assert (physics.hardware.name, physics.model.name, physics.tp, config.engine.ranks) == ("h200", "llama-3-70b", 2, 2)
    assert physics.efficiency == Efficiency(mfu=0.5, attention=0.5, mbu=0.6, overhead_ms=1.0)
    assert physics.capacity.requested_bytes == int(physics.hardware.hbm_bytes * 0.85)
    assert (config.sim.completions, config.sim.lookup_workers, config.sim.lookup_per_key_ms) == ("exact", 3, 0.01)


def test_a_profile_file_is_found_beside_the_config(tmp_path: Path) -> None:
    (tmp_path / "gpus").mkdir()
    (tmp_path / "gpus" / "mine.toml").write_text(H100.read_text().replace('name = "h100-sxm"', 'name = "mine"'))
    path = tmp_path / "kvlife.toml"
    path.write_text('[sim]\nhardware = "gpus/mine.toml"\n')
    config = load_config(path)
    assert config.sim.hardware == str(tmp_path / "gpus" / "mine.toml")
    assert resolve(config)[1].hardware.name == "mine"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('[sim]\nmodel = "llama-9"\n',
         "FILE:2: field 'sim.model': unknown model profile 'llama-9' (known: llama-3-70b, llama-3-8b, "
         "mistral-7b, qwen2.5-7b; or give a path)"),
        ('[sim]\nhardware = "h1000"\n',
         "FILE:2: field 'sim.hardware': unknown hardware profile 'h1000' (known: a100-80gb, h100-sxm, h200, l40s; "
         "or give a path)"),
        ("[sim]\nseed = 1\ntp = 3\n", "FILE:3: field 'sim.tp': 3 does not divide llama-3-8b's 32 attention heads"),
        ('[sim]\nmodel = "llama-3-70b"\n',
         "FILE:1: field 'sim.tp': llama-3-70b does not fit on h100-sxm at tp=1: 71.3 GiB usable, 131.4 GiB weights "
         "+ 5.9 GiB activations per rank leave no room for one 160 MiB block"),
        ("[sim]\ngpu_memory_utilization = 0\n",
         "FILE:2: field 'sim.gpu_memory_utilization': must be a number in (0, 1], got 0"),
        ('[sim]\ncompletions = "late"\n',
         "FILE:2: field 'sim.completions': must be one of 'step_boundary', 'exact'; got 'late'"),
        ("[sim]\ndecode_step_ms = 12.0\n",
         "FILE:2: field 'sim.decode_step_ms': unknown key (removed: step costs come from sim.model and "
         "sim.hardware (profiles.step_cost))"),
        ("[sim]\nblock_bytes = 1\n",
         "FILE:2: field 'sim.block_bytes': unknown key (removed: KV bytes per block derive from sim.model, "
         "sim.tp and engine.block_tokens)"),
    ],
)
def test_bad_physics_keys_are_one_line_errors_at_their_line(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "kvlife.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).replace(str(path), "FILE") == expected


def test_a_bad_profile_file_names_its_own_file_line_and_field(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    gpu = tmp_path / "gpu.toml"
    gpu.write_text(H100.read_text().replace("read_gb_s = 7.0", "read_gb_s = -1"))
    line = next(n for n, text in enumerate(gpu.read_text().splitlines(), 1) if text.startswith("read_gb_s"))
    expected = f"kvlife: error: {gpu}:{line}: field 'nvme.read_gb_s': must be a finite positive number, got -1"
    assert one_line_error(capsys, "run", "--limit", "3", "--hardware", str(gpu)) == expected
    config = tmp_path / "kvlife.toml"
    config.write_text(f'[sim]\nhardware = "{gpu}"\n')
    assert one_line_error(capsys, "run", "--limit", "3", "--config", str(config)) == expected


# ---- flags -----------------------------------------------------------------------------------
def test_physics_flags_override_the_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "kvlife.toml"
    path.write_text('[sim]\nmodel = "llama-3-70b"\ntp = 4\n')
    assert main(["run", "--config", str(path), "--limit", "20", "--model", "qwen2.5-7b", "--tp", "2",
                 "--hardware", "a100-80gb", "--completions", "exact", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)["summary"]
    setup = summary["setup"]
    assert (setup["hardware"], setup["model"], setup["tp"], setup["ranks"]) == ("a100-80gb", "qwen2.5-7b", 2, 2)
    assert setup["completions"] == "exact"
    assert setup["block_bytes"] == 2 * setup["block_bytes_per_rank"]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--model", "llama-9"], "kvlife run: error: --model llama-9: unknown model profile 'llama-9' "
                                 "(known: llama-3-70b, llama-3-8b, mistral-7b, qwen2.5-7b; or give a path)"),
        (["--tp", "3"], "kvlife run: error: --tp 3: 3 does not divide llama-3-8b's 32 attention heads"),
        (["--model", "llama-3-70b"], "kvlife run: error: --model llama-3-70b: llama-3-70b does not fit on h100-sxm "
                                     "at tp=1: 71.3 GiB usable, 131.4 GiB weights + 5.9 GiB activations per rank "
                                     "leave no room for one 160 MiB block"),
        (["--completions", "late"], "kvlife run: error: argument --completions: invalid choice: 'late' "
                                    "(choose from step_boundary, exact)"),
        (["--live", "--model", "llama-3-8b"], "kvlife run: error: --model applies to simulated runs; --live moves "
                                              "the real bytes of its own small model shape ([live] in the config)"),
    ],
)
def test_bad_physics_flags_are_one_line_errors(capsys: pytest.CaptureFixture[str], args: list[str],
                                               expected: str) -> None:
    line = one_line_error(capsys, "run", "--limit", "3", *args)
    if "invalid choice" in expected:  # argparse quotes the choices differently across versions
        assert line.startswith("kvlife run: error: argument --completions: invalid choice: 'late'")
    else:
        assert line == expected


def test_compare_takes_the_physics_flags_and_says_what_it_ran_on(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", "--limit", "20", "--stack", "baseline", "--tp", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # By hand, as vLLM sizes the KV cache, per rank at TP=2 (figures from llama-3-8b's config.json
    # and the h100-sxm profile; the reserve's terms are those of profiles.derived's constants):
    usable = int(85_018_877_624 * 0.9)  # HBM x gpu_memory_utilization
    weights = 2 * (32 * (4096 * 128 * (16 + 2 * 4 + 16) + 3 * 4096 * 14336 // 2)  # bf16: q, k, v, o and MLP shards
                   + 2 * 4096 * 128_256 // 2 + (2 * 32 + 1) * 4096)  # embedding and lm_head halves, norms whole
    reserve = (8192 * (3 * 14336 // 2 + 4 * 4096) * 2  # forward peak of 8,192 tokens
               + 8 * 1024 * 128_256 * 4 + int(0.55 * 2**30))  # sampler's float32 logits, non-torch memory
    block = 2 * 32 * (8 // 2) * 128 * 2 * 512  # K and V x layers x KV heads per rank x head dim x bf16 x tokens
    assert (out["setup"]["tp"], out["setup"]["ranks"]) == (2, 2)
    assert out["setup"]["device_blocks"] == (usable - weights - reserve) // block == 1879


# ---- the trace header --------------------------------------------------------------------------
def test_the_trace_header_records_the_derived_config_and_how(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    assert main(["run", "--limit", "10", "--trace", str(trace)]) == 0
    header = orjson.loads(trace.read_bytes().splitlines()[0])
    assert header["config"]["engine"]["device_blocks"] == 821 and header["config"]["engine"]["ranks"] == 1
    assert header["setup"]["device_blocks_source"] == "derived"
    assert header["setup"]["device"].startswith("821 (derived: h100-sxm")
    assert replay(trace).identical
    # resolving the recorded config again changes nothing: a what-if reruns it as recorded
    recorded = config_from_header(header)
    assert resolve(recorded)[0] == recorded


def test_a_trace_from_the_old_linear_cost_model_still_replays(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    assert main(["run", "--limit", "10", "--trace", str(trace)]) == 0
    lines = trace.read_bytes().splitlines()
    header = orjson.loads(lines[0])
    header["config"]["sim"].update(decode_step_ms=12.0, prefill_tokens_per_s=60000.0, decode_per_request_ms=0.08,
                                   block_bytes=64 << 20)
    for key in ("hardware", "model", "tp", "completions"):
        del header["config"]["sim"][key]
    trace.write_bytes(b"\n".join([orjson.dumps(header), *lines[1:]]) + b"\n")
    assert replay(trace).identical


# ---- calibrate and profile-gpu -------------------------------------------------------------------
def steps_csv(path: Path, truth: Efficiency) -> Path:
    cost = StepCostModel(load_model("llama-3-8b"), load_hardware("h100-sxm"), 1, truth)
    points = [(p, 0, c) for p in (1024, 4096, 8192) for c in (0, 16384, 32768)]
    points += [(0, d, c) for d in (1, 32, 128) for c in (512, 8192)]
    rows = [(p, d, c, cost.step_ms(*composition_of_row(p, d, c))) for p, d, c in points]
    return write_csv(path, rows, "synthetic")


def test_calibrate_fits_writes_and_the_run_uses_the_fit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    truth = Efficiency(mfu=0.4, attention=0.6, mbu=0.8, overhead_ms=1.2)
    csv = steps_csv(tmp_path / "steps.csv", truth)
    out = tmp_path / "fit.toml"
    assert main(["calibrate", str(csv), "--model", "llama-3-8b", "--hardware", "h100-sxm", "-o", str(out),
                 "--json"]) == 0
    fit = json.loads(capsys.readouterr().out)
    assert (fit["kind"], fit["schema"], fit["rows"], fit["output"]) == ("calibrate", 1, 15, str(out))
    for name in ("mfu", "attention", "mbu", "overhead_ms"):
        assert fit["efficiency"][name] == pytest.approx(getattr(truth, name), rel=0.02)
    assert fit["profile_efficiency"]["mbu"] == 0.7
    # the written profile is what --efficiency (sim.efficiency) runs on
    assert main(["run", "--limit", "10", "--efficiency", str(out), "--json"]) == 0
    efficiency = json.loads(capsys.readouterr().out)["summary"]["setup"]["efficiency"]
    assert efficiency == pytest.approx({"mfu": 0.4, "attention": 0.6, "mbu": 0.8, "overhead_ms": 1.2}, rel=0.02)
    # the text form names each factor beside the profile's
    assert main(["calibrate", str(csv)]) == 0
    text = capsys.readouterr().out
    assert "mbu" in text and "relative error of the fit" in text


def test_calibrate_bad_csv_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("prefill_tokens,decode_requests,context_tokens,step_ms\n1024,0,0,-5\n")
    line = one_line_error(capsys, "calibrate", str(bad))
    assert line.startswith(f"kvlife: error: {bad}:2: field 'step_ms':")
    assert one_line_error(capsys, "calibrate", str(bad), "--model", "nope").startswith(
        "kvlife: error: field 'model': unknown model profile 'nope'")


def test_profile_gpu_without_cuda_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    if importlib.util.find_spec("torch") is not None:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has a CUDA GPU")
    monkeypatch.chdir(tmp_path)
    assert one_line_error(capsys, "profile-gpu", "--model", "llama-3-8b") == f"kvlife profile-gpu: error: {NO_GPU}"
    assert not list(tmp_path.iterdir())


def test_default_config_is_still_a_plain_run_config() -> None:
    config = RunConfig()
    assert (config.sim.hardware, config.sim.model, config.sim.tp) == ("h100-sxm", "llama-3-8b", 1)
    # None until resolved, once; a bare Engine gets what a default run derives: one default.
    assert config.engine.device_blocks_set is None and config.engine.ranks_set is None
    assert resolve(config)[0].engine.device_blocks == config.engine.device_blocks == 821
    assert resolve(config)[0].engine.ranks == config.engine.ranks == 1
