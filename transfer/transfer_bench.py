"""Transfer benchmark: copy-engine throughput against a raw torch copy of the same bytes.

For each block size and batch size the bench stores a batch of device blocks into a tier
and loads it back into other device blocks through ``CopyEngine`` (submit, flush, poll:
everything the live driver pays), and times, in the same run, a plain ``copy_`` of the
same number of bytes as one contiguous tensor. Both sides walk through buffers at least
as large as the pools, a fresh window per repeat, so neither is served from CPU caches.
Device block ids are a fixed pseudo-random permutation (a paged allocator after churn);
slots are consecutive, as a fresh tier index hands them out. Medians over repeats.

Disk rows time the same engine path against a file in ``disk_dir`` (the page cache is
warm: this measures the tier's CPU cost, checksums included, not the drive). Redis rows
need a server URL. Lookup latency is the tier's own lookup for a batch of hashes:
``TierIndex.lookup`` for disk, one pipelined ``exists_many`` round trip for Redis.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvlife.transfer.copy_engine import CopyEngine, Move, Tier
from kvlife.transfer.disk_tier import DiskTier
from kvlife.transfer.host_pool import HostPool
from kvlife.transfer.layout import BlockGeometry, DeviceKV, ModelShape
from kvlife.transfer.redis_tier import RedisTier

KB = 1024
MB = 1024 * KB
DEFAULT_BLOCK_SIZES = (16 * KB, 64 * KB, 256 * KB, 1 * MB, 2 * MB)
DEFAULT_BATCHES = (1, 8, 32, 128, 1024)
QUICK_BLOCK_SIZES = (64 * KB, 1 * MB)
QUICK_BATCHES = (1, 32)
# fp16, 8 KV heads x 128 dims: K and V of one token in one layer are 4 KB.
_TOKEN_LAYER_BYTES = 2 * 8 * 128 * 2

Row = dict[str, Any]


def shape_for_block_bytes(block_bytes: int) -> ModelShape:
    """A Llama-like shape whose block across all layers is exactly ``block_bytes``."""
    tokens = max(1, min(16, block_bytes // _TOKEN_LAYER_BYTES))
    layers = block_bytes // (tokens * _TOKEN_LAYER_BYTES)
    shape = ModelShape(
        num_layers=max(1, layers),
        num_kv_heads=8,
        head_dim=128,
        dtype="float16",
        block_tokens=tokens,
    )
    if BlockGeometry(shape).block_bytes != block_bytes:
        raise ValueError(f"block size {block_bytes} is not a multiple of {_TOKEN_LAYER_BYTES} B")
    return shape


def _interleaved_medians(runs: dict[str, Callable[[int], None]], repeats: int) -> dict[str, float]:
    """Median seconds of each run. The runs alternate within every repeat, so a noisy
    neighbour on a shared machine hits engine and baseline alike, not one of them."""
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for rep in range(repeats + 1):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn(rep)
            if rep:  # rep 0 warms up: first-touch and allocator effects stay out
                samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in samples.items()}


def _percentile_us(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e6


def _engine_runs(
    engine: CopyEngine, tier_name: str, device_order: list[int], tier_blocks: int, batch: int
) -> dict[str, Callable[[int], None]]:
    """Store and load of one batch through the engine; load ``rep`` reads what store
    ``rep`` wrote (disk and Redis check it)."""
    num_device = len(device_order)
    windows = max(1, num_device // (2 * batch))

    def moves(rep: int, half: int) -> list[Move]:
        # Stores read one half of the device blocks, loads write the other half.
        start = ((rep % windows) * 2 + half) * batch
        slot0 = (rep * batch) % max(1, tier_blocks - batch + 1)
        return [Move(1 + slot0 + i, device_order[(start + i) % num_device], tier_name, slot0 + i) for i in range(batch)]

    def run(kind: str, rep: int) -> None:
        if kind == "store":
            engine.submit_store(rep, moves(rep, 0))
        else:
            engine.submit_load(rep, moves(rep, 1))
        engine.flush()
        engine.synchronize()
        (done,) = engine.poll()
        if done.failed_hashes:
            raise RuntimeError(f"bench {kind} failed for {len(done.failed_hashes)} blocks")

    return {"store": lambda rep: run("store", rep), "load": lambda rep: run("load", rep)}


def _raw_run(src: torch.Tensor, dst: torch.Tensor, nbytes: int) -> Callable[[int], None]:
    """One contiguous copy of ``nbytes``, from a fresh window of the big buffers per repeat."""
    windows = max(1, src.numel() // nbytes)
    cuda = dst.device.type == "cuda"

    def run(rep: int) -> None:
        s = ((rep * 7) % windows) * nbytes
        d = ((rep * 3 + 1) % windows) * nbytes
        dst[d : d + nbytes].copy_(src[s : s + nbytes], non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()

    return run


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def usable_batches(tier_name: str, block_bytes: int, batches: Sequence[int], pool_bytes: int,
                   disk_batch_bytes: int) -> list[int]:
    """The batches measured for this tier and block size: at most half the pool (host), and
    at most ``disk_batch_bytes`` per batch (disk, Redis)."""
    num_blocks = max(2, pool_bytes // block_bytes)
    if tier_name == "host":
        return [b for b in batches if 2 * b <= num_blocks]
    return [b for b in batches if b * block_bytes <= disk_batch_bytes and 2 * b <= num_blocks]


def run_transfer_bench(
    block_sizes: Sequence[int] = DEFAULT_BLOCK_SIZES,
    batches: Sequence[int] = DEFAULT_BATCHES,
    repeats: int = 9,
    tiers: Sequence[str] = ("host", "disk"),
    redis_url: str | None = None,
    pool_bytes: int = 512 * MB,
    disk_batch_bytes: int = 64 * MB,
    disk_dir: str | None = None,
    quick: bool = False,
    lookup_samples: int = 200,
    progress: Callable[[int, int], None] | None = None,
    threads: int | None = None,
) -> list[Row]:
    """Measure and return one row per (tier, block size, batch).

    Batches larger than half the pool (host) or than ``disk_batch_bytes`` (disk, Redis)
    are skipped so the full run stays within a few minutes and < 4 GB of RAM.
    ``progress(rows done, rows planned)`` is called after each row. ``threads`` sets torch's
    intra-op threads (None: torch's choice).
    """
    if threads is not None:
        torch.set_num_threads(threads)
    if quick:
        block_sizes, batches, repeats = QUICK_BLOCK_SIZES, QUICK_BATCHES, 2
        pool_bytes, disk_batch_bytes, lookup_samples = 64 * MB, 16 * MB, 20
    tiers = [t for t in tiers if t != "redis" or redis_url is not None]
    planned = sum(len(usable_batches(t, b, batches, pool_bytes, disk_batch_bytes)) for b in block_sizes for t in tiers)
    rows: list[Row] = []
    done = 0

    def row_done() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, planned)

    with tempfile.TemporaryDirectory(prefix="kvlife-bench-", dir=disk_dir) as tmp:
        for block_bytes in block_sizes:
            geo = BlockGeometry(shape_for_block_bytes(block_bytes))
            num_blocks = max(2, pool_bytes // block_bytes)
            kv = DeviceKV(geo, num_blocks)
            device_order = list(range(num_blocks))
            random.Random(block_bytes).shuffle(device_order)
            # Raw baseline buffers as large as the pools: a fresh window per repeat.
            # On CUDA the baseline is one host-to-device copy of pinned memory.
            raw_src = torch.ones(num_blocks * block_bytes, dtype=torch.uint8, pin_memory=kv.device.type == "cuda")
            raw_dst = torch.zeros(num_blocks * block_bytes, dtype=torch.uint8, device=kv.device)
            for tier_name in tiers:
                rows.extend(
                    _bench_tier(
                        tier_name,
                        geo,
                        kv,
                        device_order,
                        batches,
                        repeats,
                        raw_src,
                        raw_dst,
                        disk_batch_bytes,
                        tmp,
                        redis_url,
                        lookup_samples,
                        row_done,
                    )
                )
            del kv, raw_src, raw_dst
    return rows


def _bench_tier(
    tier_name: str,
    geo: BlockGeometry,
    kv: DeviceKV,
    device_order: list[int],
    batches: Sequence[int],
    repeats: int,
    raw_src: torch.Tensor,
    raw_dst: torch.Tensor,
    disk_batch_bytes: int,
    tmp: str,
    redis_url: str | None,
    lookup_samples: int,
    row_done: Callable[[], None] = lambda: None,
) -> list[Row]:
    block_bytes = geo.block_bytes
    num_blocks = kv.num_blocks
    usable = usable_batches(tier_name, block_bytes, batches, num_blocks * block_bytes, disk_batch_bytes)
    capacity = num_blocks if tier_name == "host" else max(usable, default=1)
    if not usable:
        return []
    tier: Tier
    lookup: Callable[[list[int]], object]
    if tier_name == "host":
        tier = HostPool(geo, capacity)
        lookup = tier.index.lookup
    elif tier_name == "disk":
        tier = DiskTier(f"{tmp}/disk-{block_bytes}.bin", geo, capacity)
        lookup = tier.index.lookup
    elif tier_name == "redis" and redis_url is not None:
        tier = RedisTier(redis_url, geo, key_prefix=f"kvlife-bench-{block_bytes}")
        lookup = tier.exists_many
    else:
        raise ValueError(f"unknown tier {tier_name!r}")
    if isinstance(tier, HostPool | DiskTier):
        # Register block 1 + s at slot s, as the moves below assume, so lookups walk
        # real entries (a fresh index hands out the lowest free slot first).
        plan = tier.index.prepare_store(range(1, capacity + 1))
        tier.index.complete_store([h for h, _ in plan.accepted])
        if any(slot != h - 1 for h, slot in plan.accepted):
            raise RuntimeError("tier index did not hand out slots in order")
    engine = CopyEngine(kv, 0, {tier_name: tier}, staging_bytes=min(64 * MB, capacity * block_bytes))
    rows = []
    for batch in usable:
        nbytes = batch * block_bytes
        runs = _engine_runs(engine, tier_name, device_order, capacity, batch)
        runs["raw"] = _raw_run(raw_src, raw_dst, nbytes)
        medians = _interleaved_medians(runs, repeats)
        store_s, load_s, raw_s = medians["store"], medians["load"], medians["raw"]
        row: Row = {
            "tier": tier_name,
            "block_bytes": block_bytes,
            "batch": batch,
            "load_gbps": _gbps(nbytes, load_s),
            "store_gbps": _gbps(nbytes, store_s),
            "raw_gbps": _gbps(nbytes, raw_s),
            "load_ratio": raw_s / load_s,
            "store_ratio": raw_s / store_s,
            "lookup_p50_us": None,
            "lookup_p99_us": None,
        }
        if tier_name != "host":
            hashes = [1 + i for i in range(batch)]
            samples = []
            for _ in range(lookup_samples):
                start = time.perf_counter()
                lookup(hashes)
                samples.append(time.perf_counter() - start)
            row["lookup_p50_us"] = _percentile_us(samples, 0.50)
            row["lookup_p99_us"] = _percentile_us(samples, 0.99)
        row_done()
        rows.append(row)
    if isinstance(tier, DiskTier | RedisTier):
        tier.close()
    return rows


def _size(nbytes: int) -> str:
    return f"{nbytes // MB} MB" if nbytes >= MB else f"{nbytes // KB} KB"


def format_table(rows: Sequence[Row]) -> str:
    """A fixed-width text table of bench rows."""
    header = (
        f"{'tier':<6}{'block':>8}{'batch':>7}{'load GB/s':>11}{'store GB/s':>12}"
        f"{'raw GB/s':>10}{'load/raw':>10}{'store/raw':>11}{'lookup p50 us':>15}"
        f"{'p99 us':>9}"
    )
    lines = [header, "-" * len(header)]

    def us(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    for r in rows:
        lines.append(
            f"{r['tier']:<6}{_size(r['block_bytes']):>8}{r['batch']:>7}"
            f"{r['load_gbps']:>11.2f}{r['store_gbps']:>12.2f}{r['raw_gbps']:>10.2f}"
            f"{r['load_ratio']:>10.2f}{r['store_ratio']:>11.2f}"
            f"{us(r['lookup_p50_us']):>15}{us(r['lookup_p99_us']):>9}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m kvlife.transfer.transfer_bench ARGS`` is ``kvlife bench transfer ARGS``."""
    import sys

    from kvlife.lifecycle.cli.main import main as kvlife

    return kvlife(["bench", "transfer", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
