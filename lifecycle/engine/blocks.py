"""The device block pool: reference-counted blocks with prefix caching by block hash.

A block is held by references: the request whose block table holds it, and every
in-flight transfer job that reads or writes it. It returns to the free queue only when
the last reference goes, which is how invariant 2 (never free a block under a transfer)
holds whatever a policy decides. A free block keeps its hash and can still be hit by
prefix caching until it is reallocated.

The free queue is ordered as vLLM's ``BlockPool.free_blocks`` orders it (v1
``block_pool.py``): a request gives its blocks back tail first; a freed block with no hash
goes to the front of the queue (reused first, it holds nothing worth keeping), a freed
block with a hash to the back (reused last: LRU among cached blocks). So a request's
prefix stays cached longest, and its partial last block is recycled at once.

Blocks past the prompt have no hash in the workload; ``derived_block_hash`` names them
(output blocks, and prompt blocks a trace gave no hash for): a chained hash of the
previous block's hash, the request id and the block index. A workload that continues a
conversation (``kvlife.lifecycle.workloads.synthetic``) derives the same hashes for the
previous turn's answer, so the next turn can hit the blocks that turn stored.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence

BlockHash = int
NO_HASH = -1


def derived_block_hash(previous: BlockHash | None, request_id: str, index: int) -> BlockHash:
    """The hash of block ``index`` of ``request_id`` when the workload gave none: chained
    on the previous block's hash (``None`` for block 0), stable across processes, below
    2**63 so every JSON reader takes it."""
    key = f"{'' if previous is None else previous}/{request_id}/{index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") >> 1


def extend_hashes(hashes: Sequence[BlockHash], request_id: str, count: int) -> tuple[BlockHash, ...]:
    """``hashes`` extended with derived hashes up to ``count`` blocks."""
    out = list(hashes)
    while len(out) < count:
        out.append(derived_block_hash(out[-1] if out else None, request_id, len(out)))
    return tuple(out)


class OutOfBlocks(Exception):
    pass


class DeviceBlockPool:
    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"device pool capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.refs = [0] * capacity
        self.hashes = [NO_HASH] * capacity
        self.cached: dict[BlockHash, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(capacity))
        self.freed_total = 0  # blocks that went back to the free queue, ever
        # Hashes someone is watching (the scheduler: a blocked head's blocks): ``watch_hit``
        # turns True when one of them enters or leaves the prefix cache.
        self.watch: frozenset[BlockHash] | None = None
        self.watch_hit = False

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.capacity - len(self._free)

    def cached_prefix(self, hashes: Sequence[BlockHash]) -> int:
        """Number of leading hashes whose blocks are on the device and valid."""
        count = 0
        cached = self.cached
        for h in hashes:
            if h not in cached:
                break
            count += 1
        return count

    def block_of(self, block_hash: BlockHash) -> int | None:
        return self.cached.get(block_hash)

    def acquire_cached(self, block_hash: BlockHash) -> int:
        block = self.cached[block_hash]
        if self.refs[block] == 0:
            del self._free[block]
        self.refs[block] += 1
        return block

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise OutOfBlocks(f"need {count} blocks, {len(self._free)} free")
        blocks = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            old = self.hashes[block]
            if old != NO_HASH:
                # Reusing a cached block evicts its hash from the prefix cache.
                if self.cached.get(old) == block:
                    del self.cached[old]
                    if self.watch is not None and old in self.watch:
                        self.watch_hit = True
                self.hashes[block] = NO_HASH
            self.refs[block] = 1
            blocks.append(block)
        return blocks

    def retain(self, blocks: Iterable[int]) -> None:
        """Add a reference (a transfer job that reads or writes these blocks)."""
        refs = self.refs
        for block in blocks:
            if refs[block] <= 0:
                raise AssertionError(f"retain of unreferenced device block {block}")
            refs[block] += 1

    def release(self, blocks: Iterable[int]) -> list[int]:
        """Drop a reference; returns the blocks that became free, in the order given.
        Give a request's blocks tail first (``reversed(block_table)``): vLLM's eviction
        order. Freed blocks without a hash go to the front of the free queue (in that
        order), the others to the back."""
        freed = []
        unhashed = []
        refs = self.refs
        free = self._free
        hashes = self.hashes
        for block in blocks:
            if refs[block] <= 0:
                raise AssertionError(f"double release of device block {block}")
            refs[block] -= 1
            if refs[block] == 0:
                if hashes[block] == NO_HASH:
                    unhashed.append(block)
                else:
                    free[block] = None
                freed.append(block)
        for block in reversed(unhashed):
            free[block] = None
            free.move_to_end(block, last=False)
        self.freed_total += len(freed)
        return freed

    def register(self, block: int, block_hash: BlockHash) -> bool:
        """Publish a computed or loaded block in the prefix cache (first one wins)."""
        if block_hash in self.cached:
            return False
        self.cached[block_hash] = block
        self.hashes[block] = block_hash
        if self.watch is not None and block_hash in self.watch:
            self.watch_hit = True
        return True

    def forget(self, block: int) -> None:
        """Withdraw a block whose content is not what its hash says (a failed load)."""
        old = self.hashes[block]
        if old != NO_HASH and self.cached.get(old) == block:
            del self.cached[old]
            if self.watch is not None and old in self.watch:
                self.watch_hit = True
        self.hashes[block] = NO_HASH

    def check_accounting(self) -> None:
        """Invariant 8 on the device: free + used == capacity, free means unreferenced."""
        free_refs = [b for b in self._free if self.refs[b] != 0]
        if free_refs:
            raise AssertionError(f"device blocks {free_refs[:5]} are free but referenced")
        used = sum(1 for r in self.refs if r > 0)
        if used + len(self._free) != self.capacity:
            raise AssertionError(
                f"device: used {used} + free {len(self._free)} != capacity {self.capacity}"
            )
