"""The native tier index and eviction orders against the reference (``transfer/index.py``,
``transfer/eviction.py``): the same random operations on both, small capacities so that evictions,
rejections and ghost hits happen all the time, and after every operation the same result (or the
same exception, type and arguments) and the same state: every query, the free-slot stack, and the
eviction order's lists in their iteration order."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvlife.transfer.eviction import make_eviction_order
from kvlife.transfer.index import StorePlan, TierIndex

pytest.importorskip("kvlife.lifecycle.native._core")
from kvlife.lifecycle.native import load  # noqa: E402

core = load()

EXTREMES = (2**63 - 1, -(2**63))
POOL = (*range(-2, 11), *EXTREMES)  # every block hash an operation may name
BLOCKS = st.integers(-2, 12).map(lambda i: EXTREMES[i - 11] if i > 10 else i)  # an extreme 2 times in 15
LISTS = st.lists(BLOCKS, max_size=5)
# Names with every quoting case of repr(): quotes, backslashes, control and non-ASCII characters.
NAMES = st.text(st.sampled_from("'\"\\\t\n\r\x00\x1f\x7f aZéß日€") | st.characters(max_codepoint=0x7F), max_size=6)
EVICTIONS = st.sampled_from(["lru", "arc"])

Outcome = tuple[Any, ...]


def outcome(call: Callable[[], Any]) -> Outcome:
    """What a call did: its result, or the exception's type and arguments."""
    try:
        result = call()
    except (KeyError, ValueError, AssertionError) as exc:
        return ("raised", type(exc), exc.args)
    if isinstance(result, (StorePlan, core.StorePlan)):
        return ("plan", result.accepted, result.evicted, result.skipped_present, result.rejected_full)
    return ("returned", result)


def order_state(order: Any) -> tuple[Any, ...]:
    if order.name == "arc":
        return ("arc", order.capacity, order.p, list(order.t1), list(order.t2), list(order.b1), list(order.b2))
    return ("lru", list(order._order))


def state(index: Any) -> dict[str, Any]:
    """Everything the index answers, and the private state that decides what it answers next."""
    return {
        "name": index.name,
        "capacity": index.capacity,
        "used": index.used,
        "free": index.free,
        "has_room": index.has_room(),
        "busy": index.busy(),
        "pinned": index.pinned(),
        "evictions": index.evictions,
        "contains": [index.contains(b) for b in POOL],
        "slot_of": [outcome(partial(index.slot_of, b)) for b in POOL],
        "lookup": [index.lookup(POOL), index.lookup(POOL[::-1]), index.lookup([])],
        "accounting": outcome(index.check_accounting),
        "free_slots": list(index._free_slots),
        "order": order_state(index._order),
    }


def _entries(index: TierIndex, keep: Callable[[Any], bool], count: int) -> list[int]:
    """Blocks of the reference whose entry passes ``keep``, the first ``count`` in entry order."""
    return [b for b, e in index._entries.items() if keep(e)][:count]


# An operation: (method, blocks, number, flag). "*_of" methods pick the first ``number`` blocks
# of the reference's entries in a given state, so that completions and loads succeed often, not
# only raise; ``flag`` is a store's ok; adopt takes the first block (if any) and ``number`` as slot.
# Stores and their completions weigh most, unpins next: the tier fills up and evicts.
WEIGHTS = {"prepare_store": 4, "complete_store_of": 4, "complete_load_of": 2, "complete_store": 1,
           "prepare_load": 1, "prepare_load_of": 1, "complete_load": 1, "discard": 1, "adopt": 1, "lookup": 1}
Operation = tuple[str, list[int], int, bool]
OPERATIONS = st.tuples(
    st.sampled_from([m for m, w in WEIGHTS.items() for _ in range(w)]),
    LISTS,
    st.integers(-1, 9),
    st.sampled_from([True, True, False]),
)


def _concrete(op: Operation, reference: TierIndex) -> tuple[Any, ...]:
    """The call the operation makes, with the blocks a "*_of" one picks from the reference now."""
    method, blocks, number, ok = op
    if method == "complete_store_of":
        return ("complete_store", _entries(reference, lambda e: not e.ready, number), ok)
    if method == "prepare_load_of":  # each block pinned twice
        return ("prepare_load", _entries(reference, lambda e: e.ready and not e.doomed, number) * 2)
    if method == "complete_load_of":
        return ("complete_load", _entries(reference, lambda e: e.pins > 0, number))
    if method == "complete_store":
        return (method, blocks, ok)
    if method == "adopt":
        return (method, blocks[0] if blocks else number, number)
    return (method, blocks)


def _apply(index: Any, call: tuple[Any, ...]) -> Outcome:
    method, *args = call
    if method == "complete_store" and args[1]:
        return outcome(lambda: index.complete_store(iter(args[0])))  # ok's default
    if method != "adopt":
        args = [iter(args[0]), *args[1:]]  # the blocks as a one-pass iterable, as the reference allows
    return outcome(lambda: getattr(index, method)(*args))


@settings(max_examples=250, deadline=None)
@given(
    name=NAMES,
    capacity=st.integers(0, 8),
    eviction=EVICTIONS,
    adopted=st.none() | st.lists(st.tuples(BLOCKS, st.integers(-1, 9)), max_size=6),
    ops=st.lists(OPERATIONS, min_size=20, max_size=60),
)
def test_a_native_tier_index_does_what_the_reference_does(
    name: str, capacity: int, eviction: str, adopted: list[tuple[int, int]] | None, ops: list[Operation]
) -> None:
    if adopted is None:
        reference, native = TierIndex(name, capacity, eviction), core.TierIndex(name, capacity, eviction)
    else:
        made = outcome(lambda: TierIndex.adopting(name, capacity, eviction, iter(adopted)))
        got = outcome(lambda: core.TierIndex.adopting(name, capacity, eviction, iter(adopted)))
        assert got[0] == made[0]
        if made[0] == "raised":
            assert got == made
            return
        reference, native = made[1], got[1]
    assert state(native) == state(reference)
    for op in ops:
        call = _concrete(op, reference)
        want = _apply(reference, call)
        assert _apply(native, call) == want, call
        assert state(native) == state(reference), call


# ---- the eviction orders alone, with any sequence of calls (also ones no index makes) ----------

# (method, block, the blocks victim()'s predicate lets go). A few blocks and weights that favour
# insertions, accesses and evictions: T2 fills, its ghosts overflow B2, ghost hits move p.
ORDER_WEIGHTS = {"inserted": 3, "accessed": 2, "evicted": 2, "evict_victim": 2, "removed": 1, "victim": 1}
ORDER_OPERATIONS = st.tuples(
    st.sampled_from([m for m, w in ORDER_WEIGHTS.items() for _ in range(w)]),
    st.integers(0, 6),
    st.frozensets(st.integers(0, 6)),
)


def _ask(order: Any, op: tuple[str, int, frozenset[int]]) -> tuple[Any, list[int]]:
    """The call's result, and for a victim every block the predicate was asked about, in order."""
    method, block, allowed = op
    if method not in ("victim", "evict_victim"):
        return getattr(order, method)(block), []
    asked: list[int] = []

    def evictable(candidate: int) -> int:
        asked.append(candidate)
        return int(candidate in allowed or method == "evict_victim")  # a truth value that is not a bool

    victim = order.victim(evictable)
    if method == "evict_victim" and victim is not None:  # as the tier index evicts
        (order.evicted if order.name == "arc" else order.removed)(victim)
    return victim, asked


@settings(max_examples=300, deadline=None)
@given(
    eviction=EVICTIONS,
    capacity=st.integers(-1, 4),
    ops=st.lists(ORDER_OPERATIONS, min_size=10, max_size=60),
)
def test_a_native_eviction_order_ranks_as_the_reference_does(
    eviction: str, capacity: int, ops: list[tuple[str, int, frozenset[int]]]
) -> None:
    reference, native = make_eviction_order(eviction, capacity), core.make_eviction_order(eviction, capacity)
    assert native.name == reference.name
    for op in ops:
        if op[0] == "evicted" and eviction == "lru":
            continue  # only ARC remembers evicted blocks
        assert _ask(native, op) == _ask(reference, op), op
        assert order_state(native) == order_state(reference), op


# ---- construction ------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@example(name="it's \"a\"\\\t\x00\x7fé", capacity=-1, eviction="lru")  # both quotes: repr picks '
@example(name="it's", capacity=0, eviction="it's \"arc\"")
@given(
    name=NAMES,
    capacity=st.integers(-3, 3),
    eviction=st.sampled_from(["lru", "arc", "LRU", "fifo", ""]) | NAMES,
)
def test_a_native_tier_index_refuses_what_the_reference_refuses(name: str, capacity: int, eviction: str) -> None:
    want = outcome(lambda: TierIndex(name, capacity, eviction))
    got = outcome(lambda: core.TierIndex(name, capacity, eviction))
    assert got[0] == want[0]
    if want[0] == "raised":
        assert got == want
    else:
        assert state(got[1]) == state(want[1])
    want_order = outcome(lambda: make_eviction_order(eviction, capacity))
    got_order = outcome(lambda: core.make_eviction_order(eviction, capacity))
    assert got_order[0] == want_order[0]
    if want_order[0] == "raised":
        assert got_order == want_order
    else:
        assert order_state(got_order[1]) == order_state(want_order[1])


def test_the_defaults_are_an_lru_order_and_a_successful_store() -> None:
    reference, native = TierIndex("host", 2), core.TierIndex("host", 2)
    assert native._order.name == reference._order.name == "lru"
    for index in (reference, native):
        index.prepare_store([7])
        index.complete_store([7])
    assert native.contains(7) and state(native) == state(reference)
