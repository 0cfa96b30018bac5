"""Liveness in runs: a request that never finishes is stranded, named, traced, and fails the run.

Invariant 7 (``docs/design.md``): once inputs stop, every request is finished. The
simulator ends when nothing is left to happen; whatever is not finished then is stranded,
whatever state it is in (waiting and running included, not only the states that wait on IO).
"""

from __future__ import annotations

import json
from pathlib import Path

import orjson
import pytest

from kvlife.lifecycle.cli.main import main
from kvlife.lifecycle.engine.request import Request
from kvlife.lifecycle.engine.scheduler import Scheduler

ALWAYS_DEFER = '''
from kvlife.policies.base import Decision

class AlwaysDefer:
    name = "always-defer"

    def admission(self, request, engine, load):
        return Decision("defer", "never admit a request that would load")
'''

# A small device under a host tier: requests that hit the host must load, and get deferred.
SMALL = ["--limit", "60", "--device-blocks", "100", "--tier", "host=200"]


def _stranded_warnings(trace: Path) -> list[dict[str, object]]:
    records = [orjson.loads(line) for line in trace.read_bytes().splitlines()]
    return [r for r in records if r.get("kind") == "warning" and r.get("what") == "stranded"]


def _validate_stranded(trace: Path) -> list[str]:
    """Requests ``kvlife validate`` reports as never finished (invariant 7)."""
    from kvlife.lifecycle.traces.validate import validate

    report = validate(trace)
    return sorted(f.message.split()[0] for f in report.findings
                  if f.invariant == 7 and "never finished" in f.message)


def test_always_defer_strands_requests_and_the_run_says_so(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    policy = tmp_path / "defer.py"
    policy.write_text(ALWAYS_DEFER)
    trace = tmp_path / "t.jsonl"
    code = main(["run", *SMALL, "--stack", f"{policy}:AlwaysDefer", "--trace", str(trace), "--json"])
    captured = capsys.readouterr()
    summary = json.loads(captured.out)["summary"]
    assert code == 1
    assert summary["stranded"] > 0
    assert len(summary["stranded_requests"]) == summary["stranded"]
    assert all(entry.endswith(":waiting") for entry in summary["stranded_requests"])
    assert "never finished" in captured.err and "Traceback" not in captured.err
    warned = _stranded_warnings(trace)
    assert sorted(f"{w['req']}:{w['state']}" for w in warned) == sorted(summary["stranded_requests"])
    # validate reads the trace alone and finds the same requests never finished (invariant 7)
    assert _validate_stranded(trace) == sorted(e.split(":")[0] for e in summary["stranded_requests"])


def test_the_text_summary_names_the_stranded(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy = tmp_path / "defer.py"
    policy.write_text(ALWAYS_DEFER)
    assert main(["run", *SMALL, "--stack", f"{policy}:AlwaysDefer"]) == 1
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("stranded"))
    assert ":waiting" in line and not line.split()[-1].startswith("0")


def test_a_healthy_run_strands_nothing_and_exits_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    assert main(["run", *SMALL, "--trace", str(trace), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)["summary"]
    assert summary["stranded"] == 0 and summary["stranded_requests"] == []
    assert _stranded_warnings(trace) == []
    assert _validate_stranded(trace) == []


def test_never_releasing_preempted_blocks_is_stranded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """The broken engine of issue 11: a preempted request keeps its device blocks. The pool
    fills with blocks nobody will free; the queue behind them never runs."""

    def leaky_preempt(self: Scheduler, req: Request) -> None:
        state = self.state
        state.running.remove(req)
        req.block_table = []  # forgets the blocks without releasing them
        req.computed = req.confirmed = req.placeholders = req.registered_blocks = req.admitted_tokens = 0
        req.epoch += 1
        req.lookup = None
        req.preemptions += 1
        self.lifecycle.move(req, "preempted", "leaky preemption")
        state.waiting.insert(0, req)

    monkeypatch.setattr(Scheduler, "_preempt", leaky_preempt)
    monkeypatch.setattr("kvlife.lifecycle.engine.state.EngineState.check_invariants", lambda self: None)
    trace = tmp_path / "t.jsonl"
    code = main(["run", "--limit", "200", "--device-blocks", "40", "--time-scale", "4", "--trace", str(trace),
                 "--json"])
    summary = json.loads(capsys.readouterr().out)["summary"]
    assert code == 1
    assert summary["stranded"] > 0
    assert _stranded_warnings(trace)
    assert _validate_stranded(trace)  # a validate finding, from the trace alone
