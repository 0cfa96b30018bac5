"""Deterministic KV content, so every loaded block can be checked byte-exact (invariant 9).

The simulated "model" writes, for block hash h, layer l, K/V index c, token position p
within the block, global head g and dim d, the small integer

    ((lattice(c, p, g, d) * a(h, l) + b(h, l)) mod 251) - 125

where ``a`` in [1, 250] and ``b`` in [0, 250] come from a 64-bit integer mix of (h, l).
Values lie in [-125, 125], which float16, bfloat16 and float32 all represent exactly, so
the bytes are identical whatever the dtype rounding. A rank holding heads [r*H, (r+1)*H)
gets exactly the slice of the full block for its heads: rank enters through the global
head index, which keeps tensor-parallel shards consistent with one another.

Only integer arithmetic on Python ints and small tensors: never Python's ``hash()``,
which is randomised per process for strings.
"""

from __future__ import annotations

import functools

import torch

from kvlife.transfer.layout import BlockGeometry, DeviceKV

_PRIME = 251
_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def stable_mix(*parts: int) -> int:
    """A 64-bit mix of arbitrary Python ints (any sign, any width), stable across runs."""
    state = 0x6A09E667F3BCC909
    for part in parts:
        if isinstance(part, bool) or not isinstance(part, int):
            raise TypeError(f"stable_mix takes ints, got {type(part).__name__}")
        # Fold sign and every 64-bit limb in, so wide hashes do not collide by truncation.
        value = (-part << 1) | 1 if part < 0 else part << 1
        while True:
            state = _splitmix64(state ^ (value & _MASK64))
            value >>= 64
            if value == 0:
                break
    return state


@functools.lru_cache(maxsize=64)
def _lattice(geometry: BlockGeometry, rank: int, device: torch.device) -> torch.Tensor:
    """int32 ``[2, tokens, local_heads, head_dim]``: the per-element term, mod 251."""
    if not 0 <= rank < geometry.world_size:
        raise ValueError(f"rank {rank} out of range for world_size {geometry.world_size}")
    shape = geometry.shape
    heads = geometry.local_heads
    kv = torch.arange(2, dtype=torch.int64).view(2, 1, 1, 1)
    pos = torch.arange(shape.block_tokens, dtype=torch.int64).view(1, -1, 1, 1)
    head = (rank * heads + torch.arange(heads, dtype=torch.int64)).view(1, 1, -1, 1)
    dim = torch.arange(shape.head_dim, dtype=torch.int64).view(1, 1, 1, -1)
    # Coefficients are primes that are non-zero mod 251, so neighbours differ.
    lattice = (kv * 7919 + pos * 104729 + head * 1299709 + dim * 15485863) % _PRIME
    return lattice.to(torch.int32).to(device)


def _layer_coefficients(block_hash: int, num_layers: int) -> tuple[list[int], list[int]]:
    mults: list[int] = []
    offsets: list[int] = []
    for layer in range(num_layers):
        mixed = stable_mix(block_hash, layer)
        mults.append(1 + mixed % (_PRIME - 1))
        offsets.append((mixed >> 32) % _PRIME)
    return mults, offsets


def expected_block(
    geometry: BlockGeometry,
    block_hash: int,
    rank: int = 0,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """The content of one block as held by ``rank``: shape ``geometry.block_shape``."""
    dev = torch.device(device)
    lattice = _lattice(geometry, rank, dev)
    mults, offsets = _layer_coefficients(block_hash, geometry.shape.num_layers)
    a = torch.tensor(mults, dtype=torch.int32, device=dev).view(-1, 1, 1, 1, 1)
    b = torch.tensor(offsets, dtype=torch.int32, device=dev).view(-1, 1, 1, 1, 1)
    values = (lattice.unsqueeze(0) * a + b) % _PRIME - (_PRIME // 2)
    return values.to(geometry.shape.torch_dtype)


def expected_bytes(geometry: BlockGeometry, block_hash: int, rank: int = 0) -> torch.Tensor:
    """The block as a flat uint8 CPU tensor of ``geometry.block_bytes``."""
    return expected_block(geometry, block_hash, rank).reshape(-1).view(torch.uint8)


def fill_block(kv: DeviceKV, block_id: int, block_hash: int, rank: int = 0) -> None:
    """Write the content of ``block_hash`` into device block ``block_id``."""
    kv.data[block_id].copy_(expected_block(kv.geometry, block_hash, rank, kv.device))


def verify_block(kv: DeviceKV, block_id: int, block_hash: int, rank: int = 0) -> bool:
    """True when device block ``block_id`` holds exactly the bytes of ``block_hash``."""
    expected = expected_block(kv.geometry, block_hash, rank, kv.device)
    return torch.equal(kv.flat[block_id], expected.reshape(-1).view(torch.uint8))


def verify_bytes(geometry: BlockGeometry, data: torch.Tensor, block_hash: int, rank: int = 0) -> bool:
    """True when the flat uint8 tensor ``data`` holds exactly the bytes of ``block_hash``."""
    expected = expected_bytes(geometry, block_hash, rank)
    return data.numel() == expected.numel() and torch.equal(data.reshape(-1).cpu(), expected)
