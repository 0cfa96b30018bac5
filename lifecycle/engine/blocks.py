"""The device block pool: vLLM 0.33's ``BlockPool`` for one full-attention KV cache group.

A block's reference count is the number of requests whose block tables hold it (vLLM's
``ref_cnt``). A block whose count drops to 0 goes back to the free queue, keeping its hash,
so it can still be hit by prefix caching until it is handed out again; being handed out
evicts its hash. The free queue is ordered as ``BlockPool.free_blocks`` orders it (v1
``block_pool.py``): a request gives its blocks back tail first; a freed block with no hash
goes to the front of the queue (reused first: it holds nothing worth keeping), a freed block
with a hash to the back (reused last: LRU among cached blocks). A hit takes a cached block
out of the free queue (``touch``).

The prefix cache maps a block hash to every block cached under it, oldest first
(``BlockHashToBlockMap``): vLLM does not de-duplicate (block tables are append-only), so two
requests that computed the same prompt block each keep their copy cached, and a hit takes
the oldest still cached. A request's full blocks are cached when the step that computes them
is scheduled (``KVCacheManager.allocate_slots`` → ``cache_blocks``), not when it ends; a load
caches its blocks when it lands.

Transfers hold no reference here (vLLM's connector cannot hold one either). The safety of a
block under a transfer comes from the lifecycle: a loading request keeps its blocks until
its load reports; a finished request whose stores still read its blocks is held
(``request_finished`` answers True) until they report; a preempted request's stores are
flushed before the next step writes anything. The connector core adds one hold of its own
(``hold``/``unhold``): the blocks of a transfer it gave up at a deadline stay out of the free
queue until the late report comes or the job is reclaimed.

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
        # hash -> the blocks cached under it, oldest first (a dict used as an ordered set).
        self.cached: dict[BlockHash, dict[int, None]] = {}
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(capacity))

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.capacity - len(self._free)

    def block_of(self, block_hash: BlockHash) -> int | None:
        """The block a hit on ``block_hash`` takes (the oldest cached copy), if any."""
        blocks = self.cached.get(block_hash)
        return next(iter(blocks)) if blocks else None

    def cached_prefix(self, hashes: Sequence[BlockHash]) -> list[int]:
        """The blocks of the longest run of leading hashes cached on the device
        (``find_longest_cache_hit``: a miss ends it, the hashes are chained)."""
        out = []
        cached = self.cached
        for h in hashes:
            blocks = cached.get(h)
            if not blocks:
                break
            out.append(next(iter(blocks)))
        return out

    def evictable(self, blocks: Iterable[int]) -> int:
        """How many of ``blocks`` sit in the free queue (a hit takes them out of it)."""
        refs = self.refs
        return sum(1 for b in blocks if refs[b] == 0)

    def touch(self, blocks: Iterable[int]) -> None:
        """A hit takes a reference on cached blocks (out of the free queue if unreferenced)."""
        refs = self.refs
        for block in blocks:
            if refs[block] == 0:
                del self._free[block]
            refs[block] += 1

    def allocate(self, count: int) -> list[int]:
        """``get_new_blocks``: the first ``count`` blocks of the free queue; a cached one
        loses its hash (evicted from the prefix cache)."""
        if count > len(self._free):
            raise OutOfBlocks(f"need {count} blocks, {len(self._free)} free")
        blocks = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self.refs[block] = 1
            blocks.append(block)
        return blocks

    def release(self, blocks: Iterable[int]) -> list[int]:
        """``free_blocks``: drop a reference on each of ``blocks``, given in eviction order
        (a request's blocks tail first). Returns the blocks that became free, in that order.
        Freed blocks without a hash go to the front of the free queue (in that order), the
        others to the back."""
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
        return freed

    def hold(self, blocks: Iterable[int]) -> None:
        """An extra reference: the connector core's quarantine of a job it gave up. A block
        no request holds any more (a preempted request's, under a store that never reported
        its flush) leaves the free queue, so nothing reuses it until the job ends."""
        self.touch(blocks)

    def cache(self, block: int, block_hash: BlockHash) -> None:
        """Publish a full block in the prefix cache under ``block_hash`` (a duplicate of a
        hash already cached is kept too, behind it)."""
        old = self.hashes[block]
        if old == block_hash:
            return
        if old != NO_HASH:
            self._evict(block)
        self.hashes[block] = block_hash
        self.cached.setdefault(block_hash, {})[block] = None

    def forget(self, blocks: Iterable[int]) -> None:
        """``evict_blocks``: withdraw blocks from the prefix cache (their content is not
        what their hash says); they stay allocated."""
        for block in blocks:
            self._evict(block)

    def _evict(self, block: int) -> None:
        old = self.hashes[block]
        if old == NO_HASH:
            return
        copies = self.cached.get(old)
        if copies is not None:
            copies.pop(block, None)
            if not copies:
                del self.cached[old]
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
        for block_hash, blocks in self.cached.items():
            for block in blocks:
                if self.hashes[block] != block_hash:
                    raise AssertionError(f"device block {block} cached under {block_hash} holds {self.hashes[block]}")
