"""Disk tier: raw slots with checksums; bad, truncated or unwritten slots are misses."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

from kvlife.transfer.block_header import layout_fingerprint
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
    assert tier.drain_events() == [{"event": "disk_checksum_mismatch", "tier": "disk", "slot": 3, "block": 11,
                                    "reason": "payload checksum mismatch"}]


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


# ---- recovery of a named path ---------------------------------------------------------------
def _fill(path: Path, blocks: dict[int, int], capacity: int = 8) -> None:
    with DiskTier(path, GEO, capacity) as first:
        for h, slot in blocks.items():
            assert first.write_block(h, slot, expected_bytes(GEO, h))


def test_reopening_a_file_recovers_the_blocks_it_holds(tmp_path: Path) -> None:
    path = tmp_path / "kv.bin"
    written = {5: 0, -5: 2, 2**90: 3, 77: 6}
    _fill(path, written)
    with DiskTier(path, GEO, 8) as again:
        assert again.recovered == written
        assert again.drain_events() == []
        for h, slot in written.items():
            assert again.index.contains(h) and again.index.slot_of(h) == slot
            assert again.read(h, slot) == expected_bytes(GEO, h).numpy().tobytes()
        again.index.check_accounting()
        assert again.index.free == 8 - len(written)
        # New stores never take a recovered slot.
        plan = again.index.prepare_store([1000, 1001, 1002, 1003])
        assert {slot for _, slot in plan.accepted} == {1, 4, 5, 7}


def test_a_corrupt_slot_is_dropped_on_recovery_with_an_event(tmp_path: Path) -> None:
    path = tmp_path / "kv.bin"
    _fill(path, {11: 1, 12: 2, 13: 4})
    stride = DiskTier(tmp_path / "probe.bin", GEO, 1).slot_stride
    with open(path, "r+b") as f:  # flip one payload byte of slot 2 and the header of slot 4
        f.seek(2 * stride + HEADER_BYTES + 100)
        byte = f.read(1)[0]
        f.seek(2 * stride + HEADER_BYTES + 100)
        f.write(bytes([byte ^ 0x10]))
        f.seek(4 * stride + 9)
        f.write(b"\xee")
    with DiskTier(path, GEO, 8) as again:
        assert again.recovered == {11: 1}
        events = again.drain_events()
        assert [(e["event"], e["slot"], e["block"], e["reason"]) for e in events] == [
            ("disk_slot_dropped", 2, 12, "payload checksum mismatch"),
            ("disk_slot_dropped", 4, None, "header checksum mismatch"),
        ]
        assert all(e["level"] == "warning" and e["path"] == str(path) for e in events)
        assert again.read(12, 2) is None and not again.index.contains(12)
        again.drain_events()
    with DiskTier(path, GEO, 8) as third:  # dropped slots were zeroed: dropped once, not forever
        assert third.recovered == {11: 1} and third.drain_events() == []


def test_recovery_drops_slots_of_another_layout_and_past_a_smaller_capacity(tmp_path: Path) -> None:
    path = tmp_path / "kv.bin"
    _fill(path, {1: 0, 2: 7})
    with DiskTier(path, GEO, 4) as smaller:  # slot 7 is past the end now: truncated away
        assert smaller.recovered == {1: 0} and smaller.drain_events() == []
    other = BlockGeometry(SMALL_SHAPE, 2)  # half the bytes per block, another slot stride
    with DiskTier(path, other, 4) as foreign:
        assert foreign.recovered == {}
        events = foreign.drain_events()  # slot 0's header, then old payload bytes where slot 1 starts now
        assert [(e["slot"], e["reason"].split(" (")[0]) for e in events] == [
            (0, f"written for layout {layout_fingerprint(GEO):016x}"), (1, "no block header")]


def test_a_fresh_file_scans_nothing(tmp_path: Path) -> None:
    with DiskTier(tmp_path / "new.bin", GEO, 8) as tier:
        assert tier.recovered == {} and tier.drain_events() == []
