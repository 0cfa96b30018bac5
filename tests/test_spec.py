from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from statemachine import State, StateMachine

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


def _reachable(start: str) -> set[str]:
    seen, todo = {start}, [start]
    while todo:
        state = todo.pop()
        for trigger in TABLE.allowed(state):
            target = TABLE.edges[(state, trigger)]
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def test_every_state_is_reachable_and_can_finish() -> None:
    # The lifecycle itself, walked through its compiled table: a state nobody reaches is
    # dead spec, and a state from which finished cannot be reached strands its requests.
    assert _reachable(TABLE.initial) == set(TABLE.states)
    for state in TABLE.states:
        assert "finished" in _reachable(state), f"{state} can never finish"


def test_every_io_wait_state_has_a_way_out_other_than_abort() -> None:
    # lookup_pending, loading and sending wait on IO: each must be left by the IO's own
    # outcome, not only by a client abort (else a missing report strands it for good).
    for state in ("lookup_pending", "loading", "sending"):
        exits = {t for t in TABLE.allowed(state) if t != "aborted"}
        assert exits, state


def test_illegal_transition_names_request_state_and_trigger() -> None:
    with pytest.raises(IllegalTransition) as info:
        TABLE.target("req-7", "finished", "admitted")
    message = str(info.value)
    assert "req-7" in message and "finished" in message and "admitted" in message


# The transitions of docs/design.md ("The request lifecycle"), written out by hand: the
# compiled table must be exactly this, neither more nor less.
DESIGN_EDGES = {
    ("waiting", "lookup_submitted"): "lookup_pending",
    ("waiting", "load_started"): "loading",
    ("waiting", "admitted"): "running",
    ("waiting", "completed"): "finished",  # vLLM stops a request whose recompute needs no new step
    ("waiting", "aborted"): "finished",
    ("waiting", "failed"): "finished",
    ("lookup_pending", "lookup_answered"): "waiting",
    ("lookup_pending", "lookup_expired"): "waiting",
    ("lookup_pending", "aborted"): "finished",
    ("loading", "load_done"): "running",
    ("loading", "load_failed"): "waiting",
    ("loading", "aborted"): "finished",
    ("loading", "failed"): "finished",
    ("running", "preempted"): "waiting",
    ("running", "turn_ended"): "waiting",  # a resumable request's next input chunk (vLLM's streaming input)
    ("running", "send_started"): "sending",
    ("running", "completed"): "finished",
    ("running", "aborted"): "finished",
    ("running", "failed"): "finished",
    ("sending", "completed"): "finished",
    ("sending", "aborted"): "finished",
    ("sending", "failed"): "finished",
}


def test_the_table_a_run_reads_is_the_spec_compiled() -> None:
    # A run reads lifecycle_table.json instead of compiling the spec: it must be the spec's
    # table exactly (regenerate with `python -m kvlife.specs.table` after changing the spec).
    assert compile_spec(RequestLifecycle) == TABLE
    assert list(TABLE.edges) == list(compile_spec(RequestLifecycle).edges)  # the order too


def test_a_run_imports_no_python_statemachine() -> None:
    import subprocess
    import sys

    code = ("import sys; from kvlife.lifecycle.drivers.runner import run_workload; "
            "from kvlife.lifecycle.engine.core import Engine; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('statemachine', 'structlog', 'hypothesis')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_compiled_table_is_the_documented_lifecycle() -> None:
    assert dict(TABLE.edges) == DESIGN_EDGES
    assert set(TABLE.triggers) == {t for _, t in DESIGN_EDGES}


def test_compile_reads_another_spec_and_refuses_a_nondeterministic_one() -> None:
    class Door(StateMachine):
        shut = State(initial=True)
        open_ = State()
        gone = State(final=True)
        push = shut.to(open_) | open_.to(shut)
        leave = open_.to(gone)

    door = compile_spec(Door)
    assert door.initial == "shut" and door.final == frozenset({"gone"})
    assert dict(door.edges) == {("shut", "push"): "open_", ("open_", "push"): "shut", ("open_", "leave"): "gone"}
    assert door.allowed("shut") == ("push",)
    assert compile_spec(RequestLifecycle) != door

    class Fork(StateMachine):
        start = State(initial=True)
        left = State(final=True)
        right = State(final=True)
        go = start.to(left) | start.to(right, cond=lambda: False)

    with pytest.raises(ValueError, match="non-deterministic"):
        compile_spec(Fork)


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


def test_design_doc_embeds_the_diagram_the_spec_generates(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/design.md shows the Mermaid diagram of the spec; a new trigger must show there."""
    from pathlib import Path

    assert main(["spec", "--format", "mermaid"]) == 0
    generated = capsys.readouterr().out.strip()
    design = (Path(__file__).parent.parent / "docs" / "design.md").read_text()
    embedded = design.split("```mermaid\n", 1)[1].split("```", 1)[0].strip()
    assert embedded == generated
    assert "lookup_pending --> waiting : Lookup expired" in embedded
