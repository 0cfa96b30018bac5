"""Invariant 14 (specs/fast_twin.py): the decode fast path checked against the step-by-step
path, input by input. A twin that plans a step differently, or writes another record, is
a finding; the same engine twice is not."""

from __future__ import annotations

import pytest

from kvlife.lifecycle.config import EngineConfig
from kvlife.lifecycle.engine.core import Engine
from kvlife.lifecycle.engine.events import Abort, Arrival, StepOutput, StepPlan, Tick
from kvlife.policies.stack import PolicyStack
from kvlife.specs.fast_twin import FastTwin, StopRules, plan_totals


def _pair(outputs: dict[str, int]) -> tuple[Engine, list[dict[str, object]], FastTwin]:
    config = EngineConfig(block_tokens=4, device_blocks=16, max_batched_tokens=32, max_running=4, ranks=1, tiers=())
    records: list[dict[str, object]] = []
    main = Engine(config, PolicyStack([]), recorder=records.append)
    twin_records: list[dict[str, object]] = []
    twin_engine = Engine(config, PolicyStack([]), recorder=twin_records.append)
    twin_engine.state.fast_limits = StopRules(outputs)
    return main, records, FastTwin(twin_engine, twin_records)


def _drive(main: Engine, records: list[dict[str, object]], twin: FastTwin, outputs: dict[str, int],
           abort_member: str | None = None) -> list[str]:
    """The requests decode to their output lengths; every input goes to both engines. With
    ``abort_member``, that request is aborted the first time it is a member of the twin's
    decode cohort while a step of the cohort runs."""
    found = []
    t = 0.0
    prompts = {"a": 6, "b": 5, "c": 7}
    events: list[object] = [Arrival(0.0, rid, prompts[rid], (i + 1,)) for i, rid in enumerate(outputs)]
    plans: list[StepPlan] = []
    for _ in range(60):
        for event in events:
            commands = list(main.handle(event))  # type: ignore[arg-type]
            plans += [c for c in commands if isinstance(c, StepPlan)]
            differs = twin.compare(event, commands, records, main.next_wakeup)
            records.clear()
            if differs is not None:
                found.append(differs)
        t += 1.0
        if plans:
            plan = plans.pop(0)
            done = tuple((e.request_id, "stopped") for e in plan.entries
                         if e.samples and main.requests[e.request_id].generated + 1 >= outputs[e.request_id])
            events = [StepOutput(t, plan.step_id, done), Tick(t + 0.5)]
            cohort = twin.engine.state.cohort
            if (abort_member is not None and cohort is not None and cohort.planned is not None
                    and any(r.request_id == abort_member for r in cohort.members)):
                events.insert(0, Abort(t - 0.5, abort_member))
                abort_member = None
        else:
            events = [Tick(t)]
    return found


def test_the_fast_path_matches_the_step_by_step_path() -> None:
    outputs = {"a": 9, "b": 7}
    main, records, twin = _pair(outputs)
    assert _drive(main, records, twin, outputs) == []
    assert twin.engine.scheduler.fast_steps > 0, "the twin never took the fast path: nothing was compared"
    assert {r.state for r in main.requests.values()} == {"finished"}


def test_a_member_aborted_while_its_cohort_step_runs() -> None:
    """The abort drops the cohort mid-step: the other members' share of that step must
    still be confirmed at its output, as step by step."""
    outputs = {"a": 20, "b": 20, "c": 20}
    main, records, twin = _pair(outputs)
    assert _drive(main, records, twin, outputs, abort_member="b") == []
    assert main.requests["b"].finish_reason == "aborted"
    assert {r.finish_reason for rid, r in main.requests.items() if rid != "b"} == {"stopped"}
    assert twin.engine.scheduler.fast_steps > 0


def test_a_fast_path_that_runs_past_a_stop_is_a_finding() -> None:
    outputs = {"a": 9, "b": 7}
    main, records, twin = _pair(outputs)
    # The twin believes a stops later than it does: its cohort plans past the stop, and its
    # own step outputs (made from its light plans) no longer finish a when the model does.
    twin.engine.state.fast_limits = {"a": (30, "stopped"), "b": (7, "stopped")}
    found = _drive(main, records, twin, outputs)
    assert found and "step_output" in found[0]


def test_light_plan_totals_are_those_of_the_entries() -> None:
    main, records, twin = _pair({"a": 3})
    commands = list(main.handle(Arrival(0.0, "a", 6, (1,)))) + list(main.handle(Tick(1.0)))
    plan = next(c for c in commands if isinstance(c, StepPlan))
    totals, samplers = plan_totals(plan.entries)
    assert totals == (6, 1, 6 * (0 + 6 + 1), 0) and samplers == ("a",)


def _decoding_pair() -> tuple[list[Engine], list[list[dict[str, object]]], list[StepPlan]]:
    """Two engines with the fast path on, in the same state: three requests decoding as a
    cohort, a step of its members alone in flight."""
    outputs = {"a": 40, "b": 40, "c": 40}
    config = EngineConfig(block_tokens=16, device_blocks=64, max_batched_tokens=64, max_running=4, ranks=1, tiers=())
    engines, logs, plans = [], [], []
    for _ in range(2):
        log: list[dict[str, object]] = []
        engine = Engine(config, PolicyStack([]), recorder=log.append)
        engine.state.fast_limits = StopRules(outputs)
        events: list[object] = [Arrival(0.0, rid, 3, ()) for rid in outputs] + [Tick(0.0)]
        t = 0.0
        for _ in range(6):
            plan = None
            for event in events:
                plan = next((c for c in engine.handle(event) if isinstance(c, StepPlan)), plan)  # type: ignore[arg-type]
            assert plan is not None
            t += 1.0
            events = [StepOutput(t, plan.step_id, ()), Tick(t)]
        engines.append(engine)
        logs.append(log)
        plans.append(plan)
    return engines, logs, plans


def test_decode_steps_in_one_call_are_the_steps_one_by_one() -> None:
    (one_by_one, batched), (log_a, log_b), (plan, _) = _decoding_pair()
    steps, until = batched.pure_decode_steps()
    assert steps >= 4 and until == float("inf")
    times = [7.0, 7.5, 9.0, 9.25]
    log_a.clear()
    log_b.clear()
    last = batched.handle_decode_steps(times)
    step = plan.step_id
    mine = None
    for t in times:
        one_by_one.handle(StepOutput(t, step, ()))
        mine = next(c for c in one_by_one.handle(Tick(t)) if isinstance(c, StepPlan))
        step = mine.step_id
    assert mine is not None and (mine.step_id, mine.totals) == (last.step_id, last.totals)
    assert log_a == log_b and len(log_a) == 3 * len(times)
    # The states go on the same: the next inputs give the same records and plans.
    follow = []
    for engine in (one_by_one, batched):
        engine.handle(StepOutput(10.0, last.step_id, ()))
        follow.append([(c.step_id, c.totals) for c in engine.handle(Tick(10.0)) if isinstance(c, StepPlan)])
    assert log_a == log_b and follow[0] == follow[1] != []
    for engine in (one_by_one, batched):
        engine.check_invariants()  # (the members' numbers settled)
    assert {rid: (r.computed, r.confirmed, r.generated) for rid, r in one_by_one.requests.items()} \
        == {rid: (r.computed, r.confirmed, r.generated) for rid, r in batched.requests.items()}


def test_decode_steps_beyond_what_the_engine_vouches_for_are_refused() -> None:
    (_, batched), _, _ = _decoding_pair()
    steps, _ = batched.pure_decode_steps()
    with pytest.raises(ValueError, match="pure decode steps"):
        batched.handle_decode_steps([7.0 + j for j in range(steps + 1)])
    with pytest.raises(ValueError, match="pure decode steps"):
        batched.handle_decode_steps([7.0, 6.0])
