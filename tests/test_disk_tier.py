"""Disk tier: raw slots with checksums; bad, truncated or unwritten slots are misses."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

from kvlife.transfer.content import expected_bytes
from kvlife.transfer.disk_tier import HEADER_BYTES, Buffer, DiskTier, DiskTierError
from kvlife.transfer.layout import SMALL_SHAPE, BlockGeometry

GEO = BlockGeometry(SMALL_SHAPE)


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[DiskTier]:
    with DiskTier(tmp_path / "kv.bin", GEO, 8) as t:
        yield t


def test_file_is_preallocated_with_aligned_slots(tier: DiskTier) -> None:
    assert tier.slot_stride % 4096 == 0 and tier.slot_stride >= HEADER_BYTES + GEO.block_bytes
    assert os.path.getsize(tier.path) == 8 * tier.slot_stride


def test_round_trip(tier: DiskTier) -> None:
    for slot, h in enumerate((5, -5, 2**90)):
        assert tier.write_block(h, slot, expected_bytes(GEO, h))
    for slot, h in enumerate((5, -5, 2**90)):
        assert tier.read(h, slot) == expected_bytes(GEO, h).numpy().tobytes()
    rows = torch.zeros((2, GEO.block_bytes), dtype=torch.uint8)
    assert tier.read_blocks([(2**90, 2), (5, 0)], rows) == [True, True]
    assert torch.equal(rows[0], expected_bytes(GEO, 2**90))
    assert tier.write_blocks([(7, 7)], rows[1:]) == [True]
    assert tier.read(7, 7) == expected_bytes(GEO, 5).numpy().tobytes()
    assert tier.drain_events() == []


def test_wrong_hash_and_unwritten_slot_are_misses(tier: DiskTier) -> None:
    assert tier.write_block(1, 0, expected_bytes(GEO, 1))
    assert tier.read(2, 0) is None
    assert tier.read(1, 1) is None
    assert [e["event"] for e in tier.drain_events()] == ["disk_hash_mismatch", "disk_bad_header"]


def test_corrupt_byte_is_a_miss_with_event(tier: DiskTier) -> None:
    assert tier.write_block(11, 3, expected_bytes(GEO, 11))
    offset = 3 * tier.slot_stride + HEADER_BYTES + GEO.block_bytes - 1
    with open(tier.path, "r+b") as f:
        f.seek(offset)
        last = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([last ^ 1]))
    dst = torch.full((GEO.block_bytes,), 7, dtype=torch.uint8)
    assert not tier.read_into(11, 3, dst)
    assert tier.drain_events() == [{"event": "disk_checksum_mismatch", "tier": "disk", "slot": 3, "block": 11}]


def test_corrupt_header_is_a_miss(tier: DiskTier) -> None:
    assert tier.write_block(11, 0, expected_bytes(GEO, 11))
    with open(tier.path, "r+b") as f:
        f.seek(20)
        f.write(b"\x01")
    assert tier.read(11, 0) is None
    assert tier.drain_events()[0]["event"] == "disk_bad_header"


def test_truncated_file_is_a_miss(tier: DiskTier) -> None:
    assert tier.write_block(4, 5, expected_bytes(GEO, 4))
    os.truncate(tier.path, 5 * tier.slot_stride + HEADER_BYTES + 10)
    assert tier.read(4, 5) is None
    (event,) = tier.drain_events()
    assert event["event"] == "disk_short_read" and event["slot"] == 5 and event["block"] == 4


def test_unwritable_path_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such" / "dir" / "kv.bin"
    with pytest.raises(DiskTierError, match=str(missing)) as info:
        DiskTier(missing, GEO, 4)
    assert isinstance(info.value, OSError) and info.value.errno == errno.ENOENT
    if os.geteuid() != 0:  # root ignores permission bits
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
        with pytest.raises(DiskTierError, match="locked"):
            DiskTier(locked / "kv.bin", GEO, 4)
    with pytest.raises(DiskTierError, match="is_a_dir"):
        (tmp_path / "is_a_dir").mkdir()
        DiskTier(tmp_path / "is_a_dir", GEO, 4)


def test_disk_full_mid_write_fails_cleanly(tmp_path: Path) -> None:
    budget = {"bytes": GEO.block_bytes + HEADER_BYTES + 1000}

    def small_disk(fd: int, buffers: Sequence[Buffer], offset: int) -> int:
        # Writes what fits, then reports ENOSPC: a disk filling up mid-block.
        data = b"".join(bytes(b) for b in buffers)
        room = budget["bytes"]
        if room <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        budget["bytes"] -= len(data)
        return os.pwrite(fd, data[:room], offset)

    with DiskTier(tmp_path / "kv.bin", GEO, 4, writer=small_disk) as tier:
        assert tier.write_block(1, 0, expected_bytes(GEO, 1))
        assert not tier.write_block(2, 1, expected_bytes(GEO, 2))  # short write
        assert not tier.write_block(3, 2, expected_bytes(GEO, 3))  # ENOSPC
        events = tier.drain_events()
        assert [e["event"] for e in events] == ["disk_short_write", "disk_write_failed"]
        assert events[1]["errno"] == errno.ENOSPC
        # The half-written slot never serves bytes; the good one still does.
        assert tier.read(2, 1) is None and tier.read(3, 2) is None
        assert tier.read(1, 0) == expected_bytes(GEO, 1).numpy().tobytes()


def test_wrong_payload_size_is_a_programming_error(tier: DiskTier) -> None:
    with pytest.raises(ValueError):
        tier.write_block(1, 0, b"short")
    with pytest.raises(IndexError):
        tier.read(1, 8)
