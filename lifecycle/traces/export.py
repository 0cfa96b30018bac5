"""Timelines from a trace: per-request state segments, and their Perfetto/Chrome export.

``read_timeline`` folds the records into what every view needs (state segments per
request, steps, transfer jobs, ticks); ``chrome_trace`` turns that into Chrome trace
event JSON, which ui.perfetto.dev and chrome://tracing open: one track per request with
one slice per state, plus tracks for scheduler ticks/steps and transfer jobs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import orjson

from kvlife.lifecycle.traces.header import header_config
from kvlife.lifecycle.traces.trace import TraceError, parse_record, read_header


@attrs.define
class Segment:
    state: str
    start: float
    end: float | None = None  # None: still in this state when the trace ends
    left_by: str | None = None  # trigger that ended it
    reason: str | None = None  # why it ended (the engine's reason)
    start_line: int = 0  # trace lines: records between them happened in this state
    end_line: int | None = None


@attrs.define
class Span:
    name: str
    start: float
    end: float | None
    args: dict[str, Any]


@attrs.define
class Timeline:
    header: dict[str, Any]
    end_t: float
    segments: dict[str, list[Segment]]  # request -> states in order
    arrivals: dict[str, dict[str, Any]]  # request -> arrival input record
    steps: list[Span]
    jobs: list[Span]
    ticks: list[float]
    records: dict[str, list[tuple[int, dict[str, Any]]]]  # request -> (line, record) about it


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def read_timeline(path: str | Path) -> Timeline:
    """Fold a trace into its timeline. The header's config, when there is one, is checked
    as a config file is; a record whose fields have the wrong types is a TraceError naming
    its line and field, never a traceback."""
    p = str(path)
    header, header_line, lines = read_header(path)
    header_config(header, p, header_line, required=False)
    segments: dict[str, list[Segment]] = {}
    arrivals: dict[str, dict[str, Any]] = {}
    records: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    steps: dict[int, Span] = {}
    jobs: dict[int, Span] = {}
    job_owner: dict[int, str] = {}
    ticks: list[float] = []
    end_t = 0.0
    for number, raw in lines:
        record = parse_record(p, number, raw)
        kind = record["kind"]
        t = record.get("t")
        if not isinstance(t, (int, float)) or isinstance(t, bool):
            raise TraceError(p, number, f"field 't': expected a number, got {t!r}")
        t = float(t)
        end_t = max(end_t, t)
        rid = record.get("req")
        if kind == "input":
            typ = record.get("type")
            rid = record.get("request_id")
            if typ == "arrival" and isinstance(rid, str) and rid not in arrivals:
                arrivals[rid] = record
                segments[rid] = [Segment("waiting", t, start_line=number)]
            elif typ == "tick":
                ticks.append(t)
            elif typ == "step_output":
                step = _int(record.get("step", record.get("step_id")))
                span = steps.get(step) if step is not None else None
                if span is not None and span.end is None:
                    span.end = t
                finished = record.get("finished")
                if finished is not None and not isinstance(finished, list):
                    raise TraceError(p, number, "field 'finished': expected a list of [request_id, reason] pairs")
                for pair in finished or ():
                    if isinstance(pair, list) and pair and isinstance(pair[0], str):
                        records.setdefault(pair[0], []).append((number, record))
            elif typ == "transfer_report":
                job_id = _int(record.get("job_id"))
                owner = job_owner.get(job_id) if job_id is not None else None
                if owner is not None:
                    records.setdefault(owner, []).append((number, record))
        elif kind == "transition" and isinstance(rid, str):
            segs = segments.setdefault(rid, [Segment(str(record.get("from")), t, start_line=number)])
            segs[-1].end = t
            segs[-1].end_line = number
            segs[-1].left_by = _text(record.get("trigger"))
            segs[-1].reason = _text(record.get("reason"))
            segs.append(Segment(str(record.get("to")), t, start_line=number))
        elif kind == "step":
            step = _int(record.get("step"))
            if step is not None:
                steps[step] = Span(f"step {step}", t, None, {k: record.get(k) for k in
                                                              ("requests", "prefill_tokens", "sync_lookups")})
        elif kind == "job":
            job = _int(record.get("job"))
            if job is not None:
                jobs[job] = Span(f"{record.get('op')} {job}", t, None,
                                 {"req": rid, "blocks": record.get("blocks"), "tiers": record.get("tiers")})
                if isinstance(rid, str):
                    job_owner[job] = rid
        elif kind == "job_done":
            job = _int(record.get("job"))
            span = jobs.get(job) if job is not None else None
            if span is not None:
                span.end = t
                span.args.update(failed=record.get("failed"), late=record.get("late"))
        elif kind == "reclaim":  # a job some rank never reported ends at its reclaim deadline
            job = _int(record.get("job"))
            span = jobs.get(job) if job is not None else None
            if span is not None and span.end is None:
                span.end = t
                span.args.update(reclaimed=True, silent_ranks=record.get("ranks"))
        if isinstance(rid, str):
            records.setdefault(rid, []).append((number, record))
    return Timeline(header, end_t, segments, arrivals, list(steps.values()), list(jobs.values()), ticks, records)


def _text(value: Any) -> str | None:
    return value if value is None or isinstance(value, str) else str(value)


def _us(t_ms: float) -> float:
    return round(t_ms * 1000.0, 3)


def chrome_trace(timeline: Timeline) -> dict[str, Any]:
    """Chrome trace event format (JSON object form), timestamps in microseconds."""
    events: list[dict[str, Any]] = []

    def meta(pid: int, tid: int | None, name: str, sort: int | None = None) -> None:
        if tid is None:
            events.append({"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}})
        else:
            events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}})
            if sort is not None:
                events.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_sort_index",
                               "args": {"sort_index": sort}})

    meta(1, None, "scheduler")
    meta(1, 1, "ticks", 0)
    meta(1, 2, "steps", 1)
    for t in timeline.ticks:
        events.append({"ph": "i", "s": "t", "pid": 1, "tid": 1, "name": "tick", "ts": _us(t)})
    for span in timeline.steps:
        end = span.end if span.end is not None else timeline.end_t
        events.append({"ph": "X", "pid": 1, "tid": 2, "name": span.name, "ts": _us(span.start),
                       "dur": _us(end - span.start), "args": span.args})
    meta(2, None, "transfer jobs")
    lanes: list[float] = []  # end time of the last job on each lane
    for span in sorted(timeline.jobs, key=lambda s: s.start):
        end = span.end if span.end is not None else timeline.end_t
        lane = next((i for i, busy in enumerate(lanes) if busy <= span.start), None)
        if lane is None:
            lane = len(lanes)
            lanes.append(end)
            meta(2, lane + 1, f"jobs lane {lane}", lane)
        lanes[lane] = end
        events.append({"ph": "X", "pid": 2, "tid": lane + 1, "name": span.name, "ts": _us(span.start),
                       "dur": _us(end - span.start), "args": span.args})
    meta(3, None, "requests")
    for tid, (rid, segs) in enumerate(timeline.segments.items(), 1):
        meta(3, tid, rid, tid)
        for seg in segs:
            if seg.state == "finished":
                events.append({"ph": "i", "s": "t", "pid": 3, "tid": tid, "name": "finished",
                               "ts": _us(seg.start)})
                continue
            end = seg.end if seg.end is not None else timeline.end_t
            events.append({"ph": "X", "pid": 3, "tid": tid, "name": seg.state, "ts": _us(seg.start),
                           "dur": _us(end - seg.start),
                           "args": {"left_by": seg.left_by, "reason": seg.reason}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"policies": timeline.header.get("policies"), "seed": timeline.header.get("seed")}}


def export_perfetto(trace: str | Path, out: str | Path) -> int:
    """Write the Chrome trace JSON (through a temporary file renamed over ``out``, which
    may not be the trace itself); returns the number of events."""
    from kvlife.lifecycle.output_files import check_output, write_output

    check_output(out, (trace,))  # before reading: the trace is what would be overwritten
    data = chrome_trace(read_timeline(trace))
    try:
        write_output(out, orjson.dumps(data), (trace,))
    except OSError as exc:
        raise TraceError(str(out), None, f"cannot write: {exc.strerror}") from None
    return len(data["traceEvents"])


# ---- OpenTelemetry (OTLP/JSON) -------------------------------------------------------------
# OTLP's JSON encoding (opentelemetry-proto, ``ExportTraceServiceRequest``; the OTLP spec,
# "JSON Protobuf Encoding"): lowerCamelCase field names, trace and span ids as hex strings,
# 64-bit integers as decimal strings, enums as numbers.
SPAN_KIND_INTERNAL = 1  # opentelemetry.proto.trace.v1.Span.SpanKind
STATUS_OK, STATUS_ERROR = 1, 2  # opentelemetry.proto.trace.v1.Status.StatusCode


def _otlp_value(value: Any) -> dict[str, Any] | None:
    """An attribute value as OTLP's AnyValue (None: not representable, left out)."""
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    if isinstance(value, float):
        return {"doubleValue": value} if value == value and abs(value) != float("inf") else None
    if isinstance(value, str):
        return {"stringValue": value}
    if value is None:
        return None
    return {"stringValue": orjson.dumps(value).decode()}


def _attributes(pairs: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for key, value in pairs.items():
        encoded = _otlp_value(value)
        if encoded is not None:
            out.append({"key": key, "value": encoded})
    return out


def _span_id(*parts: object, size: int = 8) -> str:
    """A deterministic non-zero id (hex) from ``parts``: the same trace exports the same ids."""
    import hashlib

    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=size).digest()
    return digest.hex() if any(digest) else "01" * size


# Where simulated time 0 lands on the wall clock in an OTLP export: 2024-01-01T00:00:00Z
# (a fixed instant, so an export is deterministic; collectors refuse a start time of 0).
OTLP_EPOCH_NS = 1_704_067_200 * 1_000_000_000


def _nanos(t_ms: float) -> str:
    return str(OTLP_EPOCH_NS + round(t_ms * 1_000_000))


def otlp_traces(trace: str | Path, *, allow_code: bool = False, stack: Any = None) -> dict[str, Any]:
    """The trace as one OTLP ``ExportTraceServiceRequest`` (JSON): per request, a span
    ``request REQ`` from arrival to the end of its life, with its latencies, phases
    (``kvlife.lifecycle.breakdown``), prompt tokens by source and its policies' last answers
    as attributes, a child span per state it was in (the trigger and reason that ended it as
    attributes), and each policy decision as an event on the state span it happened in.
    Each request is its own OTel trace. Times are the run's simulated time, its 0 put at
    ``OTLP_EPOCH_NS`` (2024-01-01T00:00:00Z: a simulated run has no wall clock).
    ``allow_code``/``stack``: the replay the per-request figures come from
    (``explain.trace_rows``)."""
    from kvlife.lifecycle.breakdown import PHASES, SOURCES
    from kvlife.lifecycle.traces.explain import trace_rows
    from kvlife.policies.base import HOOKS

    timeline = read_timeline(trace)
    rows = {row.request: row for row in trace_rows(trace, allow_code=allow_code, stack=stack)}
    header = timeline.header
    seed = header.get("seed")
    spans: list[dict[str, Any]] = []
    for rid, segments in timeline.segments.items():
        row = rows.get(rid)
        trace_id = _span_id("kvlife", seed, rid, size=16)
        root_id = _span_id(rid, "request")
        start = segments[0].start
        last = segments[-1]
        end = last.start if last.state == "finished" else timeline.end_t
        attrs_: dict[str, Any] = {"kvlife.request.id": rid}
        if row is not None:
            attrs_.update({
                "kvlife.request.finish_reason": row.finish_reason or None,
                "kvlife.request.prompt_tokens": row.prompt_tokens,
                "kvlife.request.output_tokens": row.output_tokens,
                "kvlife.request.preemptions": row.preemptions,
                "kvlife.latency.ttft_ms": row.ttft_ms, "kvlife.latency.tpot_ms": row.tpot_ms,
                "kvlife.latency.e2e_ms": row.e2e_ms,
                **{f"kvlife.phase.{p}_ms": v for p, v in zip(PHASES, row.phases, strict=True)},
                **{f"kvlife.prompt_tokens_by_source.{s}": v for s, v in zip(SOURCES, row.sources, strict=True)},
                **{f"kvlife.policy.{h}": a or None for h, a in zip(HOOKS, row.answers, strict=True)},
            })
        failed = row is not None and row.finish_reason in ("error", "aborted")
        spans.append({"traceId": trace_id, "spanId": root_id, "name": f"request {rid}",
                      "kind": SPAN_KIND_INTERNAL, "startTimeUnixNano": _nanos(start),
                      "endTimeUnixNano": _nanos(end), "attributes": _attributes(attrs_),
                      "status": {"code": STATUS_ERROR if failed else STATUS_OK}})
        records = timeline.records.get(rid, [])
        for index, seg in enumerate(segments):
            if seg.state == "finished":
                continue
            seg_end = seg.end if seg.end is not None else timeline.end_t
            events = []
            for line, record in records:
                if record.get("kind") != "decision" or line < seg.start_line or \
                        (seg.end_line is not None and line >= seg.end_line):
                    continue
                events.append({"timeUnixNano": _nanos(float(record.get("t", seg.start))),
                               "name": f"decision {record.get('point')}",
                               "attributes": _attributes({"kvlife.policy": record.get("policy"),
                                                          "kvlife.answer": record.get("value"),
                                                          "kvlife.reason": record.get("reason")})})
            span = {"traceId": trace_id, "spanId": _span_id(rid, "state", index), "parentSpanId": root_id,
                    "name": seg.state, "kind": SPAN_KIND_INTERNAL, "startTimeUnixNano": _nanos(seg.start),
                    "endTimeUnixNano": _nanos(seg_end),
                    "attributes": _attributes({"kvlife.state.left_by": seg.left_by,
                                               "kvlife.state.reason": seg.reason})}
            if events:
                span["events"] = events
            spans.append(span)
    resource = _attributes({"service.name": "kvlife", "kvlife.trace": str(trace), "kvlife.seed": seed,
                            "kvlife.policies": ",".join(p for p in header.get("policies") or [] if isinstance(p, str))})
    return {"resourceSpans": [{"resource": {"attributes": resource},
                               "scopeSpans": [{"scope": {"name": "kvlife"}, "spans": spans}]}]}


def export_otlp(trace: str | Path, out: str | Path, **replay_options: Any) -> int:
    """Write ``otlp_traces`` as JSON (what an OTLP/HTTP collector takes at /v1/traces);
    returns the number of spans."""
    data = otlp_traces(trace, **replay_options)
    try:
        Path(out).write_bytes(orjson.dumps(data))
    except OSError as exc:
        raise TraceError(str(out), None, f"cannot write: {exc.strerror}") from None
    return len(data["resourceSpans"][0]["scopeSpans"][0]["spans"])
