"""The native device block pool and derived block hashes against the reference
(``lifecycle/engine/blocks.py``): the same random operations on both pools, and after each
one the same result or the same exception (type and arguments), the same free queue order,
the same prefix cache (hashes in insertion order, blocks oldest first), the same reference
counts and hashes, and the same answer from ``check_accounting``."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlife.lifecycle.engine import blocks as reference
from kvlife.lifecycle.engine.blocks import NO_HASH, DeviceBlockPool

_core = pytest.importorskip("kvlife.lifecycle.native._core")

INT64 = st.integers(-(2**63), 2**63 - 1)
# Few distinct hashes, so blocks share them (copies cached behind one another), plus NO_HASH
# (the reference files a block under it: see test_a_block_cached_under_no_hash_...) and any int64.
HASHES = st.one_of(st.sampled_from([NO_HASH, 0, 1, 2, 3, 2**62]), INT64)


def _outcome(call: Callable[[], Any]) -> tuple[Any, ...]:
    try:
        result = call()
    except Exception as exc:  # the exception itself is what is compared
        # The native OutOfBlocks subclasses the reference's (test_out_of_blocks_...).
        kind = reference.OutOfBlocks if isinstance(exc, reference.OutOfBlocks) else type(exc)
        return ("raised", kind, exc.args)
    if isinstance(result, tuple):
        result = list(result)
    return ("returned", result)


def _state(pool: Any, free_queue: list[int]) -> dict[str, Any]:
    return {
        "capacity": pool.capacity,
        "free": pool.free,
        "used": pool.used,
        "refs": list(pool.refs),
        "hashes": list(pool.hashes),
        "free_queue": free_queue,
        "cached": [(h, list(blocks)) for h, blocks in pool.cached.items()],
        "check_accounting": _outcome(pool.check_accounting),
    }


def _same_state(ref: DeviceBlockPool, nat: Any) -> None:
    assert _state(nat, nat.free_queue) == _state(ref, list(ref._free))
    for h in ref.cached:
        assert nat.block_of(h) == ref.block_of(h)


def _blocks(data: st.DataObject, ref: DeviceBlockPool, pick: str) -> list[int]:
    """Block ids for an operation: mostly ones the operation is meant for (the held ones to
    release, the cached ones to touch), sometimes any id, the one past the end included."""
    cap = ref.capacity
    if pick == "held":
        mine = [b for b in range(cap) if ref.refs[b] > 0]
    elif pick == "cached":
        mine = sorted({b for blocks in ref.cached.values() for b in blocks})
    else:
        mine = []
    if mine and data.draw(st.integers(0, 9)) < 8:
        return data.draw(st.lists(st.sampled_from(mine), unique=True, max_size=len(mine)).flatmap(st.permutations))
    return data.draw(st.lists(st.integers(0, cap), max_size=cap + 2))


def _block(data: st.DataObject, ref: DeviceBlockPool) -> int:
    """A block to cache: mostly a held one (the engine caches the blocks it computes)."""
    held = [b for b in range(ref.capacity) if ref.refs[b] > 0]
    if held and data.draw(st.integers(0, 9)) < 8:
        return data.draw(st.sampled_from(held))
    return data.draw(st.integers(0, ref.capacity))


def _hash(data: st.DataObject, ref: DeviceBlockPool) -> int:
    known = list(ref.cached)
    use_known = bool(known) and data.draw(st.booleans())
    if use_known:
        return data.draw(st.sampled_from(known))
    return data.draw(HASHES)


def _call(pool: Any, op: str, args: tuple[Any, ...], tail_first: bool) -> Any:
    if tail_first:
        return getattr(pool, op)(reversed(args[0]))
    return getattr(pool, op)(*args)


OPERATIONS = [
    "allocate",
    "release",
    "release_table",
    "touch",
    "hold",
    "cache",
    "forget",
    "block_of",
    "cached_prefix",
    "evictable",
]


@settings(max_examples=250, deadline=None)
@given(data=st.data(), capacity=st.integers(1, 10))
def test_the_native_pool_does_what_the_reference_does(data: st.DataObject, capacity: int) -> None:
    ref = DeviceBlockPool(capacity)
    nat = _core.DeviceBlockPool(capacity)
    tables: list[list[int]] = []  # what allocate handed out, as a request's block table
    _same_state(ref, nat)
    for _ in range(data.draw(st.integers(1, 50), label="operations")):
        op = data.draw(st.sampled_from(OPERATIONS))
        args: tuple[Any, ...]
        if op == "allocate":
            args = (data.draw(st.integers(-1, capacity + 1)),)
        elif op == "release_table":
            if not tables:
                continue
            table = tables.pop(data.draw(st.integers(0, len(tables) - 1)))
            op, args = "release", (table,)
        elif op == "release":
            args = (_blocks(data, ref, "held"),)
        elif op in ("touch", "hold", "forget"):
            args = (_blocks(data, ref, "cached"),)
        elif op == "evictable":
            args = (_blocks(data, ref, "any"),)
        elif op == "cache":
            args = (_block(data, ref), _hash(data, ref))
        elif op == "block_of":
            args = (_hash(data, ref),)
        else:  # cached_prefix
            args = ([_hash(data, ref) for _ in range(data.draw(st.integers(0, 5)))],)
        # Any iterable, as a request gives its blocks back: tail first, lazily.
        tail_first = op == "release" and data.draw(st.booleans())
        want = _outcome(partial(_call, ref, op, args, tail_first))
        got = _outcome(partial(_call, nat, op, args, tail_first))
        assert got == want, f"{op}{args}{' reversed' if tail_first else ''}"
        if op == "allocate" and want[0] == "returned" and want[1]:
            tables.append(want[1])
        _same_state(ref, nat)


def test_a_double_release_half_way_leaves_both_pools_equally_broken() -> None:
    # release raises before it puts the unhashed blocks it freed back: those are neither free
    # nor referenced, which check_accounting reports, and touching one is a KeyError.
    ref, nat = DeviceBlockPool(3), _core.DeviceBlockPool(3)
    for pool in (ref, nat):
        pool.allocate(2)
    for pool in (ref, nat):
        with pytest.raises(AssertionError, match="double release of device block 1"):
            pool.release([0, 1, 1])
    _same_state(ref, nat)
    assert _outcome(nat.check_accounting) == ("raised", AssertionError, ("device: used 0 + free 1 != capacity 3",))
    assert _outcome(lambda: nat.touch([0])) == _outcome(lambda: ref.touch([0])) == ("raised", KeyError, (0,))


def test_a_block_cached_under_no_hash_stays_filed_under_it() -> None:
    # The reference's one oddity, mirrored: cache(b, NO_HASH) on a block with a hash files it
    # under NO_HASH while it reads as hashless, so a later hash leaves it filed under both.
    ref, nat = DeviceBlockPool(2), _core.DeviceBlockPool(2)
    for pool in (ref, nat):
        pool.cache(0, 5)
        pool.cache(0, NO_HASH)
        pool.cache(0, 6)
    _same_state(ref, nat)
    assert nat.block_of(NO_HASH) == 0
    assert _outcome(nat.check_accounting) == ("raised", AssertionError, ("device block 0 cached under -1 holds 6",))


@pytest.mark.parametrize("capacity", [0, -3])
def test_a_pool_without_blocks_is_refused_as_the_reference_refuses_it(capacity: int) -> None:
    assert _outcome(partial(_core.DeviceBlockPool, capacity)) == _outcome(partial(DeviceBlockPool, capacity))
    assert _outcome(partial(_core.DeviceBlockPool, capacity))[1] is ValueError


def test_out_of_blocks_is_the_references_exception() -> None:
    nat = _core.DeviceBlockPool(2)
    assert issubclass(_core.OutOfBlocks, reference.OutOfBlocks)
    with pytest.raises(reference.OutOfBlocks, match="^need 3 blocks, 2 free$") as caught:
        nat.allocate(3)
    assert type(caught.value) is _core.OutOfBlocks


def test_the_free_queue_keeps_its_order_across_a_thousand_blocks() -> None:
    # Deep queues and many hashes (bucket table growth past the small pools above).
    ref, nat = DeviceBlockPool(1000), _core.DeviceBlockPool(1000)
    for pool in (ref, nat):
        table = pool.allocate(900)
        for i, b in enumerate(table[::3]):
            pool.cache(b, i * 7919 % 250)
        pool.release(reversed(table[:450]))
        pool.touch(pool.cached_prefix(range(0, 250, 7)))
        pool.allocate(300)
        pool.forget(table[600:700])
        pool.release(table[450:])
    _same_state(ref, nat)


@settings(max_examples=40, deadline=None)
@given(
    churn=st.lists(st.tuples(st.integers(0, 47), st.none() | st.integers(0, 80) | INT64), min_size=150, max_size=300)
)
def test_the_prefix_cache_finds_every_hash_through_churn(churn: list[tuple[int, int | None]]) -> None:
    # Many hashes coming and going in a 48-block pool (long runs: a hash table's deletion
    # bugs need several keys sharing a probe run): the native lookup finds exactly the
    # reference's copies after every change.
    ref, nat = DeviceBlockPool(48), _core.DeviceBlockPool(48)
    for block, block_hash in churn:
        for pool in (ref, nat):
            if block_hash is None:
                pool.forget([block])
            else:
                pool.cache(block, block_hash)
        assert [nat.block_of(h) for h in ref.cached] == [ref.block_of(h) for h in ref.cached]
    assert nat.hashes == ref.hashes
    assert [(h, list(b)) for h, b in nat.cached.items()] == [(h, list(b)) for h, b in ref.cached.items()]
    assert nat.cached_prefix(ref.hashes) == ref.cached_prefix(ref.hashes)


@settings(max_examples=300, deadline=None)
@given(previous=st.none() | INT64, request_id=st.text() | st.text(min_size=100, max_size=300), index=INT64)
def test_a_derived_hash_is_the_references(previous: int | None, request_id: str, index: int) -> None:
    assert _core.derived_block_hash(previous, request_id, index) == reference.derived_block_hash(
        previous, request_id, index
    )


@pytest.mark.parametrize("key_bytes", [3, 127, 128, 129, 255, 256, 257, 1000])
def test_a_derived_hash_is_the_references_around_blake2b_block_ends(key_bytes: int) -> None:
    # The key is "/{request_id}/0": 3 bytes around the id; BLAKE2b compresses 128-byte blocks.
    request_id = "é" * ((key_bytes - 3) // 2) + "x" * ((key_bytes - 3) % 2)
    assert len(f"/{request_id}/0".encode()) == key_bytes
    assert _core.derived_block_hash(None, request_id, 0) == reference.derived_block_hash(None, request_id, 0)


@settings(max_examples=200, deadline=None)
@given(hashes=st.lists(INT64, max_size=5), request_id=st.text(), count=st.integers(-1, 12))
def test_extended_hashes_are_the_references(hashes: list[int], request_id: str, count: int) -> None:
    got = _core.extend_hashes(hashes, request_id, count)
    assert type(got) is tuple
    assert got == reference.extend_hashes(hashes, request_id, count)


@st.composite
def _hash_list_ops(draw: st.DrawFn) -> list[tuple[str, int, Any]]:
    ops: list[tuple[str, int, Any]] = []
    for _ in range(draw(st.integers(1, 25))):
        kind = draw(st.sampled_from(["share", "extend", "assign", "apart"]))
        who = draw(st.integers(0, 7))
        if kind == "share":
            ops.append((kind, who, draw(st.integers(0, 12))))
        elif kind in ("extend", "apart"):
            ops.append((kind, who, draw(st.integers(0, 14))))
        else:
            ops.append((kind, who, draw(st.lists(st.integers(0, 2**62), max_size=6))))
    return ops


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 2**62), max_size=8), _hash_list_ops())
def test_lists_sharing_a_buffer_each_hold_what_a_list_of_their_own_would(
        given_hashes: list[int], ops: list[tuple[str, int, Any]]) -> None:
    """Lists that share one buffer (a request's scheduler record and its core record) each hold
    exactly what their own Python list would after the same shares, extensions and
    assignments, whoever extended the buffer first and whatever given hashes lie past a
    shorter list's end; and so does a list taken apart and put together again (a dormant
    request's), whether it shared its buffer or not."""
    lists = [_core.HashList(given_hashes)]
    mirror = [list(given_hashes)]
    for kind, who, arg in ops:
        i = who % len(lists)
        if kind == "share":
            n = min(arg, len(mirror[i]))
            lists.append(lists[i].share(n))
            mirror.append(mirror[i][:n])
        elif kind == "extend":
            lists[i].extend("req-7", arg)
            mirror[i] = list(reference.extend_hashes(mirror[i], "req-7", arg))
        elif kind == "apart":
            lists[i] = _core.HashList.from_parts(*lists[i].take_parts())
        else:
            lists[i].assign(arg)
            mirror[i] = list(arg)
        assert [h.tolist() for h in lists] == mirror


def test_a_shared_list_keeps_one_buffer_until_it_is_given_other_hashes() -> None:
    prompt = _core.HashList([11, 12, 13])
    core = prompt.share(3)
    assert core.same_buffer(prompt)
    prompt.extend("r", 5)  # the scheduler's record derives two blocks...
    core.extend("r", 4)  # ...the core's reads the first of them, not a copy
    assert core.same_buffer(prompt) and core.tolist() == prompt.tolist()[:4]
    shorter = prompt.share(2)
    shorter.extend("r", 3)  # past it lies a given hash: it derives its own in a buffer of its own
    assert not shorter.same_buffer(prompt)
    assert shorter.tolist() == list(reference.extend_hashes([11, 12], "r", 3))
    core.assign([1, 2])
    assert not core.same_buffer(prompt) and prompt.tolist()[:3] == [11, 12, 13]


def test_a_request_id_without_utf8_raises_the_references_error() -> None:
    bad = "a\ud800"
    assert _outcome(lambda: _core.derived_block_hash(7, bad, 2)) == _outcome(
        lambda: reference.derived_block_hash(7, bad, 2)
    )
    assert _outcome(lambda: _core.derived_block_hash(7, bad, 2))[1] is UnicodeEncodeError
    assert _outcome(lambda: _core.extend_hashes([3], bad, 4)) == _outcome(lambda: reference.extend_hashes([3], bad, 4))
    # Nothing to derive, nothing encoded: no error in either.
    assert _core.extend_hashes([3, 4], bad, 2) == reference.extend_hashes([3, 4], bad, 2) == (3, 4)
