"""The index of one storage tier: which block hashes it holds, in which slot, which are
pinned by in-flight transfers, and what to evict.

Plain Python, no torch: the simulator and the live runtime share this very class, so
hit rates and evictions behave the same in both. The interface follows vLLM's
kv_offload manager: ``lookup``, ``prepare_load``/``complete_load``,
``prepare_store``/``complete_store``. The bytes (host pool, disk file, Redis) live
behind the slot numbers this index hands out.

Invariant 8 (block accounting) holds by construction: every slot is either free or
owned by exactly one entry, and ``free + used == capacity``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs

from kvlife.transfer.eviction import ARC, make_eviction_order

BlockHash = int


@attrs.define(slots=True)
class _Entry:
    slot: int
    ready: bool  # False while the store that writes it is in flight
    pins: int = 0  # in-flight loads reading it
    doomed: bool = False  # found bad while pinned: dropped when the last reader ends


@attrs.frozen
class StorePlan:
    """Outcome of ``prepare_store``: blocks accepted with their slots, blocks evicted."""

    accepted: tuple[tuple[BlockHash, int], ...]
    evicted: tuple[BlockHash, ...]
    skipped_present: int
    rejected_full: int


class TierIndex:
    """Index of one tier with a fixed number of block slots."""

    def __init__(self, name: str, capacity_blocks: int, eviction: str = "lru") -> None:
        if capacity_blocks < 0:
            raise ValueError(f"tier {name!r}: capacity_blocks must be >= 0, got {capacity_blocks}")
        self.name = name
        self.capacity = capacity_blocks
        self._order = make_eviction_order(eviction, capacity_blocks)
        self._entries: dict[BlockHash, _Entry] = {}
        # Lowest slots are handed out first so slot assignment is deterministic.
        self._free_slots: list[int] = list(range(capacity_blocks - 1, -1, -1))
        self.evictions = 0

    # ---- queries -------------------------------------------------------------------
    @property
    def used(self) -> int:
        return len(self._entries)

    @property
    def free(self) -> int:
        return len(self._free_slots)

    def has_room(self) -> bool:
        """Whether ``prepare_store`` could take one new block now: a free slot, or a block
        it may evict."""
        return bool(self._free_slots) or self._order.victim(self._evictable) is not None

    def busy(self) -> list[BlockHash]:
        """Blocks a transfer still holds: a store not completed, a load still reading."""
        return [h for h, e in self._entries.items() if not e.ready or e.pins or e.doomed]

    def contains(self, block: BlockHash) -> bool:
        entry = self._entries.get(block)
        return entry is not None and entry.ready and not entry.doomed

    def slot_of(self, block: BlockHash) -> int:
        return self._entries[block].slot

    def lookup(self, blocks: Sequence[BlockHash]) -> int:
        """Number of leading blocks that are present and readable."""
        count = 0
        for block in blocks:
            entry = self._entries.get(block)
            if entry is None or not entry.ready or entry.doomed:
                break
            count += 1
        return count

    def pinned(self) -> int:
        return sum(1 for e in self._entries.values() if e.pins > 0 or not e.ready)

    # ---- loads ---------------------------------------------------------------------
    def prepare_load(self, blocks: Iterable[BlockHash]) -> list[int]:
        """Pin blocks for reading and return their slots; each must be present."""
        slots = []
        for block in blocks:
            entry = self._entries.get(block)
            if entry is None or not entry.ready or entry.doomed:
                raise KeyError(f"tier {self.name!r}: block {block} is not readable")
            entry.pins += 1
            self._order.accessed(block)
            slots.append(entry.slot)
        return slots

    def complete_load(self, blocks: Iterable[BlockHash]) -> None:
        for block in blocks:
            entry = self._entries.get(block)
            if entry is None or entry.pins == 0:
                raise KeyError(f"tier {self.name!r}: block {block} was not pinned for load")
            entry.pins -= 1
            if entry.doomed and entry.pins == 0:
                self._drop(block)

    # ---- stores --------------------------------------------------------------------
    def prepare_store(self, blocks: Iterable[BlockHash]) -> StorePlan:
        """Reserve slots for blocks not yet present, evicting unpinned blocks if needed.

        Accepted blocks are pinned (not ready) until ``complete_store``.
        """
        accepted: list[tuple[BlockHash, int]] = []
        evicted: list[BlockHash] = []
        present = 0
        rejected = 0
        seen: set[BlockHash] = set()
        for block in blocks:
            if block in self._entries or block in seen:
                present += 1
                if block in self._entries:
                    self._order.accessed(block)
                continue
            if not self._free_slots:
                victim = self._order.victim(self._evictable)
                if victim is None:
                    rejected += 1
                    continue
                self._evict(victim)
                evicted.append(victim)
            slot = self._free_slots.pop()
            self._entries[block] = _Entry(slot=slot, ready=False)
            self._order.inserted(block)
            seen.add(block)
            accepted.append((block, slot))
        return StorePlan(tuple(accepted), tuple(evicted), present, rejected)

    def complete_store(self, blocks: Iterable[BlockHash], ok: bool = True) -> None:
        """Make stored blocks readable, or drop them when the store failed."""
        for block in blocks:
            entry = self._entries.get(block)
            if entry is None or entry.ready:
                raise KeyError(f"tier {self.name!r}: block {block} has no store in flight")
            if ok:
                entry.ready = True
            else:
                self._drop(block)

    @classmethod
    def adopting(cls, name: str, capacity_blocks: int, eviction: str,
                 blocks: Iterable[tuple[BlockHash, int]]) -> TierIndex:
        """A new index already holding ``blocks`` ((hash, slot) pairs, adopted in that order):
        the engine's index of a disk tier that recovered them, in the live run and in its
        replay alike."""
        index = cls(name, capacity_blocks, eviction)
        for block, slot in blocks:
            index.adopt(block, slot)
        return index

    def adopt(self, block: BlockHash, slot: int) -> None:
        """Register a readable block already sitting in ``slot`` (a disk tier recovering
        the file a previous run left)."""
        if block in self._entries:
            raise KeyError(f"tier {self.name!r}: block {block} is already indexed")
        try:
            self._free_slots.remove(slot)
        except ValueError:
            raise KeyError(f"tier {self.name!r}: slot {slot} is not free") from None
        self._entries[block] = _Entry(slot=slot, ready=True)
        self._order.inserted(block)

    # ---- removal -------------------------------------------------------------------
    def discard(self, blocks: Iterable[BlockHash]) -> list[BlockHash]:
        """Forget readable blocks that turned out bad (corrupt, lost). A block still pinned
        by a load stays owned until that load ends, but is never handed out again."""
        dropped = []
        for block in blocks:
            entry = self._entries.get(block)
            if entry is None or not entry.ready or entry.doomed:
                continue
            if entry.pins == 0:
                self._drop(block)
                dropped.append(block)
            else:
                entry.doomed = True
        return dropped

    def _evictable(self, block: BlockHash) -> bool:
        entry = self._entries[block]
        return entry.ready and entry.pins == 0 and not entry.doomed

    def _evict(self, block: BlockHash) -> None:
        if isinstance(self._order, ARC):
            self._order.evicted(block)
        else:
            self._order.removed(block)
        entry = self._entries.pop(block)
        self._free_slots.append(entry.slot)
        self.evictions += 1

    def _drop(self, block: BlockHash) -> None:
        self._order.removed(block)
        entry = self._entries.pop(block)
        self._free_slots.append(entry.slot)

    def check_accounting(self) -> None:
        """Invariant 8: free + used == capacity and no slot is owned twice."""
        slots = [e.slot for e in self._entries.values()]
        if len(slots) + len(self._free_slots) != self.capacity:
            raise AssertionError(
                f"tier {self.name!r}: used {len(slots)} + free {len(self._free_slots)}"
                f" != capacity {self.capacity}"
            )
        if len(set(slots) | set(self._free_slots)) != self.capacity:
            raise AssertionError(f"tier {self.name!r}: a slot is owned twice")
