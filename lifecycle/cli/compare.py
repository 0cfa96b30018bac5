"""Run one workload under several policy stacks and put the results side by side.

Every stack sees the same workload, config and seed, so the differences are the policies'
doing. The figures come from the run summary (``kvlife.lifecycle.metrics``) plus the engine's
prefetch counters, which the summary predates.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import attrs

from kvlife.lifecycle.cli.output import columns
from kvlife.lifecycle.config import RunConfig
from kvlife.lifecycle.drivers.runner import run_workload
from kvlife.lifecycle.drivers.simulator import Progress
from kvlife.lifecycle.workloads.mooncake import WorkloadRequest
from kvlife.policies.base import PolicyError
from kvlife.policies.loading import load_stack


def parse_stack(text: str) -> tuple[str, ...]:
    """``"async-lookup, shared-loads"`` -> its policy specs, top of the stack first."""
    specs = tuple(s.strip() for s in text.split(","))
    if any(not s for s in specs) and specs != ("",):
        raise PolicyError(f"stack {text!r}: empty policy name between commas")
    return tuple(s for s in specs if s and s != "baseline")


def stack_label(stack: Sequence[str]) -> str:
    """The stack as ``--stack`` writes it: ``"async-lookup,shared-loads"``, or ``"baseline"``."""
    return ",".join(stack) or "baseline"


# A progress bar per stack: label -> a context that yields the run's callback.
StackProgress = Callable[[str], AbstractContextManager[Progress | None]]


@contextlib.contextmanager
def _no_progress(label: str) -> Iterator[Progress | None]:
    yield None


def compare_stacks(
    config: RunConfig,
    workload: list[WorkloadRequest],
    stacks: Sequence[Sequence[str]],
    workload_name: str = "synthetic",
    progress: StackProgress = _no_progress,
) -> list[dict[str, Any]]:
    # Load every stack first: a broken policy fails the command before any run starts.
    loaded = [load_stack(stack) for stack in stacks]
    rows = []
    for stack, policies in zip(stacks, loaded, strict=True):
        run_config = attrs.evolve(config, policies=tuple(stack))
        with progress(stack_label(stack)) as bar:
            outcome = run_workload(run_config, workload, stack=policies, workload_name=workload_name, progress=bar)
        summary = outcome.summary
        stats = outcome.result.engine.stats
        bytes_prefetched = stats.blocks_prefetched * summary["setup"]["block_bytes"]
        rows.append(
            {
                "stack": stack_label(stack),
                "requests": summary["requests"],
                "stranded": summary["stranded"],
                "ttft_p50_ms": summary["ttft_ms"]["p50"],
                "ttft_p99_ms": summary["ttft_ms"]["p99"],
                "throughput_tokens_per_s": summary["throughput_tokens_per_s"],
                "redundant_block_loads": summary["redundant_block_loads"],
                "bytes_moved": summary["bytes_loaded"] + summary["bytes_stored"] + bytes_prefetched,
                "bytes_loaded": summary["bytes_loaded"],
                "bytes_stored": summary["bytes_stored"],
                "bytes_prefetched": bytes_prefetched,
                "critical_path_lookup_ms": summary["critical_path_lookup_ms"],
                "sync_lookups": summary["sync_lookups"],
                "async_lookups": summary["async_lookups"],
                "prefetch_gave_up": stats.prefetch_gave_up,
                "deferrals": summary["deferrals"],
                "simulated_s": summary["simulated_s"],
            }
        )
    return rows


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:,.1f}"


_ROWS: tuple[tuple[str, Any], ...] = (
    ("TTFT p50 (ms)", lambda r: _ms(r["ttft_p50_ms"])),
    ("TTFT p99 (ms)", lambda r: _ms(r["ttft_p99_ms"])),
    ("throughput (output tok/s)", lambda r: f"{r['throughput_tokens_per_s']:,.1f}"),
    ("redundant block loads", lambda r: f"{r['redundant_block_loads']:,}"),
    ("bytes moved", lambda r: _gib(r["bytes_moved"])),
    ("  loaded / stored / prefetched", lambda r: " / ".join(
        _gib(r[k]).removesuffix(" GiB") for k in ("bytes_loaded", "bytes_stored", "bytes_prefetched")) + " GiB"),
    ("critical-path lookup (ms)", lambda r: _ms(r["critical_path_lookup_ms"])),
    ("deferrals by reason", lambda r: ", ".join(f"{k} {v:,}" for k, v in r["deferrals"].items()) or "none"),
    ("stranded", lambda r: f"{r['stranded']:,}"),
)


def format_comparison(rows: list[dict[str, Any]], markdown: bool = False) -> str:
    """Metrics down, stacks across."""
    stacks = [r["stack"] for r in rows]
    header = ["metric", *(f"`{s}`" for s in stacks)] if markdown else ["", *stacks]
    body = [[name, *(fmt(r) for r in rows)] for name, fmt in _ROWS]
    return columns([header, *body], markdown)
