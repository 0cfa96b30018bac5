"""The engine decides as vLLM 0.33's scheduler and connectors do (issues 9 and 10).

Each test drives ``Engine.handle`` by hand (or a simulated run) and checks one rule that a
broken engine would get wrong: lookup answers consumed by the admission that uses them,
no lookup without a full block, stores of generated tokens (a second turn hits the first
turn's answer), admission of the whole sequence, tail-first frees, ``max_running``
counting running requests only, landed loads first, preempted requests first,
``finished_sending`` with a later step, and the async-scheduling rules (no step past
``max_tokens``, no free under a step in flight). ``kvlife.lifecycle.drivers.vllm.differential``
checks the same rules step by step against vLLM itself.
"""

from __future__ import annotations

from typing import Any

from kvlife.lifecycle.config import EngineConfig, RunConfig, SimConfig, TierConfig
from kvlife.lifecycle.drivers.runner import run_workload
from kvlife.lifecycle.engine.blocks import DeviceBlockPool, derived_block_hash, extend_hashes
from kvlife.lifecycle.engine.core import Engine
from kvlife.lifecycle.engine.events import (
    Abort,
    Arrival,
    Command,
    LookupAnswer,
    StartLoad,
    StartStore,
    StepOutput,
    StepPlan,
    SubmitLookup,
    Tick,
    TransferReport,
)
from kvlife.lifecycle.workloads.mooncake import WorkloadRequest
from kvlife.policies.loading import load_stack

BT = 4
HOST = (TierConfig("host", capacity_blocks=64),)


def engine(stack: tuple[str, ...] = (), records: list[dict[str, Any]] | None = None, **config: Any) -> Engine:
    values: dict[str, Any] = {"block_tokens": BT, "device_blocks": 16, "max_batched_tokens": 64, "max_running": 8,
                              "tiers": HOST}
    values.update(config)
    recorder = records.append if records is not None else None
    return Engine(EngineConfig(**values), load_stack(list(stack)), recorder=recorder, reference=True)


def plan_of(commands: list[Command]) -> StepPlan | None:
    return next((c for c in commands if isinstance(c, StepPlan)), None)


def scheduled(commands: list[Command]) -> dict[str, tuple[int, int]]:
    plan = plan_of(commands)
    return {} if plan is None else {e.request_id: (e.computed_before, e.num_tokens) for e in plan.entries}


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def step(e: Engine, now: Clock, finished: tuple[tuple[str, str], ...] = ()) -> list[Command]:
    """One tick and, if it planned a step, that step's output (sync scheduling)."""
    commands = e.handle(Tick(now()))
    plan = plan_of(commands)
    if plan is not None:
        commands += e.handle(StepOutput(now(), plan.step_id, finished))
    return commands


def warm(e: Engine, hashes: tuple[int, ...]) -> None:
    """Put blocks in the host tier, as a previous run's stores would have."""
    tier = e.tiers["host"]
    plan = tier.prepare_store(list(hashes))
    tier.complete_store([h for h, _ in plan.accepted])


# ---- issue 9, item 7: lookup answers as vLLM consumes them --------------------------------------
def _blocked_after_answer(stack: tuple[str, ...], records: list[dict[str, Any]],
                          warm_blocks: tuple[int, ...] = ()) -> tuple[Engine, Clock]:
    """Both lookups answered; ``a`` takes 5 of the 6 device blocks, then ``b``'s whole
    sequence (3 blocks) does not fit: its answer was used by an admission that failed."""
    e = engine(stack, records, device_blocks=6)
    now = Clock()
    warm(e, warm_blocks)
    e.handle(Arrival(now(), "a", 20, tuple(range(100, 105))))
    e.handle(Arrival(now(), "b", 12, (1, 2, 3)))
    lookups = [c for c in e.handle(Tick(now())) if isinstance(c, SubmitLookup)]
    assert [c.request_id for c in lookups] == ["a", "b"] and e.requests["b"].state == "lookup_pending"
    for lookup in lookups:
        e.handle(LookupAnswer(now(), lookup.request_id, lookup.epoch, e.sync_lookup(lookup.block_hashes)))
    commands = e.handle(Tick(now()))
    assert scheduled(commands) == {"a": (0, 20)} and e.requests["b"].state == "waiting"
    plan = plan_of(commands)
    assert plan is not None
    e.handle(StepOutput(now(), plan.step_id))
    return e, now


def test_an_async_answer_is_consumed_by_the_admission_it_is_used_for() -> None:
    records: list[dict[str, Any]] = []
    e, now = _blocked_after_answer(("async-lookup",), records)
    # The answer was used by b's admission, which failed: consumed (the baseline's
    # lookup_reuse answer), though nothing is submitted until b is considered again.
    consume = [r for r in records if r["kind"] == "decision" and r["req"] == "b" and r["point"] == "lookup_reuse"]
    assert [r["value"] for r in consume] == ["consume"] and e.stats.async_lookups == 2
    # Considered again: a new lookup goes out (vLLM asks get_num_new_matched_tokens again).
    commands = e.handle(Tick(now()))
    again = [c for c in commands if isinstance(c, SubmitLookup)]
    assert [c.request_id for c in again] == ["b"] and e.requests["b"].state == "lookup_pending"
    reason = [r["reason"] for r in records if r["kind"] == "transition" and r["req"] == "b"][-1]
    assert "submitted again" in reason and "consumed" in reason
    # No spinning: while it is pending, further ticks submit nothing.
    assert not any(isinstance(c, SubmitLookup) for c in e.handle(Tick(now())))
    assert e.stats.async_lookups == 3


def test_keep_lookup_answers_reuses_the_answer_and_traces_its_age() -> None:
    records: list[dict[str, Any]] = []
    e, now = _blocked_after_answer(("keep-lookup-answers", "async-lookup"), records)
    assert e.requests["b"].lookup == ()  # kept
    commands = step(e, now)
    assert not any(isinstance(c, SubmitLookup) for c in commands) and "b" not in scheduled(commands)
    reuse = [r for r in records if r["kind"] == "lookup_reuse"]
    assert reuse and reuse[0]["req"] == "b" and reuse[0]["uses"] == 2 and reuse[0]["age_ms"] > 0
    assert reuse[0]["evicted"] == 0
    decision = [r for r in records if r["kind"] == "decision" and r["point"] == "lookup_reuse"]
    assert decision[-1]["value"] == "keep" and decision[-1]["policy"] == "keep-lookup-answers"
    assert e.stats.async_lookups == 2


def test_a_kept_answer_reports_blocks_evicted_since() -> None:
    records: list[dict[str, Any]] = []
    e, now = _blocked_after_answer(("keep-lookup-answers", "async-lookup"), records, warm_blocks=(1, 2))
    assert e.requests["b"].lookup == ("host", "host")
    e.tiers["host"].discard([2])  # a block of the answer leaves the tier
    step(e, now)
    reuse = [r for r in records if r["kind"] == "lookup_reuse"]
    assert reuse and reuse[-1]["blocks"] == 2 and reuse[-1]["evicted"] == 1


def test_a_request_with_no_full_block_skips_the_lookup() -> None:
    for stack in ((), ("async-lookup",), ("early-lookup", "async-lookup")):
        e = engine(stack)
        now = Clock()
        e.handle(Arrival(now(), "short", 3, (7,)))  # a partial block only
        e.handle(Arrival(now(), "exact", 4, (8,)))  # one full block, but its last token is computed
        commands = e.handle(Tick(now()))
        assert not any(isinstance(c, SubmitLookup) for c in commands), stack
        assert set(scheduled(commands)) == {"short", "exact"}, stack
        assert e.stats.sync_lookups == 0 and e.stats.async_lookups == 0, stack


# ---- issue 9, item 8: stores cover the whole token sequence --------------------------------------
def test_blocks_of_generated_tokens_are_stored_at_finish_included() -> None:
    records: list[dict[str, Any]] = []
    e = engine((), records)
    now = Clock()
    prompt = (11, 12)  # 8 prompt tokens: 2 full blocks
    e.handle(Arrival(now(), "a", 8, prompt))
    stored: list[int] = []
    for i in range(9):  # 9 tokens: the KV of the first 8 + 8 = 16 positions is computed
        commands = step(e, now, (("a", "stopped"),) if i == 8 else ())
        stored += [m.block_hash for c in commands if isinstance(c, StartStore) for m in c.moves]
    # The store of the last full block (positions 12..15) was decided at the finish and
    # reads a's blocks: a is held (request_finished answered True) ...
    assert e.requests["a"].state == "sending"
    finish_t = next(r["t"] for r in records if r["kind"] == "transition" and r["req"] == "a"
                    and r["to"] == "sending")
    last_store = [r for r in records if r["kind"] == "job" and r["op"] == "store"][-1]
    assert last_store["t"] == finish_t
    # ... and the job goes to the workers with the next step's metadata (vLLM's
    # build_connector_meta), whatever that step schedules.
    commands = e.handle(Tick(now()))
    stored += [m.block_hash for c in commands if isinstance(c, StartStore) for m in c.moves]
    assert stored == list(extend_hashes(prompt, "a", 4))
    assert stored[3] == derived_block_hash(stored[2], "a", 3)
    assert last_store["moves"][0][0] == stored[3]


def _turns(fillers: int) -> list[WorkloadRequest]:
    """Turn 2's prompt is turn 1's prompt (40 tokens), its answer (30) and 20 new tokens."""
    bt = 16
    first = WorkloadRequest("t1", 0.0, 40, 30, (1, 2, 3))
    context = extend_hashes(first.hash_ids[: 40 // bt], "t1", (40 + 30) // bt)
    out = [first]
    for i in range(fillers):  # unrelated requests that turn the device cache over
        out.append(WorkloadRequest(f"f{i}", 2000.0 + 50 * i, 64, 2, tuple(range(1000 + 10 * i, 1005 + 10 * i))))
    out.append(WorkloadRequest("t2", 9000.0, 90, 5, (*context, 501, 502)))
    return out


def test_a_second_turn_hits_the_first_turns_output_blocks() -> None:
    config = RunConfig(engine=EngineConfig(block_tokens=16, device_blocks=12, max_batched_tokens=512,
                                           tiers=(TierConfig("host", capacity_blocks=200),)),
                       sim=SimConfig())
    # Device cache still warm: turn 2 hits 4 blocks on the device, 2 of them turn 1's answer.
    outcome = run_workload(config, _turns(0), keep_requests=True)
    t2 = outcome.result.engine.requests["t2"]
    assert t2.device_hit_blocks == 4 and not t2.tier_hit_blocks
    # Device turned over: the answer's blocks come back from the host tier, where turn 1 stored them.
    outcome = run_workload(config, _turns(12), keep_requests=True)
    t2 = outcome.result.engine.requests["t2"]
    assert t2.device_hit_blocks + t2.tier_hit_blocks.get("host", 0) == 4
    assert t2.tier_hit_blocks.get("host", 0) >= 2


# ---- issue 10: the scheduler decides as vLLM's -----------------------------------------------------
def test_admission_needs_room_for_the_whole_sequence() -> None:
    e = engine((), device_blocks=6, max_batched_tokens=8)
    now = Clock()
    e.handle(Arrival(now(), "a", 8, (1, 2)))
    step(e, now)  # a: 2 blocks
    e.handle(Arrival(now(), "b", 20, tuple(range(10, 15))))
    # b's first chunk (8 tokens, 2 blocks) would fit in the 4 free blocks, its 20 tokens
    # (5 blocks) do not: vLLM's scheduler_reserve_full_isl declines it.
    for _ in range(3):
        assert "b" not in scheduled(step(e, now))
    assert e.requests["b"].state == "waiting"


def test_a_request_gives_its_blocks_back_tail_first_unhashed_first() -> None:
    pool = DeviceBlockPool(4)
    blocks = pool.allocate(3)
    pool.cache(blocks[0], 100)
    pool.cache(blocks[1], 101)
    spare = pool.allocate(1)
    pool.release(reversed(blocks))
    # vLLM's free_blocks: the unhashed tail block goes to the front of the free queue and
    # is reused first; the cached ones go to the back, tail first, so the prefix (100)
    # stays cached longest.
    assert pool.allocate(1) == [blocks[2]]
    pool.release(spare)  # unhashed: reused before any cached block (LIFO)
    assert pool.allocate(3) == [spare[0], blocks[1], blocks[0]]
    assert pool.block_of(100) is None and pool.block_of(101) is None  # reused blocks leave the cache


def test_max_running_counts_running_requests_only() -> None:
    e = engine((), max_running=1)
    now = Clock()
    warm(e, (1, 2))
    e.handle(Arrival(now(), "x", 12, (1, 2, 3)))
    e.handle(Arrival(now(), "y", 6, (50,)))
    commands = e.handle(Tick(now()))
    loads = [c for c in commands if isinstance(c, StartLoad)]
    # x loads (WAITING_FOR_REMOTE_KVS is not counted by max_num_seqs) and y runs.
    assert [c.request_id for c in loads] == ["x"] and scheduled(commands) == {"y": (0, 6)}
    e.handle(TransferReport(now(), loads[0].job_id, 0))
    assert e.requests["x"].state == "loading"  # landed: the next tick takes it, when a slot is free
    plan = plan_of(commands)
    assert plan is not None
    e.handle(StepOutput(now(), plan.step_id, (("y", "stopped"),)))
    assert scheduled(e.handle(Tick(now()))) == {"x": (8, 4)}
    assert e.requests["x"].state == "running"


def test_a_landed_load_is_taken_before_any_waiting_request() -> None:
    e = engine((), max_batched_tokens=4)
    now = Clock()
    warm(e, (1, 2))
    e.handle(Arrival(now(), "x", 12, (1, 2, 3)))
    commands = e.handle(Tick(now()))
    load = next(c for c in commands if isinstance(c, StartLoad))
    plan = plan_of(commands)
    assert plan is not None
    e.handle(Arrival(now(), "z", 4, (60,)))
    e.handle(TransferReport(now(), load.job_id, 0))
    e.handle(StepOutput(now(), plan.step_id))  # the worker reports x in finished_recving
    assert scheduled(e.handle(Tick(now()))) == {"x": (8, 4)}  # the whole budget; z waits
    assert e.requests["z"].state == "waiting"


def test_a_preempted_request_goes_to_the_front_of_the_queue() -> None:
    e = engine(("async-lookup",), device_blocks=5)
    now = Clock()
    e.handle(Arrival(now(), "a", 4, (1,)))  # no full block to hit: no lookups for a and b
    e.handle(Arrival(now(), "p", 12, (5, 6, 7)))  # its lookup goes out and is never answered
    e.handle(Arrival(now(), "b", 4, (3,)))
    for _ in range(8):
        step(e, now)
        if e.stats.preemptions:
            break
    assert e.requests["b"].preemptions == 1 and e.requests["p"].state == "lookup_pending"
    # vLLM prepends the victim: ahead of p, which arrived before it and was skipped in place.
    assert [r.request_id for r in e.scheduler.waiting] == ["b", "p"]


def test_a_held_request_is_released_with_the_next_step_output() -> None:
    records: list[dict[str, Any]] = []
    e = engine((), records)
    now = Clock()
    e.handle(Arrival(now(), "a", 8, (1, 2)))
    e.handle(Arrival(now(), "b", 6, (9,)))
    commands = e.handle(Tick(now()))
    plan = plan_of(commands)
    assert plan is not None
    e.handle(StepOutput(now(), plan.step_id))  # a's 2 prompt blocks are confirmed: stored
    second = e.handle(Tick(now()))
    store = next(c for c in second if isinstance(c, StartStore))  # with the next step's metadata
    plan = plan_of(second)
    assert plan is not None
    e.handle(StepOutput(now(), plan.step_id, (("a", "stopped"),)))
    assert e.requests["a"].state == "sending"
    # Its store reports in the same output: vLLM's worker hears of the finish only from
    # the next scheduler output, so finished_sending comes with the next step's output.
    e.handle(TransferReport(now(), store.job_id, 0))
    assert e.requests["a"].state == "sending"
    third = plan_of(e.handle(Tick(now())))
    assert third is not None and e.requests["a"].state == "sending"
    e.handle(StepOutput(now(), third.step_id))
    assert e.requests["a"].state == "finished"
    assert e.pool.free == e.pool.capacity - len(e.requests["b"].block_table)


def test_async_scheduling_schedules_no_step_past_max_tokens() -> None:
    e = engine((), async_scheduling=True)
    now = Clock()
    e.handle(Arrival(now(), "a", 8, (1, 2), max_tokens=2))
    e.handle(Arrival(now(), "n", 8, (3, 4)))  # no limit known: one step too many is scheduled
    first = plan_of(e.handle(Tick(now())))
    second = plan_of(e.handle(Tick(now())))  # step 1 in flight: a's decode samples its 2nd token
    assert first is not None and second is not None
    assert {x.request_id for x in second.entries} == {"a", "n"}
    e.handle(StepOutput(now(), first.step_id))
    third = plan_of(e.handle(Tick(now())))
    assert third is not None and {x.request_id for x in third.entries} == {"n"}


def test_async_scheduling_frees_no_block_a_step_in_flight_writes() -> None:
    e = engine((), async_scheduling=True, device_blocks=6)
    now = Clock()
    e.handle(Arrival(now(), "a", 8, (1, 2)))
    e.handle(Arrival(now(), "b", 8, (3, 4)))
    first = plan_of(e.handle(Tick(now())))
    second = plan_of(e.handle(Tick(now())))
    assert first is not None and second is not None
    free = e.pool.free
    commands = e.handle(Abort(now(), "b"))  # b is in both steps in flight
    assert not any(type(c).__name__ == "FreeBlocks" for c in commands) and e.pool.free == free
    e.handle(StepOutput(now(), first.step_id))
    assert e.pool.free == free
    e.handle(StepOutput(now(), second.step_id))
    assert e.pool.free == free + 3  # given back once the last step that wrote them is done


def test_async_scheduling_never_preempts_a_request_a_step_in_flight_writes() -> None:
    e = engine((), async_scheduling=True, device_blocks=6)
    now = Clock()
    e.handle(Arrival(now(), "a", 7, (1,)))
    e.handle(Arrival(now(), "b", 14, (2, 3, 4)))
    first = plan_of(e.handle(Tick(now())))  # a: 2 blocks, b: 4 blocks: the pool is full
    second = plan_of(e.handle(Tick(now())))  # both decode in their last block
    assert first is not None and second is not None and e.pool.free == 0
    e.handle(StepOutput(now(), first.step_id))
    # a needs a third block; the victim would be b, but the step in flight writes b's
    # blocks: vLLM (defer_block_free) schedules neither and preempts nobody.
    idle = plan_of(e.handle(Tick(now())))
    assert idle is not None and idle.entries == () and e.stats.preemptions == 0
    e.handle(StepOutput(now(), second.step_id))
    third = plan_of(e.handle(Tick(now())))
    assert e.requests["b"].preemptions == 1
    assert third is not None and {x.request_id for x in third.entries} == {"a"}
