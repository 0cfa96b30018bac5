"""Fuzz the trace-file surface: mutated and garbled traces given to validate, replay, explain and export.

The invariant, whatever the file holds: the command returns (within a time bound) with exit
code 0, 1 or 2, never a traceback; an exit 2 is one line, ``kvlife: error: FILE:LINE: ...``,
that names the trace file and, when the problem is a value, its line and field.

A mutated real trace is also held to what its mutation did (``expect_reported``), with
``validate`` and ``replay`` as the two readers that judge a trace: ``validate`` checks it
against the spec, ``replay`` re-derives every record the engine wrote from the header and
the inputs. Each mutation is classified from the bytes before and after, and each class
says which exit codes it may give (``hypothesis.event`` counts the classes):

- ``unchanged``: every line re-reads as the same JSON (a value replaced by itself, a swap
  of a line with itself, a cut or flip that left the line equal), lines of white space only
  left out (every reader skips them): both commands exit 0.
- ``outputs``: a record the engine wrote changed, or lines were added, removed or
  reordered: ``replay`` must report it (1 or 2), since it re-derives each of those records.
  ``validate`` is not required to: a changed reason text or an added key is no spec
  violation; whether it reported is counted as an event.
- ``header or inputs``: only the header or input records changed. Either command reports
  it, or the change did not matter to this run: ``replay`` reproduces every record (a tier
  no request reached, a block hash nobody shared, a descriptive header field), and then the
  trace is the true record of a run and ``validate`` must accept it too (exit 0).

The default suite runs a few dozen examples per test (a few seconds in all);
``pytest tests/test_trace_fuzz.py --hypothesis-profile=deep`` runs the deep profile's count.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import re
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any, NamedTuple

import pytest
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from kvlife.lifecycle.cli.main import main
from kvlife.lifecycle.config import EngineConfig, RunConfig, TierConfig
from kvlife.lifecycle.drivers.runner import run_workload
from kvlife.lifecycle.workloads.mooncake import WorkloadRequest

COMMAND_SECONDS = 20  # a command on a few-hundred-line trace takes milliseconds: past this it hangs
# Problems with a whole line (or file) rather than one of its values: no field to name.
WHOLE_LINE = ("not JSON", "missing header", "empty trace", "cannot read trace", "request ")


def _examples(default: int) -> int:
    """``default`` in the default profile; the loaded profile's count when it asks for more (deep)."""
    return max(default, settings.default.max_examples) if settings.default.max_examples > 100 else default


FUZZ = settings(max_examples=_examples(30), deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@functools.cache
def base_traces() -> tuple[tuple[bytes, ...], ...]:
    """Three small real traces: the default stack; async lookups with a host tier, two ranks
    and async scheduling (lookup answers, transfer reports, jobs); early prefetch into a
    small host tier from disk with a tight device and a transfer deadline (loads, prefetches)."""
    out = []
    configs = [
        RunConfig(),
        RunConfig(engine=EngineConfig(device_blocks=60, ranks=2, async_scheduling=True,
                                      tiers=(TierConfig("host", 200),)),
                  policies=("async-lookup", "shared-loads")),
        RunConfig(engine=EngineConfig(device_blocks=5, transfer_deadline_ms=3.0,
                                      tiers=(TierConfig("host", 4), TierConfig("disk", 100))),
                  policies=("early-prefetch",)),
    ]
    workloads = [
        [WorkloadRequest(f"req-{n}", 5.0 * n, 1100 + 300 * (n % 3), 3 + n % 4, (1, 2, 10 + n % 2)) for n in range(6)],
        # A prefix evicted from the 5-block device between its uses: the next use loads it.
        [WorkloadRequest(f"req-{n}", 300.0 * n, 1700, 3, (1, 2, 3) if n % 2 == 0 else (100 + n, 200 + n, 300 + n))
         for n in range(6)],
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for i, config in enumerate(configs):
            path = Path(tmp) / f"base{i}.jsonl"
            workload = workloads[i // 2]
            run_workload(config, workload, trace_path=path)
            out.append(tuple(path.read_bytes().splitlines()))
    return tuple(out)


# ---- values a crafted or broken trace may hold -----------------------------------------------
NASTY: st.SearchStrategy[Any] = st.one_of(
    st.sampled_from([0, -1, 1, 2, 10**8, 10**9, 2**63, -(2**63), 2**64 + 1, 10**30,
                     0.5, -0.0, 1e308, float("nan"), float("inf"), float("-inf"),
                     True, False, None, "", "x", "evil.py:P", "os:system", "/dev/zero", "line\nbreak", "\x1b[31m",
                     [], [1], [[1, 2]], ["a", "b"], {}, {"a": 1}]),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
)


def _dumps(value: Any) -> bytes:
    """JSON as a careless writer makes it: NaN and Infinity literals, big integers, any text."""
    return json.dumps(value, separators=(",", ":"), allow_nan=True).encode()


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every place in a JSON value: dict keys and list indexes, depth first."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield (*prefix, key)
            yield from _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield (*prefix, index)
            yield from _paths(item, (*prefix, index))


def _set(document: Any, path: tuple[Any, ...], value: Any, delete: bool) -> None:
    parent = document
    for part in path[:-1]:
        parent = parent[part]
    if delete:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value


class Mutated(NamedTuple):
    """A real trace (``base``) and the lines a mutation made of it."""

    base: tuple[bytes, ...]
    lines: list[bytes]


@st.composite
def value_mutation(draw: st.DrawFn, header: bool) -> Mutated:
    """A real trace with values replaced, deleted or added: in the header, or in one to
    three records."""
    base = draw(st.sampled_from(base_traces()))
    lines = list(base)
    for _ in range(1 if header else draw(st.integers(1, 3))):
        index = 0 if header else draw(st.integers(1, len(lines) - 1))
        try:
            document = json.loads(lines[index])
        except ValueError:
            continue
        places = [p for p in _paths(document) if not (header and p == ("kind",))]
        how = draw(st.sampled_from(["replace", "replace", "delete", "add"]))
        if how == "add" or not places:
            parents = [p for p in [(), *places] if isinstance(_get(document, p), dict)]
            if not parents:
                continue
            where = draw(st.sampled_from(parents))
            _set(document, (*where, draw(st.sampled_from(["zz", "kind", "t", "extra"]))), draw(NASTY), delete=False)
        else:
            where = draw(st.sampled_from(places))
            _set(document, where, draw(NASTY), delete=how == "delete")
        lines[index] = _dumps(document)
    return Mutated(base, lines)


def _get(document: Any, path: tuple[Any, ...]) -> Any:
    for part in path:
        document = document[part]
    return document


@st.composite
def garbled(draw: st.DrawFn) -> Mutated:
    """A real trace with lines deleted, duplicated, swapped, cut or overwritten with bytes."""
    base = draw(st.sampled_from(base_traces()))
    lines = list(base)
    for _ in range(draw(st.integers(1, 3))):
        if not lines:
            break
        i = draw(st.integers(0, len(lines) - 1))
        op = draw(st.sampled_from(["delete", "duplicate", "swap", "cut", "bytes", "flip"]))
        if op == "delete":
            del lines[i]
        elif op == "duplicate":
            lines.insert(i, lines[i])
        elif op == "swap":
            j = draw(st.integers(0, len(lines) - 1))
            lines[i], lines[j] = lines[j], lines[i]
        elif op == "cut":
            lines[i] = lines[i][: draw(st.integers(0, max(0, len(lines[i]) - 1)))]
        elif op == "bytes":
            lines[i] = draw(st.binary(max_size=40)).replace(b"\n", b"")
        elif lines[i]:
            at = draw(st.integers(0, len(lines[i]) - 1))
            lines[i] = lines[i][:at] + bytes([lines[i][at] ^ (1 << draw(st.integers(0, 7)))]) + lines[i][at + 1:]
            lines[i] = lines[i].replace(b"\n", b"")
    return Mutated(base, lines)


# ---- running the commands ------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def one_parser() -> Iterator[None]:
    """Build the argument parser once: main() builds it per call, which would cost more than
    the commands themselves on these small traces."""
    from kvlife.lifecycle.cli import main as cli

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cli, "build_parser", functools.cache(cli.build_parser))
        yield


class Hang(Exception):
    pass


def _alarm(_signum: int, _frame: FrameType | None) -> None:
    raise Hang(f"no answer within {COMMAND_SECONDS} s")


def run(argv: list[str]) -> tuple[int, str, str]:
    """main(argv) in process, bounded in time: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(COMMAND_SECONDS)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    return code, out.getvalue(), err.getvalue()


ERROR = re.compile(r"kvlife: error: (?P<path>.+?)(?::(?P<line>\d+))?: (?P<message>.*)")


def check_all_commands(lines: list[bytes]) -> dict[str, int]:
    """Every trace-reading command on these lines keeps the invariant (module docstring);
    their exit codes by command."""
    codes: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "t.jsonl"
        trace.write_bytes(b"\n".join(lines) + (b"\n" if lines else b""))
        commands = {
            "validate": (["validate", str(trace)], (0, 1, 2)),
            "replay": (["replay", str(trace)], (0, 1, 2)),
            "explain": (["explain", str(trace), "req-0"], (0, 2)),
            "export": (["export", str(trace), "--perfetto", str(Path(tmp) / "x.json")], (0, 2)),
        }
        for name, (argv, allowed) in commands.items():
            code, _out, err = run(argv)
            codes[name] = code
            assert code in allowed, (name, code, err)
            assert "Traceback" not in err, (name, err)
            if code != 2:
                continue
            assert err.count("\n") == 1 and err.endswith("\n"), (name, err)
            match = ERROR.fullmatch(err.rstrip("\n"))
            assert match is not None and match["path"] == str(trace), (name, err)
            message = match["message"]
            if not message.startswith(WHOLE_LINE):
                assert match["line"] is not None and "field '" in message, (name, err)
    return codes


def _reread(raw: bytes) -> bytes:
    """A line as the readers see it: its JSON written back the one way ``_dumps`` writes it
    (so a value replaced by an equal one is no change; ``1`` and ``true`` still differ). A
    float keeps its text: ``replay`` compares a record's bytes, and two spellings of one
    double (a flipped last digit past its 17th) are two records to it."""
    try:
        return _dumps(json.loads(raw, parse_float=lambda text: {"float literal": text}))
    except ValueError:
        return raw


def classify(mutated: Mutated) -> str:
    """The mutation's class (module docstring), from the lines before and after (a line of
    white space only is no record: every reader skips it, as ``Lines`` does)."""
    before = [_reread(raw) for raw in mutated.base if raw.strip()]
    after = [_reread(raw) for raw in mutated.lines if raw.strip()]
    if before == after:
        return "unchanged"
    if len(before) != len(after):
        return "outputs"
    changed = [i for i, (old, new) in enumerate(zip(before, after, strict=True)) if old != new]
    if all(i == 0 or json.loads(mutated.base[i]).get("kind") == "input" for i in changed):
        return "header or inputs"
    return "outputs"


def _event(text: str) -> None:
    """``hypothesis.event`` inside a Hypothesis test; nothing in a plain one."""
    if currently_in_test_context():
        event(text)


def _note(text: str) -> None:
    if currently_in_test_context():
        note(text)


def expect_reported(mutated: Mutated) -> None:
    """The invariant of every command, and the exit codes of ``validate`` and ``replay``
    that the mutation's class allows (module docstring)."""
    kind = classify(mutated)
    _event(kind)
    codes = check_all_commands(mutated.lines)
    validate, replay = codes["validate"], codes["replay"]
    _note(f"class {kind!r}: validate exit {validate}, replay exit {replay}")
    if kind == "unchanged":
        assert (validate, replay) == (0, 0), codes
    elif kind == "outputs":
        assert replay in (1, 2), f"replay reproduced a trace whose records were changed: {codes}"
        _event(f"outputs: validate exit {validate}")
    else:
        if replay == 0:
            assert validate == 0, f"validate rejects a trace replay reproduces record for record: {codes}"
            _event("header or inputs: a value this run never depended on")
        else:
            _event(f"header or inputs: validate exit {validate}, replay exit {replay}")


@FUZZ
@given(value_mutation(header=True))
def test_mutated_header_values(mutated: Mutated) -> None:
    expect_reported(mutated)


@FUZZ
@given(value_mutation(header=False))
def test_mutated_record_values(mutated: Mutated) -> None:
    expect_reported(mutated)


@FUZZ
@given(garbled())
def test_garbled_lines(mutated: Mutated) -> None:
    expect_reported(mutated)


def test_the_base_traces_are_valid_and_replay() -> None:
    """What the mutations start from: each real trace is valid and replays exactly, so a
    report on a mutated one is the mutation's doing."""
    for base in base_traces():
        assert check_all_commands(list(base)) == {"validate": 0, "replay": 0, "explain": 0, "export": 0}


@pytest.mark.parametrize(("name", "edit", "kind"), [
    ("a value replaced by itself", lambda r: r, "unchanged"),
    ("a transition's reason text", lambda r: {**r, "reason": "x"} if r["kind"] == "transition" else r, "outputs"),
    ("an input's time", lambda r: {**r, "t": r["t"] + 0.25} if r.get("type") == "arrival" else r, "header or inputs"),
])
def test_a_mutation_is_classified_by_what_it_changed(name: str, edit: Any, kind: str) -> None:
    """The classifier the fuzz tests rely on, on hand-made edits of one line (the first
    line its edit changes, or line 1)."""
    base = base_traces()[0]
    records = [json.loads(raw) for raw in base]
    index = next((i for i, r in enumerate(records) if i and edit(r) != r), 1)
    lines = list(base)
    lines[index] = _dumps(edit(records[index]))
    assert classify(Mutated(base, lines)) == kind, name


def _move_edit(index: int, value: Any) -> Any:
    """A store job's first move with its ``index``-th entry replaced by ``value``."""
    def edit(r: dict[str, Any]) -> dict[str, Any]:
        moves = [list(m) for m in r["moves"]]
        moves[0][index] = value
        return {**r, "moves": moves}
    return edit


# Edits a deep fuzz run found crashing a reader (a traceback, not a report): each applied to
# the first record it fits, in the first base trace that has one.
@pytest.mark.parametrize(("name", "fits", "edit"), [
    ("a job's op as a list", lambda r: r["kind"] == "job", lambda r: {**r, "op": []}),
    ("a step's sync_lookups as a list", lambda r: r["kind"] == "step", lambda r: {**r, "sync_lookups": [1]}),
    ("a step's sync_lookups as text", lambda r: r["kind"] == "step", lambda r: {**r, "sync_lookups": "x"}),
    ("a step's flush as a number", lambda r: r["kind"] == "step", lambda r: {**r, "flush": 5}),
    ("an evicted block as a list", lambda r: r["kind"] == "evict", lambda r: {**r, "blocks": [[1]]}),
    ("a store move's tier as a list", lambda r: r["kind"] == "job" and r["op"] == "store", _move_edit(2, [])),
    ("a store move's device block as a list", lambda r: r["kind"] == "job" and r["op"] == "store",
     _move_edit(1, [])),
    ("a transfer report's failed blocks as null", lambda r: r.get("type") == "transfer_report",
     lambda r: {**r, "failed": None}),
])
def test_edits_that_crashed_a_reader_are_reported(name: str, fits: Any, edit: Any) -> None:
    for base in base_traces():
        records = [json.loads(raw) for raw in base]
        index = next((i for i, r in enumerate(records) if i and fits(r)), None)
        if index is not None:
            break
    assert index is not None, f"no base trace has a record for: {name}"
    lines = list(base)
    lines[index] = _dumps(edit(records[index]))
    expect_reported(Mutated(base, lines))


def test_a_blank_line_is_no_change_and_a_respelled_float_is_one() -> None:
    """White space only lines are skipped by every reader; a float written another way (the
    same double) is another record to replay, which compares bytes."""
    base = base_traces()[0]
    blank = Mutated(base, [b"  ", *base])
    assert classify(blank) == "unchanged"
    expect_reported(blank)
    index = next(i for i, raw in enumerate(base) if b'"kind":"transition"' in raw and b'"t":0.0,' in raw)
    respelled = list(base)
    respelled[index] = base[index].replace(b'"t":0.0,', b'"t":0.00,')
    assert classify(Mutated(base, respelled)) == "outputs"
    expect_reported(Mutated(base, respelled))


@pytest.mark.parametrize("content", [b"", b"\n\n", b"{}", b"[]", b"null", b'{"kind":"header"}', b"\xff\xfe",
                                     b'{"kind":"header","schema":1,"config":{}}\n{"kind":"input"}'])
def test_degenerate_files(content: bytes, tmp_path: Path) -> None:
    lines = content.split(b"\n") if content else []
    codes = check_all_commands([line for line in lines if line] if content.strip() else lines)
    assert codes["validate"] in (1, 2) and codes["replay"] == 2, codes  # none of them is a trace


def _edit(lines: list[bytes], index: int, **values: Any) -> None:
    lines[index] = json.dumps({**json.loads(lines[index]), **values}, separators=(",", ":")).encode()


def test_a_chunk_past_the_device_is_a_finding_not_a_hang() -> None:
    """Two crafted values together: a prompt chunk of 10**15 tokens and a store of a block the
    request never had. Followed, the validator would derive block names up to that token."""
    lines = list(base_traces()[0])
    records = [json.loads(raw) for raw in lines]
    step = next(i for i, r in enumerate(records) if r["kind"] == "step" and r["prompt"])
    chunk = records[step]["prompt"][0]
    _edit(lines, step, prompt=[[chunk[0], 0, 10**15]])
    store = next(i for i, r in enumerate(records) if i > step and r["kind"] == "job" and r["req"] == chunk[0])
    moves = records[store]["moves"]
    _edit(lines, store, moves=[[123456789, *moves[0][1:]], *moves[1:]])
    check_all_commands(lines)
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "t.jsonl"
        trace.write_bytes(b"\n".join(lines) + b"\n")
        code, out, _err = run(["validate", str(trace)])
    assert code == 1
    assert f"line {step + 1}: invariant 0 (well-formed trace): step " in out and "field 'prompt'" in out


@pytest.mark.parametrize(("field", "value"), [("block_hashes", [[], 2]), ("block_hashes", ["x"]),
                                              ("prompt_tokens", -5)])
def test_arrival_values_the_engine_trusts_are_checked(field: str, value: Any) -> None:
    lines = list(base_traces()[0])
    _edit(lines, 1, **{field: value})
    assert b'"type":"arrival"' in lines[1]
    check_all_commands(lines)
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "t.jsonl"
        trace.write_bytes(b"\n".join(lines) + b"\n")
        code, _out, err = run(["replay", str(trace)])
        assert code == 2 and err.startswith(f"kvlife: error: {trace}:2: field '{field}': "), err
        code, out, _err = run(["validate", str(trace)])
        assert code == 1 and f"line 2: invariant 0 (well-formed trace): bad input record: field '{field}'" in out


def test_an_unknown_finish_reason_is_a_bad_input_not_a_crash() -> None:
    """Found by this fuzz suite: a step output finishing a request for a reason the engine
    does not know (here "") crashed replay in the scheduler."""
    lines = list(base_traces()[0])
    records = [json.loads(raw) for raw in lines]
    index = next(i for i, r in enumerate(records) if r.get("type") == "step_output" and r["finished"])
    _edit(lines, index, finished=[[records[index]["finished"][0][0], ""]])
    check_all_commands(lines)
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "t.jsonl"
        trace.write_bytes(b"\n".join(lines) + b"\n")
        code, _out, err = run(["replay", str(trace)])
        assert code == 2 and err.startswith(f"kvlife: error: {trace}:{index + 1}: field 'finished': "
                                            "unknown finish reason ''"), err
        code, out, _err = run(["validate", str(trace)])
        assert code == 1 and f"line {index + 1}: invariant 0 (well-formed trace): bad input record: field 'finished'" \
            in out, out


def test_a_newer_schema_is_one_line_naming_the_field() -> None:
    """Found by this suite's deep profile: the header's schema past this kvlife's named no field."""
    lines = list(base_traces()[0])
    _edit(lines, 0, schema=2)
    codes = check_all_commands(lines)
    assert codes == {"validate": 2, "replay": 2, "explain": 2, "export": 2}
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "t.jsonl"
        trace.write_bytes(b"\n".join(lines) + b"\n")
        _code, _out, err = run(["validate", str(trace)])
    assert err == f"kvlife: error: {trace}:1: field 'schema': trace schema 2 is newer than this kvlife " \
                  "(reads schema 1 and older)\n"


def test_a_job_done_with_a_non_integer_failed_count() -> None:
    lines = list(base_traces()[2])
    records = [json.loads(raw) for raw in lines]
    index = next(i for i, r in enumerate(records) if r["kind"] == "job_done")
    _edit(lines, index, failed="x")
    codes = check_all_commands(lines)
    assert codes["validate"] == 1 and codes["replay"] == 1, codes


def test_a_late_job_with_a_malformed_move() -> None:
    """Found by this suite's deep profile: a move that is not a list, in a store job whose
    report comes late, crashed validate's structure check."""
    lines = list(base_traces()[2])
    records = [json.loads(raw) for raw in lines]
    late = next(r["job"] for r in records if r["kind"] == "job_done" and r["late"])
    index = next(i for i, r in enumerate(records) if r["kind"] == "job" and r["job"] == late)
    _edit(lines, index, moves=[1, *records[index]["moves"][1:]])
    codes = check_all_commands(lines)
    assert codes["validate"] == 1 and codes["replay"] == 1, codes
