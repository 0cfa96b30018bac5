"""Deadlines are transitions (issue 11, item 2): a lookup that never answers expires at
``engine.lookup_deadline_ms`` (``lookup_expired``), a load given up at
``engine.transfer_deadline_ms`` says so in its ``load_failed`` reason, a job some rank
never reports has its blocks reclaimed at ``engine.reclaim_deadline_ms`` (a ``reclaim``
record; a later report is ``late_report`` and changes nothing), and a prefetch whose
patience runs out is abandoned (an ``abandon`` record; what it lands is not published).
Each is acted on at its deadline and not before, and the independent observer checks
both sides."""

from __future__ import annotations

from typing import Any

import pytest

from kvlife.lifecycle.config import EngineConfig, TierConfig
from kvlife.lifecycle.engine.core import Engine
from kvlife.lifecycle.engine.events import (
    Abort,
    Arrival,
    DiscardLookup,
    FreeBlocks,
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
from kvlife.policies.base import Decision
from kvlife.policies.loading import load_policy
from kvlife.policies.stack import PolicyStack
from kvlife.specs.invariants import InvariantObserver, Settings
from kvlife.specs.model_check import AsyncLookups

BT = 4


def _config(**overrides: Any) -> EngineConfig:
    values: dict[str, Any] = {
        "block_tokens": BT, "device_blocks": 16, "max_batched_tokens": 64, "ranks": 2,
        "lookup_deadline_ms": 10.0, "reclaim_deadline_ms": 100.0,
        "tiers": (TierConfig("host", capacity_blocks=16), TierConfig("disk", capacity_blocks=16)),
    }
    values.update(overrides)
    return EngineConfig(**values)


def _engine(config: EngineConfig, stack: PolicyStack, records: list[dict[str, Any]]) -> Engine:
    return Engine(config, stack, recorder=records.append, reference=True)


def _observer(config: EngineConfig, records: list[dict[str, Any]], **deadlines: float) -> InvariantObserver:
    """The independent observer over ``records`` as a trace (validate's mode)."""
    observer = InvariantObserver(Settings.of(
        config, live=False,
        lookup_deadline_ms=deadlines.get("lookup", config.lookup_deadline_ms),
        transfer_deadline_ms=deadlines.get("transfer", config.transfer_deadline_ms),
        reclaim_deadline_ms=deadlines.get("reclaim", config.reclaim_deadline_ms)))
    for record in records:
        observer.feed_record(record)
    observer.end_input()  # close the last handling (its end-of-tick checks)
    return observer


def _warm(engine: Engine, tier: str, hashes: tuple[int, ...]) -> None:
    index = engine.tiers[tier]
    plan = index.prepare_store(hashes)
    index.complete_store([h for h, _ in plan.accepted])


def _tick(engine: Engine, t: float) -> list[Any]:
    """One scheduler pass at ``t`` and, at once, its step's output (no request stops): as a
    driver delivers every step's output. The commands of both."""
    commands = engine.handle(Tick(t))
    for command in list(commands):
        if isinstance(command, StepPlan):
            commands.extend(engine.handle(StepOutput(t, command.step_id, ())))
    return commands


def _run_to_finish(engine: Engine, rid: str, t: float) -> float:
    """Tick and deliver step outputs (``rid`` stops after one token), every rank reporting
    every load and store at once, until it finishes."""
    for _ in range(20):
        if engine.requests[rid].state == "finished":
            return t
        t += 1.0
        commands = engine.handle(Tick(t))
        for command in list(commands):
            if isinstance(command, StepPlan):
                t += 1.0
                done = tuple((e.request_id, "stopped") for e in command.entries if e.samples)
                commands.extend(engine.handle(StepOutput(t, command.step_id, done)))
        for command in commands:
            if isinstance(command, (StartLoad, StartStore)):
                for rank in range(engine.config.ranks):
                    engine.handle(TransferReport(t, command.job_id, rank))
    raise AssertionError(f"{rid} never finished: {engine.requests[rid].state}")


def _transitions(records: list[dict[str, Any]], trigger: str) -> list[dict[str, Any]]:
    return [r for r in records if r["kind"] == "transition" and r["trigger"] == trigger]


# ---- lookups -----------------------------------------------------------------------------
def test_an_unanswered_lookup_expires_at_its_deadline_not_before_and_the_request_finishes() -> None:
    config = _config()
    records: list[dict[str, Any]] = []
    engine = _engine(config, PolicyStack([AsyncLookups()]), records)
    _warm(engine, "host", (1, 2))
    submitted = [c for c in engine.handle(Arrival(0.0, "a", 9, (1, 2))) if isinstance(c, SubmitLookup)]
    assert len(submitted) == 1 and engine.requests["a"].state == "lookup_pending"
    assert engine.next_wakeup() == 10.0  # a driver wakes the engine for the deadline
    _tick(engine, 9.999)
    assert engine.requests["a"].state == "lookup_pending"  # not before
    commands = _tick(engine, 10.0)
    assert DiscardLookup("a", 0) in commands  # the driver may drop the lookup
    expired = _transitions(records, "lookup_expired")
    assert len(expired) == 1 and expired[0]["from"] == "lookup_pending" and expired[0]["to"] == "waiting"
    assert expired[0]["t"] == 10.0 and expired[0]["reason"].startswith("lookup deadline: no answer 10 ms")
    req = engine.requests["a"]
    # A miss: admitted in the same tick, computing its whole prompt (no load from the tier).
    assert req.state == "running" and req.epoch == 1 and req.computed == 9
    assert not any(isinstance(c, StartLoad) for c in commands)
    assert engine.stats.expired_lookups == 1
    # The late answer is stale: recorded, changes nothing.
    engine.handle(LookupAnswer(11.0, "a", 0, ("host", "host")))
    assert records[-1]["kind"] == "stale_lookup" and records[-1]["epoch"] == 0 and records[-1]["current_epoch"] == 1
    assert engine.requests["a"].state == "running"
    _run_to_finish(engine, "a", 11.0)
    observer = _observer(config, records)
    observer.finish()
    assert observer.violations == []


def test_an_answer_in_time_cancels_the_deadline() -> None:
    records: list[dict[str, Any]] = []
    engine = _engine(_config(), PolicyStack([AsyncLookups()]), records)
    engine.handle(Arrival(0.0, "a", 9, (1, 2)))
    engine.handle(LookupAnswer(9.0, "a", 0, ()))
    assert engine.next_wakeup() is None
    _tick(engine, 50.0)
    assert _transitions(records, "lookup_expired") == []


def test_the_observer_refuses_an_early_expiry_and_a_missed_one() -> None:
    config = _config()
    records: list[dict[str, Any]] = []
    engine = _engine(config, PolicyStack([AsyncLookups()]), records)
    engine.handle(Arrival(0.0, "a", 9, (1, 2)))
    _tick(engine, 10.0)
    # Told the deadline is 20 ms, the observer sees an expiry at 10 ms: illegal (1).
    early = _observer(config, records, lookup=20.0).violations
    assert [v.invariant for v in early] == [1]
    assert "lookup expired at t=10, before its deadline t=20" in early[0].message
    # An engine that never expires: after a tick past the deadline the lookup is still
    # pending, a liveness finding (7).
    records = []
    engine = _engine(config, PolicyStack([AsyncLookups()]), records)
    engine.core._expire_lookups = lambda: None  # type: ignore[method-assign]
    engine.handle(Arrival(0.0, "a", 9, (1, 2)))
    _tick(engine, 12.0)
    missed = _observer(config, records).violations
    assert [v.invariant for v in missed] == [7]
    assert "a: its lookup of t=0 is still pending after a tick at t=12, past its deadline t=10" in missed[0].message


# ---- transfers -----------------------------------------------------------------------------
def _start_load(engine: Engine) -> StartLoad:
    _warm(engine, "host", (1, 2))
    engine.handle(Arrival(0.0, "a", 9, (1, 2)))
    loads = [c for c in _tick(engine, 0.0) if isinstance(c, StartLoad)]
    assert len(loads) == 1 and engine.requests["a"].state == "loading"
    return loads[0]


def test_a_load_given_up_at_the_transfer_deadline_says_so() -> None:
    config = _config(transfer_deadline_ms=5.0)
    records: list[dict[str, Any]] = []
    engine = _engine(config, PolicyStack([]), records)
    load = _start_load(engine)
    engine.handle(TransferReport(1.0, load.job_id, 0))
    assert engine.next_wakeup() == 5.0
    _tick(engine, 4.0)
    assert engine.requests["a"].state == "loading"
    _tick(engine, 5.0)
    failed = _transitions(records, "load_failed")
    assert len(failed) == 1
    assert "transfer deadline: ranks [1] silent 5 ms after it started (deadline 5 ms)" in failed[0]["reason"]
    _run_to_finish(engine, "a", 5.0)


def test_an_abort_during_loading_with_a_silent_rank_frees_its_blocks_at_the_reclaim_deadline() -> None:
    config = _config()
    records: list[dict[str, Any]] = []
    engine = _engine(config, PolicyStack([]), records)
    load = _start_load(engine)
    engine.handle(TransferReport(1.0, load.job_id, 0))  # rank 1 never reports
    engine.handle(Abort(2.0, "a"))
    assert engine.requests["a"].state == "finished"
    held = {m.device_block for m in load.moves}
    assert engine.pool.used == len(held)  # the job still holds them
    assert engine.next_wakeup() == 100.0
    _tick(engine, 99.9)
    assert engine.pool.used == len(held)  # not before the deadline
    commands = _tick(engine, 100.0)
    assert engine.pool.used == 0 and load.job_id not in engine.jobs
    assert any(isinstance(c, FreeBlocks) and set(c.device_blocks) >= held for c in commands)
    reclaim = [r for r in records if r["kind"] == "reclaim"]
    assert len(reclaim) == 1 and reclaim[0]["job"] == load.job_id and reclaim[0]["ranks"] == [1]
    assert reclaim[0]["reason"].startswith("reclaim deadline: ranks [1] silent 100 ms")
    kinds = [r["kind"] for r in records]
    assert kinds.index("reclaim") < len(kinds) - 1 - kinds[::-1].index("free")  # reclaim, then the free
    assert not engine.busy()
    # The late report is recorded and ignored: no job_done, nothing freed or published.
    before = len(records)
    engine.handle(TransferReport(150.0, load.job_id, 1))
    late = records[before + 1:]
    assert [(r["kind"], r.get("what")) for r in late] == [("warning", "late_report")]
    assert engine.stats.late_reports == 1 and not engine.pool.cached_prefix((1, 2))
    engine.check_invariants()
    observer = _observer(config, records)
    observer.finish()
    assert observer.violations == []


def test_the_observer_catches_a_reclaim_before_its_deadline_and_a_missed_one() -> None:
    config = _config()
    records: list[dict[str, Any]] = []
    engine = _engine(config, PolicyStack([]), records)
    load = _start_load(engine)
    engine.handle(TransferReport(1.0, load.job_id, 0))
    engine.handle(Abort(2.0, "a"))
    _tick(engine, 100.0)
    early = _observer(config, records, reclaim=200.0).violations
    assert early and early[0].invariant == 2 and "reclaimed at t=100, before its deadline t=200" in early[0].message
    records = []
    engine = _engine(config, PolicyStack([]), records)
    engine.core.transfers.reclaim_jobs = lambda deadline: None  # type: ignore[method-assign]
    load = _start_load(engine)
    engine.handle(TransferReport(1.0, load.job_id, 0))
    engine.handle(Abort(2.0, "a"))
    _tick(engine, 100.0)
    missed = _observer(config, records).violations
    assert [v.invariant for v in missed] == [7]
    assert "not reclaimed after a tick at t=100" in missed[0].message and "its blocks leak" in missed[0].message


def test_a_silent_rank_on_a_store_of_a_request_in_sending_ends_at_the_reclaim_deadline() -> None:
    """No transfer deadline: the reclaim deadline alone gives the store up (the request
    finishes, saying why) and reclaims its blocks."""
    config = _config(device_blocks=8)
    records: list[dict[str, Any]] = []
    stack = PolicyStack([])  # the baseline holds a finished request while its stores run
    engine = _engine(config, stack, records)
    engine.handle(Arrival(0.0, "a", 8, (1, 2)))
    plan = next(c for c in engine.handle(Tick(0.0)) if isinstance(c, StepPlan))
    out = engine.handle(StepOutput(1.0, plan.step_id, (("a", "stopped"),)))
    stores = [c for c in out if type(c).__name__ == "StartStore"] + \
        [c for c in _tick(engine, 1.0) if type(c).__name__ == "StartStore"]
    assert stores and engine.requests["a"].state == "sending"
    for store in stores:
        engine.handle(TransferReport(2.0, store.job_id, 0))  # rank 1 stays silent
    assert engine.next_wakeup() == 101.0  # the stores started with the step output at t=1
    _tick(engine, 100.9)
    assert engine.requests["a"].state == "sending"
    _tick(engine, 101.0)
    done = _transitions(records, "completed")
    reclaimed = [r for r in records if r["kind"] == "reclaim"]
    assert len(done) == 1 and {r["job"] for r in reclaimed} == {s.job_id for s in stores}
    assert all(r["t"] == 101.0 and r["ranks"] == [1] for r in reclaimed)
    assert engine.pool.used == 0 and not engine.busy()
    assert all(not engine.tiers[t].contains(1) for t in ("host", "disk"))  # not kept
    observer = _observer(config, records)
    observer.finish()
    assert observer.violations == []


# ---- prefetch ------------------------------------------------------------------------------
class _PrefetchNoPatience:
    name = "prefetch-no-patience"

    def on_arrival(self, req: Any, engine: Any) -> Any:
        return Decision("prefetch", "test: prefetch at arrival")

    def prefetch_patience(self, req: Any, prefetch: Any, engine: Any) -> Any:
        return Decision(2.0, "test: wait 2 ms")


@pytest.mark.parametrize("fail", [False, True])
def test_an_abandoned_prefetch_is_traced_and_what_it_lands_is_never_published(fail: bool) -> None:
    config = _config()
    records: list[dict[str, Any]] = []
    engine = _engine(config, PolicyStack([_PrefetchNoPatience()]), records)
    _warm(engine, "disk", (1, 2))
    engine.handle(Arrival(0.0, "a", 9, (1, 2)))
    engine.handle(LookupAnswer(1.0, "a", 0, ("disk", "disk")))  # the prefetch starts (t=1)
    assert engine.next_wakeup() == 3.0
    # The workers get it with the next pass's metadata.
    pulls = [c for c in _tick(engine, 2.0) if isinstance(c, StartPrefetch)]
    assert len(pulls) == 1
    assert engine.requests["a"].state == "waiting"  # deferred while patience lasts
    _tick(engine, 3.0)
    abandon = [r for r in records if r["kind"] == "abandon"]
    assert len(abandon) == 1 and abandon[0]["job"] == pulls[0].job_id and abandon[0]["req"] == "a"
    assert abandon[0]["reason"].startswith("prefetch deadline: patience ran out after 2.0 ms")
    for rank in (0, 1):
        engine.handle(TransferReport(4.0, pulls[0].job_id, rank, (1,) if fail else ()))
    done = [r for r in records if r["kind"] == "job_done" and r["job"] == pulls[0].job_id]
    assert done and done[0]["abandoned"] is True
    assert engine.tiers["host"].lookup([1, 2]) == 0  # nothing of it published as landed
    engine.check_invariants()
    _run_to_finish(engine, "a", 4.0)
    observer = _observer(config, records)
    observer.finish()
    assert observer.violations == []


def test_the_simulator_ends_with_the_default_deadlines_unfired() -> None:
    """The defaults (lookup 5 s, reclaim 480 s) never fire on a run whose driver answers
    everything: no expiry, no reclaim."""
    from kvlife.lifecycle.config import RunConfig, SimConfig
    from kvlife.lifecycle.drivers.simulator import Simulator
    from kvlife.lifecycle.workloads.synthetic import synthetic_workload

    config = RunConfig(engine=EngineConfig(device_blocks=64, tiers=(TierConfig("host", capacity_blocks=64),)),
                       sim=SimConfig(seed=1))
    workload = synthetic_workload(seed=1, num_requests=40)
    result = Simulator(config, workload, PolicyStack([load_policy("async-lookup")])).run()
    stats = result.engine.stats
    assert stats.async_lookups > 0 and stats.expired_lookups == 0 and stats.reclaimed_jobs == 0
    assert result.stranded == []


def test_validate_and_explain_read_a_reclaim(tmp_path: Any) -> None:
    """The abort-with-a-silent-rank trace, written as a file: ``kvlife validate`` finds
    it valid, and ``kvlife explain`` shows the reclaim after the request finished."""
    from kvlife.lifecycle.config import RunConfig
    from kvlife.lifecycle.traces.explain import explain
    from kvlife.lifecycle.traces.trace import TraceWriter
    from kvlife.lifecycle.traces.validate import validate

    config = _config()
    path = tmp_path / "reclaim.trace.jsonl"
    with TraceWriter(path) as writer:
        writer.write_header(RunConfig(engine=config).to_dict(), ["baseline"], 0)
        engine = _engine(config, PolicyStack([]), [])
        engine.state.recorder = writer.record
        load = _start_load(engine)
        engine.handle(TransferReport(1.0, load.job_id, 0))
        engine.handle(Abort(2.0, "a"))
        engine.handle(Tick(100.0))
        engine.handle(TransferReport(150.0, load.job_id, 1))
        for step_id in sorted(engine.scheduler.steps):  # a run that ended delivered every step's output
            engine.handle(StepOutput(160.0, step_id, ()))
    report = validate(path)
    assert report.ok, report.format()
    lines = explain(path, "a")
    assert any("finished" in line for line in lines)
    reclaim = [line for line in lines if "reclaimed" in line]
    assert len(reclaim) == 1 and "t=100.0: load job 0 reclaimed - reclaim deadline: ranks [1]" in reclaim[0]
