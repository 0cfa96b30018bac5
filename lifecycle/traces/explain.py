"""One request's life, in readable lines: each state, how long, and why; or, briefly, where
its time went, and which requests were slowest.

The "why" is what the trace recorded: the reason the engine gave for each transition and
the decisions the policies gave (policy, value, reason) while the request was there.
The brief forms (``--brief``, ``--slowest N``) are the per-request rows of
``kvlife.lifecycle.breakdown`` (what ``kvlife run --requests-out`` writes), made from the
trace: its transition records for the phases, an exact replay for the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvlife.lifecycle.breakdown import PHASES, SOURCES, PhaseClock, RequestRow, describe, row_of, slowest
from kvlife.lifecycle.traces.export import Timeline, read_timeline
from kvlife.lifecycle.traces.trace import TraceError, iter_lines, parse_record
from kvlife.policies.base import HOOKS


def _ms(value: float) -> str:
    return f"{value:,.1f} ms"


def _detail(record: dict[str, Any]) -> str | None:
    kind = record.get("kind")
    if kind == "decision":
        return (f"decision {record.get('point')}: {record.get('value')!r} by {record.get('policy')} "
                f"- {record.get('reason')}")
    if kind == "job":
        tiers_field = record.get("tiers")
        tiers = ", ".join(f"{k} {v}" for k, v in tiers_field.items()) if isinstance(tiers_field, dict) else ""
        return f"{record.get('op')} job {record.get('job')} started: {record.get('blocks')} blocks ({tiers})"
    if kind in ("reclaim", "abandon"):
        what = "reclaimed" if kind == "reclaim" else "abandoned"
        return f"{record.get('op')} job {record.get('job')} {what} - {record.get('reason')}"
    if kind == "stale_lookup":
        return (f"stale lookup answer (epoch {record.get('epoch')}, current {record.get('current_epoch')}) "
                f"dropped")
    if kind == "warning":
        fields = {k: v for k, v in record.items() if k not in ("kind", "t", "what", "req")}
        return f"warning {record.get('what')} {fields if fields else ''}".rstrip()
    if kind == "input":
        typ = record.get("type")
        if typ == "lookup_answer":
            found = record.get("tiers")
            answer = "failed" if not isinstance(found, list) else f"{len(found)} blocks in tiers"
            return f"lookup answer for epoch {record.get('epoch')}: {answer}"
        if typ == "abort":
            return "client abort"
        if typ == "transfer_report":
            failed = record.get("failed")
            failed = failed if isinstance(failed, list) else []
            return (f"rank {record.get('rank')} reported job {record.get('job_id')}"
                    f"{f': {len(failed)} failed blocks' if failed else ''}")
        if typ == "step_output":
            return f"step {record.get('step_id')} output: finished"
    return None


def explain_lines(timeline: Timeline, request_id: str, path: str = "trace") -> list[str]:
    segments = timeline.segments.get(request_id)
    if segments is None:
        known = ", ".join(list(timeline.segments)[:5])
        raise TraceError(path, None, f"request {request_id!r} is not in the trace (e.g. {known})")
    arrival = timeline.arrivals.get(request_id, {})
    config = timeline.header.get("config") or {}  # checked by read_timeline: a dict, when there is one
    bt = (config.get("engine") or {}).get("block_tokens")
    tokens = arrival.get("prompt_tokens")
    blocks = f", {tokens // bt} full blocks" if isinstance(tokens, int) and isinstance(bt, int) else ""
    start = segments[0].start
    out = [f"{request_id}: arrived at t={start:,.1f} ms with {tokens} prompt tokens{blocks}"]
    records = timeline.records.get(request_id, [])
    totals: dict[str, float] = {}
    for seg in segments:
        end = seg.end
        if seg.state == "finished":
            out.append(f"  t={seg.start:>12,.1f}  finished")
            # Its jobs may outlive it: a transfer reclaimed at its deadline after an abort.
            for line, record in records:
                if line > seg.start_line and record.get("kind") == "reclaim":
                    out.append(f"  {'':14}    . t={record.get('t', 0.0):,.1f}: {_detail(record)}")
            break
        duration = (end if end is not None else timeline.end_t) - seg.start
        totals[seg.state] = totals.get(seg.state, 0.0) + duration
        still = "" if end is not None else " (still there when the trace ends)"
        out.append(f"  t={seg.start:>12,.1f}  {seg.state:<15} {_ms(duration):>12}{still}")
        for line, record in records:
            t = record.get("t", 0.0)
            in_segment = seg.start_line <= line and (seg.end_line is None or line < seg.end_line)
            if record.get("kind") in ("transition", "header") or not in_segment:
                continue
            if record.get("kind") == "input" and record.get("type") == "arrival":
                continue
            detail = _detail(record)
            if detail:
                out.append(f"  {'':14}    . t={t:,.1f}: {detail}")
        if end is not None:
            out.append(f"  {'':14}    -> {seg.left_by}: {seg.reason}")
    total = sum(totals.values())
    out.append("time by state: " + ", ".join(f"{k} {_ms(v)}" for k, v in totals.items())
               + f"; total {_ms(total)}")
    return out


def explain(trace: str | Path, request_id: str) -> list[str]:
    return explain_lines(read_timeline(trace), request_id, str(trace))


def trace_rows(trace: str | Path, *, allow_code: bool = False, stack: Sequence[str] | None = None) -> list[RequestRow]:
    """One row per request of ``trace`` (``breakdown.RequestRow``), in arrival order: the
    phases from its transition records, the rest from an exact replay (which must match;
    ``allow_code`` and ``stack`` as ``kvlife.lifecycle.traces.replay.replay`` takes them)."""
    from kvlife.lifecycle.traces.replay import replay

    p = str(trace)
    result = replay(trace, allow_code=allow_code, stack=stack)
    if result.divergence is not None:
        raise TraceError(p, result.divergence.line, "the trace does not replay exactly here, and the per-request "
                                                    "figures come from its replay (kvlife replay says more)")
    clock = PhaseClock()
    end = 0.0
    for number, raw in iter_lines(trace):
        record = parse_record(p, number, raw)
        t = record.get("t")
        if isinstance(t, (int, float)) and not isinstance(t, bool):
            end = max(end, float(t))
        if record["kind"] in ("transition", "input"):
            clock.record(record)  # replayed byte for byte: engine records, well formed
    requests = sorted(result.engine.requests.values(), key=lambda r: r.seq)
    return [row_of(req, clock, end) for req in requests]


def brief_line(trace: str | Path, request_id: str, **replay_options: Any) -> str:
    """``describe`` of one request's row."""
    rows = trace_rows(trace, **replay_options)
    for row in rows:
        if row.request == request_id:
            return describe(row)
    known = ", ".join(r.request for r in rows[:5])
    raise TraceError(str(trace), None, f"request {request_id!r} is not in the trace (e.g. {known})")


def slowest_table(rows: Sequence[RequestRow], n: int, by: str = "e2e") -> list[list[str]]:
    """The ``n`` slowest requests as table rows (header first): latencies, phases, prompt
    tokens by source and the admission answer."""
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:,.1f}"

    header = ["request", "e2e ms", "ttft ms", *(f"{p} ms" for p in PHASES), "preempt", "lookups", "prompt",
              *SOURCES, "admission"]
    table = [header]
    for row in slowest(rows, n, by):
        table.append([row.request, ms(row.e2e_ms), ms(row.ttft_ms), *(ms(v) for v in row.phases),
                      str(row.preemptions), str(row.async_lookups), f"{row.prompt_tokens:,}",
                      *(f"{v:,}" for v in row.sources), row.answers[HOOKS.index("admission")] or "-"])
    return table
