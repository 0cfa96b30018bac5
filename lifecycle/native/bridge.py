"""Native mirrors built from the Python reference's objects: the one place that reads the
reference's derived constants and hands them to ``_core`` unchanged."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence, Sized
from typing import TYPE_CHECKING, Any, cast

from kvlife.lifecycle.config import EngineConfig
from kvlife.lifecycle.drivers.links import Link
from kvlife.lifecycle.drivers.lookup_service import LookupService
from kvlife.lifecycle.native import load
from kvlife.lifecycle.profiles.step_cost import StepCostModel
from kvlife.specs.table import TABLE

if TYPE_CHECKING:
    from kvlife.lifecycle.config import RunConfig, TierConfig
    from kvlife.lifecycle.drivers.physics import Physics
    from kvlife.lifecycle.drivers.simulator import SimResult
    from kvlife.lifecycle.engine.request import Request
    from kvlife.lifecycle.engine.state import Recorder
    from kvlife.lifecycle.workloads.mooncake import WorkloadError, WorkloadRequest
    from kvlife.policies.stack import PolicyStack


def step_cost(model: StepCostModel) -> Any:
    """``_core.StepCost`` pricing steps exactly as ``model.totals_ms`` does."""
    return load().StepCost(
        linear_flops_per_token=model._linear_flops_per_token,
        lm_head_flops_per_request=model._lm_head_flops_per_request,
        ms_per_flop=model._ms_per_flop,
        weight_ms=model._weight_ms,
        allreduces=float(model._allreduces),
        ring_factor=model._ring_factor,
        allreduce_bytes_per_token=model._allreduce_bytes_per_token,
        link=model._link,
        allreduce_latency_ms=model._allreduce_latency_ms,
        attention_flops_per_pair=model._attention_flops_per_pair,
        ms_per_attention_flop=model._ms_per_attention_flop,
        kv_bytes_per_token=model._kv_bytes_per_token,
        ms_per_byte=model._ms_per_byte,
        overhead_ms=model._overhead_ms,
    )


def link(reference: Link) -> Any:
    """``_core.Link`` with ``reference``'s name, bandwidths and latency: its twin as long as both
    are given the same calls. Only a link that has carried nothing yet has one (its state is not
    copied): ValueError otherwise."""
    if reference._seq or reference._now:
        raise ValueError(f"link {reference.name}: already in use; only a fresh link has a native twin")
    return load().Link(reference.name, reference.bandwidth_gb_s, reference.latency_ms,
                       reference.write_bandwidth_gb_s)


def lookup_service(reference: LookupService) -> Any:
    """``_core.LookupService`` with ``reference``'s workers and latencies, for a service that has
    taken no lookup yet (its queue is not copied): ValueError otherwise."""
    if reference.submitted:
        raise ValueError("lookup service already in use; only a fresh one has a native twin")
    return load().LookupService(reference.workers, reference.base_ms, reference.per_key_ms)


def core_config(config: EngineConfig) -> Any:
    """``_core.CoreConfig``: the fields of ``config`` the connector core reads, its tiers in order."""
    core = load()
    native = core.CoreConfig()
    native.block_tokens = config.block_tokens
    native.ranks = config.ranks
    native.transfer_deadline_ms = config.transfer_deadline_ms
    native.lookup_deadline_ms = config.lookup_deadline_ms
    native.reclaim_deadline_ms = config.reclaim_deadline_ms
    native.max_async_lookups = config.max_async_lookups
    native.kv_load_failure_policy = config.kv_load_failure_policy
    native.tiers = [core.CoreTierConfig(t.name, t.capacity_blocks, t.eviction) for t in config.tiers]
    return native


def transition_table() -> Any:
    """``_core.TransitionTable`` with the edges of the compiled spec table (specs/lifecycle_table.json,
    as ``kvlife.specs.table.TABLE`` read it): the table stays declared once, in specs/."""
    return load().TransitionTable([(state, trigger, target) for (state, trigger), target in TABLE.edges.items()])


def engine(config: EngineConfig, policies: Any, trace: bool = False, retire: Any = None) -> Any:
    """``_core.NativeEngine``: ``core.Engine(config, policies)``'s native twin (tiers from the
    config, no reference mode, the driver answers lookups, inputs recorded as handled), its
    trace rendered into a buffer when ``trace`` (``trace_bytes()``). ``retire``: called with a
    dict of each retired request's final fields (None: every request is kept)."""
    return load().NativeEngine(core=core_config(config), device_blocks=config.device_blocks,
                               max_batched_tokens=config.max_batched_tokens, max_running=config.max_running,
                               async_scheduling=config.async_scheduling,
                               kv_load_failure_policy=config.kv_load_failure_policy, table=transition_table(),
                               policies=policies, trace=trace, retire=retire)


def arrivals_of(workload: Iterable[WorkloadRequest], size: int | None
                ) -> tuple[Sequence[WorkloadRequest], Iterator[WorkloadRequest], int | None]:
    """What the simulated drivers take from a workload: the list given (empty for a stream),
    the requests in arrival order (a list out of order sorted, stably, as ``Simulator``
    sorts it) and the size when known."""
    if isinstance(workload, Sequence):
        ordered = all(a.arrival_ms <= b.arrival_ms for a, b in itertools.pairwise(workload))
        arrivals = iter(workload if ordered else sorted(workload, key=lambda w: w.arrival_ms))
        return workload, arrivals, size if size is not None else len(workload)
    if size is None and isinstance(workload, Sized):
        size = len(workload)
    return (), iter(workload), size


def sim_links(physics: Physics, tiers: Sequence[TierConfig]
              ) -> tuple[list[Any], list[tuple[str, float, int, int, bool]]]:
    """One rank's native links (a tier whose loads and stores compete names one link twice;
    the loop gives each rank its own copies) and, per tier, (name, failure rate, load link,
    store link, whether a store writes)."""
    from kvlife.lifecycle.drivers.physics import rank_links

    links: list[Link] = []
    spec: list[tuple[str, float, int, int, bool]] = []
    for tier in tiers:
        pair = rank_links(physics.hardware, (tier,))[tier.name]
        load_at = len(links)
        links.append(pair.load)
        store_at = load_at
        if pair.store is not pair.load:
            store_at = len(links)
            links.append(pair.store)
        spec.append((tier.name, tier.failure_rate, load_at, store_at, pair.store_is_write))
    return [link(x) for x in links], spec


INT64_MAX = 2**63 - 1  # the native core's block hashes are signed 64-bit (blocks.hpp BlockHash)


def past_native_hashes(w: WorkloadRequest) -> WorkloadError:
    """The error for a request with a block hash past ``INT64_MAX``, which the native loop
    cannot hold (a workload may name hashes up to 2**64 - 1; the native core's are signed
    64-bit)."""
    from kvlife.lifecycle.workloads.mooncake import WorkloadError

    index, value = next((i, h) for i, h in enumerate(w.hash_ids) if h > INT64_MAX)
    return WorkloadError(f"request {w.request_id}", None, "hash_ids",
                         f"element {index}: {value} is past 2**63 - 1, the largest block hash the native "
                         "engine holds; run it with --engine python")


def feed(native: Any, arrivals: Iterator[WorkloadRequest], chunk: int) -> Callable[[], bool]:
    """The native loop's refill hook: the next ``chunk`` requests handed over as arrays
    (False once the workload has ended); a reader's error, or a request the native loop
    cannot hold (``past_native_hashes``), is raised once the requests before it are taken,
    when the loop asks for the one it failed at."""
    failure: list[BaseException] = []

    def refill() -> bool:
        if failure:
            raise failure[0]
        batch: list[WorkloadRequest] = []
        try:
            for w in arrivals:
                if w.hash_ids and max(w.hash_ids) > INT64_MAX:
                    problem = past_native_hashes(w)
                    if not batch:
                        raise problem
                    failure.append(problem)
                    break
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

    return refill


def simulate(
    config: RunConfig,
    workload: Iterable[WorkloadRequest],
    policies: PolicyStack,
    recorder: Recorder | None = None,
    progress: Callable[[int, int], None] | None = None,
    check_every: int | None = None,
    *,
    size: int | None = None,
    keep_requests: bool = True,
    chunk: int = 1024,
) -> SimResult:
    """``Simulator(config, workload, ...).run()`` with the native loop (``_core.PyEngineSimulator``)
    around the Python ``Engine``: the same trace, byte for byte, and the same ``SimResult``.
    The workload is handed over ``chunk`` requests at a time (a stream stays a stream; a
    reader's error is raised when the loop reaches the request it failed at, as the Python
    loop raises it). Ctrl-C/SIGTERM cut between two events, with the ``interrupted`` record.
    ``--chaos`` and ``--check`` are not in the native loop: ValueError."""
    from kvlife.lifecycle.drivers import interrupts
    from kvlife.lifecycle.drivers.physics import resolve
    from kvlife.lifecycle.drivers.simulator import SimResult, cut_record  # noqa: F811
    from kvlife.lifecycle.engine.core import Engine
    from kvlife.lifecycle.metrics import RequestTotals

    if config.sim.chaos is not None or config.sim.check:
        raise ValueError("the native simulator has no --chaos or --check: those run on the Python engine")
    config, physics = resolve(config)
    given, arrivals, size = arrivals_of(workload, size)
    retired = None if keep_requests else RequestTotals()
    native: Any = None

    def retire(req: Request) -> None:
        cast(RequestTotals, retired).fold(req)
        native.retired(req.request_id)

    engine = Engine(config.engine, policies, recorder=recorder, retire=None if keep_requests else retire)
    links, tiers = sim_links(physics, config.engine.tiers)
    native = load().PyEngineSimulator(
        engine, ranks=config.engine.ranks, async_scheduling=config.engine.async_scheduling,
        exact=config.sim.completions == "exact", rank_jitter_ms=config.sim.rank_jitter_ms,
        max_output_tokens=config.sim.max_output_tokens, seed=config.sim.seed,
        rank_block_bytes=physics.rank_block_bytes, check_every=check_every, size=size,
        cost=step_cost(physics.cost),
        lookups=lookup_service(LookupService(config.sim.lookup_workers, config.engine.lookup_latency_ms,
                                             config.sim.lookup_per_key_ms)),
        links=links, tiers=tiers)

    native.set_refill(feed(native, arrivals, chunk))
    native.set_progress(progress)
    with interrupts.held() as gate:
        try:
            makespan, events, stranded, critical = native.run(gate)
        except KeyboardInterrupt as exc:
            if engine.recorder is not None:
                engine.recorder(cut_record(engine, exc, native.total, gate.clean, steps=native.steps_in_flight))
            raise
    return SimResult(engine, given, makespan, events, stranded, critical, physics, retired)
