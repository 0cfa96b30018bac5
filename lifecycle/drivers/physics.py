"""What a simulated run is physically: one hardware profile, one model profile, a TP degree,
and everything derived from them.

``resolve(config)`` loads the profiles a ``RunConfig`` names (``sim.hardware``, ``sim.model``,
``sim.tp``, the efficiency layers) and returns the config with its derived values filled in
(``engine.device_blocks`` sized like vLLM sizes its KV cache, ``engine.ranks = sim.tp``, unless
either was set) and a ``Physics`` record: the step-cost model, the KV bytes a block takes on
each rank, the device capacity and how it was reached. ``rank_links`` builds one rank's links
to the tiers (``drivers.links``) from the hardware profile, with a tier's own
``bandwidth_gbps`` / ``latency_ms`` over them when set.

Efficiency layers, later wins: the hardware profile's ``[efficiency]``, the ``sim.efficiency``
file (``kvlife calibrate -o``), the single ``sim.mfu`` / ``sim.attention_efficiency`` /
``sim.mbu`` / ``sim.step_overhead_ms``.

A bad name, file or degree is a ``profiles.ProfileError`` (one line, naming the field).
"""

from __future__ import annotations

import functools
from typing import Any

import attrs

from kvlife.lifecycle.config import RunConfig, TierConfig, is_derived, is_profile_path
from kvlife.lifecycle.drivers.links import Link, TierLinks
from kvlife.lifecycle.profiles import (
    DeviceCapacity,
    Efficiency,
    Hardware,
    Model,
    device_capacity,
    kv_bytes_per_block,
    load_efficiency,
    load_hardware,
    load_model,
)
from kvlife.lifecycle.profiles.derived import GIB
from kvlife.lifecycle.profiles.step_cost import StepCostModel

MIB = 1 << 20


@functools.lru_cache(maxsize=16)
def _bundled_hardware(name: str) -> Hardware:
    return load_hardware(name)


@functools.lru_cache(maxsize=16)
def _bundled_model(name: str) -> Model:
    return load_model(name)


def hardware_profile(name_or_path: str) -> Hardware:
    """A hardware profile (bundled ones are read once per process; files every time)."""
    return load_hardware(name_or_path) if is_profile_path(name_or_path) else _bundled_hardware(name_or_path)


def model_profile(name_or_path: str) -> Model:
    """A model profile (bundled ones are read once per process; files every time)."""
    return load_model(name_or_path) if is_profile_path(name_or_path) else _bundled_model(name_or_path)


@attrs.frozen
class Physics:
    """The physical side of a simulated run (sizes per rank unless named otherwise)."""

    hardware: Hardware
    model: Model
    tp: int
    ranks: int
    efficiency: Efficiency
    capacity: DeviceCapacity  # what vLLM's sizing gives (used unless device_blocks was set)
    device_blocks: int  # what the run uses
    device_blocks_derived: bool
    block_bytes: int  # KV bytes of one block over all ranks (summary volumes)
    rank_block_bytes: float  # what one rank moves per block
    cost: StepCostModel = attrs.field(eq=False, repr=False)

    def device_line(self, origin: str | None = None) -> str:
        """``821 (derived: h100-sxm 79.2 GiB x 0.90 - weights 15.0 GiB - activations 4.9 GiB) / 64 MiB``,
        or ``400 (--device-blocks; derived: 821) / 64 MiB``; ``origin`` names where a set value came from."""
        cap = self.capacity
        per_block = f"{cap.block_bytes / MIB:.4g} MiB per block" + (" per rank" if self.tp > 1 else "")
        if self.device_blocks_derived:
            utilization = cap.requested_bytes / cap.hbm_bytes
            return (f"{self.device_blocks} (derived: {self.hardware.name} {cap.hbm_bytes / GIB:.1f} GiB x "
                    f"{utilization:.2f} - weights {cap.weight_bytes / GIB:.1f} GiB - activations "
                    f"{cap.reserve_bytes / GIB:.1f} GiB) / {per_block}")
        return f"{self.device_blocks} ({origin or 'engine.device_blocks'}; derived: {cap.blocks}) / {per_block}"

    def summary(self, origin: str | None = None) -> dict[str, Any]:
        """The ``setup`` object of a simulated run's summary."""
        e = self.efficiency
        return {
            "hardware": self.hardware.name,
            "model": self.model.name,
            "tp": self.tp,
            "ranks": self.ranks,
            "device_blocks": self.device_blocks,
            "device_blocks_source": "derived" if self.device_blocks_derived else (origin or "engine.device_blocks"),
            "derived_device_blocks": self.capacity.blocks,
            "device": self.device_line(origin),
            "block_bytes": self.block_bytes,
            "block_bytes_per_rank": self.capacity.block_bytes,
            "efficiency": {"mfu": e.mfu, "attention": e.attention, "mbu": e.mbu, "overhead_ms": e.overhead_ms},
        }


def efficiency_of(config: RunConfig, hardware: Hardware) -> Efficiency:
    """The hardware's factors, under the ``sim.efficiency`` file, under the single overrides."""
    sim = config.sim
    efficiency = hardware.efficiency
    if sim.efficiency is not None:
        efficiency = load_efficiency(sim.efficiency)
    overrides = {"mfu": sim.mfu, "attention": sim.attention_efficiency, "mbu": sim.mbu,
                 "overhead_ms": sim.step_overhead_ms}
    given = {k: v for k, v in overrides.items() if v is not None}
    return attrs.evolve(efficiency, **given) if given else efficiency


def resolve(config: RunConfig) -> tuple[RunConfig, Physics]:
    """The config with engine.device_blocks and engine.ranks derived where not set, and its physics."""
    sim = config.sim
    engine = config.engine
    hardware = hardware_profile(sim.hardware)
    model = model_profile(sim.model)
    # The activation reserve follows vLLM's profiling run: a forward pass of the token budget
    # (engine.max_batched_tokens is vLLM's max_num_batched_tokens) and a sampler pass over
    # vLLM's default max_num_seqs (1024), the setup the reserve was fitted on. kvlife's
    # engine.max_running (128) caps admissions; it is not what vLLM profiles with.
    capacity = device_capacity(model, hardware, engine.block_tokens, sim.tp, sim.gpu_memory_utilization,
                               max_num_batched_tokens=engine.max_batched_tokens)
    derived = is_derived(engine)
    device_blocks = capacity.blocks if derived else engine.device_blocks
    ranks = sim.tp if is_derived(engine, "ranks") else engine.ranks
    efficiency = efficiency_of(config, hardware)
    block_bytes = kv_bytes_per_block(model, engine.block_tokens, sim.tp) * sim.tp
    physics = Physics(
        hardware=hardware,
        model=model,
        tp=sim.tp,
        ranks=ranks,
        efficiency=efficiency,
        capacity=capacity,
        device_blocks=device_blocks,
        device_blocks_derived=derived,
        block_bytes=block_bytes,
        rank_block_bytes=block_bytes / ranks,
        cost=StepCostModel(model, hardware, sim.tp, efficiency),
    )
    resolved = attrs.evolve(config, engine=attrs.evolve(engine, device_blocks=device_blocks, ranks=ranks))
    return resolved, physics


def rank_links(hardware: Hardware, tiers: tuple[TierConfig, ...]) -> dict[str, TierLinks]:
    """Fresh links for one rank, one ``TierLinks`` per configured tier: host over the host link
    (one link per direction, full duplex), disk over one NVMe drive (reads and writes compete),
    remote over the NIC (full duplex). A tier's ``bandwidth_gbps`` / ``latency_ms`` replace
    the profile's figures (a disk's read and write bandwidth both)."""
    out: dict[str, TierLinks] = {}
    for tier in tiers:
        bw, lat = tier.bandwidth_gbps, tier.latency_ms
        if tier.name == "host":
            rate = bw if bw is not None else hardware.host_link_gb_s
            latency = lat if lat is not None else 0.0
            out["host"] = TierLinks(load=Link("host->device", rate, latency),
                                    store=Link("device->host", rate, latency), store_is_write=False)
        elif tier.name == "disk":
            nvme = hardware.nvme
            drive = Link("nvme", bw if bw is not None else nvme.read_gb_s, lat if lat is not None else nvme.latency_ms,
                         write_bandwidth_gb_s=bw if bw is not None else nvme.write_gb_s)
            out["disk"] = TierLinks(load=drive, store=drive, store_is_write=True)
        else:
            net = hardware.network
            rate = bw if bw is not None else net.gb_s
            latency = lat if lat is not None else net.latency_ms
            out[tier.name] = TierLinks(load=Link("network rx", rate, latency), store=Link("network tx", rate, latency),
                                       store_is_write=False)
    return out
