"""The native phase clock (``_core.PhaseClock``) against the reference (``breakdown.PhaseClock``):
the same phases, bit for bit (``float.hex``), for random sequences of arrivals, transitions
(legal and odd: unknown requests, repeated states, equal, growing or odd times) and takes
(with and without a first token and an end), and for every request of real runs, fed the
run's own records."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_policy_effects import BT, shared_prefix_bursts

from kvlife.lifecycle.breakdown import PHASES, PhaseClock
from kvlife.lifecycle.config import EngineConfig, RunConfig, TierConfig
from kvlife.lifecycle.drivers import runner
from kvlife.lifecycle.drivers.runner import run_workload
from kvlife.lifecycle.workloads.synthetic import synthetic_burst_workload
from kvlife.specs.names import RequestState

core = pytest.importorskip("kvlife.lifecycle.native._core")
NativeClock = core.PhaseClock
NATIVE_STATE = {s.value: getattr(NativeClock.State, s.name) for s in RequestState}
STATE_OF_NATIVE = {v: k for k, v in NATIVE_STATE.items()}

# A few requests, one with an id too long for a short-string buffer; "ghost" is never arrived.
RIDS = ("r0", "r1", "r2", "a-request-id-longer-than-sixteen-chars", "ghost")
STATES = tuple(s.value for s in RequestState)


def _hex(values: Any) -> list[str]:
    return [float(v).hex() for v in values]


def test_the_native_states_are_the_specs_in_its_order() -> None:
    assert [(m.name, int(m.value)) for m in NativeClock.State.__members__.values()] \
        == [(s.name, i) for i, s in enumerate(RequestState)]


# A time: a step forward from the last one (0: the same time), or any float at all (back in
# time, negative zero, infinities, NaN: an infinite span or first token tells apart
# comparisons that finite times leave equivalent, such as <= and <).
times = st.one_of(
    st.tuples(st.just("step"), st.sampled_from([0.0, 0.0, 0.5, 1.0, 1e-9, 0.1, 3.7, 1e6])),
    st.tuples(st.just("step"), st.floats(0.0, 1e4)),
    st.tuples(st.just("at"), st.sampled_from([math.inf, -math.inf, math.nan, 0.0, -0.0, 2.0])),
    st.tuples(st.just("at"), st.floats(allow_nan=True, allow_infinity=True)),
)
optional_times = st.one_of(st.none(), times)
rids = st.sampled_from(RIDS)
states = st.sampled_from(STATES)
ops = st.one_of(
    st.tuples(st.just("arrival"), rids, times),
    st.tuples(st.just("transition"), rids, states, states, times),
    st.tuples(st.just("transition"), rids, states, states, times),  # twice as likely
    st.tuples(st.just("take"), rids, optional_times, optional_times),
)


class _Clock:
    """The time the operations walk along."""

    def __init__(self) -> None:
        self.now = 0.0

    def at(self, choice: tuple[str, float] | None) -> float | None:
        if choice is None:
            return None
        how, value = choice
        if how == "at":
            return value
        self.now += value
        return self.now


INF = ("at", math.inf)


@settings(max_examples=600, deadline=None)
@given(st.lists(ops, max_size=60))
# Where a span ends at the first token (<= and < differ only there, and only for infinite times).
@example([("transition", "r0", "waiting", "running", ("at", 1.0)), ("take", "r0", INF, INF)])
# Where a span starts at the first token (>= and >).
@example([("transition", "r0", "waiting", "running", ("at", -math.inf)), ("take", "r0", ("at", -math.inf), None)])
# A request first seen leaving a state counts from the transition's own time (t - t).
@example([("transition", "r0", "running", "waiting", INF), ("take", "r0", None, None)])
# A request taken, then seen again: it starts from nothing.
@example([("transition", "r0", "waiting", "running", ("at", 0.0)), ("transition", "r0", "running", "finished",
          ("at", 1.0)), ("take", "r0", None, None), ("transition", "r0", "waiting", "running", ("at", 2.0)),
          ("take", "r0", None, ("at", 3.0))])
def test_random_records_give_the_same_phases_natively(sequence: list[tuple[Any, ...]]) -> None:
    want, got, clock = PhaseClock(), NativeClock(), _Clock()
    for op in sequence:
        if op[0] == "arrival":
            _, rid, when = op
            t = clock.at(when)
            want.record({"kind": "input", "type": "arrival", "t": t, "request_id": rid, "prompt_tokens": 1})
            got.arrival(rid, t)
        elif op[0] == "transition":
            _, rid, source, target, when = op
            t = clock.at(when)
            want.record({"kind": "transition", "t": t, "req": rid, "from": source, "to": target, "trigger": "x"})
            got.transition(rid, NATIVE_STATE[source], NATIVE_STATE[target], t)
        else:
            _, rid, first, end = op
            first_ms, end_ms = clock.at(first), clock.at(end)
            taken = want.take(rid, first_ms, end_ms)
            assert _hex(got.take(rid, first_ms, end_ms)) == _hex(taken[p] for p in PHASES)
        assert got.end_ms.hex() == want.end_ms.hex()
        assert len(got) == len(want._since)
        for rid in RIDS:
            held = got.since(rid)
            reference = want._since.get(rid)
            if reference is None:
                assert held is None
            else:
                assert held is not None
                assert (STATE_OF_NATIVE[held[0]], held[1].hex()) == (str(reference[0]), float(reference[1]).hex())


def test_a_take_defaults_to_the_latest_time_seen_and_forgets_the_request() -> None:
    want, got = PhaseClock(), NativeClock()
    want.record({"kind": "input", "type": "arrival", "t": 1.0, "request_id": "a"})
    got.arrival("a", 1.0)
    for t, source, target in ((2.0, "waiting", "running"), (5.0, "running", "waiting"), (6.0, "waiting", "running")):
        want.record({"kind": "transition", "t": t, "req": "a", "from": source, "to": target})
        got.transition("a", NATIVE_STATE[source], NATIVE_STATE[target], t)
    want.record({"kind": "input", "type": "arrival", "t": 9.0, "request_id": "b"})
    got.arrival("b", 9.0)
    # "a" still running: cut at 9.0; its first token at 4.0 splits the first span.
    wanted = want.take("a", 4.0)
    assert tuple(wanted[p] for p in PHASES) == (2.0, 0.0, 0.0, 2.0, 4.0, 0.0)
    assert got.take("a", 4.0) == (2.0, 0.0, 0.0, 2.0, 4.0, 0.0)
    assert got.since("a") is None and len(got) == 1
    assert got.take("a", 4.0) == (0.0,) * 6


# Real runs: a small device under bursts with a host tier and async lookups: requests wait,
# look up, load, get preempted, run and hold their blocks while their stores are read.
PRESSURE = RunConfig(engine=EngineConfig(block_tokens=64, device_blocks=120, max_batched_tokens=1024,
                                         tiers=(TierConfig("host", capacity_blocks=400),)),
                     policies=("async-lookup", "shared-loads"))
BURSTS = RunConfig(engine=EngineConfig(block_tokens=BT, device_blocks=250, max_batched_tokens=4096, max_running=64,
                                       lookup_latency_ms=1.0, tiers=(TierConfig("host", capacity_blocks=6000),)),
                   policies=("async-lookup", "shared-loads"))


class _Twin(PhaseClock):
    """The reference clock of a run, the native one beside it: fed the same records, each
    take compared as it is made (the rows the run makes from the reference's)."""

    __slots__ = ("native", "records", "taken")

    def __init__(self) -> None:
        super().__init__()
        self.native = NativeClock()
        self.records: list[dict[str, Any]] = []
        self.taken: list[tuple[str, float | None, tuple[float, ...]]] = []

    def record(self, record: dict[str, Any]) -> None:
        super().record(record)
        kind = record["kind"]
        if kind == "transition":
            self.native.transition(record["req"], NATIVE_STATE[record["from"]], NATIVE_STATE[record["to"]],
                                   record["t"])
            self.records.append(record)
        elif kind == "input" and record.get("type") == "arrival":
            self.native.arrival(record["request_id"], record["t"])
            self.records.append(record)
        assert self.native.end_ms.hex() == self.end_ms.hex()

    def take(self, rid: str, first_token_ms: float | None, end_ms: float | None = None) -> dict[str, float]:
        self.native.end_ms = self.end_ms  # RequestTotals.of moves the reference's end to the makespan
        want = super().take(rid, first_token_ms, end_ms)
        got = self.native.take(rid, first_token_ms, end_ms)
        assert _hex(got) == _hex(want[p] for p in PHASES), rid
        self.taken.append((rid, first_token_ms, got))
        return want


def _run(config: RunConfig, workload: list[Any], monkeypatch: pytest.MonkeyPatch) -> tuple[_Twin, Any]:
    twins: list[_Twin] = []

    def made() -> _Twin:
        twins.append(_Twin())
        return twins[-1]

    monkeypatch.setattr(runner, "PhaseClock", made)
    outcome = run_workload(config, workload, breakdown=True)
    assert len(twins) == 1
    return twins[0], outcome


@pytest.mark.parametrize("which", ["pressure", "bursts"])
def test_every_request_of_a_real_run_has_the_same_phases_natively(which: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    if which == "pressure":
        config = PRESSURE
        workload = synthetic_burst_workload(seed=2, num_requests=80, block_tokens=64, arrival_rate_per_s=20.0)
    else:
        config, workload = BURSTS, shared_prefix_bursts(n_prefixes=2, prefix_blocks=24, burst=8, own=6, fillers=20)
    twin, outcome = _run(config, workload, monkeypatch)
    rows = outcome.rows
    assert len(twin.taken) == len(rows) == len(workload) and len(twin.native) == 0
    # The rows are the reference's, so they are the native phases too.
    by_rid = {rid: phases for rid, _, phases in twin.taken}
    assert all(_hex(by_rid[row.request]) == _hex(row.phases) for row in rows)
    # The runs meet every phase (and preemptions: a request runs again after waiting).
    for i, phase in enumerate(PHASES):
        assert any(row.phases[i] > 0 for row in rows), phase
    if which == "pressure":
        assert outcome.summary["preemptions"] > 0

    # The same records again, read back as explain's replay reads them, up to the moment most
    # requests are in a state short of finished: every request taken there, cut just after.
    state: dict[str, str] = {}
    busiest, most = 0, 0
    for i, record in enumerate(twin.records):
        if record["kind"] == "transition":
            state[record["req"]] = record["to"]
        else:
            state.setdefault(record["request_id"], "waiting")
        pending_now = sum(s != "finished" for s in state.values())
        if pending_now > most:
            busiest, most = i, pending_now
    upto = twin.records[: busiest + 1]
    cut = upto[-1]["t"]
    firsts = {rid: first for rid, first, _ in twin.taken}
    want, got = PhaseClock(), NativeClock()
    for record in upto:
        want.record(record)
        if record["kind"] == "transition":
            got.transition(record["req"], NATIVE_STATE[record["from"]], NATIVE_STATE[record["to"]], record["t"])
        else:
            got.arrival(record["request_id"], record["t"])
    assert most > 3 and sum(held != "finished" for held, _ in want._since.values()) == most
    for rid in list(want._since):
        first = firsts[rid]
        first = first if first is not None and first <= cut else None
        wanted = want.take(rid, first, cut + 1.5)
        assert _hex(got.take(rid, first, cut + 1.5)) == _hex(wanted[p] for p in PHASES), rid
    assert len(got) == 0 and got.end_ms.hex() == want.end_ms.hex()
