"""Native mirrors built from the Python reference's objects: the one place that reads the
reference's derived constants and hands them to ``_core`` unchanged."""

from __future__ import annotations

from typing import Any

from kvlife.lifecycle.config import EngineConfig
from kvlife.lifecycle.drivers.links import Link
from kvlife.lifecycle.drivers.lookup_service import LookupService
from kvlife.lifecycle.native import load
from kvlife.lifecycle.profiles.step_cost import StepCostModel
from kvlife.specs.table import TABLE


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
