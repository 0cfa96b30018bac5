"""The primitives the connector core's parts share: record, move, ask.

``Lifecycle`` works on the ``CoreState`` it is given and the policy stack. Every state
change of a request goes through ``move`` (h11's rule: every transition in one place): a
lookup in the compiled spec table (``kvlife.specs.table``), the state counts, and one
``transition`` record with its trigger and reason. Every policy question goes through
``ask``, which records a ``decision`` when the answer changes and counts every answer per
policy, hook and value (``answers``). The engine view a policy sees carries the time of the
driver's clock and the device blocks of whichever scheduler runs (``DeviceInfo``).
"""

from __future__ import annotations

from typing import Any, Protocol

from kvlife.lifecycle.engine import records
from kvlife.lifecycle.engine.request import Request
from kvlife.lifecycle.engine.state import CoreState
from kvlife.policies.base import EngineView
from kvlife.policies.stack import PolicyStack
from kvlife.specs.names import RequestState, Trigger
from kvlife.specs.table import TABLE, ReferenceRequest

_EDGES = TABLE.edges  # (state, trigger) -> state


class DeviceInfo(Protocol):
    """What a policy may know of the scheduler's device blocks: kvlife's block pool, or
    vLLM's (``KVLifeConnector`` reads it from the cache manager vLLM binds)."""

    @property
    def free(self) -> int: ...

    @property
    def capacity(self) -> int: ...


class Lifecycle:
    def __init__(self, state: CoreState, policies: PolicyStack, device: DeviceInfo | None = None) -> None:
        self.state = state
        self.policies = policies
        self.device = device
        # (policy, hook, value) -> answers given, every ask counted (``decision`` records
        # only say when an answer changes).
        self.answers: dict[tuple[str, str, str], int] = {}

    def record(self, record: dict[str, Any]) -> None:
        recorder = self.state.recorder
        if recorder is not None:
            recorder(record)

    def warn(self, what: str, **fields: Any) -> None:
        warnings = self.state.stats.warnings
        warnings[what] = warnings.get(what, 0) + 1
        self.record(records.warning(self.state.now, what, **fields))

    def move(self, req: Request, trigger: Trigger, reason: str) -> None:
        """Fire ``trigger`` on ``req``: its new state is the compiled table's, or
        ``IllegalTransition``. The one writer of a request's state."""
        state = self.state
        source = req.state
        # The edge dict directly; an illegal move falls through to the table, which raises.
        target = _EDGES.get((source, trigger)) or TABLE.target(req.request_id, source, trigger)
        reference = state.reference
        if reference is not None:
            ref = reference.setdefault(req.request_id, ReferenceRequest(req.request_id))
            if ref.fire(trigger) != target:
                raise AssertionError(f"reference and table disagree on {req.request_id} {trigger}")
        req.state = target
        state.moves += 1
        counts = state.state_counts
        counts[source] -= 1
        counts[target] += 1
        recorder = state.recorder
        if recorder is not None:
            recorder(records.transition(state.now, req.request_id, source, target, trigger, reason))

    def ask(self, req: Request, hook: str, *args: Any) -> Any:
        """The policy stack's answer at decision point ``hook``; a changed answer is recorded."""
        state = self.state
        answer = self.policies.ask(hook, req.view(), *args, self.engine_view())
        key = (answer.policy, hook, str(answer.value))
        self.answers[key] = self.answers.get(key, 0) + 1
        last = req.last_decisions.get(hook)
        current = (answer.policy, answer.value, answer.reason)
        if last != current:
            # Log a decision when it changes, not on every pass it is re-asked.
            req.last_decisions[hook] = current
            if hook == "admission" and answer.value == "defer":
                deferrals = state.stats.deferrals
                deferrals[answer.policy] = deferrals.get(answer.policy, 0) + 1
            self.record(records.decision(state.now, req.request_id, hook, answer.policy, answer.value,
                                         answer.reason))
        return answer.value

    def engine_view(self) -> EngineView:
        """What a policy sees of the engine: the driver's time, the requests in each state
        as the connector knows them, and the scheduler's device blocks."""
        counts = self.state.state_counts
        device = self.device
        return EngineView(
            now_ms=self.state.now,
            running=counts[RequestState.RUNNING],
            waiting=counts[RequestState.WAITING] + counts[RequestState.LOOKUP_PENDING],
            loading=counts[RequestState.LOADING],
            free_device_blocks=device.free if device is not None else 0,
            device_blocks=device.capacity if device is not None else 0,
        )
