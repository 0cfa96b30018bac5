"""Exact replay, divergence reporting, what-if, and bad input."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from kvlife.lifecycle.cli.main import main
from kvlife.lifecycle.config import RunConfig
from kvlife.lifecycle.drivers.runner import run_workload
from kvlife.lifecycle.traces.replay import config_from_header, replay, workload_from_trace
from kvlife.lifecycle.traces.trace import SCHEMA_VERSION, TraceError
from kvlife.lifecycle.workloads.synthetic import synthetic_workload


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("replay") / "run.jsonl"
    config = RunConfig()
    workload = synthetic_workload(seed=3, num_requests=60, block_tokens=config.engine.block_tokens,
                                  arrival_rate_per_s=8.0)
    run_workload(config, workload, trace_path=path)
    return path


def _lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines()


def _write(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_config_round_trips_through_the_header(trace: Path) -> None:
    header = orjson.loads(_lines(trace)[0])
    assert orjson.loads(orjson.dumps(config_from_header(header).to_dict())) == header["config"]


def test_exact_replay_is_identical(trace: Path) -> None:
    result = replay(trace)
    assert result.identical, result.divergence
    assert result.lines == len(_lines(trace))
    assert result.inputs > 60


def test_first_divergence_names_line_expected_and_got(trace: Path, tmp_path: Path) -> None:
    lines = _lines(trace)
    index = next(i for i, raw in enumerate(lines) if b'"kind":"transition"' in raw and i > 50)
    record = orjson.loads(lines[index])
    record["reason"] = "tampered"
    lines[index] = orjson.dumps(record)
    result = replay(_write(tmp_path / "t.jsonl", lines))
    assert result.divergence is not None
    assert result.divergence.line == index + 1
    assert "tampered" in result.divergence.expected
    assert "tampered" not in result.divergence.got


def test_missing_records_at_the_end_diverge(trace: Path, tmp_path: Path) -> None:
    lines = _lines(trace)
    last_input = max(i for i, raw in enumerate(lines) if b'"kind":"input"' in raw)
    assert len(lines) > last_input + 1  # the last request's finish follows the last step output
    cut = _write(tmp_path / "cut.jsonl", lines[: last_input + 1])
    result = replay(cut)
    assert result.divergence is not None and result.divergence.expected == "<end of trace>"
    assert result.divergence.line == last_input + 2
    assert b'"to":"finished"' in result.divergence.got.encode() or b'"kind":"free"' in result.divergence.got.encode()


def test_a_trace_ending_on_an_input_mid_run_diverges_at_its_end(trace: Path, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Cut right after an input whose handling records nothing: every line matches, but a
    run without an interrupted record ended with its whole workload arrived."""
    lines = _lines(trace)
    index = next(i for i, raw in enumerate(lines)
                 if i > 20 and raw.startswith(b'{"kind":"input","type":"step_output"')
                 and i + 1 < len(lines) and lines[i + 1].startswith(b'{"kind":"input"'))
    cut = _write(tmp_path / "cut.jsonl", lines[: index + 1])
    arrived = sum(1 for raw in lines[: index + 1] if b'"type":"arrival"' in raw)
    assert 0 < arrived < 60
    result = replay(cut)
    d = result.divergence
    assert d is not None and d.end and d.line == index + 2
    assert d.expected.startswith("60 requests arrived (the header's workload.requests")
    assert d.got.startswith(f"{arrived} arrived")
    assert main(["replay", str(cut)]) == 1
    assert capsys.readouterr().out.startswith(f"diverged at the end of the trace (after line {index + 1})")


def _silent_step_outputs(lines: list[bytes]) -> list[int]:
    """Indexes of step outputs whose handling recorded nothing (the next line is an input)."""
    return [i for i, raw in enumerate(lines[:-1]) if raw.startswith(b'{"kind":"input","type":"step_output"')
            and lines[i + 1].startswith(b'{"kind":"input"')]


def test_a_dropped_step_output_is_a_divergence(trace: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's case: a step output that finishes nobody and stores nothing leaves no line
    behind. Every scheduler pass writes its step record, and the pass after a lost output
    schedules without the tokens it would have confirmed, so its step record diverges; a lost
    last output (the trace cut after its step) is seen by the end check."""
    lines = _lines(trace)
    assert main(["replay", str(trace)]) == 0
    assert capsys.readouterr().out.startswith("identical")
    silent = _silent_step_outputs(lines)
    assert len(silent) > 100
    for index in [*silent[:10], *silent[len(silent) // 2:][:10], *silent[-10:]]:
        result = replay(_write(tmp_path / "dropped.jsonl", lines[:index] + lines[index + 1:]))
        d = result.divergence
        assert d is not None and not d.end, f"dropping line {index + 1} went unnoticed"
        # the first line that differs is a step record (of the dropped file: line index + 2 or later)
        assert d.line > index and orjson.loads(d.expected)["kind"] == "step"
    last = max(i for i, raw in enumerate(lines) if raw.startswith(b'{"kind":"input","type":"step_output"'))
    step = orjson.loads(lines[last])["step_id"]
    dropped = _write(tmp_path / "dropped.jsonl", lines[:last])
    d = replay(dropped).divergence
    assert d is not None and d.end
    assert d.expected.startswith("no step in flight: the trace has no interrupted record")
    assert d.got.startswith(f"the engine ends with step {step} in flight: req-")
    assert "1 sampled token(s) never generated" in d.got
    assert main(["replay", str(dropped), "--json"]) == 1
    verdict = orjson.loads(capsys.readouterr().out)
    assert verdict["identical"] is False and verdict["divergence"]["end"] is True
    assert verdict["divergence"]["line"] == last + 1  # one past the last of its ``last`` lines


@pytest.mark.parametrize("which", ["first", "middle", "last"])
def test_dropping_any_step_output_diverges(trace: Path, tmp_path: Path, which: str) -> None:
    lines = _lines(trace)
    outputs = [i for i, raw in enumerate(lines) if raw.startswith(b'{"kind":"input","type":"step_output"')]
    index = {"first": outputs[0], "middle": outputs[len(outputs) // 2], "last": outputs[-1]}[which]
    result = replay(_write(tmp_path / "d.jsonl", lines[:index] + lines[index + 1:]))
    assert result.divergence is not None


@pytest.mark.parametrize(("kind", "edit"), [
    ("arrival", lambda r: r.update(prompt_tokens=r["prompt_tokens"] + 1)),
    ("step_output", lambda r: r.update(step_id=r["step_id"] + 1)),
    ("tick", lambda r: r.update(t=r["t"] + 0.5)),
])
def test_editing_one_input_diverges(trace: Path, tmp_path: Path, kind: str, edit: Callable[[dict], None],
                                    capsys: pytest.CaptureFixture[str]) -> None:
    lines = _lines(trace)
    index = next(i for i, raw in enumerate(lines) if i > 40 and f'"type":"{kind}"'.encode() in raw
                 and i + 1 < len(lines) and not lines[i + 1].startswith(b'{"kind":"input"'))
    record = orjson.loads(lines[index])
    edit(record)
    lines[index] = orjson.dumps(record)
    assert main(["replay", str(_write(tmp_path / "e.jsonl", lines))]) == 1
    assert capsys.readouterr().out.startswith("diverged at")


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda ls: ls[1:], "missing header"),
        (lambda ls: [ls[0].replace(f'"schema":{SCHEMA_VERSION}'.encode(), b'"schema":99')] + ls[1:], "newer"),
        (lambda ls: ls[:3] + [b"{not json"] + ls[3:], "not JSON"),
        (lambda ls: ls[:3] + [b'{"kind":"mystery","t":1}'] + ls[3:], "unknown record kind"),
        (lambda ls: ls[:1] + [b'{"kind":"input","type":"teleport","t":0}'] + ls[1:], "unknown input event"),
    ],
)
def test_bad_input_is_one_clear_error_with_line(trace: Path, tmp_path: Path, mutate: object,
                                                 message: str, capsys: pytest.CaptureFixture[str]) -> None:
    bad = _write(tmp_path / "bad.jsonl", mutate(_lines(trace)))  # type: ignore[operator]
    with pytest.raises(TraceError, match=message):
        replay(bad)
    assert main(["replay", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvlife: error:") and err.count("\n") == 1
    if message != "newer" and message != "missing header":
        assert f"{bad}:4" in err or f"{bad}:2" in err


def test_cli_replay_reports_identical_and_divergence(trace: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(trace)]) == 0
    assert capsys.readouterr().out.startswith("identical")
    lines = _lines(trace)
    lines[5] = lines[5].replace(b'"kind":"decision"', b'"kind":"decision","extra":1') \
        if b'"kind":"decision"' in lines[5] else lines[5] + b" "
    lines[5] = orjson.dumps({**orjson.loads(lines[5]), "zz": 1})
    assert main(["replay", str(_write(tmp_path / "d.jsonl", lines))]) == 1
    out = capsys.readouterr().out
    assert "diverged at line 6" in out and "expected:" in out and "got:" in out


def test_workload_is_recovered_from_the_trace(trace: Path) -> None:
    config, workload = workload_from_trace(trace)
    assert len(workload) == 60
    original = synthetic_workload(seed=3, num_requests=60, block_tokens=config.engine.block_tokens,
                                  arrival_rate_per_s=8.0)
    by_id = {w.request_id: w for w in original}
    for w in workload:
        assert w.input_length == by_id[w.request_id].input_length
        assert w.output_length == by_id[w.request_id].output_length
        assert w.hash_ids == by_id[w.request_id].hash_ids


def test_what_if_prints_both_runs(trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(trace), "--stack", "kvlife.specs.model_check:AsyncLookups"]) == 0
    out = capsys.readouterr().out
    assert "recorded: baseline" in out and "what-if: kvlife.specs.model_check:AsyncLookups" in out
    lookups = next(line for line in out.splitlines() if line.startswith("lookups async"))
    assert lookups.split()[2] == "0" and lookups.split()[3] != "0"


@pytest.mark.parametrize(("broken", "message"), [
    (b"this is not json", "not JSON"),
    (b'{"kind":"weird"}', "unknown record kind 'weird'"),
    (b'{"kind":"transition","t":0.0,"req"', "not JSON"),
])
def test_broken_line_mid_trace_is_an_error_not_a_divergence(trace: Path, tmp_path: Path, broken: bytes,
                                                             message: str) -> None:
    from kvlife.lifecycle.traces.trace import TraceError

    lines = _lines(trace)
    index = next(i for i, raw in enumerate(lines) if b'"kind":"transition"' in raw and i > 20)
    path = _write(tmp_path / "broken.jsonl", lines[:index] + [broken] + lines[index + 1:])
    with pytest.raises(TraceError) as info:
        replay(path)
    assert info.value.line == index + 1 and message in str(info.value)


def test_what_if_takes_a_comma_stack(trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(trace), "--stack", "kvlife.specs.model_check:AsyncLookups,shared-loads"]) == 0
    assert "what-if: kvlife.specs.model_check:AsyncLookups, shared-loads" in capsys.readouterr().out
    assert main(["replay", str(trace), "--stack", "baseline"]) == 0
    assert "what-if: baseline" in capsys.readouterr().out


@pytest.fixture(scope="module")
def cut_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run cut short by SIGTERM while a step is in flight: it ends with an interrupted record."""
    import os
    import signal

    from kvlife.lifecycle.drivers import interrupts
    from kvlife.lifecycle.drivers.runner import recording
    from kvlife.lifecycle.drivers.simulator import Simulator
    from kvlife.policies.loading import load_stack

    config = RunConfig()
    workload = synthetic_workload(seed=4, num_requests=80, arrival_rate_per_s=20.0)
    stack = load_stack(config.policies)
    trace = tmp_path_factory.mktemp("cut") / "cut.jsonl"
    previous = signal.getsignal(signal.SIGTERM)
    interrupts.install_sigterm_handler()
    try:
        with recording(trace, config, stack, workload={"name": "synthetic", "requests": len(workload)}) as writer:
            steps = []

            def record(entry: dict[str, object]) -> None:
                writer.record(entry)
                if entry["kind"] == "step":
                    steps.append(entry["step"])
                    if len(steps) == 40:
                        os.kill(os.getpid(), signal.SIGTERM)

            with pytest.raises(interrupts.Terminated):
                Simulator(config, workload, stack, record).run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    return trace


def test_an_interrupted_trace_replays_and_its_counts_are_checked(cut_trace: Path, tmp_path: Path) -> None:
    lines = _lines(cut_trace)
    last = orjson.loads(lines[-1])
    assert last["kind"] == "interrupted" and last["clean"] is True and last["steps"] == 1 and last["not_arrived"] > 0
    assert replay(cut_trace).identical  # open work at the cut is what the cut record says
    for key, value in (("finished", last["finished"] + 1), ("steps", 0), ("not_arrived", 0),
                       ("requests", {"waiting": 1})):
        tampered = _write(tmp_path / "t.jsonl", lines[:-1] + [orjson.dumps({**last, key: value})])
        d = replay(tampered).divergence
        assert d is not None and d.end, key
        assert d.expected.startswith(f"{key} ") and f"(the interrupted record, line {len(lines)})" in d.expected
        assert d.got.startswith(f"the engine ends with {key} ")


def test_an_interrupted_trace_without_its_cut_record_diverges(cut_trace: Path, tmp_path: Path) -> None:
    """Without the record the trace claims a finished run, but a step is still in flight."""
    d = replay(_write(tmp_path / "uncut.jsonl", _lines(cut_trace)[:-1])).divergence
    assert d is not None and d.end
    assert d.expected.startswith("no step in flight: the trace has no interrupted record")
    assert d.got.startswith("the engine ends with step ")


def test_the_step_inputs_record_as_every_other_input_does() -> None:
    """``input_to_record`` writes a tick and a step output out by hand (every step has
    both); the dict must be the one the generic path makes from the event's fields, keys
    in the same order, and read back to the same event."""
    import attrs

    from kvlife.lifecycle.engine.events import StepOutput, Tick, input_from_record, input_to_record

    for event in (Tick(1.5), Tick(0.0), StepOutput(2.25, 7), StepOutput(3.0, 8, (("a", "stop"), ("b", "length"))),
                  StepOutput(4.0, 9, (), ((3, 0, ()), (4, 1, (17, 18)))), StepOutput(5.0, 10, failed_ranks=(1,))):
        generic = {"kind": "input", "type": event.type, **attrs.asdict(event, recurse=False)}
        if isinstance(event, StepOutput):
            generic["finished"] = [list(pair) for pair in event.finished]
            # the workers' job reports: only when there are some (a step without any, the
            # common case, writes no empty list)
            if event.reports:
                generic["reports"] = [[job, rank, list(failed)] for job, rank, failed in event.reports]
            else:
                del generic["reports"]
            if event.failed_ranks:  # (the live runtime's failed steps only)
                generic["failed_ranks"] = list(event.failed_ranks)
            else:
                del generic["failed_ranks"]
        record = input_to_record(event)
        assert list(record.items()) == list(generic.items())
        assert input_from_record(orjson.loads(orjson.dumps(record))) == event
