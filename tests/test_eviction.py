"""LRU and ARC through the tier index: eviction order, scan resistance, and (stateful)
that pinned or in-flight blocks are never evicted and block accounting always holds."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvlife.transfer.eviction import ARC
from kvlife.transfer.index import TierIndex


def _store(index: TierIndex, blocks: list[int]) -> tuple[int, ...]:
    plan = index.prepare_store(blocks)
    index.complete_store([b for b, _ in plan.accepted])
    return plan.evicted


def _touch(index: TierIndex, blocks: list[int]) -> None:
    index.prepare_load(blocks)
    index.complete_load(blocks)


def test_lru_evicts_least_recently_used() -> None:
    index = TierIndex("t", 3, "lru")
    _store(index, [1, 2, 3])
    _touch(index, [1])
    assert _store(index, [4]) == (2,)
    assert _store(index, [5]) == (3,)
    assert index.lookup([1, 4, 5]) == 3


@pytest.mark.parametrize(("eviction", "hot_survive"), [("lru", False), ("arc", True)])
def test_arc_resists_a_scan_lru_does_not(eviction: str, hot_survive: bool) -> None:
    index = TierIndex("t", 4, eviction)
    _store(index, [1, 2])
    _touch(index, [1, 2])  # seen twice: frequent
    for block in range(100, 110):  # a one-pass scan
        _store(index, [block])
    assert (index.lookup([1, 2]) == 2) is hot_survive
    index.check_accounting()


def test_arc_ghost_hit_adapts_target() -> None:
    index = TierIndex("t", 2, "arc")
    _store(index, [1, 2])
    assert _store(index, [3]) == (1,)
    order = index._order
    assert isinstance(order, ARC) and 1 in order.b1
    _store(index, [1])  # a hit in the T1 ghost list: grow T1's target
    assert order.p >= 1 and 1 in order.t2


@pytest.mark.parametrize("eviction", ["lru", "arc"])
def test_pinned_and_inflight_blocks_are_never_evicted(eviction: str) -> None:
    index = TierIndex("t", 3, eviction)
    _store(index, [1, 2])
    index.prepare_load([1])  # pinned by a load
    inflight = index.prepare_store([3])  # pinned by its own store
    assert inflight.accepted[0][0] == 3
    plan = index.prepare_store([4, 5])
    assert plan.evicted == (2,) and plan.rejected_full == 1
    assert index.lookup([1]) == 1
    index.complete_store([3])
    index.complete_load([1])
    assert index.prepare_store([6]).evicted in {(1,), (3,)}
    index.check_accounting()


class TierIndexMachine(RuleBasedStateMachine):
    """Drives a TierIndex with random stores, loads, completions and discards and checks
    it against a simple model of which blocks are pinned."""

    def __init__(self) -> None:
        super().__init__()
        self.index: TierIndex | None = None
        self.ready: set[int] = set()
        self.storing: set[int] = set()
        self.pins: dict[int, int] = {}
        self.doomed: set[int] = set()

    @precondition(lambda self: self.index is None)
    @rule(capacity=st.integers(1, 6), eviction=st.sampled_from(["lru", "arc"]))
    def create(self, capacity: int, eviction: str) -> None:
        self.index = TierIndex("m", capacity, eviction)

    @precondition(lambda self: self.index is not None)
    @rule(blocks=st.lists(st.integers(0, 15), min_size=1, max_size=5))
    def store(self, blocks: list[int]) -> None:
        assert self.index is not None
        protected = self.storing | {b for b, n in self.pins.items() if n} | self.doomed
        plan = self.index.prepare_store(blocks)
        assert not set(plan.evicted) & protected, "evicted a pinned block"
        assert set(plan.evicted) <= self.ready
        self.ready -= set(plan.evicted)
        for block, _slot in plan.accepted:
            assert block not in self.ready and block not in self.storing
            self.storing.add(block)

    @precondition(lambda self: bool(self.storing))
    @rule(data=st.data(), ok=st.booleans())
    def finish_store(self, data: st.DataObject, ok: bool) -> None:
        assert self.index is not None
        block = data.draw(st.sampled_from(sorted(self.storing)))
        self.index.complete_store([block], ok)
        self.storing.discard(block)
        if ok:
            self.ready.add(block)

    @precondition(lambda self: bool(self.ready - self.doomed))
    @rule(data=st.data())
    def load(self, data: st.DataObject) -> None:
        assert self.index is not None
        block = data.draw(st.sampled_from(sorted(self.ready - self.doomed)))
        self.index.prepare_load([block])
        self.pins[block] = self.pins.get(block, 0) + 1

    @precondition(lambda self: any(self.pins.values()))
    @rule(data=st.data())
    def finish_load(self, data: st.DataObject) -> None:
        assert self.index is not None
        block = data.draw(st.sampled_from(sorted(b for b, n in self.pins.items() if n)))
        self.index.complete_load([block])
        self.pins[block] -= 1
        if self.pins[block] == 0 and block in self.doomed:
            self.doomed.discard(block)
            self.ready.discard(block)

    @precondition(lambda self: bool(self.ready))
    @rule(data=st.data())
    def discard(self, data: st.DataObject) -> None:
        assert self.index is not None
        block = data.draw(st.sampled_from(sorted(self.ready)))
        self.index.discard([block])
        if self.pins.get(block, 0):
            self.doomed.add(block)
        else:
            self.ready.discard(block)

    @invariant()
    def accounting_and_model_agree(self) -> None:
        if self.index is None:
            return
        self.index.check_accounting()
        for block in range(16):
            expected = block in self.ready and block not in self.doomed
            assert self.index.contains(block) == expected
        assert self.index.used == len(self.ready) + len(self.storing)


TestTierIndexMachine = TierIndexMachine.TestCase
TestTierIndexMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
