"""The native WorkerBook and OutputAggregator against the reference
(``lifecycle/engine/worker_book.py``): random sequences of jobs added (loads, stores, others;
joins ``after`` a load whose owner finishes before or after the join comes, or ``after``
itself), holds, jobs done (unknown ones, failed blocks with repeats) and takes give the same
results and the same books after every operation; combining ranks' reports gives the same
finished requests in the same order. Python's sets have no order that holds across processes,
so sets are compared as sets; dicts, whose order is Python's, in order."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlife.lifecycle.engine.worker_book import OutputAggregator, WorkerBook

core = pytest.importorskip("kvlife.lifecycle.native._core")

# Request ids that sort differently by UTF-16 unit and by code point, and one whose characters
# are request ids (a str held is its characters, in both).
RIDS = ["a", "b", "ab", "é", "\uffee", "\U0001d11e"]
JOB_IDS = list(range(5))
rids = st.sampled_from(RIDS)
job_ids = st.sampled_from(JOB_IDS)
# Pools, so that a step draws little: hashes and device blocks whose lengths zip cuts short,
# failed blocks with repeats and blocks of no job.
hash_lists = st.sampled_from([(), (1,), (1, 2), (2, 1, 2), (3, 4, 5)])
device_lists = st.sampled_from([(), (10,), (10, 11), (12, 13, 14, 15)])
failed_lists = st.sampled_from([(), (), (1,), (2,), (2, 1, 2), (4, 9), (9,)])

adds = st.tuples(st.just("add"), job_ids, st.sampled_from(["load", "load", "load", "store", "prefetch"]), rids,
                 hash_lists, device_lists, st.sampled_from([None, None, *JOB_IDS, 99]))
holds = st.tuples(st.just("hold"), st.sampled_from([[], ["a"], ["b", "a"], ["\uffee", "\U0001d11e", "é"], ("ab",),
                                                    "ab", {"b"}]))
dones = st.tuples(st.just("done"), st.sampled_from([*JOB_IDS, *JOB_IDS, 99]), failed_lists)
takes = st.tuples(st.just("take"))
STEPS = {"add": adds, "hold": holds, "done": dones, "take": takes}
# Adds and dones weigh most: jobs meet their joins and finish.
book_operations = st.lists(st.sampled_from(["add"] * 4 + ["done"] * 4 + ["hold", "take"]).flatmap(STEPS.__getitem__),
                           min_size=10, max_size=60)


def _view(book: Any) -> Any:
    """A book as a caller sees it: jobs and each request's loads and stores in dict order
    (the job ids of one request as a set), the held requests and whether it is busy."""
    return (
        [(job_id, (e.kind, e.request_id, e.moves)) for job_id, e in book.jobs.items()],
        list(book.loads_of.items()),
        list(book.stores_of.items()),
        book.holds,
        book.busy,
    )


def _apply(book: Any, op: tuple[Any, ...]) -> Any:
    name, *args = op
    if name == "add":
        job_id, kind, rid, hashes, device_blocks, after = args
        return book.add(job_id, kind, rid, hashes, device_blocks, after)
    if name == "hold":
        return book.hold(*args)
    if name == "done":
        return book.done(*args)
    taken = book.take()
    assert type(taken) is tuple and all(type(s) is set for s in taken)
    return taken


@settings(max_examples=400, deadline=None)
@given(ops=book_operations)
def test_random_jobs_keep_the_same_book_natively(ops: list[tuple[Any, ...]]) -> None:
    ref, native = WorkerBook(), core.WorkerBook()
    for op in [*ops, ("take",)]:
        assert _apply(native, op) == _apply(ref, op), op
        assert _view(native) == _view(ref), op


def test_a_join_holds_its_owners_request_until_it_ends() -> None:
    """The join path by hand, on both: the owner done first waits for its join; a join added
    after its owner finished reads nothing; a job after itself is its own join."""
    for book in (WorkerBook(), core.WorkerBook()):
        book.add(1, "load", "r", [7, 8], [70, 80])
        book.add(2, "load", "s", [7], [71], after=1)
        book.done(1, [8, 8])
        assert book.take() == (set(), set(), {80})
        book.add(3, "load", "t", [], [], after=1)  # 1 is done: no join
        book.done(3)
        assert book.take() == ({"t"}, set(), set())
        book.done(2)
        assert book.take() == ({"r", "s"}, set(), set())
        book.add(4, "load", "u", [], [], after=4)
        book.done(4)
        assert book.take() == ({"u"}, set(), set()) and not book.busy


# A rank's reports, from pools (drawing sets of text is slow): the same request from several
# ranks, and ranks reporting a request twice before the others do.
rid_sets = st.sampled_from([set(), set(), {"a"}, {"b", "a"}, {"ab", "b"}, {"é", "\uffee", "\U0001d11e"}, set(RIDS)])
block_sets = st.sampled_from([set(), set(), {1}, {2, 1}, {7}])
outputs = st.lists(st.tuples(rid_sets, rid_sets, block_sets), max_size=5)


@settings(max_examples=300, deadline=None)
@given(world_size=st.integers(-1, 4), steps=st.lists(outputs, min_size=1, max_size=8))
def test_random_reports_combine_the_same_natively(world_size: int, steps: list[list[Any]]) -> None:
    ref, native = OutputAggregator(world_size), core.OutputAggregator(world_size)
    assert native.world_size == ref.world_size
    for step in steps:
        want = ref.aggregate(step)
        got = native.aggregate(step)
        assert type(got[0]) is tuple and type(got[1]) is tuple and type(got[2]) is frozenset
        assert got == want  # the finished requests in the same order


@given(st.lists(st.text(st.characters(exclude_categories=("Cs",)), max_size=3), max_size=8))
def test_request_ids_sort_as_python_sorts_them(names: list[str]) -> None:
    """Any text, not just ``RIDS``: a one-rank aggregator reports a rank's set sorted."""
    output = [(set(names), set(), set())]
    assert core.OutputAggregator(1).aggregate(output) == OutputAggregator(1).aggregate(output)


def _rank_steps(world_size: int) -> st.SearchStrategy[list[tuple[Any, ...]]]:
    """Engine inputs: a job to every rank's book (the engine adds each job to all ranks), one
    rank finishing a job, holds for every rank, or every rank reporting and the reports
    combined."""
    steps = {**STEPS, "done": st.tuples(st.just("done_on"), st.integers(0, world_size - 1), job_ids, failed_lists),
             "take": st.tuples(st.just("step"))}
    return st.lists(st.sampled_from(["add"] * 3 + ["done"] * 4 + ["hold", "take"]).flatmap(steps.__getitem__),
                    min_size=10, max_size=60)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), world_size=st.integers(1, 3))
def test_ranks_and_their_combined_reports_agree_natively(data: st.DataObject, world_size: int) -> None:
    books: dict[str, Sequence[Any]] = {
        "ref": [WorkerBook() for _ in range(world_size)], "native": [core.WorkerBook() for _ in range(world_size)]}
    combine = {"ref": OutputAggregator(world_size), "native": core.OutputAggregator(world_size)}
    ops = data.draw(_rank_steps(world_size))
    for op in [*ops, ("step",)]:
        seen = {}
        for side in ("ref", "native"):
            if op[0] == "done_on":
                _, rank, job_id, failed = op
                seen[side] = books[side][rank].done(job_id, failed)
            elif op[0] == "step":
                seen[side] = combine[side].aggregate([book.take() for book in books[side]])
            else:
                seen[side] = [_apply(book, op) for book in books[side]]
        assert seen["native"] == seen["ref"], op
        assert [_view(b) for b in books["native"]] == [_view(b) for b in books["ref"]], op
