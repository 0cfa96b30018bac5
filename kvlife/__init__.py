"""kvlife: a request lifecycle engine for the KV-cache connectors of LLM serving engines.

The public API, importable from ``kvlife`` directly::

    from kvlife import Engine, EngineConfig, Arrival, Tick, StepOutput, TransferReport
    from kvlife import Decision, RequestView, EngineView, LoadView, PrefetchView
    from kvlife import check_policy, load_trace, validate_trace

The subpackages hold the rest: ``kvlife.lifecycle`` (engine, drivers, traces, CLI),
``kvlife.policies`` (the policy protocol and built-ins), ``kvlife.specs`` (the lifecycle
spec, invariants, model checker) and ``kvlife.transfer`` (KV bytes; needs ``kvlife[live]``).
Names are imported on first use, so ``import kvlife`` stays light (no torch, no hypothesis).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "Abort",
    "Arrival",
    "Decision",
    "Engine",
    "EngineConfig",
    "EngineView",
    "LoadView",
    "LookupAnswer",
    "PrefetchView",
    "RequestView",
    "RunConfig",
    "StepOutput",
    "Tick",
    "TransferReport",
    "check_policy",
    "load_stack",
    "load_trace",
    "run_workload",
    "validate_trace",
]

# name -> (module, attribute)
_EXPORTS: dict[str, tuple[str, str]] = {
    "Engine": ("kvlife.lifecycle.engine.core", "Engine"),
    "EngineConfig": ("kvlife.lifecycle.config", "EngineConfig"),
    "RunConfig": ("kvlife.lifecycle.config", "RunConfig"),
    "Arrival": ("kvlife.lifecycle.engine.events", "Arrival"),
    "Abort": ("kvlife.lifecycle.engine.events", "Abort"),
    "Tick": ("kvlife.lifecycle.engine.events", "Tick"),
    "LookupAnswer": ("kvlife.lifecycle.engine.events", "LookupAnswer"),
    "TransferReport": ("kvlife.lifecycle.engine.events", "TransferReport"),
    "StepOutput": ("kvlife.lifecycle.engine.events", "StepOutput"),
    "Decision": ("kvlife.policies.base", "Decision"),
    "RequestView": ("kvlife.policies.base", "RequestView"),
    "EngineView": ("kvlife.policies.base", "EngineView"),
    "LoadView": ("kvlife.policies.base", "LoadView"),
    "PrefetchView": ("kvlife.policies.base", "PrefetchView"),
    "load_stack": ("kvlife.policies.loading", "load_stack"),
    "check_policy": ("kvlife.specs.model_check", "check_policy"),
    "load_trace": ("kvlife.lifecycle.traces.trace", "read_trace"),
    "validate_trace": ("kvlife.lifecycle.traces.validate", "validate"),
    "run_workload": ("kvlife.lifecycle.drivers.runner", "run_workload"),
}


def __getattr__(name: str) -> Any:
    try:
        module, attribute = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'kvlife' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from kvlife.lifecycle.config import EngineConfig, RunConfig
    from kvlife.lifecycle.drivers.runner import run_workload
    from kvlife.lifecycle.engine.core import Engine
    from kvlife.lifecycle.engine.events import Abort, Arrival, LookupAnswer, StepOutput, Tick, TransferReport
    from kvlife.lifecycle.traces.trace import read_trace as load_trace
    from kvlife.lifecycle.traces.validate import validate as validate_trace
    from kvlife.policies.base import Decision, EngineView, LoadView, PrefetchView, RequestView
    from kvlife.policies.loading import load_stack
    from kvlife.specs.model_check import check_policy
