"""Hardware and model profiles: loading, refusal of bad files, and the derived sizes."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvlife.lifecycle.profiles import (
    DEFAULT_HARDWARE,
    DEFAULT_MODEL,
    Efficiency,
    ProfileError,
    device_capacity,
    kv_bytes_per_block,
    kv_bytes_per_token,
    kv_heads_per_rank,
    list_profiles,
    load_efficiency,
    load_hardware,
    load_model,
    param_count,
    weight_bytes_per_rank,
)
from kvlife.lifecycle.profiles.derived import GIB, activation_reserve_bytes, kv_replicas

MIB = 1 << 20


def test_bundled_profiles_are_listed_and_all_load() -> None:
    profiles = list_profiles()
    assert {"h100-sxm", "h200", "a100-80gb", "l40s"} <= set(profiles["hardware"])
    assert {"llama-3-8b", "llama-3-70b", "qwen2.5-7b", "mistral-7b"} <= set(profiles["models"])
    for name in profiles["hardware"]:
        hw = load_hardware(name)
        assert hw.name == name
        # Dense, not sparsity figures: no GPU here exceeds 1 PFLOP/s dense bf16.
        assert 100e12 < hw.peak_bf16_flops < 1000e12
    for name in profiles["models"]:
        assert load_model(name).name == name
    assert DEFAULT_HARDWARE in profiles["hardware"] and DEFAULT_MODEL in profiles["models"]


def test_every_bundled_figure_has_a_source_comment() -> None:
    data = Path(__file__).resolve().parents[1] / "lifecycle" / "profiles" / "data"
    for path in [*data.glob("hardware/*.toml"), *data.glob("models/*.toml")]:
        text = path.read_text()
        assert "https://" in text, path
        assert text.count("#") >= 10, path


def test_parameter_counts_match_the_published_sizes() -> None:
    # Published: Llama-3-8B 8.03B, Llama-3-70B 70.6B, Qwen2.5-7B 7.61B, Mistral-7B 7.24B.
    assert param_count(load_model("llama-3-8b")) == 8_030_261_248
    assert param_count(load_model("llama-3-70b")) == pytest.approx(70.55e9, rel=1e-3)
    assert param_count(load_model("qwen2.5-7b")) == pytest.approx(7.62e9, rel=2e-3)
    assert param_count(load_model("mistral-7b")) == pytest.approx(7.24e9, rel=1e-3)


def test_kv_bytes_of_llama_3_8b() -> None:
    model = load_model("llama-3-8b")
    # 2 (K, V) x 32 layers x 8 KV heads x 128 dims x 2 bytes = 128 KiB per token.
    assert kv_bytes_per_token(model) == 131072
    assert kv_bytes_per_block(model, 512) == 64 * MIB
    assert kv_bytes_per_block(model, 16) == 2 * MIB  # vLLM's default block: 2 MiB
    assert kv_bytes_per_block(model, 512, tp=2) == 32 * MIB


def test_tensor_parallel_shards_kv_heads_and_replicates_past_them() -> None:
    model = load_model("llama-3-70b")  # 64 heads, 8 KV heads
    assert kv_heads_per_rank(model, 4) == 2
    assert kv_heads_per_rank(model, 8) == 1
    assert (kv_heads_per_rank(model, 16), kv_replicas(model, 16)) == (1, 2)  # vLLM replicates
    assert kv_bytes_per_token(model, 16) == kv_bytes_per_token(model, 8)
    with pytest.raises(ProfileError, match=r"field 'tp': 3 does not divide llama-3-70b's 64 attention heads"):
        kv_heads_per_rank(model, 3)
    qwen = load_model("qwen2.5-7b")  # 28 heads, 4 KV heads
    with pytest.raises(ProfileError, match="8 does not divide qwen2.5-7b's 28 attention heads"):
        kv_heads_per_rank(qwen, 8)
    custom = load_model("llama-3-8b")
    with pytest.raises(ProfileError, match="6 does not divide"):
        kv_heads_per_rank(custom, 6)


def test_weights_per_rank_split_with_tp() -> None:
    model = load_model("llama-3-70b")
    total = weight_bytes_per_rank(model, 1)
    assert total == pytest.approx(2 * 70.55e9, rel=1e-3)
    assert weight_bytes_per_rank(model, 4) == pytest.approx(total / 4, rel=1e-3)


def test_device_capacity_of_the_default_pair_is_what_vllm_derives() -> None:
    # vLLM's log for Llama-3.1-8B on one H100 (gpu_memory_utilization 0.9): 51.38 GiB of KV
    # (llm-d-benchmark empirical-vllm-memory-results.md) = 822 blocks of 64 MiB.
    cap = device_capacity(load_model(DEFAULT_MODEL), load_hardware(DEFAULT_HARDWARE), block_tokens=512)
    assert cap.block_bytes == 64 * MIB
    assert 800 <= cap.blocks <= 900
    assert cap.kv_bytes / GIB == pytest.approx(51.38, rel=0.01)
    assert cap.weight_bytes / GIB == pytest.approx(14.96, rel=0.01)
    assert "821 blocks of 64.0 MiB" in cap.summary()
    # Less memory handed to vLLM, fewer blocks; the reserve grows with max_num_batched_tokens.
    assert device_capacity(load_model(DEFAULT_MODEL), load_hardware(DEFAULT_HARDWARE), 512,
                           gpu_memory_utilization=0.8).blocks < cap.blocks
    model = load_model(DEFAULT_MODEL)
    assert activation_reserve_bytes(model, max_num_batched_tokens=16384) > activation_reserve_bytes(model)


def test_70b_needs_tensor_parallelism_on_h100() -> None:
    model, h100 = load_model("llama-3-70b"), load_hardware("h100-sxm")
    with pytest.raises(ProfileError, match=r"llama-3-70b does not fit on h100-sxm at tp=1"):
        device_capacity(model, h100, 512, tp=1)
    tp4 = device_capacity(model, h100, 512, tp=4)
    assert tp4.block_bytes == 40 * MIB  # 2 KV heads per rank
    assert 800 <= tp4.blocks <= 900


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "mine.toml"
    path.write_text(text)
    return path


def test_a_users_own_file_loads(tmp_path: Path) -> None:
    text = Path(load_hardware("h100-sxm").source or "").name
    assert text == "h100-sxm.toml"
    bundled = Path(__file__).resolve().parents[1] / "lifecycle" / "profiles" / "data" / "hardware" / "h100-sxm.toml"
    mine = write(tmp_path, bundled.read_text().replace('name = "h100-sxm"', 'name = "my-h100"'))
    hw = load_hardware(str(mine))
    assert hw.name == "my-h100" and hw.source == str(mine)
    assert hw.efficiency == load_hardware("h100-sxm").efficiency


HARDWARE_OK = """name = "x"
description = "a GPU"
peak_bf16_flops = 1e15
hbm_bytes = 1000000000
hbm_bandwidth_gb_s = 1000.0
host_link = "PCIe"
host_link_gb_s = 25.0
interconnect = "PCIe"
interconnect_gb_s = 25.0
allreduce_latency_us = 10.0
[nvme]
read_gb_s = 7.0
write_gb_s = 4.0
latency_ms = 0.1
[network]
gb_s = 25.0
latency_ms = 0.05
"""


def test_efficiency_section_is_optional(tmp_path: Path) -> None:
    assert load_hardware(write(tmp_path, HARDWARE_OK)).efficiency == Efficiency()


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (("latency_ms = 0.05", "latency_ms = -1"),
         "mine.toml:17: field 'network.latency_ms': must be a finite non-negative number, got -1"),
        (("read_gb_s = 7.0", "read_gb_s = inf"),
         "mine.toml:12: field 'nvme.read_gb_s': must be a finite positive number, got inf"),
        (("read_gb_s = 7.0", "read_gb_s = nan"),
         "mine.toml:12: field 'nvme.read_gb_s': must be a finite positive number, got nan"),
        (("hbm_bytes = 1000000000", "hbm_bytes = 1.5e9"),
         "mine.toml:4: field 'hbm_bytes': must be a positive integer, got 1500000000.0"),
        (("host_link = \"PCIe\"", "host_link = \"PCIe\"\nhost_lnik_gb_s = 3"),
         "mine.toml:7: field 'host_lnik_gb_s': unknown key (known: "),
        (("write_gb_s = 4.0", "write_gb_s = 4.0\nspeed = 1"),
         "mine.toml:14: field 'nvme.speed': unknown key (known: latency_ms, read_gb_s, write_gb_s)"),
        (("[network]\ngb_s = 25.0\n", "[network]\n"), "mine.toml:15: field 'network.gb_s': missing"),
        (("[network]", "[network"), "mine.toml:15: field '-': not valid TOML"),
        (("latency_ms = 0.05", "latency_ms = 0.05\n[efficiency]\nmfu = 1.5\nattention = 0.5\nmbu = 0.7\n"
                                "overhead_ms = 0"),
         "mine.toml:19: field 'efficiency.mfu': must be a number in (0, 1], got 1.5"),
    ],
)
def test_bad_hardware_files_are_one_line_errors(tmp_path: Path, edit: tuple[str, str], expected: str) -> None:
    path = write(tmp_path, HARDWARE_OK.replace(*edit))
    with pytest.raises(ProfileError) as info:
        load_hardware(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(str(tmp_path / expected.split(":")[0]) + ":" + expected.split(":", 1)[1])


def test_bad_model_files_name_the_field(tmp_path: Path) -> None:
    bundled = Path(__file__).resolve().parents[1] / "lifecycle" / "profiles" / "data" / "models" / "llama-3-8b.toml"
    text = bundled.read_text()
    cases = [
        ("num_kv_heads = 8 ", "num_kv_heads = 5 ", "num_kv_heads",
         "field 'num_kv_heads': must divide num_attention_heads (32), got 5"),
        ('dtype = "bfloat16"', 'dtype = "bf16"', "dtype",
         "field 'dtype': must be one of bfloat16, float16, float32, float8_e4m3fn; got 'bf16'"),
        ("num_layers = 32 ", "num_layers = 0 ", "num_layers", "field 'num_layers': must be a positive integer, got 0"),
        ("vocab_size = 128256", "vocab_size = 128256\nrope_theta = 5e5", "rope_theta",
         "field 'rope_theta': unknown key"),
    ]
    for old, new, key, expected in cases:
        assert old in text
        path = write(tmp_path, text.replace(old, new))
        line = next(n for n, row in enumerate(path.read_text().splitlines(), 1) if row.startswith(key + " "))
        with pytest.raises(ProfileError) as info:
            load_model(path)
        assert str(info.value).startswith(f"{path}:{line}: {expected}"), str(info.value)


def test_unknown_names_list_the_known_ones() -> None:
    with pytest.raises(ProfileError, match=r"field 'hardware': unknown hardware profile 'h100' \(known: a100-80gb, "):
        load_hardware("h100")
    with pytest.raises(ProfileError, match=r"cannot read model profile"):
        load_model("/nonexistent/model.toml")


def test_load_efficiency_reads_a_hardware_profile_or_a_calibration(tmp_path: Path) -> None:
    bundled = Path(__file__).resolve().parents[1] / "lifecycle" / "profiles" / "data" / "hardware" / "h100-sxm.toml"
    assert load_efficiency(bundled) == load_hardware("h100-sxm").efficiency
    path = tmp_path / "fit.toml"
    path.write_text("[efficiency]\nmfu = 0.4\nattention = 0.6\nmbu = 0.8\noverhead_ms = 1.0\n"
                    "[calibration]\nrows = 3\n")
    assert load_efficiency(path) == Efficiency(0.4, 0.6, 0.8, 1.0)
    path.write_text("[calibration]\nrows = 3\n")
    with pytest.raises(ProfileError, match="field 'efficiency': missing section"):
        load_efficiency(path)
