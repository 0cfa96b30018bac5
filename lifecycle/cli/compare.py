"""Run one workload under several policy stacks and put the results side by side.

Every stack sees the same workload, config and seed, so the differences are the policies'
doing. The figures come from the run summary (``kvlife.lifecycle.metrics``) plus the engine's
prefetch counters, which the summary predates.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import attrs

from kvlife.lifecycle.breakdown import RequestRow
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
    goodput: Mapping[str, float] | None = None,
    keep_rows: list[list[RequestRow]] | None = None,
) -> list[dict[str, Any]]:
    """One row per stack (docs/cli.md, ``compare``). ``keep_rows``: a list that gets each
    stack's per-request rows (``breakdown.RequestRow``, arrival order), for plots."""
    # Load every stack first: a broken policy fails the command before any run starts.
    loaded = [load_stack(stack) for stack in stacks]
    rows = []
    for stack, policies in zip(stacks, loaded, strict=True):
        run_config = attrs.evolve(config, policies=tuple(stack))
        with progress(stack_label(stack)) as bar:
            outcome = run_workload(run_config, workload, stack=policies, workload_name=workload_name, progress=bar,
                                   breakdown=True, goodput=goodput)
        if keep_rows is not None:
            keep_rows.append(outcome.rows or [])
        summary = outcome.summary
        stats = outcome.result.engine.stats
        bytes_prefetched = stats.blocks_prefetched * summary["setup"]["block_bytes"]
        phases = summary["latency_breakdown_ms"]
        rows.append(
            {
                "stack": stack_label(stack),
                "requests": summary["requests"],
                "stranded": summary["stranded"],
                "overloaded": summary["overloaded"],
                "stability_ratio": summary["stability"]["ratio"],
                "ttft_p50_ms": summary["ttft_ms"]["p50"],
                "ttft_p99_ms": summary["ttft_ms"]["p99"],
                "ttft_mean_ms": summary["ttft_ms"]["mean"],
                "tpot_p50_ms": summary["tpot_ms"]["p50"],
                "tpot_p99_ms": summary["tpot_ms"]["p99"],
                "e2e_p50_ms": summary["e2e_ms"]["p50"],
                "e2e_p99_ms": summary["e2e_ms"]["p99"],
                "itl_mean_ms": summary["itl_ms"]["mean"],
                "goodput": summary.get("goodput"),
                "phase_mean_ms": {phase: v["mean"] for phase, v in phases.items()},
                "phase_p99_ms": {phase: v["p99"] for phase, v in phases.items()},
                "prompt_tokens_by_source": summary["prompt_tokens_by_source"],
                "decisions": summary["decisions"],
                "joined_blocks": summary["joined_blocks"],
                "preemptions": summary["preemptions"],
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


def _answers(row: dict[str, Any], hook: str) -> str:
    """``shared-loads join 52, baseline go 148``: the requests by the answer that stood."""
    by_policy = row["decisions"].get(hook, {})
    return ", ".join(f"{p} {v} {n:,}" for p, values in by_policy.items() for v, n in values.items()) or "-"


def _overload(row: dict[str, Any]) -> str:
    if not row["overloaded"]:
        return "no"
    ratio = row["stability_ratio"]
    return "YES (no first token late)" if ratio is None or ratio == float("inf") else f"YES ({ratio:,.1f}x)"


def _goodput(row: dict[str, Any]) -> str:
    good = row["goodput"]
    return "-" if good is None else f"{good['requests']:,} ({good['requests_per_s']:,.3g}/s)"


_ROWS: tuple[tuple[str, Any], ...] = (
    ("overloaded (last/first decile TTFT)", _overload),
    ("TTFT p50 (ms)", lambda r: _ms(r["ttft_p50_ms"])),
    ("TTFT p99 (ms)", lambda r: _ms(r["ttft_p99_ms"])),
    ("TPOT p50 / p99 (ms)", lambda r: f"{_ms(r['tpot_p50_ms'])} / {_ms(r['tpot_p99_ms'])}"),
    ("E2E p50 / p99 (ms)", lambda r: f"{_ms(r['e2e_p50_ms'])} / {_ms(r['e2e_p99_ms'])}"),
    ("goodput (requests)", _goodput),
    ("mean queue / lookup / load / prefill (ms)", lambda r: " / ".join(
        _ms(r["phase_mean_ms"][p]) for p in ("queue", "lookup", "load", "prefill"))),
    ("p99 queue / lookup / load / prefill (ms)", lambda r: " / ".join(
        _ms(r["phase_p99_ms"][p]) for p in ("queue", "lookup", "load", "prefill"))),
    ("admission answers (requests)", lambda r: _answers(r, "admission")),
    ("joined blocks", lambda r: f"{r['joined_blocks']:,}"),
    ("lookup mode (requests)", lambda r: _answers(r, "lookup_mode")),
    ("preemptions", lambda r: f"{r['preemptions']:,}"),
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
    """Metrics down, stacks across; an overloaded stack is marked in its heading."""
    marks = [" (overloaded)" if r["overloaded"] else "" for r in rows]
    if markdown:
        header = ["metric", *(f"`{r['stack']}`{mark}" for r, mark in zip(rows, marks, strict=True))]
    else:
        header = ["", *(r["stack"] + mark for r, mark in zip(rows, marks, strict=True))]
    body = [[name, *(fmt(r) for r in rows)] for name, fmt in _ROWS]
    return columns([header, *body], markdown)
