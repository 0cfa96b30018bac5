"""The header every stored KV block carries, on disk and in Redis: bytes bound to their writer.

A stored block is this fixed 64-byte header (``struct``, little-endian), then the raw
payload; never pickle:

    offset  size  field
         0     4  magic b"KVLB"
         4     2  format version (``FORMAT_VERSION``)
         6     2  flags (0)
         8     8  layout fingerprint: model, dtype, block tokens, layers, KV heads, head dim,
                  TP degree (``layout_fingerprint``)
        16     2  rank: the tensor-parallel rank whose shard the payload is
        18     2  TP degree (also in the fingerprint; kept readable for messages)
        20     4  payload length in bytes
        24     4  crc32 of the payload
        28     8  fingerprint of the block hash (any width)
        36     1  block hash length in bytes (0: too wide to keep; the fingerprint still binds it)
        37    23  block hash, signed little-endian (a disk file is recovered from it)
        60     4  crc32 of bytes 0..59

A reader (``BlockFormat.check``) accepts a block only when every field is its own: the
format version, the layout of its model, its rank, the block hash it asked for, the
length of its blocks, and both checksums. Anything else is a ``Mismatch``, which the
tiers turn into a miss plus a tier event, whatever ``live.verify`` says: a value written
by another rank, another dtype or model of the same block size, or a well-formed value
re-checksummed under another fingerprint is never served.

The checksums catch accidents (torn writes, bit rot, a value under the wrong key), not a
forger with write access to the store: that needs a keyed MAC, which this format leaves
to a later version (the flags field is reserved for it).
"""

from __future__ import annotations

import hashlib
import struct
import zlib

import attrs

from kvlife.transfer.content import stable_mix
from kvlife.transfer.layout import BlockGeometry, Buffer

MAGIC = b"KVLB"
FORMAT_VERSION = 3  # 1-2: the disk tier's earlier headers, without layout or rank
HEADER_BYTES = 64
_HASH_BYTES = 23
_FIELDS = struct.Struct("<4sHHQHHIIQB23s")
_CRC = struct.Struct("<I")
_CRC_AT = HEADER_BYTES - _CRC.size
assert _FIELDS.size == _CRC_AT

# Mismatch kinds, in the order they are checked (tier events are "<tier>_<kind>").
BAD_HEADER = "bad_header"
FOREIGN_LAYOUT = "foreign_layout"
FOREIGN_RANK = "foreign_rank"
BAD_LENGTH = "bad_length"
HASH_MISMATCH = "hash_mismatch"
CHECKSUM_MISMATCH = "checksum_mismatch"


def layout_fingerprint(geometry: BlockGeometry) -> int:
    """64 bits naming the layout of one rank's block bytes: model, dtype, block tokens,
    layers, KV heads, head dim and TP degree. Stable across processes and machines."""
    shape = geometry.shape
    text = (f"kvlife-kv/{FORMAT_VERSION}|model={shape.model}|dtype={shape.dtype}|block_tokens={shape.block_tokens}"
            f"|layers={shape.num_layers}|kv_heads={shape.num_kv_heads}|head_dim={shape.head_dim}"
            f"|tp={geometry.world_size}")
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def hash_fingerprint(block_hash: int) -> int:
    return stable_mix(block_hash)


@attrs.frozen
class Mismatch:
    """Why a stored block is not the reader's: ``kind`` (one of the constants above) and a
    short human reason."""

    kind: str
    reason: str


@attrs.frozen
class Header:
    """A parsed header whose own checksum and magic are good (not yet checked against a reader)."""

    version: int
    layout: int
    rank: int
    world_size: int
    length: int
    payload_crc: int
    hash_fingerprint: int
    block_hash: int | None  # None: too wide to have been recorded


def _hash_field(block_hash: int) -> tuple[int, bytes]:
    length = block_hash.bit_length() // 8 + 1  # one more bit for the sign
    if length > _HASH_BYTES:
        return 0, b""
    return length, block_hash.to_bytes(length, "little", signed=True)


def parse(header: Buffer) -> Header | Mismatch:
    """The fields of ``header`` (``HEADER_BYTES`` long), or why it is not a header."""
    view = memoryview(header).cast("B")
    if view.nbytes < HEADER_BYTES:
        return Mismatch(BAD_HEADER, f"{view.nbytes} bytes, a header is {HEADER_BYTES}")
    magic, version, _flags, layout, rank, world, length, crc, hash_fp, hash_len, raw = _FIELDS.unpack_from(view)
    (header_crc,) = _CRC.unpack_from(view, _CRC_AT)
    if magic != MAGIC:
        return Mismatch(BAD_HEADER, "no block header (bad magic)")
    if header_crc != zlib.crc32(view[:_CRC_AT]):
        return Mismatch(BAD_HEADER, "header checksum mismatch")
    block_hash = int.from_bytes(raw[:hash_len], "little", signed=True) if 0 < hash_len <= _HASH_BYTES else None
    return Header(version, layout, rank, world, length, crc, hash_fp, block_hash)


class BlockFormat:
    """Packs and checks the blocks of one rank of one layout."""

    def __init__(self, geometry: BlockGeometry, rank: int = 0) -> None:
        if not 0 <= rank < geometry.world_size:
            raise ValueError(f"rank {rank} out of range for TP degree {geometry.world_size}")
        self.geometry = geometry
        self.rank = rank
        self.block_bytes = geometry.block_bytes
        self.layout = layout_fingerprint(geometry)

    def pack(self, block_hash: int, payload: memoryview) -> bytearray:
        """The header of ``payload`` (the raw bytes of ``block_hash``) as this rank writes it."""
        length, raw = _hash_field(block_hash)
        header = bytearray(HEADER_BYTES)
        _FIELDS.pack_into(header, 0, MAGIC, FORMAT_VERSION, 0, self.layout, self.rank, self.geometry.world_size,
                          payload.nbytes, zlib.crc32(payload), hash_fingerprint(block_hash), length, raw)
        _CRC.pack_into(header, _CRC_AT, zlib.crc32(header[:_CRC_AT]))
        return header

    def check_header(self, header: Buffer, block_hash: int | None) -> Header | Mismatch:
        """Everything but the payload checksum. ``block_hash`` None: any block of this
        rank and layout (recovering a file; the header names the block)."""
        parsed = parse(header)
        if isinstance(parsed, Mismatch):
            return parsed
        if parsed.version != FORMAT_VERSION:
            return Mismatch(BAD_HEADER, f"format version {parsed.version}, this reader has {FORMAT_VERSION}")
        if parsed.layout != self.layout:
            return Mismatch(FOREIGN_LAYOUT, f"written for layout {parsed.layout:016x} (another model, dtype or "
                                            f"shape), this reader's is {self.layout:016x}")
        if parsed.rank != self.rank or parsed.world_size != self.geometry.world_size:
            return Mismatch(FOREIGN_RANK, f"written by rank {parsed.rank} of {parsed.world_size}, "
                                          f"read by rank {self.rank} of {self.geometry.world_size}")
        if parsed.length != self.block_bytes:
            return Mismatch(BAD_LENGTH, f"payload of {parsed.length} bytes, blocks are {self.block_bytes}")
        if block_hash is not None and parsed.hash_fingerprint != hash_fingerprint(block_hash):
            return Mismatch(HASH_MISMATCH, "the value belongs to another block")
        if block_hash is None and (parsed.block_hash is None
                                   or parsed.hash_fingerprint != hash_fingerprint(parsed.block_hash)):
            return Mismatch(HASH_MISMATCH, "the header names no block it can be checked against")
        return parsed

    def check(self, header: Buffer, block_hash: int | None, payload: Buffer) -> Header | Mismatch:
        """The parsed header when ``header`` + ``payload`` are exactly this rank's
        ``block_hash`` in this layout; otherwise why not."""
        parsed = self.check_header(header, block_hash)
        if isinstance(parsed, Mismatch):
            return parsed
        if parsed.payload_crc != zlib.crc32(payload):
            return Mismatch(CHECKSUM_MISMATCH, "payload checksum mismatch")
        return parsed
