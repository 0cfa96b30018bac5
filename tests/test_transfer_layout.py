"""Block geometry, the device layout and deterministic KV content."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvlife.transfer.content import (
    expected_block,
    expected_bytes,
    fill_block,
    stable_mix,
    verify_block,
    verify_bytes,
)
from kvlife.transfer.layout import LLAMA3_8B_SHAPE, SMALL_SHAPE, BlockGeometry, DeviceKV, ModelShape

ROOT = Path(__file__).resolve().parents[1]


def test_llama_like_block_is_two_mib() -> None:
    geo = BlockGeometry(LLAMA3_8B_SHAPE)
    assert geo.bytes_per_layer_block == 2 * 16 * 8 * 128 * 2 == 64 * 1024
    assert geo.block_bytes == 32 * 64 * 1024 == 2 * 1024 * 1024
    assert geo.block_shape == (32, 2, 16, 8, 128)


def test_sharding_divides_heads() -> None:
    geo = BlockGeometry(LLAMA3_8B_SHAPE, world_size=4)
    assert geo.local_heads == 2
    assert geo.block_bytes == BlockGeometry(LLAMA3_8B_SHAPE).block_bytes // 4
    with pytest.raises(ValueError, match="world_size"):
        BlockGeometry(LLAMA3_8B_SHAPE, world_size=3)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_layers", 0),
        ("num_kv_heads", -1),
        ("head_dim", 1.5),
        ("block_tokens", True),
        ("dtype", "float8"),
    ],
)
def test_shape_validation_names_the_field(field: str, value: object) -> None:
    kwargs: dict[str, object] = {
        "num_layers": 2,
        "num_kv_heads": 2,
        "head_dim": 8,
        "dtype": "float16",
        "block_tokens": 4,
    }
    kwargs[field] = value
    with pytest.raises(ValueError, match=field):
        ModelShape(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(("dtype", "size"), [("float16", 2), ("bfloat16", 2), ("float32", 4)])
def test_itemsize_per_dtype(dtype: str, size: int) -> None:
    shape = ModelShape(num_layers=3, num_kv_heads=2, head_dim=8, dtype=dtype, block_tokens=4)
    geo = BlockGeometry(shape)
    assert geo.block_bytes == 3 * 2 * 4 * 2 * 8 * size


def test_device_kv_views() -> None:
    geo = BlockGeometry(SMALL_SHAPE)
    kv = DeviceKV(geo, 5, device="cpu")
    assert kv.data.shape == (5, *geo.block_shape)
    assert kv.flat.shape == (5, geo.block_bytes)
    assert kv.flat.dtype == torch.uint8
    assert kv.layer(1).shape == (5, *geo.layer_block_shape)
    # The byte view aliases the typed tensor.
    kv.block(2)[1, 0, 0, 0, 0] = 1.0
    assert kv.flat[2].any() and not kv.flat[1].any()


def test_content_is_deterministic_and_block_specific() -> None:
    geo = BlockGeometry(SMALL_SHAPE)
    a = expected_block(geo, 12345)
    assert torch.equal(a, expected_block(geo, 12345))
    assert not torch.equal(a, expected_block(geo, 12346))
    # Layers differ from each other too, so a layer mix-up is caught.
    assert not torch.equal(a[0], a[1])
    assert a.abs().max() <= 125


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_fill_and_verify(dtype: str) -> None:
    shape = ModelShape(num_layers=2, num_kv_heads=2, head_dim=16, dtype=dtype, block_tokens=4)
    geo = BlockGeometry(shape)
    kv = DeviceKV(geo, 4, device="cpu")
    fill_block(kv, 1, -7)
    assert verify_block(kv, 1, -7)
    assert not verify_block(kv, 1, 8)
    assert not verify_block(kv, 0, -7)
    kv.flat[1, 5] ^= 1  # one flipped bit
    assert not verify_block(kv, 1, -7)
    assert verify_bytes(geo, expected_bytes(geo, 99), 99)


def test_rank_shards_are_slices_of_the_full_block() -> None:
    full = expected_block(BlockGeometry(LLAMA3_8B_SHAPE), 42)
    geo = BlockGeometry(LLAMA3_8B_SHAPE, world_size=4)
    for rank in range(4):
        shard = expected_block(geo, 42, rank)
        assert torch.equal(shard, full[:, :, :, rank * 2 : rank * 2 + 2])
    with pytest.raises(ValueError, match="rank"):
        expected_block(geo, 42, 4)


def test_stable_mix_takes_wide_and_negative_ints_only() -> None:
    assert stable_mix(1 << 100) != stable_mix(1 << 36)
    assert stable_mix(-1) != stable_mix(1)
    with pytest.raises(TypeError):
        stable_mix("abc")  # type: ignore[arg-type]


def test_content_does_not_depend_on_hash_randomisation() -> None:
    script = (
        "import hashlib;"
        "from kvlife.transfer.content import expected_bytes;"
        "from kvlife.transfer.layout import BlockGeometry, SMALL_SHAPE;"
        "print(hashlib.sha256(expected_bytes(BlockGeometry(SMALL_SHAPE), 2**70 + 5).numpy()"
        ".tobytes()).hexdigest())"
    )
    digests = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT)}
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
        digests.add(out.stdout.strip())
    local = hashlib.sha256(expected_bytes(BlockGeometry(SMALL_SHAPE), 2**70 + 5).numpy().tobytes()).hexdigest()
    assert digests == {local}
