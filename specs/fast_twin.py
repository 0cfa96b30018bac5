"""Invariant 14: the engine's decode fast path is exact.

A driver that knows when each request stops (the simulator: ``EngineState.fast_limits``)
lets the engine plan runs of pure decode steps without per-request work
(``scheduler.Scheduler._cohort_tick``) and hand it light step plans (totals and the
sampling requests that may stop instead of per-entry records). Issue 13 requires the results to be
exactly those of the step-by-step path. ``FastTwin`` checks that under the checker's
adversarial inputs: a second engine, built the same way but with the stop rules given,
takes every input the checked engine takes; after each one, both must have written the
same records, issued the same commands (a light plan stands for the full plan with the
same step id, sync lookups and totals, its samplers in the full plan's order) and named the same next wakeup.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any


class StopRules(Mapping[str, tuple[int, str]]):
    """The checker's output lengths as the engine's stop rules: a request stops when it
    has generated ``outputs[rid]`` tokens (reason ``stopped``), as the checker's step
    outputs say. A live view: an arrival's output length is there before it arrives."""

    def __init__(self, outputs: dict[str, int]) -> None:
        self._outputs = outputs

    def __getitem__(self, request_id: str) -> tuple[int, str]:
        return (self._outputs[request_id], "stopped")

    def __iter__(self) -> Iterator[str]:
        return iter(self._outputs)

    def __len__(self) -> int:
        return len(self._outputs)


def plan_totals(entries: Sequence[Any]) -> tuple[tuple[int, int, int, int], tuple[str, ...]]:
    """What a light plan gives instead of ``entries`` (``events.StepPlan.totals`` and
    ``samplers``), computed from the entries of a full plan."""
    tokens = cached = pairs = 0
    samplers = []
    for e in entries:
        before, n = e.computed_before, e.num_tokens
        tokens += n
        cached += before
        pairs += n * (2 * before + n + 1)
        if e.samples:
            samplers.append(e.request_id)
    return (tokens, len(entries), pairs, cached), tuple(samplers)


class FastTwin:
    """A second engine on the fast path, fed what the checked engine is fed."""

    def __init__(self, engine: Any, records: list[dict[str, Any]]) -> None:
        self.engine = engine
        self.records = records  # its recorder appends here
        self.fast_steps = 0  # steps its decode cohort planned (the fast path really ran)
        self.plans: dict[int, Any] = {}  # its step plans that have had no output yet

    def _own_output(self, event: Any) -> Any:
        """A step's output as the simulator makes it from the twin's own (light) plan:
        the requests its plan names as sampling stop (``simulator.step_finishes``). A
        cohort that ran past a request's stop then shows, as it would in a simulation.
        An output of a step it has no plan for (stale, unknown) is passed on as it is."""
        from kvlife.lifecycle.drivers.simulator import step_finishes
        from kvlife.lifecycle.engine.events import StepOutput

        if not isinstance(event, StepOutput) or event.step_id not in self.plans:
            return event
        plan = self.plans.pop(event.step_id)
        state = self.engine.state
        return StepOutput(event.t, event.step_id, step_finishes(plan, state.requests, state.fast_limits))

    def compare(self, event: Any, commands: Sequence[Any], records: list[dict[str, Any]],
                wakeup: Callable[[], float | None]) -> str | None:
        """Feed ``event``; None if the twin did exactly what the checked engine did
        (``commands``, ``records``, ``wakeup()``), else what differs."""
        from kvlife.lifecycle.engine.events import StepPlan

        try:
            twin_commands = list(self.engine.handle(self._own_output(event)))
        except Exception as exc:  # noqa: BLE001 - any failure of the fast path is the finding
            return f"the fast path raised {type(exc).__name__}: {exc}"
        self.plans.update((c.step_id, c) for c in twin_commands if isinstance(c, StepPlan))
        self.fast_steps = getattr(getattr(self.engine, "scheduler", None), "fast_steps", self.fast_steps)
        for i, (mine, theirs) in enumerate(zip(records, self.records, strict=False)):
            if mine != theirs:
                return f"record {i} of this input differs: step by step {mine}, fast path {theirs}"
        if len(records) != len(self.records):
            return (f"{len(records)} records step by step, {len(self.records)} on the fast path "
                    f"(first extra: {(records + self.records)[min(len(records), len(self.records))]})")
        if len(commands) != len(twin_commands):
            return f"{len(commands)} commands step by step, {len(twin_commands)} on the fast path"
        for mine, theirs in zip(commands, twin_commands, strict=True):
            if isinstance(mine, StepPlan) and isinstance(theirs, StepPlan) and theirs.totals is not None:
                totals, samplers = plan_totals(mine.entries)
                # A light plan may leave out sampling requests it knows do not stop (the
                # cohort's members): a wrong omission shows as a missing finish afterwards.
                named = iter(samplers)
                same = (mine.step_id == theirs.step_id and mine.sync_lookups == theirs.sync_lookups
                        and mine.sync_lookup_keys == theirs.sync_lookup_keys and totals == theirs.totals
                        and all(rid in named for rid in theirs.samplers))
                if not same:
                    return (f"step {mine.step_id}: the fast path's light plan (step {theirs.step_id}, totals "
                            f"{theirs.totals}, samplers {list(theirs.samplers)}) is not the plan step by step "
                            f"(totals {totals}, samplers {list(samplers)})")
            elif mine != theirs:
                return f"command differs: step by step {mine}, fast path {theirs}"
        mine_wake, theirs_wake = wakeup(), self.engine.next_wakeup()
        if mine_wake != theirs_wake:
            return f"next_wakeup() is {mine_wake} step by step, {theirs_wake} on the fast path"
        self.records.clear()
        return None
