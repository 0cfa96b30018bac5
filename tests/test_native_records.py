"""The native Trace sink (``records.hpp``) against the reference: for every record kind of
``lifecycle/engine/records.py`` and every input event (``events.input_to_record``), with any
floats (NaN and infinities too), ints at the int64 edges and any text, the native line is the
bytes the trace writer renders for the Python record (``trace.render_record`` plus its newline);
a disabled Trace writes nothing."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlife.lifecycle.engine import events, records
from kvlife.lifecycle.engine.state import count_tiers, moves_record
from kvlife.lifecycle.traces.trace import render_record

core = pytest.importorskip("kvlife.lifecycle.native._core")

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
ints = st.one_of(st.integers(INT64_MIN, INT64_MAX), st.sampled_from([0, 1, -1, INT64_MIN, INT64_MAX]))
int32s = st.integers(-(2**31), 2**31 - 1)
floats = st.floats()  # NaN and the infinities included (rendered null)
texts = st.text()
opt_ints = st.none() | ints
tier_names = st.sampled_from(["host", "disk", "remote", "é", ""]) | texts
json_scalars = st.none() | st.booleans() | ints | floats | texts
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=12,
)
# A warning's extra fields: the typed ones (str, int, float, bool, None, a list of ints) and,
# through the general path, any JSON value.
field_values = json_scalars | st.lists(ints, max_size=5) | json_values


def line(record: dict[str, Any]) -> bytes:
    return render_record(record) + b"\n"


def native() -> Any:
    return core.TraceRecords()


def kwargs(reserved: set[str]) -> st.SearchStrategy[dict[str, Any]]:
    return st.dictionaries(texts.filter(lambda k: k not in reserved), field_values, max_size=5)


block_moves = st.lists(st.builds(events.BlockMove, ints.filter(lambda h: h >= 0) | ints, int32s, tier_names, ints),
                       max_size=6)
tier_moves = st.lists(st.builds(events.TierMove, ints, tier_names, ints, tier_names, ints), max_size=6)

SETTINGS = settings(max_examples=150, deadline=None)


@SETTINGS
@given(floats, texts, texts, texts, texts, texts)
def test_transition(t: float, rid: str, source: str, target: str, trigger: str, reason: str) -> None:
    out = native()
    out.transition(t, rid, source, target, trigger, reason)
    assert out.take() == line(records.transition(t, rid, source, target, trigger, reason))


@SETTINGS
@given(floats, texts, texts, texts, st.none() | st.booleans() | ints | floats | texts, texts)
def test_decision(t: float, rid: str, point: str, policy: str, value: Any, reason: str) -> None:
    out = native()
    out.decision(t, rid, point, policy, value, reason)
    assert out.take() == line(records.decision(t, rid, point, policy, value, reason))


@SETTINGS
@given(floats, texts, kwargs({"kind", "t", "what"}))
def test_warning(t: float, what: str, fields: dict[str, Any]) -> None:
    out = native()
    out.warning(t, what, **fields)
    assert out.take() == line(records.warning(t, what, **fields))


@SETTINGS
@given(floats, texts, ints, opt_ints, st.none() | texts)
def test_stale_lookup(t: float, rid: str, epoch: int, current: int | None, state: str | None) -> None:
    out = native()
    out.stale_lookup(t, rid, epoch, current, state)
    assert out.take() == line(records.stale_lookup(t, rid, epoch, current, state))


@SETTINGS
@given(floats, texts, floats, ints, ints, ints)
def test_lookup_reuse(t: float, rid: str, answered: float, uses: int, blocks: int, evicted: int) -> None:
    out = native()
    out.lookup_reuse(t, rid, answered, uses, blocks, evicted)
    assert out.take() == line(records.lookup_reuse(t, rid, answered, uses, blocks, evicted))


@SETTINGS
@given(floats, ints, st.sampled_from(["load", "store"]) | texts, texts, block_moves,
       st.none() | st.dictionaries(ints, ints, max_size=4), opt_ints, st.data())
def test_job(t: float, job_id: int, op: str, rid: str, moves: list[events.BlockMove],
             named: dict[int, int] | None, after: int | None, data: st.DataObject) -> None:
    if named is not None and moves and data.draw(st.booleans()):
        named[moves[0].block_hash] = data.draw(ints)  # a move whose position is written
    extra = {} if after is None else {"after": after}
    out = native()
    out.job(t, job_id, op, rid, moves, named, after)
    expected = records.job(t, job_id, op, rid, count_tiers(m.tier for m in moves), moves_record(moves, named), **extra)
    assert out.take() == line(expected)


@SETTINGS
@given(floats, ints, texts, tier_moves)
def test_job_prefetch(t: float, job_id: int, rid: str, moves: list[events.TierMove]) -> None:
    out = native()
    out.job_prefetch(t, job_id, rid, moves)
    expected = records.job(t, job_id, "prefetch", rid, count_tiers(m.src_tier for m in moves),
                           [[m.block_hash, m.src_tier, m.dst_tier] for m in moves])
    assert out.take() == line(expected)


@SETTINGS
@given(floats, ints, texts, ints, st.booleans(), st.booleans())
def test_job_done(t: float, job_id: int, op: str, failed: int, late: bool, abandoned: bool) -> None:
    out = native()
    out.job_done(t, job_id, op, failed, late, abandoned)
    assert out.take() == line(records.job_done(t, job_id, op, failed, late, abandoned))


@SETTINGS
@given(floats, st.lists(int32s, max_size=8), texts, st.lists(ints, max_size=8))
def test_free_and_evict(t: float, blocks: list[int], tier: str, hashes: list[int]) -> None:
    out = native()
    out.free(t, blocks)
    out.evict(t, tier, hashes)
    assert out.take() == line(records.free(t, blocks)) + line(records.evict(t, tier, hashes))


@SETTINGS
@given(floats, texts, texts, ints)
def test_store_rejected(t: float, rid: str, tier: str, blocks: int) -> None:
    out = native()
    out.store_rejected(t, rid, tier, blocks)
    assert out.take() == line(records.store_rejected(t, rid, tier, blocks))


chunks = st.lists(st.tuples(texts, ints, ints).map(list), max_size=4)


@SETTINGS
@given(floats, ints, ints, ints, ints, chunks, chunks, st.lists(ints, max_size=4))
def test_step(t: float, step_id: int, requests: int, prefill: int, sync: int, prompt: list[list[Any]],
              fills: list[list[Any]], flush: list[int]) -> None:
    out = native()
    out.step(t, step_id, requests, prefill, sync, prompt, fills, flush)
    assert out.take() == line(records.step(t, step_id, requests, prefill, sync, prompt, fills, flush))


@SETTINGS
@given(floats, ints, texts, texts, st.lists(ints, max_size=4), ints, texts)
def test_reclaim_and_abandon(t: float, job_id: int, op: str, rid: str, ranks: list[int], blocks: int,
                             reason: str) -> None:
    out = native()
    out.reclaim(t, job_id, op, rid, ranks, blocks, reason)
    out.abandon(t, job_id, op, rid, reason)
    assert out.take() == (line(records.reclaim(t, job_id, op, rid, ranks, blocks, reason))
                          + line(records.abandon(t, job_id, op, rid, reason)))


INTERRUPTED_NAMES = {"kind", "t", "signal", "clean", "requests", "finished", "not_arrived", "jobs",
                     "quarantined_jobs", "prefetches"}


@SETTINGS
@given(floats, texts, st.booleans(), st.dictionaries(texts, ints, max_size=4), ints, ints, ints, ints, ints,
       st.dictionaries(texts.filter(lambda k: k not in INTERRUPTED_NAMES), ints, max_size=3))
def test_interrupted(t: float, signal: str, clean: bool, requests: dict[str, int], finished: int, not_arrived: int,
                     jobs: int, quarantined: int, prefetches: int, open_work: dict[str, int]) -> None:
    out = native()
    out.interrupted(t, signal, clean, requests, finished, not_arrived, jobs, quarantined, prefetches, **open_work)
    assert out.take() == line(records.interrupted(t, signal, clean, requests, finished, not_arrived, jobs,
                                                  quarantined, prefetches, **open_work))


@SETTINGS
@given(ints, st.dictionaries(texts, json_values, max_size=5), st.lists(texts, max_size=4), ints,
       kwargs({"kind", "schema", "config", "policies", "seed"}))
def test_header(schema: int, config: dict[str, Any], policies: list[str], seed: int, extra: dict[str, Any]) -> None:
    out = native()
    out.header(schema, config, policies, seed, **extra)
    assert out.take() == line(records.header(schema, config, policies, seed, **extra))


hashes = st.lists(ints, max_size=5).map(tuple)
input_events = st.one_of(
    st.builds(events.Arrival, floats, texts, ints, hashes, st.booleans(), opt_ints),
    st.builds(events.Abort, floats, texts),
    st.builds(events.Tick, floats),
    st.builds(events.LookupAnswer, floats, texts, ints, st.none() | st.lists(tier_names, max_size=4).map(tuple)),
    st.builds(events.TransferReport, floats, ints, ints, hashes),
    st.builds(events.StepOutput, floats, ints,
              st.lists(st.tuples(texts, texts), max_size=3).map(tuple),
              st.lists(st.tuples(ints, ints, hashes), max_size=3).map(tuple),
              st.lists(ints, max_size=3).map(tuple)),
)


@settings(max_examples=400, deadline=None)
@given(st.lists(input_events, min_size=1, max_size=4))
def test_input(batch: list[Any]) -> None:
    out = native()
    for event in batch:
        out.input(event)
    assert out.take() == b"".join(line(events.input_to_record(event)) for event in batch)


def test_disabled_trace_writes_nothing() -> None:
    out = core.TraceRecords(enabled=False)
    move = events.BlockMove(1, 2, "host", 3)
    out.header(1, {"a": 1}, ["p"], 0, x=1)
    out.input(events.Tick(1.0))
    out.transition(1.0, "r", "waiting", "running", "admitted", "why")
    out.decision(1.0, "r", "admission", "p", "go", "why")
    out.warning(1.0, "w", a=1)
    out.stale_lookup(1.0, "r", 1, None, None)
    out.lookup_reuse(1.0, "r", 0.5, 1, 2, 3)
    out.job(1.0, 1, "load", "r", [move])
    out.job_prefetch(1.0, 1, "r", [events.TierMove(1, "disk", 0, "host", 1)])
    out.job_done(1.0, 1, "load", 0, False)
    out.free(1.0, [1])
    out.evict(1.0, "host", [1])
    out.store_rejected(1.0, "r", "host", 1)
    out.step(1.0, 1, 1, 1, 0, [["r", 0, 1]], [])
    out.reclaim(1.0, 1, "load", "r", [0], 1, "why")
    out.abandon(1.0, 1, "load", "r", "why")
    out.interrupted(1.0, "SIGINT", True, {"running": 1}, 0, 0, 0, 0, 0)
    assert out.take() == b""
    enabled = core.TraceRecords()
    enabled.job(1.0, 1, "load", "r", [move])
    assert enabled.take() == line(records.job(1.0, 1, "load", "r", {"host": 1}, [[1, 2, "host"]]))
