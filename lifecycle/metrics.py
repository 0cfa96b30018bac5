"""The run summary: latency percentiles, throughput, hit rates, transfer volume."""

from __future__ import annotations

from typing import Any

from kvlife.lifecycle.drivers.simulator import SimResult


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default method)."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summarize(result: SimResult, wall_s: float, block_bytes: int) -> dict[str, Any]:
    engine = result.engine
    stats = engine.stats
    requests = list(engine.requests.values())
    ttft = [r.first_token_ms - r.arrival_ms for r in requests if r.first_token_ms is not None]
    tpot = [
        (r.finish_ms - r.first_token_ms) / (r.generated - 1)
        for r in requests
        if r.first_token_ms is not None and r.finish_ms is not None and r.generated > 1
    ]
    reasons: dict[str, int] = {}
    for r in requests:
        if r.finish_reason is not None:
            reasons[r.finish_reason] = reasons.get(r.finish_reason, 0) + 1
    candidates = sum(max(0, (r.prompt_tokens - 1) // r.block_tokens) for r in requests)
    hits = {"device": sum(r.device_hit_blocks for r in requests)}
    for name in engine.tiers:
        hits[name] = sum(r.tier_hit_blocks.get(name, 0) for r in requests)
    output_tokens = sum(r.generated for r in requests)
    makespan_s = result.makespan_ms / 1000.0
    first_arrival = min((r.arrival_ms for r in requests), default=0.0)
    span_s = max(makespan_s - first_arrival / 1000.0, 1e-9)
    return {
        "requests": len(requests),
        "finished": reasons,
        "stranded": len(result.stranded),
        # Requests that never finished once nothing was left to happen ("id:state").
        "stranded_requests": list(result.stranded),
        # jobs given up after the rank deadline whose late reports never came: their
        # blocks are held for good rather than risk reuse under a live copy
        "quarantined_jobs": sum(1 for job in engine.jobs.values() if job.timed_out),
        "ttft_ms": {"p50": percentile(ttft, 50), "p90": percentile(ttft, 90), "p99": percentile(ttft, 99)},
        "tpot_ms": {"p50": percentile(tpot, 50), "p90": percentile(tpot, 90), "p99": percentile(tpot, 99)},
        "throughput_tokens_per_s": output_tokens / span_s,
        "output_tokens": output_tokens,
        "simulated_s": span_s,
        "prefix_hit_rate": {k: (v / candidates if candidates else 0.0) for k, v in hits.items()},
        "blocks_loaded": stats.blocks_loaded,
        "bytes_loaded": stats.blocks_loaded * block_bytes,
        "blocks_stored": stats.blocks_stored,
        "bytes_stored": stats.blocks_stored * block_bytes,
        "redundant_block_loads": stats.redundant_block_loads,
        "failed_blocks": stats.failed_blocks,
        "preemptions": stats.preemptions,
        "deferrals": dict(sorted(stats.deferrals.items())),
        "sync_lookups": stats.sync_lookups,
        "critical_path_lookup_ms": (result.critical_path_lookup_ms if result.critical_path_lookup_ms is not None
                                    else stats.sync_lookups * engine.config.lookup_latency_ms),
        "async_lookups": stats.async_lookups,
        "stale_lookup_answers": stats.stale_lookup_answers,
        "warnings": dict(sorted(stats.warnings.items())),
        "scheduler_ticks": stats.ticks,
        "steps": stats.steps,
        "events": result.events,
        "wall_s": wall_s,
    }


def format_value(value: Any, fractions_as_percent: bool = False) -> str:
    """A summary value for a table cell; dict values as "key value, ..."."""
    if value is None:
        return "-"
    if isinstance(value, float):
        if fractions_as_percent and 0.0 <= value <= 1.0:
            return f"{value:.1%}"
        return f"{value:,.3f}" if abs(value) < 10 else f"{value:,.1f}"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, dict):
        return ", ".join(f"{k} {format_value(v, fractions_as_percent)}" for k, v in value.items()) or "none"
    return str(value)



def _bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:,.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover


def setup_rows(setup: dict[str, Any]) -> list[tuple[str, str]]:
    """What a simulated run ran on: hardware, model, TP, device blocks and how they were sized."""
    ranks = "" if setup["ranks"] == setup["tp"] else f", {setup['ranks']} ranks"
    return [
        ("hardware / model / TP", f"{setup['hardware']} / {setup['model']} / TP {setup['tp']}{ranks}"),
        ("device blocks", setup["device"]),
    ]


def _named(stranded: list[str], shown: int = 5) -> str:
    """`` (r1:waiting, r2:running, +3 more)``: which requests never finished."""
    if not stranded:
        return ""
    more = f", +{len(stranded) - shown} more" if len(stranded) > shown else ""
    return f" ({', '.join(stranded[:shown])}{more})"


def format_summary(summary: dict[str, Any]) -> str:
    hit = ", ".join(f"{k} {v:.1%}" for k, v in summary["prefix_hit_rate"].items())
    rows = setup_rows(summary["setup"]) if "setup" in summary else []
    rows += [
        ("requests", format_value(summary["requests"])),
        ("finished", format_value(summary["finished"])),
        ("stranded / quarantined jobs", f"{summary['stranded']} / {summary['quarantined_jobs']}"
                                        + _named(summary.get("stranded_requests", []))),
        ("TTFT p50 / p90 / p99 (ms)", " / ".join(format_value(summary["ttft_ms"][q]) for q in ("p50", "p90", "p99"))),
        ("TPOT p50 / p90 / p99 (ms)", " / ".join(format_value(summary["tpot_ms"][q]) for q in ("p50", "p90", "p99"))),
        ("throughput (output tok/s)", format_value(summary["throughput_tokens_per_s"])),
        ("prefix hit rate", hit),
        ("loaded", f"{summary['blocks_loaded']:,} blocks, {_bytes(summary['bytes_loaded'])}"),
        ("stored", f"{summary['blocks_stored']:,} blocks, {_bytes(summary['bytes_stored'])}"),
        ("redundant block loads", format_value(summary["redundant_block_loads"])),
        ("deferrals by reason", format_value(summary["deferrals"])),
        ("lookups (sync / async)", f"{summary['sync_lookups']:,} / {summary['async_lookups']:,}"),
        ("critical-path lookup (ms)", format_value(summary["critical_path_lookup_ms"])),
        ("preemptions", format_value(summary["preemptions"])),
        ("warnings", format_value(summary["warnings"])),
        ("scheduler ticks", format_value(summary["scheduler_ticks"])),
        ("simulated time (s)", format_value(summary["simulated_s"])),
        ("wall time (s)", format_value(summary["wall_s"])),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
