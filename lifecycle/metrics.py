"""The run summary: latency percentiles, throughput, hit rates, transfer volume.

The per-request figures go through ``RequestTotals``: each request is folded once it is
final (finished and let go by the engine, or whatever is left in ``engine.requests`` when
the summary is made). It keeps counters, and per request its arrival number, arrival time,
TTFT, TPOT and E2E latency in compact arrays (``array``, 8 bytes each): about 60 bytes a request,
so the percentiles stay exact (every value is kept) while the requests themselves are gone.
100,000 requests cost 6 MB here. Given a ``breakdown.PhaseClock`` (``collect``), it also
keeps one ``breakdown.RequestRow`` per request: where its time went, for
``--requests-out`` and the summary's ``latency_breakdown_ms``.

Latencies, as vLLM's benchmark defines them: TTFT from arrival to the first token; TPOT a
request's mean gap between output tokens after the first; E2E from arrival to the last
token (or the abort or failure); ITL the mean gap between consecutive output tokens over
every token of the run (token-weighted, where TPOT's mean weights requests). Each has its
mean and (population) standard deviation beside the percentiles.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, overload

from kvlife.lifecycle.breakdown import (
    SOURCES,
    PhaseClock,
    RequestRow,
    answers_of,
    phase_totals,
    prompt_sources,
    row_of,
)
from kvlife.policies.base import HOOK_VALUES, HOOKS

if TYPE_CHECKING:
    from kvlife.lifecycle.drivers.simulator import SimResult
    from kvlife.lifecycle.engine.request import Request

_NONE = math.nan  # the TTFT of a request without a first token
# Hooks whose answers are a few named choices, counted by answer; the others (a token
# count, a patience in ms) are counted as ``answered``.
_CHOICE_HOOKS = frozenset(h for h, values in HOOK_VALUES.items() if isinstance(values, tuple))


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
    per tier, prompt tokens by source, output tokens, the first arrival, the policies'
    last answers per hook, and every TTFT, TPOT and E2E value. Each request's arrival
    number (``Request.seq``) is kept with its arrival time and latencies, so ``samples``
    gives them in arrival order whatever order the requests were folded in.
    """

    __slots__ = ("requests", "finished", "_first_seen", "candidates", "hits", "output_tokens", "first_arrival_ms",
                 "seq", "arrival_ms", "ttft_ms", "tpot_ms", "req_tpot_ms", "e2e_ms", "sources", "answers",
                 "decode_ms", "gaps", "clock", "rows")

    def __init__(self) -> None:
        self.requests = 0
        self.finished: dict[str, int] = {}
        self._first_seen: dict[str, int] = {}  # finish reason -> smallest arrival number with it
        self.candidates = 0  # blocks a prefix hit could cover
        self.hits: dict[str, int] = {"device": 0}  # hit blocks: on the device, per tier
        self.output_tokens = 0
        self.first_arrival_ms: float | None = None
        # In fold order: arrival number, arrival time, TTFT, TPOT and E2E (NaN: none); and
        # the TPOT of each request that has one (the percentiles' input).
        self.seq = array("q")
        self.arrival_ms = array("d")
        self.ttft_ms = array("d")
        self.tpot_ms = array("d")
        self.req_tpot_ms = array("d")
        self.e2e_ms = array("d")
        self.sources: dict[str, int] = dict.fromkeys(SOURCES, 0)  # prompt tokens by source
        # hook -> policy -> value -> requests whose last answer at that hook it was
        self.answers: dict[str, dict[str, dict[str, int]]] = {}
        self.decode_ms = array("d")  # first to last token of each request with a TPOT: ITL's numerator
        self.gaps = 0  # gaps between consecutive output tokens: ITL's denominator
        self.clock: PhaseClock | None = None  # ``collect``: rows are kept
        self.rows: list[RequestRow] | None = None

    def collect(self, clock: PhaseClock) -> RequestTotals:
        """Keep a row per request from now on (``breakdown.row_of``), its phases from
        ``clock``, which must see the run's records. Returns self."""
        self.clock = clock
        if self.rows is None:
            self.rows = []
        return self

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
        sources = self.sources
        for name, n in prompt_sources(req).items():
            sources[name] += n
        answers = self.answers
        for hook, (policy, value) in answers_of(req).items():
            by_policy = answers.get(hook)
            if by_policy is None:
                by_policy = answers[hook] = {}
            by_value = by_policy.get(policy)
            if by_value is None:  # (not setdefault: it would build two dicts per answer to drop them)
                by_value = by_policy[policy] = {}
            key = str(value) if hook in _CHOICE_HOOKS else "answered"
            by_value[key] = by_value.get(key, 0) + 1
        self.output_tokens += req.generated
        arrival = req.arrival_ms
        if self.first_arrival_ms is None or arrival < self.first_arrival_ms:
            self.first_arrival_ms = arrival
        self.seq.append(seq)
        self.arrival_ms.append(arrival)
        first = req.first_token_ms
        finish = req.finish_ms
        self.e2e_ms.append(_NONE if finish is None else finish - arrival)
        tpot = _NONE
        if first is None:
            self.ttft_ms.append(_NONE)
        else:
            self.ttft_ms.append(first - arrival)
            if finish is not None and req.generated > 1:
                tpot = (finish - first) / (req.generated - 1)
                self.tpot_ms.append(tpot)
                self.decode_ms.append(finish - first)
                self.gaps += req.generated - 1
        self.req_tpot_ms.append(tpot)
        if self.clock is not None and self.rows is not None:
            self.rows.append(row_of(req, self.clock))

    def copy(self) -> RequestTotals:
        other = RequestTotals()
        other.requests = self.requests
        other.finished = dict(self.finished)
        other._first_seen = dict(self._first_seen)
        other.candidates = self.candidates
        other.hits = dict(self.hits)
        other.output_tokens = self.output_tokens
        other.first_arrival_ms = self.first_arrival_ms
        for name in ("seq", "arrival_ms", "ttft_ms", "tpot_ms", "req_tpot_ms", "e2e_ms", "decode_ms"):
            setattr(other, name, array(getattr(self, name).typecode, getattr(self, name)))
        other.sources = dict(self.sources)
        other.answers = {h: {p: dict(v) for p, v in by.items()} for h, by in self.answers.items()}
        other.gaps = self.gaps
        other.clock = self.clock
        other.rows = list(self.rows) if self.rows is not None else None
        return other

    @classmethod
    def of(cls, result: SimResult, clock: PhaseClock | None = None) -> RequestTotals:
        """Every request of a run: those that left the engine (``result.retired``) and
        those still in it (``clock``: rows for those too, their phases cut at the end). For
        reading only: with nothing left to fold in, it is ``result.retired`` itself (a copy
        would double the arrays' memory at the run's end for nothing)."""
        held = list(result.engine.requests.values())
        if result.retired is not None and clock is None and not held:
            return result.retired
        totals = result.retired.copy() if result.retired is not None else cls()
        if clock is not None:
            totals.collect(clock)
            clock.end_ms = max(clock.end_ms, result.makespan_ms)
        totals.add(held)
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

    def ttfts(self) -> array[float]:
        """TTFT of every request that got a first token (in fold order)."""
        return array("d", (t for t in self.ttft_ms if not math.isnan(t)))

    def e2es(self) -> array[float]:
        """E2E latency of every request that finished (in fold order)."""
        return array("d", (t for t in self.e2e_ms if not math.isnan(t)))

    def decisions(self) -> dict[str, dict[str, dict[str, int]]]:
        """hook -> policy -> answer -> requests whose last answer at that hook it was (for
        ``admission``: the answer that admitted them), hooks in the order a request meets
        them, policies and answers sorted (the same whatever order requests were folded in)."""
        return {str(hook): {policy: dict(sorted(values.items()))
                            for policy, values in sorted(self.answers[hook].items())}
                for hook in HOOKS if hook in self.answers}

    def goodput(self, slo: Mapping[str, float]) -> dict[str, Any]:
        """Requests that met every per-request limit of ``slo`` (``ttft``, ``tpot``, ``e2e``:
        ms), as vLLM's benchmark counts goodput: a request without the figure (no first
        token, unfinished, one output token for TPOT) does not meet it."""
        columns = {"ttft": self.ttft_ms, "tpot": self.req_tpot_ms, "e2e": self.e2e_ms}
        good = 0
        for i in range(len(self.seq)):
            ok = True
            for metric, limit in slo.items():
                value = columns[metric][i]
                if metric == "tpot" and math.isnan(value) and not math.isnan(self.e2e_ms[i]) \
                        and not math.isnan(self.ttft_ms[i]):
                    continue  # finished with one output token: no gap to judge
                if math.isnan(value) or value > limit:
                    ok = False
                    break
            good += ok
        return {"slo_ms": dict(slo), "requests": good,
                "fraction": good / len(self.seq) if len(self.seq) else None}

    def samples(self) -> Samples:
        """(arrival ms, TTFT ms or None) of every request, in arrival order."""
        # Arrival numbers are unique: each one's fold position goes in its slot, and the slots
        # in order give arrival order (8 bytes a slot; a sort would hold an int object a request).
        seq = self.seq
        slots = array("q", [-1]) * (max(seq) + 1 if seq else 0)
        for position, number in enumerate(seq):
            slots[number] = position
        order = array("q", (position for position in slots if position >= 0))
        return Samples(array("d", (self.arrival_ms[i] for i in order)), array("d", (self.ttft_ms[i] for i in order)))


def _none_if_nan(value: float) -> float | None:
    return None if value != value else value


class Samples(Sequence[tuple[float, float | None]]):
    """(arrival ms, TTFT ms or None) of each request, built as they are read from two arrays
    (NaN: None): 16 bytes a request, where a list of tuples costs about 100 (a tuple and two
    floats), which at 100k requests was most of the memory a summary took."""

    __slots__ = ("_arrival", "_ttft")

    def __init__(self, arrival: array[float], ttft: array[float]) -> None:
        if len(arrival) != len(ttft):
            raise ValueError(f"Samples: {len(arrival)} arrivals but {len(ttft)} TTFTs")
        self._arrival = arrival
        self._ttft = ttft

    def __len__(self) -> int:
        return len(self._arrival)

    @overload
    def __getitem__(self, index: int) -> tuple[float, float | None]: ...

    @overload
    def __getitem__(self, index: slice) -> list[tuple[float, float | None]]: ...

    def __getitem__(self, index: int | slice) -> tuple[float, float | None] | list[tuple[float, float | None]]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        ttft = self._ttft[index]
        return (self._arrival[index], None if math.isnan(ttft) else ttft)

    def __iter__(self) -> Iterator[tuple[float, float | None]]:
        """The samples in order, read from the arrays as they go (no ``__getitem__`` per sample)."""
        return zip(self._arrival, map(_none_if_nan, self._ttft), strict=True)

    def __eq__(self, other: object) -> bool:
        """Equal to any sequence with the same samples in the same order (a list of tuples too)."""
        if not isinstance(other, Sequence):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]


def distribution(values: Sequence[float]) -> dict[str, float | None]:
    """p50, p90, p99, mean and population standard deviation (None for no values); the
    same whatever order the values come in (``math.fsum`` is exactly rounded)."""
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None, "std": None}
    mean = math.fsum(values) / len(values)
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / len(values))
    return {"p50": percentile(values, 50), "p90": percentile(values, 90), "p99": percentile(values, 99),
            "mean": mean, "std": std}


def summarize(result: SimResult, wall_s: float, block_bytes: int, *, totals: RequestTotals | None = None,
              goodput: Mapping[str, float] | None = None) -> dict[str, Any]:
    """The run summary (docs/cli.md lists its fields). ``totals``: the run's requests folded
    (default ``RequestTotals.of(result)``); when they kept rows (``RequestTotals.collect``),
    the summary adds ``latency_breakdown_ms``, their phases summed. ``goodput``: per-request
    limits (ms) by metric (``ttft``, ``tpot``, ``e2e``) for the ``goodput`` field."""
    from kvlife.lifecycle.fidelity.stability import check_stability

    engine = result.engine
    stats = engine.stats
    if totals is None:
        totals = RequestTotals.of(result)
    ttft = totals.ttfts()
    tpot = totals.tpot_ms
    candidates = totals.candidates
    hits = totals.hit_blocks(engine.tiers)
    output_tokens = totals.output_tokens
    makespan_s = result.makespan_ms / 1000.0
    first_arrival = totals.first_arrival_ms if totals.first_arrival_ms is not None else 0.0
    span_s = max(makespan_s - first_arrival / 1000.0, 1e-9)
    sources = {name: n for name, n in totals.sources.items()
               if name in ("local_cache_hit", "local_compute") or name in engine.tiers or n}
    summary = {
        "requests": totals.requests,
        "finished": totals.reasons(),
        "stranded": len(result.stranded),
        # Requests that never finished once nothing was left to happen ("id:state").
        "stranded_requests": list(result.stranded),
        # jobs given up after the rank deadline whose late reports never came: their
        # blocks are held for good rather than risk reuse under a live copy
        "quarantined_jobs": sum(1 for job in engine.jobs.values() if job.timed_out),
        "ttft_ms": distribution(ttft),
        "tpot_ms": distribution(tpot),
        "e2e_ms": distribution(totals.e2es()),
        "itl_ms": {"mean": math.fsum(totals.decode_ms) / totals.gaps if totals.gaps else None},
        "throughput_tokens_per_s": output_tokens / span_s,
        "requests_per_s": totals.requests / span_s,
        "output_tokens": output_tokens,
        "prompt_tokens": sum(totals.sources.values()),
        "prompt_tokens_by_source": sources,
        "simulated_s": span_s,
        "prefix_hit_rate": {k: (v / candidates if candidates else 0.0) for k, v in hits.items()},
        "blocks_loaded": stats.blocks_loaded,
        "bytes_loaded": stats.blocks_loaded * block_bytes,
        "blocks_stored": stats.blocks_stored,
        "bytes_stored": stats.blocks_stored * block_bytes,
        "redundant_block_loads": stats.redundant_block_loads,
        "joined_blocks": stats.joined_blocks,
        "failed_blocks": stats.failed_blocks,
        "preemptions": stats.preemptions,
        "deferrals": dict(sorted(stats.deferrals.items())),
        "decisions": totals.decisions(),
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
    if goodput:
        good = totals.goodput(goodput)
        good["requests_per_s"] = good["requests"] / span_s
        summary["goodput"] = good
    # Overloaded: the queue grows over the run (the stability rule's growth criterion,
    # ``fidelity.stability``; its TTFT p50 limit is a service target, not a sign of overload).
    stability = check_stability(totals.samples())
    last = max(totals.arrival_ms) if len(totals.arrival_ms) else 0.0
    summary["stability"] = {**stability.to_dict(), "arrivals_s": (last - first_arrival) / 1000.0}
    summary["overloaded"] = not stability.ratio_ok
    if totals.rows is not None:
        summary["latency_breakdown_ms"] = phase_totals(totals.rows)
    return summary


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


def _latency(figures: Mapping[str, float | None]) -> str:
    """``76.7 / 103.7 / 136.3 (mean 79.4, std 43.2)``."""
    text = " / ".join(format_value(figures[q]) for q in ("p50", "p90", "p99"))
    if figures.get("mean") is None:
        return text
    return f"{text} (mean {format_value(figures['mean'])}, std {format_value(figures['std'])})"


def _shares(counts: Mapping[str, int]) -> str:
    """``local_cache_hit 463,360 (58.0%), host 0, ...``: each count and its share of the total."""
    total = sum(counts.values())
    return ", ".join(f"{k} {v:,}" + (f" ({v / total:.1%})" if v and total else "") for k, v in counts.items())


def _goodput_row(summary: Mapping[str, Any]) -> list[tuple[str, str]]:
    good = summary.get("goodput")
    if good is None:
        return []
    slo = ", ".join(f"{k} <= {v:,g} ms" for k, v in good["slo_ms"].items())
    share = f" ({good['fraction']:.1%})" if good["fraction"] is not None else ""
    return [(f"goodput ({slo})", f"{good['requests']:,} of {summary['requests']:,} requests{share}, "
                                 f"{good['requests_per_s']:,.3g} requests/s")]


def _breakdown_row(summary: Mapping[str, Any]) -> list[tuple[str, str]]:
    phases = summary.get("latency_breakdown_ms")
    if phases is None:
        return []
    text = ", ".join(f"{p} {format_value(v['mean'])}" for p, v in phases.items() if v["total"])
    return [("time per request (mean ms)", text or "none")]


def _answers_row(decisions: Mapping[str, Mapping[str, Mapping[str, int]]]) -> list[tuple[str, str]]:
    """Hooks where a policy other than the baseline answered (and admission, always): the
    requests by the answer that stood, e.g. ``admission: shared-loads join 52, baseline go 148``."""
    parts = []
    for hook, by_policy in decisions.items():
        if hook != "admission" and set(by_policy) <= {"baseline"}:
            continue
        answers = ", ".join(f"{policy} {value} {n:,}" for policy, values in by_policy.items()
                            for value, n in values.items())
        parts.append(f"{hook}: {answers}")
    return [("policy answers (requests)", "; ".join(parts))] if parts else []


def overload_line(summary: Mapping[str, Any], time_scale: float, request_rate: float | None = None) -> str | None:
    """One line when the run is overloaded (its queue grew: ``summary["overloaded"]``), else
    None: ``overloaded: TTFT of the last arrival decile is 9.8x the first; try --time-scale 0.31``.
    The suggestion assumes the run served what it could: the arrivals took ``arrivals_s``,
    serving them all took ``simulated_s``, so arrivals that many times slower (and 20 % more,
    to leave the queue room) would have been kept up with; rounded down to two digits."""
    if not summary.get("overloaded"):
        return None
    stability = summary["stability"]
    ratio = stability["ratio"]
    growth = ("never got a first token" if not math.isfinite(ratio)
              else f"is {ratio:,.1f}x the first ({stability['growth_ms']:+,.0f} ms)")
    line = f"overloaded: TTFT of the last arrival decile {growth}"
    arrivals, served = stability.get("arrivals_s") or 0.0, summary["simulated_s"]
    if arrivals > 0 and served > 0:
        factor = min(1.0, arrivals / served) * 0.8
        if request_rate is not None:
            line += f"; try --request-rate {_two_digits(request_rate * factor):g}"
        else:
            line += f"; try --time-scale {_two_digits(time_scale * factor):g}"
    return line


def _two_digits(x: float) -> float:
    """``x`` rounded down to two significant digits."""
    if x <= 0 or not math.isfinite(x):
        return x
    step = 10.0 ** (math.floor(math.log10(x)) - 1)
    return round(math.floor(x / step + 1e-9) * step, 12)


def format_summary(summary: dict[str, Any]) -> str:
    hit = ", ".join(f"{k} {v:.1%}" for k, v in summary["prefix_hit_rate"].items())
    rows = setup_rows(summary["setup"]) if "setup" in summary else []
    rows += [
        ("requests", format_value(summary["requests"])),
        ("finished", format_value(summary["finished"])),
        ("stranded / quarantined jobs", f"{summary['stranded']} / {summary['quarantined_jobs']}"
                                        + _named(summary.get("stranded_requests", []))),
        ("TTFT p50 / p90 / p99 (ms)", _latency(summary["ttft_ms"])),
        ("TPOT p50 / p90 / p99 (ms)", _latency(summary["tpot_ms"])),
        ("E2E p50 / p90 / p99 (ms)", _latency(summary["e2e_ms"])),
        ("ITL mean (ms)", format_value(summary["itl_ms"]["mean"])),
        *_goodput_row(summary),
        ("throughput (output tok/s)", format_value(summary["throughput_tokens_per_s"])),
        ("prefix hit rate", hit),
        ("prompt tokens by source", _shares(summary["prompt_tokens_by_source"])),
        *_breakdown_row(summary),
        *_answers_row(summary["decisions"]),
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
