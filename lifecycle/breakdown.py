"""Where each request's time went and where its prompt tokens came from: one row per request.

A row is made from two things a run already produces:

- the request's ``transition`` records (and its ``arrival`` input), folded by ``PhaseClock``
  as they are recorded (a recorder, beside or instead of the trace writer) or read back from
  a trace: how long the request spent in each state;
- the engine's record of the request when it is final (``metrics.RequestTotals.fold`` gets
  each one): arrival, first token and finish times, output tokens, the blocks it found on
  the device and in each tier at its first admission, and the last answer each policy hook
  gave it.

Phases (ms), in the order a request meets them; they add up to the time from arrival to
the end of ``sending`` (the E2E latency plus ``hold``):

- ``queue``: in ``waiting``: not admitted yet, deferred, or preempted and waiting again;
- ``lookup``: in ``lookup_pending``: an async tier lookup not answered yet (a sync lookup
  delays the step it is made for: it shows in ``prefill``);
- ``load``: in ``loading``: its external hit blocks coming in from a tier;
- ``prefill``: in ``running`` before its first token (chunked prefill; recompute after a
  preemption before it);
- ``decode``: in ``running`` from its first token to its last;
- ``hold``: in ``sending``: finished, its blocks held until its stores are read.

Prompt tokens by source, as vLLM's ``vllm:prompt_tokens_by_source`` counter names them where
it has a name: ``local_cache_hit`` (the device prefix cache), one column per kvlife tier
(``host``, ``disk``, ``remote``: together vLLM's ``external_kv_transfer``) and
``local_compute`` (the rest, computed). They describe what the request found at its first
admission (a request never admitted counts all its prompt as ``local_compute``).

The same rows feed ``kvlife run --requests-out``, ``kvlife explain --slowest/--brief`` and the
summary's ``latency_breakdown_ms``, so their figures agree (tested).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import attrs

from kvlife.policies.base import HOOKS

if TYPE_CHECKING:
    from kvlife.lifecycle.engine.request import Request

PHASES: tuple[str, ...] = ("queue", "lookup", "load", "prefill", "decode", "hold")
# The state each phase but prefill/decode is (running splits at the first token).
_STATE_PHASE = {"waiting": "queue", "lookup_pending": "lookup", "loading": "load", "sending": "hold"}
TIER_SOURCES: tuple[str, ...] = ("host", "disk", "remote")
SOURCES: tuple[str, ...] = ("local_cache_hit", *TIER_SOURCES, "local_compute")


class PhaseClock:
    """A recorder fold: for each request, the time it spent in each state, and the spans
    it spent running (split at the first token when its row is made). Give ``record`` every
    record of a run (it reads ``arrival`` inputs and ``transition`` records, and ignores the
    rest); ``take`` hands a request's figures over and forgets them, so memory holds only the
    requests not made into rows yet."""

    __slots__ = ("_since", "_spent", "_running", "end_ms")

    def __init__(self) -> None:
        self._since: dict[str, tuple[str, float]] = {}  # request -> (state, since when)
        self._spent: dict[str, dict[str, float]] = {}  # request -> phase -> ms (running excluded)
        self._running: dict[str, list[tuple[float, float]]] = {}  # request -> running spans
        self.end_ms = 0.0  # the latest time seen: where a request still in a state is cut

    def record(self, record: dict[str, Any]) -> None:
        kind = record["kind"]
        if kind == "transition":
            rid = record["req"]
            t = record["t"]
            source, since = self._since.get(rid, (record["from"], t))
            self._close(rid, source, since, t)
            self._since[rid] = (record["to"], t)
            if t > self.end_ms:
                self.end_ms = t
        elif kind == "input" and record.get("type") == "arrival":
            t = record["t"]
            self._since.setdefault(record["request_id"], ("waiting", t))
            if t > self.end_ms:
                self.end_ms = t

    def _close(self, rid: str, state: str, since: float, t: float) -> None:
        if state == "running":
            self._running.setdefault(rid, []).append((since, t))
        elif state != "finished":
            spent = self._spent.setdefault(rid, {})
            phase = _STATE_PHASE.get(state, "queue")
            spent[phase] = spent.get(phase, 0.0) + (t - since)

    def take(self, rid: str, first_token_ms: float | None, end_ms: float | None = None) -> dict[str, float]:
        """The request's phases in ms (``PHASES`` order), its figures forgotten. A request
        still in a state is cut at ``end_ms`` (default: the latest time seen)."""
        since = self._since.pop(rid, None)
        if since is not None and since[0] != "finished":
            self._close(rid, since[0], since[1], max(since[1], end_ms if end_ms is not None else self.end_ms))
        spent = self._spent.pop(rid, {})
        prefill = decode = 0.0
        for start, stop in self._running.pop(rid, ()):
            if first_token_ms is None or stop <= first_token_ms:
                prefill += stop - start
            elif start >= first_token_ms:
                decode += stop - start
            else:
                prefill += first_token_ms - start
                decode += stop - first_token_ms
        return {"queue": spent.get("queue", 0.0), "lookup": spent.get("lookup", 0.0), "load": spent.get("load", 0.0),
                "prefill": prefill, "decode": decode, "hold": spent.get("hold", 0.0)}


def answers_of(req: Request) -> dict[str, tuple[str, Any]]:
    """hook -> (policy, answer) that stood for ``req`` at the end (for ``admission``: the
    answer that admitted it). The one place the rows and the summary's ``decisions`` learn
    what the policies answered: the engine keeps each request's last answer per hook
    (``Request.last_decisions``); an engine that kept every answer that took effect would be
    read here."""
    return {str(hook): (policy, value) for hook, (policy, value, _) in req.last_decisions.items()}


def prompt_sources(req: Request) -> dict[str, int]:
    """Prompt tokens by source (``SOURCES``) of one request, from what its first admission
    found; they add up to its prompt tokens."""
    bt = req.block_tokens
    found = {"local_cache_hit": req.device_hit_blocks * bt}
    for tier in TIER_SOURCES:
        found[tier] = req.tier_hit_blocks.get(tier, 0) * bt
    found["local_compute"] = req.prompt_tokens - sum(found.values())
    return found


@attrs.frozen(slots=True)
class RequestRow:
    """One request: its latencies (ms; None where it never got that far), its phases, its
    tokens and the answer each policy hook gave it last (``"policy:value"``, empty when the
    hook was never asked for it; ``admission`` is the answer that admitted it)."""

    request: str
    seq: int
    arrival_ms: float
    finish_reason: str  # stopped, length, aborted, error; empty: unfinished
    prompt_tokens: int
    output_tokens: int
    ttft_ms: float | None
    tpot_ms: float | None
    e2e_ms: float | None
    phases: tuple[float, ...]  # PHASES order
    preemptions: int
    async_lookups: int  # async lookups it submitted (each answer is consumed by one admission, as vLLM does)
    sources: tuple[int, ...]  # SOURCES order
    answers: tuple[str, ...]  # HOOKS order

    def phase(self, name: str) -> float:
        return self.phases[PHASES.index(name)]

    def source(self, name: str) -> int:
        return self.sources[SOURCES.index(name)]

    def as_dict(self) -> dict[str, Any]:
        """The row as ``COLUMNS`` names it (what ``--requests-out`` writes)."""
        row: dict[str, Any] = {
            "request": self.request, "arrival_ms": self.arrival_ms, "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
            "ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms, "e2e_ms": self.e2e_ms,
        }
        row.update({f"{p}_ms": v for p, v in zip(PHASES, self.phases, strict=True)})
        row["preemptions"] = self.preemptions
        row["async_lookups"] = self.async_lookups
        row.update({f"tokens_{s}": v for s, v in zip(SOURCES, self.sources, strict=True)})
        row.update(zip(HOOKS, self.answers, strict=True))
        return row


COLUMNS: tuple[str, ...] = (
    "request", "arrival_ms", "finish_reason", "prompt_tokens", "output_tokens", "ttft_ms", "tpot_ms", "e2e_ms",
    *(f"{p}_ms" for p in PHASES), "preemptions", "async_lookups", *(f"tokens_{s}" for s in SOURCES), *HOOKS,
)


def latencies(req: Request) -> tuple[float | None, float | None, float | None]:
    """TTFT, TPOT and E2E of one request (ms; None where it never got that far). TPOT is
    the mean gap between its output tokens after the first; E2E runs from arrival to its
    last token (or to its abort or failure)."""
    first, finish = req.first_token_ms, req.finish_ms
    ttft = None if first is None else first - req.arrival_ms
    tpot = (finish - first) / (req.generated - 1) if first is not None and finish is not None \
        and req.generated > 1 else None
    e2e = None if finish is None else finish - req.arrival_ms
    return ttft, tpot, e2e


def row_of(req: Request, clock: PhaseClock, end_ms: float | None = None) -> RequestRow:
    """The row of a request made final (its figures leave ``clock``)."""
    ttft, tpot, e2e = latencies(req)
    phases = clock.take(req.request_id, req.first_token_ms, end_ms)
    sources = prompt_sources(req)
    decided = answers_of(req)
    answers = tuple(f"{decided[h][0]}:{decided[h][1]}" if h in decided else "" for h in HOOKS)
    return RequestRow(req.request_id, req.seq, req.arrival_ms, req.finish_reason or "", req.prompt_tokens,
                      req.generated, ttft, tpot, e2e, tuple(phases[p] for p in PHASES), req.preemptions,
                      req.async_lookups, tuple(sources[s] for s in SOURCES), answers)


def in_arrival_order(rows: Iterable[RequestRow]) -> list[RequestRow]:
    return sorted(rows, key=lambda r: r.seq)


def phase_totals(rows: Sequence[RequestRow]) -> dict[str, dict[str, float | None]]:
    """Per phase: the total over the requests, and the mean, p50 and p99 per request (ms):
    the summary's ``latency_breakdown_ms``."""
    from kvlife.lifecycle.metrics import percentile

    out: dict[str, dict[str, float | None]] = {}
    for i, phase in enumerate(PHASES):
        values = [r.phases[i] for r in rows]
        total = math.fsum(values)
        out[phase] = {"total": total, "mean": total / len(values) if values else None,
                      "p50": percentile(values, 50), "p99": percentile(values, 99)}
    return out


def slowest(rows: Iterable[RequestRow], n: int, by: str = "e2e") -> list[RequestRow]:
    """The ``n`` slowest requests by ``by`` (``e2e`` or ``ttft``; a request that never got
    there is slowest of all), ties in arrival order."""
    key = "e2e_ms" if by == "e2e" else "ttft_ms"

    def value(row: RequestRow) -> float:
        v = getattr(row, key)
        return math.inf if v is None else v

    return sorted(rows, key=lambda r: (-value(r), r.seq))[:n]


def _cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, float):  # the shortest text that reads back as the same float
        return repr(value) if math.isfinite(value) else ""
    return value


def write_csv(rows: Iterable[RequestRow], out: IO[str]) -> int:
    """One CSV line per row (``COLUMNS``; an empty cell where a latency does not exist);
    returns the rows written. ``pandas.read_csv(FILE)`` reads it as is."""
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(COLUMNS)
    count = 0
    for row in rows:
        data = row.as_dict()
        writer.writerow([_cell(data[c]) for c in COLUMNS])
        count += 1
    return count


def save_csv(rows: Iterable[RequestRow], path: str | Path) -> int:
    """``write_csv`` to a file; an OSError propagates (the caller names the file)."""
    with open(path, "w", newline="", encoding="utf-8") as out:
        return write_csv(rows, out)


def describe(row: RequestRow) -> str:
    """One line: ``req-17 e2e 9,210.4 ms = queue 8,000.0 + load 12.0 + ... ; tokens: ...``."""
    parts = " + ".join(f"{p} {v:,.1f}" for p, v in zip(PHASES, row.phases, strict=True) if v)
    e2e = "unfinished" if row.e2e_ms is None else f"e2e {row.e2e_ms:,.1f} ms"
    ttft = "-" if row.ttft_ms is None else f"{row.ttft_ms:,.1f}"
    found = ", ".join(f"{s} {v:,}" for s, v in zip(SOURCES, row.sources, strict=True) if v)
    decided = ", ".join(f"{h} {a}" for h, a in zip(HOOKS, row.answers, strict=True)
                        if a and h in ("admission", "lookup_mode", "on_arrival"))
    pre = f", {row.preemptions} preemptions" if row.preemptions else ""
    pre += f", {row.async_lookups} async lookups" if row.async_lookups else ""
    return (f"{row.request}: {e2e} (TTFT {ttft} ms, {row.output_tokens:,} output tokens{pre}) = {parts or '0'} ms; "
            f"prompt {row.prompt_tokens:,} tokens: {found}" + (f"; {decided}" if decided else ""))
