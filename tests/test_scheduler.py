"""The scheduler tick: token budget, max running, chunked prefill, FIFO, preemption."""

from __future__ import annotations

from kvlife.lifecycle.config import EngineConfig, TierConfig
from kvlife.lifecycle.engine.core import Engine
from kvlife.lifecycle.engine.events import Abort, Arrival, StartLoad, StepOutput, StepPlan, Tick
from kvlife.policies.stack import PolicyStack


def make_engine(**overrides: object) -> Engine:
    base: dict[str, object] = {"block_tokens": 16, "device_blocks": 64, "max_batched_tokens": 64,
                               "max_running": 8, "tiers": ()}
    base.update(overrides)
    return Engine(EngineConfig(**base), PolicyStack([]), reference=True)  # type: ignore[arg-type]


def plan_of(commands: list[object]) -> StepPlan:
    plans = [c for c in commands if isinstance(c, StepPlan)]
    assert len(plans) == 1
    return plans[0]


def test_prefill_is_chunked_by_the_token_budget() -> None:
    engine = make_engine()
    engine.handle(Arrival(0.0, "a", 150, ()))
    tokens = []
    t = 0.0
    while engine.requests["a"].generated == 0:
        plan = plan_of(engine.handle(Tick(t)))
        assert sum(e.num_tokens for e in plan.entries) <= 64
        tokens.append(plan.entries[0].num_tokens)
        t += 1
        engine.handle(StepOutput(t, plan.step_id))
    assert tokens == [64, 64, 22]
    assert engine.requests["a"].state == "running"
    # then one token per step (decode)
    plan = plan_of(engine.handle(Tick(t)))
    assert [e.num_tokens for e in plan.entries] == [1]


def test_budget_is_shared_fifo_and_max_running_holds() -> None:
    engine = make_engine(max_running=2)
    for i, rid in enumerate(["a", "b", "c"]):
        engine.handle(Arrival(float(i) * 0.0, rid, 40, ()))
    plan = plan_of(engine.handle(Tick(0.0)))
    assert [(e.request_id, e.num_tokens) for e in plan.entries] == [("a", 40), ("b", 24)]
    assert engine.requests["c"].state == "waiting"


def test_running_requests_go_before_new_admissions() -> None:
    engine = make_engine(max_batched_tokens=32)
    engine.handle(Arrival(0.0, "a", 20, ()))
    plan = plan_of(engine.handle(Tick(0.0)))
    engine.handle(StepOutput(1.0, plan.step_id))
    engine.handle(Arrival(1.0, "b", 100, ()))
    plan = plan_of(engine.handle(Tick(1.0)))
    assert [(e.request_id, e.num_tokens) for e in plan.entries] == [("a", 1), ("b", 31)]


def test_preemption_when_device_blocks_run_out() -> None:
    # 6 blocks of 16 tokens: a (48 tokens = 3 blocks) and b (40 tokens = 3 blocks) fill the device.
    engine = make_engine(device_blocks=6, max_batched_tokens=256)
    engine.handle(Arrival(0.0, "a", 47, ()))
    engine.handle(Arrival(0.0, "b", 40, ()))
    plan = plan_of(engine.handle(Tick(0.0)))
    assert {e.request_id for e in plan.entries} == {"a", "b"}
    engine.handle(StepOutput(1.0, plan.step_id))
    assert engine.pool.free == 0
    # a's first decode token needs no new block (47 + 1 = 48); its second needs a 4th block.
    plan = plan_of(engine.handle(Tick(1.0)))
    engine.handle(StepOutput(2.0, plan.step_id))
    plan = plan_of(engine.handle(Tick(2.0)))
    assert engine.requests["b"].state == "waiting"  # the latest admitted is preempted
    assert engine.requests["b"].preemptions == 1
    assert [e.request_id for e in plan.entries] == ["a"]
    assert engine.stats.preemptions == 1
    engine.check_invariants()


def test_preempted_request_resumes_from_its_cached_prefix() -> None:
    engine = make_engine(device_blocks=8, max_batched_tokens=256)
    engine.handle(Arrival(0.0, "a", 64, (1, 2, 3, 4)))
    plan = plan_of(engine.handle(Tick(0.0)))
    engine.handle(StepOutput(1.0, plan.step_id))
    # a second request with the same prefix hits the device prefix cache
    engine.handle(Arrival(1.0, "b", 64, (1, 2, 3, 4)))
    plan = plan_of(engine.handle(Tick(1.0)))
    entry = {e.request_id: e for e in plan.entries}["b"]
    assert entry.computed_before == 48  # 3 full blocks hit; the last prompt token is recomputed
    assert entry.num_tokens == 16
    assert engine.requests["b"].device_hit_blocks == 3


def test_request_larger_than_the_device_fails_instead_of_stranding() -> None:
    engine = make_engine(device_blocks=4)
    engine.handle(Arrival(0.0, "huge", 16 * 10, ()))
    assert engine.requests["huge"].state == "finished"
    assert engine.requests["huge"].finish_reason == "error"


def test_async_scheduling_counts_placeholders_as_computed() -> None:
    engine = make_engine(async_scheduling=True)
    engine.handle(Arrival(0.0, "a", 30, ()))
    first = plan_of(engine.handle(Tick(0.0)))
    req = engine.requests["a"]
    assert req.computed == 30 and req.confirmed == 0 and req.placeholders == 1
    # the next step is scheduled before the first one's output arrives
    second = plan_of(engine.handle(Tick(0.5)))
    assert [e.num_tokens for e in second.entries] == [1]
    assert req.computed == 31 and req.placeholders == 2
    engine.handle(StepOutput(1.0, first.step_id))
    assert req.confirmed == 30 and req.generated == 1 and req.placeholders == 1


def test_finish_with_a_store_in_flight_waits_in_sending() -> None:
    from kvlife.lifecycle.engine.events import FreeBlocks, TransferReport

    engine = make_engine(tiers=(TierConfig("host", capacity_blocks=16),))
    engine.handle(Arrival(0.0, "a", 33, (10, 20, 30)))
    plan = plan_of(engine.handle(Tick(0.0)))
    assert engine.handle(StepOutput(1.0, plan.step_id, (("a", "stopped"),))) == []
    # request_finished asked to hold the blocks: a store of its two full blocks is pending.
    assert engine.requests["a"].state == "sending"
    # The store goes out with the next step's connector metadata, as vLLM's build_connector_meta.
    commands = engine.handle(Tick(2.0))
    store_jobs = [c for c in commands if type(c).__name__ == "StartStore"]
    assert len(store_jobs) == 1 and [m.block_hash for m in store_jobs[0].moves] == [10, 20]
    assert engine.handle(TransferReport(3.0, store_jobs[0].job_id, 0)) == []
    # Stored; the blocks go back with the next step output (vLLM's finished_sending).
    assert engine.requests["a"].state == "sending" and engine.pool.free < engine.pool.capacity
    freed = engine.handle(StepOutput(4.0, plan_of(commands).step_id))
    assert [c for c in freed if isinstance(c, FreeBlocks)]
    assert engine.requests["a"].state == "finished"
    assert engine.tiers["host"].lookup([10, 20, 30]) == 2
    engine.check_invariants()
    assert engine.pool.free == engine.pool.capacity


def test_a_failed_step_aborts_its_requests_and_its_blocks_serve_no_hit() -> None:
    """A step that raised on a rank (the live runtime) wrote no KV: the blocks it was to
    write were published in the prefix cache when it was scheduled (vLLM caches at
    allocation), and must leave it, or a later request with the same prefix is served them."""
    for failed in (False, True):
        engine = make_engine(device_blocks=16, max_batched_tokens=256)
        engine.handle(Arrival(0.0, "a", 64, (1, 2, 3, 4)))
        plan = plan_of(engine.handle(Tick(0.0)))
        engine.handle(StepOutput(1.0, plan.step_id, failed_ranks=(1,) if failed else ()))
        assert engine.requests["a"].state == ("finished" if failed else "running")
        assert (engine.requests["a"].finish_reason == "aborted") is failed
        engine.handle(Arrival(1.0, "b", 64, (1, 2, 3, 4)))
        plan = plan_of(engine.handle(Tick(1.0)))
        entry = {e.request_id: e for e in plan.entries}["b"]
        assert entry.computed_before == (0 if failed else 48)
        engine.check_invariants()


def test_a_failed_step_aborts_the_requests_that_hit_its_blocks_and_those_that_finished_while_it_ran() -> None:
    """Under async scheduling a later step may already read a failed step's blocks: b hit
    a's first block (cached when a's step was scheduled) and its own step is in flight. When
    a's step fails, b computed over garbage: it is aborted, and its blocks after the hit
    leave the cache too. A request aborted while the step ran (c) has its blocks withdrawn
    as well: they were freed, still cached, with nothing valid in them."""
    engine = make_engine(device_blocks=32, max_batched_tokens=256, async_scheduling=True)
    engine.handle(Arrival(0.0, "a", 64, (1, 2, 3, 4)))
    engine.handle(Arrival(0.0, "c", 32, (7, 8)))
    first = plan_of(engine.handle(Tick(0.0)))
    a_blocks = set({e.request_id: e for e in first.entries}["a"].block_table[:4])
    c_blocks = set({e.request_id: e for e in first.entries}["c"].block_table[:2])
    engine.handle(Abort(0.5, "c"))
    engine.handle(Arrival(1.0, "b", 80, (1, 2, 3, 61, 62)))
    second = plan_of(engine.handle(Tick(1.0)))
    b_entry = {e.request_id: e for e in second.entries}["b"]
    assert b_entry.computed_before == 48  # a's first three blocks, cached when its step was planned
    b_own = set(b_entry.block_table[3:])
    engine.handle(StepOutput(2.0, first.step_id, failed_ranks=(0,)))
    assert engine.requests["a"].finish_reason == "aborted"
    assert engine.requests["b"].finish_reason == "aborted"
    cached = {block for blocks in engine.pool.cached.values() for block in blocks}
    assert not cached & (a_blocks | c_blocks | b_own)
    engine.handle(StepOutput(3.0, second.step_id))
    engine.check_invariants()


def test_a_store_flushed_at_a_preemption_and_given_up_later_is_not_quarantined() -> None:
    """A preemption frees a request's blocks and flushes its store (the workers finish it
    before the next step writes anything); a rank that never reports that store lets the
    transfer deadline give it up. Its blocks went back at the flush: the give-up holds none
    of them (a hold there would fall on a free block, or on one another request took)."""
    from kvlife.lifecycle.engine.events import StartStore, TransferReport

    engine = make_engine(device_blocks=8, max_batched_tokens=256, transfer_deadline_ms=100.0,
                         tiers=(TierConfig("host", capacity_blocks=16),))
    engine.handle(Arrival(0.0, "a", 60, (1, 2, 3)))
    engine.handle(Arrival(0.0, "b", 60, (4, 5, 6)))
    stores: list[StartStore] = []
    t = 0.0
    while engine.requests["b"].preemptions == 0:  # decode until a needs a 5th block: b goes
        commands = engine.handle(Tick(t))
        stores += [c for c in commands if isinstance(c, StartStore)]
        t += 1.0
        engine.handle(StepOutput(t, plan_of(commands).step_id))  # no store ever reports
    flushed = {c.job_id for c in stores if c.request_id == "b"}
    assert flushed and all(engine.jobs[j].flushed for j in flushed)
    mine = [m.device_block for c in stores if c.request_id == "b" for m in c.moves]
    blocks = [b for b in mine if engine.pool.refs[b] == 0]  # freed at the preemption, not reused
    assert blocks
    engine.handle(Tick(t + 500.0))  # past the deadline: every store is given up
    assert engine.stats.rank_timeouts == len(stores)
    assert all(engine.pool.refs[b] == 0 for b in blocks)  # not held: they went back at the flush
    assert not set(engine.state.held_blocks) & flushed
    for store in stores:  # the late reports change nothing
        engine.handle(TransferReport(t + 501.0, store.job_id, 0))
    engine.handle(Tick(t + 502.0))
    assert all(engine.pool.refs[b] == 0 for b in blocks)
    engine.check_invariants()


def _run_to_finish(engine: Engine, rid: str, t: float) -> float:
    """Step the engine (reporting every transfer at once) until ``rid`` is finished."""
    from kvlife.lifecycle.engine.events import StartLoad, StartStore, TransferReport

    while engine.requests[rid].state != "finished":
        commands = engine.handle(Tick(t))
        for c in commands:
            if isinstance(c, StartLoad | StartStore):
                engine.handle(TransferReport(t, c.job_id, 0))
        t += 1.0
        engine.handle(StepOutput(t, plan_of(commands).step_id, ((rid, "stopped"),)
                                 if engine.output_tokens(rid) else ()))
    return t


def _loading_b() -> tuple[Engine, float, list[object], StartLoad]:
    """An engine where request "b" loads its 4 blocks from the host tier (its prefix, which
    "a" stored; "filler" took every device block in between): the engine, the time, the
    tick's commands and the load."""
    engine = make_engine(device_blocks=8, max_batched_tokens=256, tiers=(TierConfig("host", capacity_blocks=16),))
    engine.handle(Arrival(0.0, "a", 65, (1, 2, 3, 4)))
    t = _run_to_finish(engine, "a", 0.0)
    engine.handle(Arrival(t, "filler", 112, (11, 12, 13, 14, 15, 16, 17)))  # takes every device block
    t = _run_to_finish(engine, "filler", t)
    engine.handle(Arrival(t, "b", 65, (1, 2, 3, 4)))
    commands = engine.handle(Tick(t))
    (load,) = [c for c in commands if isinstance(c, StartLoad)]
    return engine, t, commands, load


def test_a_load_that_fails_after_its_request_was_aborted_changes_nothing() -> None:
    """vLLM keeps an aborted request's blocks until its load reports (finished_recving); the
    report, failed blocks and all, must not touch the finished request (no load_failed from
    finished), and its blocks go back with the next step output."""
    from kvlife.lifecycle.engine.events import Abort, TransferReport

    engine, t, commands, load = _loading_b()
    assert engine.requests["b"].state == "loading" and len(load.moves) == 4
    engine.handle(Abort(t, "b"))
    assert engine.requests["b"].state == "finished"
    held = [m.device_block for m in load.moves]
    assert all(engine.pool.refs[b] > 0 for b in held)  # vLLM frees them at finished_recving
    engine.handle(TransferReport(t + 1.0, load.job_id, 0, (2, 3)))
    engine.handle(StepOutput(t + 1.0, plan_of(commands).step_id))
    assert engine.requests["b"].state == "finished" and engine.requests["b"].finish_reason == "aborted"
    assert all(engine.pool.refs[b] == 0 for b in held)
    assert not engine.tiers["host"].contains(2) and engine.tiers["host"].contains(1)  # the failed copies go
    engine.check_invariants()


def test_the_engine_is_busy_until_an_aborted_requests_load_gives_its_blocks_back() -> None:
    """An aborted request's load reports between step outputs: its blocks come back only with
    the next step output (finished_recving), so the engine stays busy, and a driver steps on
    (vLLM's engine does), until then."""
    from kvlife.lifecycle.engine.events import Abort, TransferReport

    engine, t, commands, load = _loading_b()
    engine.handle(Abort(t, "b"))
    engine.handle(StepOutput(t + 1.0, plan_of(commands).step_id))
    engine.handle(TransferReport(t + 2.0, load.job_id, 0))
    held = [m.device_block for m in load.moves]
    assert engine.requests["b"].state == "finished" and not engine.jobs
    assert all(engine.pool.refs[b] > 0 for b in held)
    assert engine.busy()  # the next step output gives them back
    commands = engine.handle(Tick(t + 3.0))
    engine.handle(StepOutput(t + 4.0, plan_of(commands).step_id))
    assert all(engine.pool.refs[b] == 0 for b in held)
    assert not engine.busy()
    engine.check_invariants()
