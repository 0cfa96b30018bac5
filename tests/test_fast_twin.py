"""Invariant 14 (specs/fast_twin.py): the decode fast path checked against the step-by-step
path, input by input. A twin that plans a step differently, or writes another record, is
a finding; the same engine twice is not."""

from __future__ import annotations

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
