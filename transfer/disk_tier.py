"""Disk tier: a preallocated file of fixed-size slots holding raw block bytes.

Slot ``i`` starts at ``i * slot_stride``: the 64-byte block header of
``kvlife.transfer.block_header`` (format version, layout fingerprint of the model, rank,
block hash, payload length, checksums), then ``block_bytes`` of raw payload (never
pickle). A read whose header is not this rank's block in this layout, whose checksum does
not match, or that comes up short (a truncated file), is a miss with a structured fault
event (``disk_<kind>``, with a reason): bad bytes are never served, whatever
``live.verify`` says. A failed write (disk full, I/O error, short write) is reported as a
failed store.

Opening a file that already holds slots (a named ``live.disk_path`` on restart) recovers
it: every slot whose header and checksum are valid for this rank and layout is indexed
again (``recovered``); every other written slot (another layout, another rank, an older
format, a bad checksum) is dropped, zeroed, and reported as a ``disk_slot_dropped`` event.

Which block sits in which slot, pinning and eviction are the business of ``index`` (a
``TierIndex``); the tier only keeps the bytes and checks them on the way back.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from typing import Any, Self

import torch

from kvlife.transfer.block_header import HEADER_BYTES, BlockFormat, Header, Mismatch
from kvlife.transfer.index import TierIndex
from kvlife.transfer.layout import BlockGeometry, Buffer, cpu_byte_view

__all__ = ["HEADER_BYTES", "Buffer", "DiskTier", "DiskTierError"]

# Page-aligned slots keep each block's payload within as few pages as possible.
_ALIGN = 4096

Writer = Callable[[int, Sequence[Buffer], int], int]


class DiskTierError(OSError):
    """The tier's file cannot be created, opened or preallocated."""


class DiskTier:
    """``capacity_blocks`` slots in the file at ``path``."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        geometry: BlockGeometry,
        capacity_blocks: int,
        eviction: str = "lru",
        name: str = "disk",
        writer: Writer | None = None,
        rank: int = 0,
    ) -> None:
        if capacity_blocks <= 0:
            raise ValueError(f"capacity_blocks must be a positive int, got {capacity_blocks!r}")
        self.name = name
        self.path = os.fspath(path)
        self.geometry = geometry
        self.capacity = capacity_blocks
        self.block_bytes = geometry.block_bytes
        self.format = BlockFormat(geometry, rank)
        self.rank = rank
        self.slot_stride = -(-(HEADER_BYTES + self.block_bytes) // _ALIGN) * _ALIGN
        self.index = TierIndex(name, capacity_blocks, eviction)
        self.events: list[dict[str, Any]] = []
        # Injectable so tests can simulate a full disk or a short write.
        self._writer: Writer = writer if writer is not None else os.pwritev
        self._header = bytearray(HEADER_BYTES)
        self.recovered: dict[int, int] = {}  # block hash -> slot, found valid at open
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise DiskTierError(
                exc.errno, f"disk tier {name!r}: cannot open {self.path}: {exc.strerror}", self.path
            ) from exc
        try:
            size = self.slot_stride * capacity_blocks
            existing = os.fstat(self._fd).st_size
            os.ftruncate(self._fd, size)
            if hasattr(os, "posix_fallocate"):
                # Reserve the blocks now so "disk full" shows up here, not mid-run.
                os.posix_fallocate(self._fd, 0, size)
        except OSError as exc:
            os.close(self._fd)
            raise DiskTierError(
                exc.errno,
                f"disk tier {name!r}: cannot preallocate {size} bytes in {self.path}: {exc.strerror}",
                self.path,
            ) from exc
        if existing:
            self._recover(min(capacity_blocks, -(-existing // self.slot_stride)))

    def _recover(self, slots: int) -> None:
        """Index again the valid blocks of a file a previous run wrote; drop the rest."""
        header = self._header
        payload = bytearray(self.block_bytes)
        for slot in range(slots):
            offset = slot * self.slot_stride
            try:
                got = os.preadv(self._fd, [header], offset)
            except OSError as exc:
                self._drop_slot(slot, None, f"cannot read the header: {exc.strerror}")
                continue
            if got < HEADER_BYTES or not any(header):
                continue  # never written (or invalidated): an empty slot
            parsed = self.format.check_header(header, None)
            if isinstance(parsed, Mismatch):
                self._drop_slot(slot, None, parsed.reason)
                continue
            block_hash = parsed.block_hash
            assert block_hash is not None  # check_header(None) insists on a named block
            try:
                got = os.preadv(self._fd, [payload], offset + HEADER_BYTES)
            except OSError as exc:
                self._drop_slot(slot, block_hash, f"cannot read the payload: {exc.strerror}")
                continue
            if got < self.block_bytes:
                self._drop_slot(slot, block_hash, "short payload")
                continue
            checked = self.format.check(header, block_hash, payload)
            if not isinstance(checked, Header):
                self._drop_slot(slot, block_hash, checked.reason)
                continue
            if block_hash in self.recovered:
                self._drop_slot(slot, block_hash, f"duplicate of slot {self.recovered[block_hash]}")
                continue
            self.index.adopt(block_hash, slot)
            self.recovered[block_hash] = slot

    def _drop_slot(self, slot: int, block_hash: int | None, reason: str) -> None:
        self._invalidate(slot)
        self.events.append({"event": "disk_slot_dropped", "level": "warning", "tier": self.name,
                            "slot": slot, "block": block_hash, "reason": reason, "path": self.path})

    # ---- lifecycle -----------------------------------------------------------------
    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def drain_events(self) -> list[dict[str, Any]]:
        events, self.events = self.events, []
        return events

    # ---- single blocks -------------------------------------------------------------
    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.capacity:
            raise IndexError(f"{self.name}: slot {slot} out of range 0..{self.capacity - 1}")

    def _fault(self, event: str, slot: int, block_hash: int, **detail: Any) -> bool:
        self.events.append({"event": event, "tier": self.name, "slot": slot, "block": block_hash, **detail})
        return False

    def write_block(self, block_hash: int, slot: int, payload: torch.Tensor | Buffer) -> bool:
        """Store one block; False (and a fault event) when the write did not complete."""
        self._check_slot(slot)
        view = cpu_byte_view(payload)
        if view.nbytes != self.block_bytes:
            raise ValueError(f"{self.name}: payload is {view.nbytes} bytes, blocks are {self.block_bytes}")
        header = self.format.pack(block_hash, view)
        offset = slot * self.slot_stride
        try:
            written = self._writer(self._fd, [header, view], offset)
        except OSError as exc:
            self._invalidate(slot)
            return self._fault("disk_write_failed", slot, block_hash, errno=exc.errno, error=exc.strerror)
        if written != HEADER_BYTES + view.nbytes:
            self._invalidate(slot)
            return self._fault(
                "disk_short_write",
                slot,
                block_hash,
                written=written,
                expected=HEADER_BYTES + view.nbytes,
            )
        return True

    def _invalidate(self, slot: int) -> None:
        """Best effort: zero the header so a half-written slot cannot look valid."""
        with contextlib.suppress(OSError):  # if this fails too, the checksum still guards
            os.pwrite(self._fd, bytes(HEADER_BYTES), slot * self.slot_stride)

    def read_into(self, block_hash: int, slot: int, dst: torch.Tensor | memoryview) -> bool:
        """Read one block into ``dst`` (``block_bytes`` long). False means a miss: then
        ``dst`` holds unspecified bytes that must not be used."""
        self._check_slot(slot)
        view = cpu_byte_view(dst) if isinstance(dst, torch.Tensor) else memoryview(dst).cast("B")
        if view.nbytes != self.block_bytes or view.readonly:
            raise ValueError(f"{self.name}: destination must be {self.block_bytes} writable bytes")
        header = self._header
        offset = slot * self.slot_stride
        try:
            got = os.preadv(self._fd, [header, view], offset)
        except OSError as exc:
            return self._fault("disk_read_failed", slot, block_hash, errno=exc.errno)
        if got < HEADER_BYTES + self.block_bytes:
            return self._fault("disk_short_read", slot, block_hash, got=got)
        checked = self.format.check(header, block_hash, view)
        if isinstance(checked, Mismatch):
            return self._fault(f"disk_{checked.kind}", slot, block_hash, reason=checked.reason)
        return True

    def read(self, block_hash: int, slot: int) -> bytes | None:
        """The block's bytes, or None on a miss."""
        buf = bytearray(self.block_bytes)
        return bytes(buf) if self.read_into(block_hash, slot, memoryview(buf)) else None

    # ---- batches (the copy engine's interface) -------------------------------------
    def write_blocks(self, items: Sequence[tuple[int, int]], src: torch.Tensor) -> list[bool]:
        """Store row ``i`` of ``src`` (``[n, block_bytes]`` uint8, CPU) as ``items[i]`` =
        (block hash, slot). Returns per-item success."""
        return [self.write_block(h, slot, src[i]) for i, (h, slot) in enumerate(items)]

    def read_blocks(self, items: Sequence[tuple[int, int]], dst: torch.Tensor) -> list[bool]:
        """Read ``items[i]`` = (block hash, slot) into row ``i`` of ``dst``; per-item hit."""
        ok = [False] * len(items)
        # File order keeps reads sequential when slots are.
        for i in sorted(range(len(items)), key=lambda k: items[k][1]):
            block_hash, slot = items[i]
            ok[i] = self.read_into(block_hash, slot, dst[i])
        return ok
