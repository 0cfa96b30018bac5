"""Validate a trace from any source (simulator, live runtime, another tool) against the spec.

Every line is checked; the first offending line is named and the rest are still checked
and counted. Format problems (non-JSON, unknown kinds, bad input events, time going
backwards) are findings of "invariant 0"; spec and invariant checks (1-7; 6 only when
the stack shares loads) come from the independent observer in ``kvlife.specs.invariants``;
records missing or repeated (an input without the records it must cause, step ids, repeated
decisions, frees and evictions, tier capacities, the header's request count) from
``kvlife.lifecycle.traces.structure`` (invariants 0 and 8).
A truncated last line (a crash mid-write) is reported and everything before it is still
used; the end-of-run checks (invariant 7) are skipped then, since the run did not end.
A run cut short by Ctrl-C or SIGTERM ends with an ``interrupted`` record: the work open at
the cut is not held to invariants 3 and 7 (a note says how much), everything before the
cut is checked as usual, and a record after it is a finding.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import orjson

from kvlife.lifecycle.config import EngineConfig, RunConfig
from kvlife.lifecycle.engine.events import BadEvent, input_from_record
from kvlife.lifecycle.traces.header import header_config, recovered_slots, workload_size
from kvlife.lifecycle.traces.inputs import check_input_values
from kvlife.lifecycle.traces.structure import TraceStructure
from kvlife.lifecycle.traces.trace import KNOWN_KINDS, TraceError, iter_lines, parse_header
from kvlife.specs.invariants import INVARIANTS, InvariantObserver, Settings, Violation

# Checkable from trace records alone; 6 only applies when the stack shares loads, and 8
# from the records (frees, evictions, tier capacities: kvlife.lifecycle.traces.structure),
# not from the pools' counters, which a trace does not hold.
CHECKED_FROM_TRACE = (0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12)
# Stacks that join in-flight loads, recognised by name in the header (no policy code is
# imported to validate a trace).
SHARING_POLICIES = frozenset({"shared-loads"})


@attrs.frozen
class ValidationReport:
    path: str
    lines: int
    findings: tuple[Violation, ...]
    truncated_line: int | None
    notes: tuple[str, ...] = ()
    sharing: bool = False
    skipped: tuple[int, ...] = ()  # not (fully) checkable: the trace lacks their records

    @property
    def checked(self) -> tuple[int, ...]:
        return tuple(i for i in CHECKED_FROM_TRACE if (i != 6 or self.sharing) and i not in self.skipped)

    @property
    def ok(self) -> bool:
        return not self.findings

    def counts(self) -> dict[int, int]:
        return dict(sorted(Counter(f.invariant for f in self.findings).items()))

    def format(self, limit: int = 20) -> str:
        out = [f"{self.path}: {self.lines:,} lines, {len(self.findings):,} findings"]
        out += [f"note: {n}" for n in self.notes]
        if self.truncated_line is not None:
            out.append(f"line {self.truncated_line}: truncated last line (crash mid-write?); "
                       f"the lines before it were used")
        if self.findings:
            out.append(f"first offending line: {self.findings[0]}")
            for inv, n in self.counts().items():
                out.append(f"  invariant {inv} ({INVARIANTS.get(inv, '?')}): {n:,}")
            for f in self.findings[:limit]:
                out.append(f"  {f}")
            if len(self.findings) > limit:
                out.append(f"  ... {len(self.findings) - limit:,} more")
        else:
            checked = ", ".join(str(i) for i in self.checked)
            why = []
            if self.skipped:
                why.append(f"{', '.join(map(str, self.skipped))} not (fully) checked: see the notes")
            if not self.sharing and 6 not in self.skipped:
                why.append("6 not checked: the stack does not share loads (--sharing on)")
            why.append("8 from the records: frees, evictions and tier capacities")
            why.append("7's progress rule (no preemption of a request a step in flight computes) needs every "
                       "step's requests: checked live (kvlife check, --check), not from a trace")
            out.append(f"valid: every transition legal; invariants {checked} hold ({'; '.join(why)})")
        return "\n".join(out)


def sharing_from_header(header: dict[str, Any]) -> bool:
    """Does the recorded stack join in-flight loads (invariant 6 applies)?"""
    names: list[Any] = []
    for source in (header.get("policies"), (header.get("config") or {}).get("policies")):
        if isinstance(source, list):
            names += source
    return any(isinstance(n, str) and n in SHARING_POLICIES for n in names)


def trace_settings(config: EngineConfig, sharing: bool, recorded: bool) -> Settings:
    """The observers' settings for a trace of ``config`` (``recorded``: a recording of
    another connector, source "vllm:...", which has no hold_at_finish decisions and whose
    worker may store a step's blocks after its forward pass)."""
    return Settings.of(config, live=False, sharing=sharing, finish_after_stores=not recorded,
                       stores_after_forward=recorded)


def validate(path: str | Path, sharing: bool | None = None) -> ValidationReport:
    """``sharing``: check invariant 6; None decides from the header's policy stack. The
    trace is read as a stream (one line ahead, to recognise a truncated last line), so
    memory does not grow with its length."""
    p = str(path)
    lines = iter_lines(path)
    first = next(lines, None)
    if first is None:
        raise TraceError(p, None, "empty trace: missing header")
    # A crash mid-write leaves a last line that is not JSON and has no newline.
    following = next(lines, None)
    if following is None and not lines.ended_with_newline and _truncated(first[1]):
        raise TraceError(p, first[0], "missing header: the only line is truncated")
    findings: list[Violation] = []
    notes: list[str] = []
    number, raw = first
    header: dict[str, Any] | None
    try:
        header = parse_header(p, number, raw)
    except TraceError as exc:
        if "missing header" not in str(exc):
            raise  # a header that is wrong (another schema, a value JSON cannot hold): bad input
        findings.append(Violation(0, str(exc).split(": ", 1)[-1], number))
        header = None
    # A header's config is checked as a config file is (bad values are bad input, exit 2);
    # a trace from another tool may have none.
    run_config = header_config(header, p, number, required=False) if header is not None else None
    body_first: tuple[int, bytes] | None = following
    if header is not None:
        lines.bound_by(header)
        if run_config is None:
            findings.append(Violation(0, "field 'config': missing from the header", number))
    else:
        body_first = first  # no header: every line is a record
        following = None
    if run_config is not None:
        config = run_config.engine
    else:
        config = EngineConfig()
        notes.append(f"no usable header: assuming {config.ranks} rank(s) and {config.block_tokens}-token blocks")
    if sharing is None:
        sharing = sharing_from_header(header) if header is not None else False
    sharing = bool(sharing)
    recorded = str((header or {}).get("source", "")).startswith("vllm:")  # another connector's records
    observer = InvariantObserver(trace_settings(config, sharing, recorded))
    structure = _structure(header, run_config, p, number)
    if header is not None and run_config is not None:
        for tier, slots in recovered_slots(header, run_config, p, number).items():
            observer.seed_tier(tier, [block for block, _slot in slots])
    last_t = float("-inf")
    truncated: int | None = None
    last_used = number
    body = _with_first(body_first, lines) if body_first is not None else iter(())
    pending = next(body, None)
    while pending is not None:
        number, raw = pending
        pending = next(body, None)
        if pending is None and not lines.ended_with_newline and _truncated(raw):
            truncated = number
            break
        last_used = number
        try:
            record = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            findings.append(Violation(0, f"not JSON: {exc}", number))
            continue
        kind = record.get("kind") if isinstance(record, dict) else None
        if not isinstance(kind, str) or kind not in KNOWN_KINDS or kind == "header":
            what = "a second header" if kind == "header" else f"unknown record kind {kind!r}"
            findings.append(Violation(0, what, number))
            continue
        assert isinstance(record, dict)
        if kind == "input":
            problem = _input_problem(record)
            if problem is not None:
                findings.append(Violation(0, f"bad input record: {problem}", number))
                continue
            t = record.get("t")
            if isinstance(t, (int, float)) and not isinstance(t, bool):
                if t < last_t:
                    findings.append(Violation(0, f"time went backwards: {t} after {last_t}", number))
                last_t = max(last_t, float(t))
        if kind == "step":
            problem = _chunk_problem(record, config)
            if problem is not None:
                findings.append(Violation(0, problem, number))
                continue
        if structure is not None:
            structure.feed(record, number)
        before = len(observer.violations)
        observer.feed_record(record, number)
        findings.extend(observer.violations[before:])
    before = len(observer.violations)
    if truncated is None:
        observer.finish()
    else:
        observer.end_input()
    findings.extend(observer.violations[before:])
    if structure is not None:
        structure.finish(complete=truncated is None)
        findings.extend(structure.findings)
        notes += structure.notes
    findings.sort(key=lambda f: (f.line is None, f.line or 0))
    notes += observer.unchecked
    skipped = set(observer.skipped) | ({8} if structure is None else structure.skipped)
    if structure is None:
        notes.append("records of another connector, or no usable header: invariant 8 (frees, evictions, tier "
                     "capacities) and the record counts were not checked")
    return ValidationReport(p, last_used, tuple(findings), truncated, tuple(notes), sharing, tuple(sorted(skipped)))


def _with_first(first: tuple[int, bytes], rest: Iterator[tuple[int, bytes]]) -> Iterator[tuple[int, bytes]]:
    yield first
    yield from rest


def _truncated(raw: bytes) -> bool:
    """A last line without its newline that is not JSON: the run stopped mid-write."""
    try:
        orjson.loads(raw)
    except orjson.JSONDecodeError:
        return True
    return False


def _structure(header: dict[str, Any] | None, config: RunConfig | None, path: str,
               line: int) -> TraceStructure | None:
    """The structure check for a kvlife trace (``kvlife.lifecycle.traces.structure``); None
    for a trace without a usable header or recorded from another connector."""
    if header is None or config is None or str(header.get("source", "")).startswith("vllm:"):
        return None
    capacities = {t.name: t.capacity_blocks for t in config.engine.tiers}
    recovered = {tier: [block for block, _slot in slots]
                 for tier, slots in recovered_slots(header, config, path, line).items()}
    return TraceStructure(capacities, workload_size(header, path, line), recovered)


def _input_problem(record: dict[str, Any]) -> str | None:
    """A value check the observer does not make (``kvlife.lifecycle.traces.inputs``); a
    record whose fields or types are wrong is left to the observer, which says so."""
    try:
        event = input_from_record(record)
    except BadEvent:
        return None
    try:
        check_input_values(event)
    except BadEvent as exc:
        return str(exc)
    return None


def _chunk_problem(record: dict[str, Any], config: EngineConfig) -> str | None:
    """A step's chunk (``[request, computed_before, tokens]`` in ``prompt`` and ``fills``) that
    no engine could have scheduled: negative, or reaching past what the device holds (a
    request's KV fits the device). The observer would otherwise follow it, naming the
    blocks up to that token one by one."""
    limit = config.device_blocks * config.block_tokens
    for field in ("prompt", "fills"):
        chunks = record.get(field)
        if not isinstance(chunks, list):
            continue
        for chunk in chunks:
            if not (isinstance(chunk, list) and len(chunk) == 3):
                continue  # the observer reports the shape
            before, tokens = chunk[1], chunk[2]
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in (before, tokens)):
                continue
            if before < 0 or tokens < 0 or before + tokens > limit:
                return (f"step {record.get('step')}: field '{field}': chunk {chunk} is outside 0..{limit:,} tokens "
                        f"(the device's {config.device_blocks:,} blocks x {config.block_tokens:,} tokens)")
    return None
