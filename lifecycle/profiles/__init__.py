"""Hardware and model profiles, the quantities derived from them, and the step-cost model.

Bundled profiles (TOML, every figure with its public source) live in ``data/``; see
``catalog`` for loading, ``derived`` for KV bytes / weights / device capacity, ``step_cost``
for the time of one engine step, ``calibrate`` to fit the efficiency factors to measurements
and ``profile_gpu`` to take those measurements on a CUDA machine. Pure Python: nothing here
imports torch except ``profile_gpu``, lazily.
"""

from __future__ import annotations

from kvlife.lifecycle.profiles.catalog import (
    Efficiency,
    Hardware,
    Model,
    Network,
    Nvme,
    ProfileError,
    list_profiles,
    load_efficiency,
    load_hardware,
    load_model,
)
from kvlife.lifecycle.profiles.derived import (
    DeviceCapacity,
    device_capacity,
    kv_bytes_per_block,
    kv_bytes_per_token,
    kv_heads_per_rank,
    param_count,
    weight_bytes_per_rank,
)

DEFAULT_HARDWARE = "h100-sxm"
DEFAULT_MODEL = "llama-3-8b"

__all__ = [
    "DEFAULT_HARDWARE",
    "DEFAULT_MODEL",
    "DeviceCapacity",
    "Efficiency",
    "Hardware",
    "Model",
    "Network",
    "Nvme",
    "ProfileError",
    "device_capacity",
    "kv_bytes_per_block",
    "kv_bytes_per_token",
    "kv_heads_per_rank",
    "list_profiles",
    "load_efficiency",
    "load_hardware",
    "load_model",
    "param_count",
    "weight_bytes_per_rank",
]
