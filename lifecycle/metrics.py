"""The run summary: latency percentiles, throughput, hit rates, transfer volume.

The per-request figures go through ``RequestTotals``: each request is folded once it is
final (finished and let go by the engine, or whatever is left in ``engine.requests`` when
the summary is made). It keeps counters, and per request its arrival number, arrival time,
TTFT and TPOT in compact arrays (``array``, 8 bytes each): 32 bytes a request, so the
percentiles stay exact (every value is kept, as before) while the requests themselves are
gone. 100,000 requests cost 3.2 MB here.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvlife.lifecycle.drivers.simulator import SimResult
    from kvlife.lifecycle.engine.request import Request

_NONE = math.nan  # the TTFT of a request without a first token


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default method)."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


class RequestTotals:
    """What the summary needs of the requests, folded one request at a time (``fold``).

    Counts by finish reason (in the order reasons first occur by arrival, as a scan of
    the requests in arrival order would list them), prefix-hit candidate and hit blocks
    per tier, output tokens, the first arrival, and every TTFT and TPOT value. Each
    request's arrival number (``Request.seq``) is kept with its arrival time and TTFT, so
    ``samples`` gives them in arrival order whatever order the requests were folded in.
    """

    __slots__ = ("requests", "finished", "_first_seen", "candidates", "hits", "output_tokens", "first_arrival_ms",
                 "seq", "arrival_ms", "ttft_ms", "tpot_ms")

    def __init__(self) -> None:
        self.requests = 0
        self.finished: dict[str, int] = {}
        self._first_seen: dict[str, int] = {}  # finish reason -> smallest arrival number with it
        self.candidates = 0  # blocks a prefix hit could cover
        self.hits: dict[str, int] = {"device": 0}  # hit blocks: on the device, per tier
        self.output_tokens = 0
        self.first_arrival_ms: float | None = None
        # In fold order: arrival number, arrival time, TTFT (NaN: no first token); TPOT of
        # each request that has one.
        self.seq = array("q")
        self.arrival_ms = array("d")
        self.ttft_ms = array("d")
        self.tpot_ms = array("d")

    def fold(self, req: Request) -> None:
        """Add one request (final: nothing about it changes after this)."""
        self.requests += 1
        seq = req.seq
        reason = req.finish_reason
        if reason is not None:
            self.finished[reason] = self.finished.get(reason, 0) + 1
            if seq < self._first_seen.get(reason, seq + 1):
                self._first_seen[reason] = seq
        self.candidates += max(0, (req.prompt_tokens - 1) // req.block_tokens)
        hits = self.hits
        hits["device"] += req.device_hit_blocks
        for name, n in req.tier_hit_blocks.items():
            hits[name] = hits.get(name, 0) + n
        self.output_tokens += req.generated
        arrival = req.arrival_ms
        if self.first_arrival_ms is None or arrival < self.first_arrival_ms:
            self.first_arrival_ms = arrival
        self.seq.append(seq)
        self.arrival_ms.append(arrival)
        first = req.first_token_ms
        if first is None:
            self.ttft_ms.append(_NONE)
        else:
            self.ttft_ms.append(first - arrival)
            if req.finish_ms is not None and req.generated > 1:
                self.tpot_ms.append((req.finish_ms - first) / (req.generated - 1))

    def copy(self) -> RequestTotals:
        other = RequestTotals()
        other.requests = self.requests
        other.finished = dict(self.finished)
        other._first_seen = dict(self._first_seen)
        other.candidates = self.candidates
        other.hits = dict(self.hits)
        other.output_tokens = self.output_tokens
        other.first_arrival_ms = self.first_arrival_ms
        other.seq = array("q", self.seq)
        other.arrival_ms = array("d", self.arrival_ms)
        other.ttft_ms = array("d", self.ttft_ms)
        other.tpot_ms = array("d", self.tpot_ms)
        return other

    @classmethod
    def of(cls, result: SimResult) -> RequestTotals:
        """Every request of a run: those that left the engine (``result.retired``) and
        those still in it."""
        totals = result.retired.copy() if result.retired is not None else cls()
        totals.add(result.engine.requests.values())
        return totals

    def add(self, requests: Iterable[Request]) -> None:
        for req in requests:
            self.fold(req)

    def reasons(self) -> dict[str, int]:
        """Requests by finish reason, reasons in order of first occurrence by arrival."""
        first = self._first_seen
        return {reason: self.finished[reason] for reason in sorted(self.finished, key=lambda r: first[r])}

    def hit_blocks(self, tiers: Iterable[str]) -> dict[str, int]:
        """Hit blocks on the device, then in each of ``tiers`` (0 where none)."""
        return {"device": self.hits["device"], **{name: self.hits.get(name, 0) for name in tiers}}

    def ttfts(self) -> list[float]:
        """TTFT of every request that got a first token (in fold order)."""
        return [t for t in self.ttft_ms if not math.isnan(t)]

    def samples(self) -> list[tuple[float, float | None]]:
        """(arrival ms, TTFT ms or None) of every request, in arrival order."""
        seq, arrival, ttft = self.seq, self.arrival_ms, self.ttft_ms
        return [(arrival[i], None if math.isnan(ttft[i]) else ttft[i])
                for i in sorted(range(len(seq)), key=seq.__getitem__)]


def summarize(result: SimResult, wall_s: float, block_bytes: int) -> dict[str, Any]:
    engine = result.engine
    stats = engine.stats
    totals = RequestTotals.of(result)
    ttft = totals.ttfts()
    tpot = totals.tpot_ms
    candidates = totals.candidates
    hits = totals.hit_blocks(engine.tiers)
    output_tokens = totals.output_tokens
    makespan_s = result.makespan_ms / 1000.0
    first_arrival = totals.first_arrival_ms if totals.first_arrival_ms is not None else 0.0
    span_s = max(makespan_s - first_arrival / 1000.0, 1e-9)
    return {
        "requests": totals.requests,
        "finished": totals.reasons(),
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
    if "chaos" in summary:  # kvlife run --chaos: what the adversary did
        chaos = {k: v for k, v in summary["chaos"].items() if k != "seed" and v}
        rows.append((f"chaos (seed {summary['chaos']['seed']})", format_value(chaos)))
    if "check" in summary:  # kvlife run --check / --chaos: the invariant observer's findings
        from kvlife.lifecycle.drivers.online_check import describe

        rows.append(("invariant check", describe(summary["check"])))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
