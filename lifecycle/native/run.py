"""A whole simulated run on the native engine (``_core.NativeSimulator``): what
``drivers.simulator.Simulator(keep_requests=False).run()`` gives ``runner.run_workload``,
the same figures and the same trace bytes.

The engine and the loop run natively; the trace lines are rendered there and handed to the
``TraceWriter`` in chunks (``write_rendered``); the breakdown's ``PhaseClock`` is native and fed
where the engine writes its transition records and arrival inputs, even with tracing off.
Each request the engine lets go reaches ``RequestTotals.fold`` (and ``breakdown.row_of``) as a
``RetiredRequest``: the final fields those read, nothing else. ``--chaos``, ``--check``,
``keep_requests=True`` and ``engine_factory`` stay on the Python engine
(``choice.uncovered``).
"""

from __future__ import annotations

from collections.abc import Iterable
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, cast

import attrs

from kvlife.lifecycle.breakdown import PHASES
from kvlife.lifecycle.drivers.lookup_service import LookupService
from kvlife.lifecycle.native import bridge, load

if TYPE_CHECKING:
    from kvlife.lifecycle.breakdown import PhaseClock
    from kvlife.lifecycle.config import EngineConfig, RunConfig
    from kvlife.lifecycle.drivers.simulator import Progress, SimResult
    from kvlife.lifecycle.traces.trace import TraceWriter
    from kvlife.lifecycle.workloads.mooncake import WorkloadRequest
    from kvlife.policies.stack import PolicyStack


@attrs.frozen(slots=True)
class RetiredRequest:
    """A request the native engine let go (or still holds at the end), as the summary reads it:
    the final fields of ``engine/request.py``'s ``Request`` that ``RequestTotals.fold`` and
    ``breakdown.row_of`` read. The native core fills the slots in this order (``RetiredMaker``)."""

    request_id: str
    seq: int
    arrival_ms: float
    prompt_tokens: int
    block_tokens: int
    state: str
    finish_reason: str | None
    generated: int
    first_token_ms: float | None
    finish_ms: float | None
    preemptions: int
    device_hit_blocks: int
    async_lookups: int
    tier_hit_blocks: dict[str, int]
    last_decisions: dict[str, tuple[str, Any, str]]  # hook -> (policy, value, reason)


class NativeClock:
    """``breakdown.PhaseClock``'s face (``end_ms``, ``take``) over the run's native clock."""

    __slots__ = ("_run",)

    def __init__(self, run: Any) -> None:
        self._run = run

    @property
    def end_ms(self) -> float:
        return float(self._run.clock_end_ms)

    @end_ms.setter
    def end_ms(self, value: float) -> None:
        self._run.clock_end_ms = value

    def take(self, rid: str, first_token_ms: float | None, end_ms: float | None = None) -> dict[str, float]:
        return dict(zip(PHASES, self._run.clock_take(rid, first_token_ms, end_ms), strict=True))


class NativeEngineView:
    """What the summary, ``RequestTotals.of`` and ``simulator.cut_record`` read of an
    ``Engine``, read from the native one when asked: ``stats``, ``tiers`` (names, in order),
    ``jobs`` (those still open: ``timed_out``), ``requests`` (those still in the engine, as
    ``RetiredRequest``), ``config``, ``now``, ``state_counts``, ``state.arrived()``, ``prefetches``."""

    def __init__(self, run: Any, config: EngineConfig) -> None:
        self._run = run
        self.config = config
        self.tiers: tuple[str, ...] = tuple(t.name for t in config.tiers)
        self.state = SimpleNamespace(arrived=run.arrived)

    @property
    def stats(self) -> SimpleNamespace:
        return SimpleNamespace(**self._run.stats())

    @property
    def jobs(self) -> dict[int, SimpleNamespace]:
        return {job: SimpleNamespace(timed_out=timed_out) for job, timed_out in self._run.jobs()}

    @property
    def requests(self) -> dict[str, Any]:
        return {req.request_id: req for req in self._run.requests()}

    @property
    def now(self) -> float:
        return float(self._run.now)

    @property
    def state_counts(self) -> dict[str, int]:
        return cast(dict[str, int], self._run.state_counts())

    @property
    def prefetches(self) -> range:
        return range(self._run.prefetches())


def simulate(
    config: RunConfig,
    workload: Iterable[WorkloadRequest],
    stack: PolicyStack,
    writer: TraceWriter | None,
    progress: Progress | None = None,
    size: int | None = None,
    clock: bool = False,
    *,
    chunk: int = 1024,
) -> tuple[SimResult, PhaseClock | None]:
    """``Simulator(config, workload, stack, recorder, progress, size=size, keep_requests=False).run()``
    on the native engine, its records going to ``writer`` (None: not rendered). ``clock``: keep
    the breakdown's phases (``runner.run_workload(breakdown=True)``); the result's ``retired``
    totals then collect a row per request. Returns the ``SimResult`` (its ``engine`` a
    ``NativeEngineView``) and the clock (``NativeClock``, None without ``clock``) for
    ``RequestTotals.of``. The workload is handed over ``chunk`` requests at a time, a reader's
    error raised when the loop reaches the request it failed at; Ctrl-C/SIGTERM cut between two
    events, with the ``interrupted`` record. ``--chaos`` and ``--check``: ValueError."""
    from kvlife.lifecycle.drivers import interrupts
    from kvlife.lifecycle.drivers.physics import resolve
    from kvlife.lifecycle.drivers.simulator import SimResult, cut_record
    from kvlife.lifecycle.metrics import RequestTotals

    if config.sim.chaos is not None or config.sim.check:
        raise ValueError("the native engine has no --chaos or --check: those run on the Python engine")
    config, physics = resolve(config)
    given, arrivals, size = bridge.arrivals_of(workload, size)
    engine = config.engine
    retired = RequestTotals()
    links, tiers = bridge.sim_links(physics, engine.tiers)
    native = load().NativeSimulator(
        core=bridge.core_config(engine), device_blocks=engine.device_blocks,
        max_batched_tokens=engine.max_batched_tokens, max_running=engine.max_running,
        kv_load_failure_policy=engine.kv_load_failure_policy, table=bridge.transition_table(), policies=stack,
        writer=writer, clock=clock, fold=retired.fold, ranks=engine.ranks,
        async_scheduling=engine.async_scheduling, exact=config.sim.completions == "exact",
        rank_jitter_ms=config.sim.rank_jitter_ms, max_output_tokens=config.sim.max_output_tokens,
        seed=config.sim.seed, rank_block_bytes=physics.rank_block_bytes, size=size,
        cost=bridge.step_cost(physics.cost),
        lookups=bridge.lookup_service(LookupService(config.sim.lookup_workers, engine.lookup_latency_ms,
                                                    config.sim.lookup_per_key_ms)),
        links=links, tiers=tiers)
    phases = NativeClock(native) if clock else None
    if phases is not None:
        retired.collect(cast("PhaseClock", phases))
    view = NativeEngineView(native, engine)
    native.set_refill(bridge.feed(native, arrivals, chunk))
    native.set_progress(progress)
    with interrupts.held() as gate:
        try:
            makespan, events, stranded, critical = native.run(gate)
        except KeyboardInterrupt as exc:
            if writer is not None:
                writer.record(cut_record(cast(Any, view), exc, native.total, gate.clean,
                                         steps=native.steps_in_flight))
            raise
    result = SimResult(cast(Any, view), given, makespan, events, stranded, critical, physics, retired)
    return result, cast("PhaseClock | None", phases)
