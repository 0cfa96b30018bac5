"""Compile the lifecycle spec into a frozen transition table, once, at import.

The engine's hot path is ``TABLE[(state, trigger)]``: a dict lookup instead of a trip
through python-statemachine's dispatcher. States and triggers are interned as small
ints so records stay compact; names are kept for traces and errors.
"""

from __future__ import annotations

from types import MappingProxyType

import attrs
from statemachine import StateMachine

from kvlife.specs.lifecycle import RequestLifecycle


class IllegalTransition(Exception):
    """A trigger the spec does not allow in the request's current state."""

    def __init__(self, request_id: str, state: str, trigger: str) -> None:
        super().__init__(
            f"request {request_id}: trigger {trigger!r} is not allowed in state {state!r}"
        )
        self.request_id = request_id
        self.state = state
        self.trigger = trigger


@attrs.frozen
class TransitionTable:
    states: tuple[str, ...]
    triggers: tuple[str, ...]
    initial: str
    final: frozenset[str]
    edges: MappingProxyType[tuple[str, str], str]

    def target(self, request_id: str, state: str, trigger: str) -> str:
        try:
            return self.edges[(state, trigger)]
        except KeyError:
            raise IllegalTransition(request_id, state, trigger) from None

    def allowed(self, state: str) -> tuple[str, ...]:
        return tuple(t for t in self.triggers if (state, t) in self.edges)


def compile_spec(spec: type[StateMachine]) -> TransitionTable:
    edges: dict[tuple[str, str], str] = {}
    triggers: list[str] = []
    initial = None
    final = set()
    for state in spec.states:
        if state.initial:
            initial = state.id
        if state.final:
            final.add(state.id)
        for transition in state.transitions:
            for trigger in transition.events:
                name = str(trigger)
                key = (state.id, name)
                if key in edges and edges[key] != transition.target.id:
                    raise ValueError(f"spec {spec.__name__}: {key} is non-deterministic")
                edges[key] = transition.target.id
                if name not in triggers:
                    triggers.append(name)
    if initial is None:
        raise ValueError(f"spec {spec.__name__} has no initial state")
    return TransitionTable(
        states=tuple(s.id for s in spec.states),
        triggers=tuple(triggers),
        initial=initial,
        final=frozenset(final),
        edges=MappingProxyType(dict(sorted(edges.items()))),
    )


TABLE = compile_spec(RequestLifecycle)


class ReferenceRequest:
    """One python-statemachine instance per request: the slow, obviously-right mode."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.machine = RequestLifecycle()

    @property
    def state(self) -> str:
        return str(self.machine.current_state_value)

    def fire(self, trigger: str) -> str:
        from statemachine.exceptions import TransitionNotAllowed

        try:
            self.machine.send(trigger)
        except TransitionNotAllowed:
            raise IllegalTransition(self.request_id, self.state, trigger) from None
        return self.state


def mermaid() -> str:
    from statemachine.contrib.diagram import MermaidGraphMachine

    return str(MermaidGraphMachine(RequestLifecycle).get_mermaid())
