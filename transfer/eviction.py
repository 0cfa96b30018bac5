"""Eviction orders for tier indexes: LRU and ARC, the only two in the code base.

An eviction order only ranks block hashes; it never decides on its own that a block
may go. The tier index asks for a victim and passes a predicate that rejects blocks a
transfer has pinned, so eviction can never touch a block that is being read or written.
Both orders iterate insertion-ordered dicts of ints, so they are deterministic.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

BlockHash = int


class EvictionOrder(Protocol):
    """What a tier index needs from an eviction policy."""

    name: str

    def inserted(self, block: BlockHash) -> None: ...

    def accessed(self, block: BlockHash) -> None: ...

    def removed(self, block: BlockHash) -> None: ...

    def victim(self, evictable: Callable[[BlockHash], bool]) -> BlockHash | None: ...


class LRU:
    """Least recently used first."""

    name = "lru"

    def __init__(self, capacity: int) -> None:
        self._order: OrderedDict[BlockHash, None] = OrderedDict()

    def inserted(self, block: BlockHash) -> None:
        self._order[block] = None
        self._order.move_to_end(block)

    def accessed(self, block: BlockHash) -> None:
        if block in self._order:
            self._order.move_to_end(block)

    def removed(self, block: BlockHash) -> None:
        self._order.pop(block, None)

    def victim(self, evictable: Callable[[BlockHash], bool]) -> BlockHash | None:
        for block in self._order:
            if evictable(block):
                return block
        return None


class ARC:
    """Adaptive Replacement Cache (Megiddo & Modha, 2003).

    T1 holds blocks seen once recently, T2 blocks seen at least twice; B1 and B2 are
    ghost lists of hashes recently evicted from T1 and T2. A hit in a ghost list moves
    the target size ``p`` of T1 towards the list that would have kept the block.
    """

    name = "arc"

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.p = 0
        self.t1: OrderedDict[BlockHash, None] = OrderedDict()
        self.t2: OrderedDict[BlockHash, None] = OrderedDict()
        self.b1: OrderedDict[BlockHash, None] = OrderedDict()
        self.b2: OrderedDict[BlockHash, None] = OrderedDict()

    def inserted(self, block: BlockHash) -> None:
        if block in self.b1:
            self.p = min(self.capacity, self.p + max(1, len(self.b2) // max(1, len(self.b1))))
            del self.b1[block]
            self.t2[block] = None
        elif block in self.b2:
            self.p = max(0, self.p - max(1, len(self.b1) // max(1, len(self.b2))))
            del self.b2[block]
            self.t2[block] = None
        else:
            self.t1[block] = None
        self._trim_ghosts()

    def accessed(self, block: BlockHash) -> None:
        if block in self.t1:
            del self.t1[block]
            self.t2[block] = None
        elif block in self.t2:
            self.t2.move_to_end(block)

    def removed(self, block: BlockHash) -> None:
        """Forget a block without remembering it as a ghost (dropped, not evicted)."""
        self.t1.pop(block, None)
        self.t2.pop(block, None)

    def victim(self, evictable: Callable[[BlockHash], bool]) -> BlockHash | None:
        prefer_t1 = len(self.t1) > 0 and len(self.t1) >= max(1, self.p)
        first, second = (self.t1, self.t2) if prefer_t1 else (self.t2, self.t1)
        for candidates in (first, second):
            for block in candidates:
                if evictable(block):
                    return block
        return None

    def evicted(self, block: BlockHash) -> None:
        """Move an evicted block into the ghost list of the list it left."""
        if block in self.t1:
            del self.t1[block]
            self.b1[block] = None
        elif block in self.t2:
            del self.t2[block]
            self.b2[block] = None
        self._trim_ghosts()

    def _trim_ghosts(self) -> None:
        while len(self.b1) > self.capacity:
            self.b1.popitem(last=False)
        while len(self.b2) > self.capacity:
            self.b2.popitem(last=False)


def make_eviction_order(name: str, capacity: int) -> LRU | ARC:
    if name == "lru":
        return LRU(capacity)
    if name == "arc":
        return ARC(capacity)
    raise ValueError(f"unknown eviction policy {name!r} (expected 'lru' or 'arc')")
