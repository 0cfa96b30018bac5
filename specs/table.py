"""The lifecycle spec compiled into a frozen transition table.

The engine's hot path is ``TABLE.target(...)``: a dict lookup instead of a trip through
python-statemachine's dispatcher. ``compile_spec`` compiles the spec
(``specs/lifecycle.py``); the result is kept as data beside this module
(``lifecycle_table.json``), so a run reads the table and never imports
python-statemachine (about 35 ms of startup). ``python -m kvlife.specs.table`` rewrites
the file from the spec; ``tests/test_spec.py`` fails when the two differ.
"""

from __future__ import annotations

from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import attrs
import orjson

if TYPE_CHECKING:
    from statemachine import StateMachine

TABLE_FILE = Path(__file__).with_name("lifecycle_table.json")


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


def table_data(table: TransitionTable) -> dict[str, Any]:
    """The table as the JSON file holds it."""
    return {
        "states": list(table.states),
        "triggers": list(table.triggers),
        "initial": table.initial,
        "final": sorted(table.final),
        "edges": [[state, trigger, target] for (state, trigger), target in table.edges.items()],
    }


def read_table(path: Path = TABLE_FILE) -> TransitionTable:
    """The compiled table kept beside this module (data: read, never run)."""
    data = orjson.loads(path.read_bytes())
    return TransitionTable(
        states=tuple(data["states"]),
        triggers=tuple(data["triggers"]),
        initial=data["initial"],
        final=frozenset(data["final"]),
        edges=MappingProxyType({(state, trigger): target for state, trigger, target in data["edges"]}),
    )


def spec_table() -> TransitionTable:
    """The table compiled from the spec itself (imports python-statemachine)."""
    from kvlife.specs.lifecycle import RequestLifecycle

    return compile_spec(RequestLifecycle)


TABLE = read_table()


class ReferenceRequest:
    """One python-statemachine instance per request: the slow, obviously-right mode."""

    def __init__(self, request_id: str) -> None:
        from kvlife.specs.lifecycle import RequestLifecycle

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

    from kvlife.specs.lifecycle import RequestLifecycle

    return str(MermaidGraphMachine(RequestLifecycle).get_mermaid())


if __name__ == "__main__":  # python -m kvlife.specs.table: rewrite the table from the spec
    TABLE_FILE.write_bytes(orjson.dumps(table_data(spec_table()), option=orjson.OPT_INDENT_2) + b"\n")
    print(f"wrote {TABLE_FILE}")
