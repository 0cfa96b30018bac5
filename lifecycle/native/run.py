"""A whole simulated run on the native engine (``_core.NativeSimulator``): what
``drivers.simulator.Simulator(keep_requests=False).run()`` gives ``runner.run_workload``,
the same figures and the same trace bytes.

The engine and the loop run natively; the trace lines are rendered there and handed to the
``TraceWriter`` in chunks (``write_rendered``); the breakdown's ``PhaseClock`` is native and fed
where the engine writes its transition records and arrival inputs, even with tracing off.
Each request the engine lets go reaches ``RequestTotals.fold`` (and ``breakdown.row_of``) as a
``_core.RetiredRequest``: the final fields those read, nothing else. ``--chaos``, ``--check``,
``keep_requests=True`` and ``engine_factory`` stay on the Python engine
(``choice.uncovered``).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence, Sized
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, cast

from kvlife.lifecycle.breakdown import PHASES
from kvlife.lifecycle.drivers.lookup_service import LookupService
from kvlife.lifecycle.native import bridge, load

if TYPE_CHECKING:
    from kvlife.lifecycle.breakdown import PhaseClock
    from kvlife.lifecycle.config import EngineConfig, RunConfig
    from kvlife.lifecycle.drivers.links import Link
    from kvlife.lifecycle.drivers.simulator import Progress, SimResult
    from kvlife.lifecycle.traces.trace import TraceWriter
    from kvlife.lifecycle.workloads.mooncake import WorkloadRequest
    from kvlife.policies.stack import PolicyStack


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
    from kvlife.lifecycle.drivers.physics import rank_links, resolve
    from kvlife.lifecycle.drivers.simulator import SimResult, cut_record
    from kvlife.lifecycle.metrics import RequestTotals

    if config.sim.chaos is not None or config.sim.check:
        raise ValueError("the native engine has no --chaos or --check: those run on the Python engine")
    config, physics = resolve(config)
    if isinstance(workload, Sequence):
        given: Sequence[WorkloadRequest] = workload
        ordered = all(a.arrival_ms <= b.arrival_ms for a, b in itertools.pairwise(workload))
        arrivals: Iterator[WorkloadRequest] = iter(
            workload if ordered else sorted(workload, key=lambda w: w.arrival_ms))
        size = size if size is not None else len(workload)
    else:
        given = ()
        arrivals = iter(workload)
        if size is None and isinstance(workload, Sized):
            size = len(workload)
    engine = config.engine
    retired = RequestTotals()
    # One rank's links (a tier whose loads and stores compete names one link twice); each rank
    # gets its own copies.
    links: list[Link] = []
    tiers: list[tuple[str, float, int, int, bool]] = []
    for tier in engine.tiers:
        pair = rank_links(physics.hardware, (tier,))[tier.name]
        load_at = len(links)
        links.append(pair.load)
        store_at = load_at
        if pair.store is not pair.load:
            store_at = len(links)
            links.append(pair.store)
        tiers.append((tier.name, tier.failure_rate, load_at, store_at, pair.store_is_write))
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
        links=[bridge.link(x) for x in links], tiers=tiers)
    phases = NativeClock(native) if clock else None
    if phases is not None:
        retired.collect(cast("PhaseClock", phases))
    view = NativeEngineView(native, engine)
    failure: list[BaseException] = []

    def refill() -> bool:
        """The next chunk of the workload; a reader's error once the requests before it are taken."""
        if failure:
            raise failure[0]
        batch: list[WorkloadRequest] = []
        try:
            for w in arrivals:
                batch.append(w)
                if len(batch) >= chunk:
                    break
        except Exception as exc:  # raised when the loop asks for the request it failed at
            if not batch:
                raise
            failure.append(exc)
        if not batch:
            return False
        native.add_arrivals([w.request_id for w in batch], [w.arrival_ms for w in batch],
                            [w.input_length for w in batch], [w.output_length for w in batch],
                            [w.hash_ids for w in batch])
        return True

    native.set_refill(refill)
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
