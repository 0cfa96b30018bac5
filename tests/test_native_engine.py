"""The native engine (``lifecycle/native/src/engine.hpp``) against the reference
(``lifecycle/engine/core.py``'s ``Engine``).

Both engines take the same random run of valid inputs: arrivals (prompts sharing prefix
blocks, some duplicates), ticks, the output of the oldest step in flight (random stops,
worker reports, now and then a failed rank), transfer reports for the jobs started (a rank
each, random failed blocks), lookup answers for the lookups submitted (some failed, some
stale) and aborts, with configs whose device pools are small (preemption), async scheduling
on and off, one or two ranks, one or two tiers, and built-in policy stacks. After every
input the commands must be equal; at the end the trace bytes (the reference's records
rendered by ``trace.pipeline()``), the stats, the policy answers, the state counts, the
stranded requests and the retired ones (``progress``, ``busy`` and ``next_wakeup`` after
every input too).
"""

from __future__ import annotations

import random
from typing import Any

import attrs
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvlife.lifecycle.config import EngineConfig, TierConfig
from kvlife.lifecycle.engine import records
from kvlife.lifecycle.engine.core import Engine
from kvlife.lifecycle.engine.events import (
    Abort,
    Arrival,
    DiscardLookup,
    LookupAnswer,
    StartLoad,
    StartPrefetch,
    StartStore,
    StepOutput,
    StepPlan,
    SubmitLookup,
    Tick,
    TransferReport,
)
from kvlife.lifecycle.native import bridge
from kvlife.lifecycle.traces.trace import pipeline
from kvlife.policies.registry import BUILTIN
from kvlife.policies.stack import PolicyStack

core_module = pytest.importorskip("kvlife.lifecycle.native._core")
if not hasattr(core_module, "NativeEngine"):  # pragma: no cover - an older build
    pytest.skip("the native engine is not built", allow_module_level=True)

# Stacks of built-in policies (each engine gets its own instances: policies may keep state).
STACKS: tuple[tuple[str, ...], ...] = (
    (),
    ("sync-lookup",),
    ("async-lookup",),
    ("async-lookup", "keep-lookup-answers"),
    ("early-lookup",),
    ("early-prefetch",),
    ("early-prefetch", "prefetch-timeout"),
    ("early-prefetch", "prefetch-wait-complete"),
    ("early-prefetch", "prefetch-best-effort"),
    ("shared-loads",),
    ("async-lookup", "shared-loads"),
    ("defer-while-loading",),
    ("naive-stores-unsafe",),
)


def _stack(names: tuple[str, ...]) -> PolicyStack:
    return PolicyStack([BUILTIN[name]() for name in names])


class Bytes:
    """The reference's trace sink: each record rendered as ``TraceWriter`` renders it."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.pipe = pipeline()

    def __call__(self, record: dict[str, Any]) -> None:
        out: Any = record
        for processor in self.pipe:
            out = processor(None, "record", out)
        self.data += out


def _plain(command: Any) -> Any:
    """A command as comparable plain data (attrs classes and named tuples alike)."""
    if isinstance(command, tuple):
        return tuple(_plain(c) for c in command)
    if isinstance(command, list):
        return [_plain(c) for c in command]
    if attrs.has(type(command)):
        return (type(command).__name__, *(_plain(getattr(command, f.name)) for f in attrs.fields(type(command))))
    return command


def _stats(stats: Any) -> dict[str, Any]:
    return attrs.asdict(stats) if attrs.has(type(stats)) else dict(stats)


@attrs.define
class Run:
    """The driver's book of the reference's commands: what a valid next input may name."""

    steps: list[StepPlan] = attrs.Factory(list)  # in flight, oldest first
    jobs: dict[int, tuple[tuple[int, ...], set[int]]] = attrs.Factory(dict)  # job -> (hashes, ranks to report)
    lookups: dict[tuple[str, int], tuple[int, ...]] = attrs.Factory(dict)  # (rid, epoch) -> hashes asked
    answered: list[tuple[str, int]] = attrs.Factory(list)  # lookups answered or discarded (stale now)
    seen: set[str] = attrs.Factory(set)

    def take(self, commands: list[Any], ranks: int) -> None:
        for c in commands:
            kind = type(c)
            self.seen.add(kind.__name__)
            if kind is StepPlan:
                self.steps.append(c)
            elif kind in (StartLoad, StartStore, StartPrefetch):
                self.jobs[c.job_id] = (tuple(m.block_hash for m in c.moves), set(range(ranks)))
            elif kind is SubmitLookup:
                self.lookups[(c.request_id, c.epoch)] = tuple(c.block_hashes)
            elif kind is DiscardLookup and self.lookups.pop((c.request_id, c.epoch), None) is not None:
                self.answered.append((c.request_id, c.epoch))


def _config(rng: random.Random, draw: dict[str, Any]) -> EngineConfig:
    tiers = [TierConfig("host", capacity_blocks=draw["host"], eviction=draw["eviction"])]
    if draw["two_tiers"]:
        tiers.append(TierConfig("disk", capacity_blocks=draw["host"] * 3))
    return EngineConfig(block_tokens=draw["bt"], device_blocks=draw["device_blocks"],
                        max_batched_tokens=draw["budget"], max_running=8, ranks=draw["ranks"],
                        async_scheduling=draw["async_scheduling"],
                        transfer_deadline_ms=draw["transfer_deadline"], lookup_deadline_ms=draw["lookup_deadline"],
                        reclaim_deadline_ms=draw["reclaim_deadline"], max_async_lookups=draw["max_async_lookups"],
                        kv_load_failure_policy=draw["failure_policy"], tiers=tuple(tiers))


def _engines(config: EngineConfig, names: tuple[str, ...], retire: bool,
             trace: bool) -> tuple[Engine, Bytes, Any, list[Any], list[Any]]:
    sink = Bytes()
    ref_retired: list[Any] = []
    nat_retired: list[Any] = []
    reference = Engine(config, _stack(names), recorder=sink if trace else None,
                       retire=(lambda r: ref_retired.append(_retired(r))) if retire else None)
    native = bridge.engine(config, _stack(names), trace=trace,
                           retire=(lambda r: nat_retired.append(r)) if retire else None)
    return reference, sink, native, ref_retired, nat_retired


def _retired(req: Any) -> dict[str, Any]:
    """What the native engine's retire callback is given of a request (its final fields)."""
    return {"request_id": req.request_id, "seq": req.seq, "arrival_ms": req.arrival_ms,
            "prompt_tokens": req.prompt_tokens, "block_tokens": req.block_tokens, "state": str(req.state),
            "epoch": req.epoch, "generated": req.generated, "finish_reason": req.finish_reason,
            "first_token_ms": req.first_token_ms, "finish_ms": req.finish_ms, "preemptions": req.preemptions,
            "device_hit_blocks": req.device_hit_blocks, "tier_hit_blocks": dict(req.tier_hit_blocks)}


def _event(rng: random.Random, run: Run, reference: Engine, t: float, arrived: list[str],
           shared: list[list[int]], bt: int, ranks: int) -> Any:
    """One valid random input at time ``t`` (None: nothing to do of the kind drawn)."""
    op = rng.random()
    if op < 0.16:
        rid = f"r{len(arrived)}" if rng.random() < 0.95 or not arrived else rng.choice(arrived)
        arrived.append(rid)
        prompt = rng.choice([1, bt - 1, bt + 1, 3 * bt, rng.randint(1, 6 * bt), rng.randint(4 * bt, 10 * bt)])
        # A prefix several requests share (one of a few families, which evict each other from
        # the device: device and tier hits both).
        family = rng.choice(shared)
        common = len(family) if rng.random() < 0.5 else rng.randint(0, len(family))
        hashes = tuple(family[i] if i < common else rng.randrange(1 << 40) for i in range(prompt // bt))
        max_tokens = rng.choice([None, rng.randint(1, 4 * bt)])
        return Arrival(t, rid, prompt, hashes, rng.random() < 0.1, max_tokens)
    if op < 0.42:
        # A driver keeps one step in flight (two under async scheduling); now and then one more.
        if len(run.steps) < (2 if reference.config.async_scheduling else 1) or rng.random() < 0.1:
            return Tick(t)
        op = 0.5
    if op < 0.66:
        if not run.steps:
            return Tick(t)
        plan = run.steps[0]
        finished = tuple((e.request_id, rng.choice(["stopped", "length"])) for e in plan.entries
                         if e.samples and rng.random() < 0.25)
        reports = []
        for job_id, (hashes, ranks_left) in list(run.jobs.items()):
            if rng.random() < 0.3:
                for rank in sorted(ranks_left):
                    if rng.random() < 0.7:
                        failed = tuple(h for h in hashes if rng.random() < 0.1)
                        reports.append((job_id, rank, failed))
                        ranks_left.discard(rank)
                if not ranks_left:
                    del run.jobs[job_id]
        failed_ranks = (rng.randrange(ranks),) if rng.random() < 0.03 else ()
        run.steps.pop(0)
        return StepOutput(t, plan.step_id, finished, tuple(reports), failed_ranks)
    if op < 0.82:
        if not run.jobs:
            return Tick(t)
        job_id = rng.choice(sorted(run.jobs))
        hashes, ranks_left = run.jobs[job_id]
        rank = rng.choice(sorted(ranks_left)) if rng.random() < 0.97 else rng.randrange(ranks + 1)
        ranks_left.discard(rank)
        if not ranks_left:
            del run.jobs[job_id]
        return TransferReport(t, job_id, rank, tuple(h for h in hashes if rng.random() < 0.1))
    if op < 0.93:
        if run.lookups and rng.random() < 0.9:
            key = rng.choice(sorted(run.lookups))
            hashes = run.lookups.pop(key)
            run.answered.append(key)
            if rng.random() < 0.1:
                tiers = None
            else:
                tiers = reference.sync_lookup(hashes)
                tiers = tiers[: rng.randint(0, len(tiers))] if rng.random() < 0.2 else tiers
                if rng.random() < 0.2:  # a name no tier of the engine has: dropped as it lands
                    at = rng.randint(0, len(tiers))
                    tiers = (*tiers[:at], "remote", *tiers[at:])
            return LookupAnswer(t, key[0], key[1], tiers)
        if run.answered:  # a stale answer: answered, discarded or expired since
            rid, epoch = rng.choice(run.answered)
            return LookupAnswer(t, rid, epoch, ("host",))
        return Tick(t)
    if not arrived:
        return Tick(t)
    return Abort(t, rng.choice(arrived) if rng.random() < 0.95 else "nobody")


def _drive(seed: int, draw: dict[str, Any], ops: int) -> set[str]:
    rng = random.Random(seed)
    config = _config(rng, draw)
    names = draw["stack"]
    reference, sink, native, ref_retired, nat_retired = _engines(config, names, draw["retire"], draw.get("trace", True))
    native.dormant_arrivals = draw.get("dormant", False)
    run = Run()
    bt = config.block_tokens
    shared = [[rng.randrange(1 << 40) for _ in range(8)] for _ in range(3)]
    arrived: list[str] = []
    t = 0.0
    for _ in range(ops):
        # Mostly small steps; now and then a jump past the lookup, transfer and reclaim deadlines.
        t += rng.choice([0.0, 0.5, 1.0, 2.0, 5.0]) if rng.random() < 0.93 else rng.choice([70.0, 150.0, 400.0])
        event = _event(rng, run, reference, t, arrived, shared, bt, config.ranks)
        commands = reference.handle(event)
        dormant = native.dormant()
        assert _plain(native.handle(event)) == _plain(commands), event
        if dormant:
            run.seen.add("dormant")
            if isinstance(event, Abort) and native.dormant() < dormant:
                run.seen.add("dormant aborted")
        assert native.progress() == reference.progress()
        assert native.busy() == reference.busy()
        assert native.next_wakeup() == reference.next_wakeup()
        run.take(commands, config.ranks)
    seen = set(run.seen)
    stats = reference.stats
    for name, reached in (("preemption", stats.preemptions), ("load", stats.loads), ("store", stats.stores),
                          ("async lookup", stats.async_lookups), ("expired lookup", stats.expired_lookups),
                          ("stale answer", stats.stale_lookup_answers), ("prefetch", stats.prefetches),
                          ("failed load", stats.failed_loads), ("reclaim", stats.reclaimed_jobs),
                          ("timeout", stats.rank_timeouts), ("join", stats.joined_blocks)):
        if reached:
            seen.add(name)
    if ref_retired:
        seen.add("retired")
    # The simulator's last records (drivers/simulator.py): a driver warning per stranded request.
    for req in reference.state.unfinished():
        if reference.recorder is not None:
            reference.recorder(records.warning(t, "stranded", origin="driver", req=req.request_id, state=req.state))
    native.record_stranded(t)
    assert bytes(native.trace_bytes()) == bytes(sink.data)
    assert native.finished_count() == reference.state_counts["finished"]
    assert native.stats() == _stats(stats)
    assert native.answers() == reference.answers
    assert native.state_counts() == reference.state_counts
    assert native.stranded() == reference.stranded()
    assert [native.output_tokens(rid) for rid in arrived] == [reference.output_tokens(rid) for rid in arrived]
    assert nat_retired == ref_retired
    for family in shared:  # what the tiers hold now, asked of each
        assert native.sync_lookup(family) == reference.sync_lookup(family)
    native.check_invariants()
    late = Tick(t - rng.choice([0.5, 1e-9, 1e6]))  # an input older than the engine's time: refused alike
    with pytest.raises(ValueError) as ref_error:
        reference.handle(late)
    with pytest.raises(ValueError) as nat_error:
        native.handle(late)
    assert str(nat_error.value) == str(ref_error.value)
    return seen


DRAW = st.fixed_dictionaries({
    "bt": st.sampled_from([2, 4, 16]),
    "device_blocks": st.sampled_from([6, 12, 24, 64]),
    "budget": st.sampled_from([8, 32, 8192]),
    "ranks": st.integers(1, 2),
    "async_scheduling": st.booleans(),
    "two_tiers": st.booleans(),
    "host": st.sampled_from([4, 16, 200]),
    "eviction": st.sampled_from(["lru", "arc"]),
    "transfer_deadline": st.sampled_from([None, None, 100.0]),
    "lookup_deadline": st.sampled_from([60.0, 5000.0]),
    "reclaim_deadline": st.sampled_from([300.0, 480_000.0]),
    "max_async_lookups": st.sampled_from([2, 1024]),
    "failure_policy": st.sampled_from(["recompute", "recompute", "fail"]),
    "stack": st.sampled_from(STACKS),
    "retire": st.booleans(),
    "trace": st.sampled_from([True, True, False]),  # off: nothing rendered, nothing decided otherwise
    "dormant": st.booleans(),  # Scheduler::dormant_arrivals: the same inputs give the same outputs
})


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), draw=DRAW)
# A request preempted while its last step runs, stopped by that step's token with a store of
# its blocks still in flight: it finishes from waiting, its blocks held (both engines raised
# IllegalTransition, send_started from waiting, before the fix).
@example(seed=4_294_967_295, draw={
    "bt": 16, "device_blocks": 6, "budget": 8, "ranks": 2, "async_scheduling": False, "two_tiers": True,
    "host": 4, "eviction": "lru", "transfer_deadline": None, "lookup_deadline": 60.0, "reclaim_deadline": 300.0,
    "max_async_lookups": 2, "failure_policy": "recompute", "stack": (), "retire": False, "trace": True})
def test_native_engine_matches_reference(seed: int, draw: dict[str, Any]) -> None:
    _drive(seed, draw, 160)


def test_reach() -> None:
    """The random runs reach what the differential test is for: preemptions, loads,
    stores, async lookups (expired and stale too), prefetches, failed loads, deadlines."""
    seen: set[str] = set()
    data = random.Random(7)
    for i in range(40):
        draw = {"bt": data.choice([2, 4, 16]), "device_blocks": data.choice([6, 12, 24, 64]),
                "budget": data.choice([8, 32, 8192]), "ranks": data.randint(1, 2),
                "async_scheduling": data.random() < 0.5, "two_tiers": data.random() < 0.5,
                "host": data.choice([4, 16, 200]), "eviction": data.choice(["lru", "arc"]),
                "transfer_deadline": data.choice([None, 100.0]), "lookup_deadline": data.choice([60.0, 5000.0]),
                "reclaim_deadline": data.choice([300.0, 480_000.0]), "max_async_lookups": data.choice([2, 1024]),
                "failure_policy": data.choice(["recompute", "fail"]), "stack": STACKS[i % len(STACKS)],
                "retire": data.random() < 0.5, "dormant": i % 2 == 1}
        seen |= _drive(i, draw, 160)
    # Joins want roomy devices and loads that stay in flight (shared-loads).
    joins = {"bt": 4, "device_blocks": 24, "budget": 8192, "ranks": 1, "async_scheduling": False,
             "two_tiers": False, "host": 200, "eviction": "lru", "transfer_deadline": None,
             "lookup_deadline": 5000.0, "reclaim_deadline": 480_000.0, "max_async_lookups": 1024,
             "failure_policy": "recompute", "stack": ("shared-loads",), "retire": False}
    for i in range(3):
        seen |= _drive(i, joins, 300)
    assert {"preemption", "load", "store", "async lookup", "expired lookup", "stale answer", "prefetch",
            "failed load", "reclaim", "timeout", "join", "retired", "SubmitLookup", "DiscardLookup",
            "StartPrefetch", "FreeBlocks", "dormant", "dormant aborted"} <= seen


class _Raises:
    """A policy whose store_limit hook raises after a few answers (a user's broken policy)."""

    name = "raises"

    def __init__(self) -> None:
        self.asked = 0

    def store_limit(self, req: Any, engine: Any) -> Any:
        self.asked += 1
        if self.asked > 3:
            raise RuntimeError(f"broken at {req.request_id}")
        return None


def test_policy_error_surfaces_alike() -> None:
    """A hook that raises stops both engines at the same input, with the same PolicyError."""
    from kvlife.policies.base import PolicyError

    config = EngineConfig(block_tokens=4, device_blocks=64, ranks=1)
    reference = Engine(config, PolicyStack([_Raises()]))
    native = bridge.engine(config, PolicyStack([_Raises()]))
    rng = random.Random(3)
    errors: list[str] = []
    for i in range(200):
        t = float(i)
        steps = [c for c in reference.handle(Tick(t)) if type(c) is StepPlan]
        native.handle(Tick(t))
        events: list[Any] = [Arrival(t, f"r{i}", rng.randint(9, 30), tuple(range(i * 10, i * 10 + 7)))]
        events += [StepOutput(t, plan.step_id, ()) for plan in steps]
        for event in events:
            try:
                reference.handle(event)
            except PolicyError as exc:
                with pytest.raises(PolicyError) as nat_error:
                    native.handle(event)
                assert str(nat_error.value) == str(exc)
                errors.append(str(exc))
                break
            native.handle(event)
        if errors:
            break
    assert errors and "broken at" in errors[0]
