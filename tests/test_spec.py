from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from statemachine import State, StateMachine
from statemachine.exceptions import InvalidDefinition

from kvlife.lifecycle.cli.main import main
from kvlife.specs.lifecycle import RequestLifecycle
from kvlife.specs.table import TABLE, IllegalTransition, ReferenceRequest, compile_spec


def test_spec_declares_the_lifecycle_states() -> None:
    assert TABLE.states == ("waiting", "lookup_pending", "loading", "running", "sending", "finished")
    assert TABLE.initial == "waiting"
    assert TABLE.final == frozenset({"finished"})


def test_abort_is_legal_from_every_live_state_and_finished_absorbs() -> None:
    for state in TABLE.states:
        if state == "finished":
            assert TABLE.allowed(state) == ()
        else:
            assert TABLE.edges[(state, "aborted")] == "finished"


def test_preemption_and_load_failure_lead_back_to_waiting() -> None:
    assert TABLE.edges[("running", "preempted")] == "waiting"
    assert TABLE.edges[("loading", "load_failed")] == "waiting"
    assert TABLE.edges[("loading", "failed")] == "finished"


def test_spec_class_is_validated_when_defined() -> None:
    with pytest.raises(InvalidDefinition):

        class Trapped(StateMachine):  # 'stuck' has no way out and is not final
            start = State(initial=True)
            stuck = State()
            done = State(final=True)
            go = start.to(stuck)
            end = start.to(done)

    with pytest.raises(InvalidDefinition):

        class Unreachable(StateMachine):
            start = State(initial=True)
            island = State()
            done = State(final=True)
            end = start.to(done)
            leave = island.to(done)


def test_illegal_transition_names_request_state_and_trigger() -> None:
    with pytest.raises(IllegalTransition) as info:
        TABLE.target("req-7", "finished", "admitted")
    message = str(info.value)
    assert "req-7" in message and "finished" in message and "admitted" in message


def test_compile_is_deterministic() -> None:
    assert compile_spec(RequestLifecycle) == TABLE


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(TABLE.triggers), max_size=30))
def test_compiled_table_agrees_with_python_statemachine(triggers: list[str]) -> None:
    reference = ReferenceRequest("req-h")
    state = TABLE.initial
    for trigger in triggers:
        try:
            expected: str | None = reference.fire(trigger)
        except IllegalTransition:
            expected = None
        try:
            got: str | None = TABLE.target("req-h", state, trigger)
        except IllegalTransition:
            got = None
        assert got == expected, (state, trigger)
        if got is not None:
            state = got
        assert reference.state == state


def test_spec_command_prints_mermaid(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["spec", "--format", "mermaid"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("stateDiagram-v2")
    assert "loading --> waiting" in out
    assert "[*] --> waiting" in out
