"""Liveness in runs: a request that never finishes is stranded, named, traced, and fails the run.

Invariant 7 (``docs/design.md``): once inputs stop, every request is finished. The
simulator ends when nothing is left to happen; whatever is not finished then is stranded,
whatever state it is in (waiting and running included, not only the states that wait on IO).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import orjson
import pytest

from kvlife.lifecycle.cli.main import main
from kvlife.lifecycle.config import RunConfig
from kvlife.lifecycle.drivers.runner import run_workload
from kvlife.lifecycle.engine.core import Engine
from kvlife.lifecycle.engine.request import SchedRequest
from kvlife.lifecycle.engine.scheduler import Scheduler
from kvlife.lifecycle.workloads.synthetic import synthetic_workload

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


class LeakyPreemption(Scheduler):
    """The broken scheduler of issue 11: a preempted request keeps its device blocks."""

    def _preempt(self, req: SchedRequest) -> None:
        req.blocks, req.table, req.num_cached_blocks = [], (), 0  # forgotten, never released
        super()._preempt(req)


class LeakyEngine(Engine):
    """The engine with ``LeakyPreemption`` for its scheduler (the real code is not edited)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The scheduler Engine built and wired to the connector core, made the leaky variant.
        self.scheduler.__class__ = LeakyPreemption


def test_never_releasing_preempted_blocks_is_stranded(tmp_path: Path) -> None:
    """The broken engine of issue 11: a preempted request keeps its device blocks. The pool
    fills with blocks nobody will free; the queue behind them never runs."""
    base = RunConfig()
    config = attrs.evolve(base, engine=attrs.evolve(base.engine, device_blocks=40))
    workload = synthetic_workload(seed=0, num_requests=60, block_tokens=config.engine.block_tokens,
                                  arrival_rate_per_s=16.0)
    # The same run with the real engine preempts, and strands nothing.
    healthy = run_workload(config, workload)
    assert healthy.summary["preemptions"] > 0 and healthy.summary["stranded"] == 0 and healthy.exit_code == 0
    trace = tmp_path / "t.jsonl"
    outcome = run_workload(config, workload, trace_path=trace, engine_factory=LeakyEngine)
    assert outcome.exit_code == 1  # what `kvlife run` exits with
    assert outcome.summary["stranded"] > 0
    assert any("never finished" in problem for problem in outcome.problems())
    warned = _stranded_warnings(trace)
    assert sorted(f"{w['req']}:{w['state']}" for w in warned) == sorted(outcome.summary["stranded_requests"])
    assert _validate_stranded(trace)  # a validate finding, from the trace alone


def _drive_with_lagging_stores(engine: Any, rounds: int) -> int | None:
    """Tick, then deliver the step's output; each store job reports one round late, so the
    request's own stores are in flight whenever it next needs blocks. Returns the round at
    which "a" finished, or None."""
    from kvlife.lifecycle.engine.events import StartStore, StepOutput, StepPlan, Tick, TransferReport

    t = 0.0
    lagging: list[int] = []
    for r in range(rounds):
        commands = engine.handle(Tick(t))
        t += 1.0
        for job_id in lagging:
            engine.handle(TransferReport(t, job_id, 0))
        lagging = [c.job_id for c in commands if isinstance(c, StartStore)]
        for plan in (c for c in commands if isinstance(c, StepPlan)):
            engine.handle(StepOutput(t, plan.step_id))
        if engine.state.requests["a"].state == "finished":
            return r
    return None


def test_request_outgrowing_the_device_fails_instead_of_preempting_itself() -> None:
    """A running request whose sequence outgrows the whole device, while its own stores are
    in flight, used to preempt itself and wait in the queue for ever (it could never be
    admitted again). It fails with a reason, and its queue is not parked behind it."""
    from kvlife.lifecycle.config import EngineConfig, TierConfig
    from kvlife.lifecycle.engine.core import Engine
    from kvlife.lifecycle.engine.events import Arrival
    from kvlife.policies.stack import PolicyStack

    config = EngineConfig(block_tokens=4, device_blocks=6, max_batched_tokens=16, ranks=1,
                          tiers=(TierConfig("host", capacity_blocks=8),))
    engine = Engine(config, PolicyStack([]), reference=True)
    engine.handle(Arrival(0.0, "a", 18, (1, 2, 3, 4)))
    finished_at = _drive_with_lagging_stores(engine, 50)
    a = engine.state.requests["a"]
    assert finished_at is not None, f"stuck in {a.state} after {a.preemptions} preemption(s)"
    assert a.finish_reason == "error" and a.preemptions == 0
    # It computed until its sequence filled the 6 blocks (24 tokens); the token sampled
    # from the 24th would need a 7th block.
    assert a.prompt_tokens + a.generated == 6 * 4 + 1


def test_a_preempted_head_that_can_never_fit_again_fails_and_the_queue_moves() -> None:
    """A request preempted by another one after its generated tokens filled the device:
    re-admitting it needs more blocks than the device has. It fails at the head of the
    queue; the request behind it is admitted and finishes."""
    from kvlife.lifecycle.config import EngineConfig
    from kvlife.lifecycle.engine.core import Engine
    from kvlife.lifecycle.engine.events import Arrival
    from kvlife.policies.stack import PolicyStack

    config = EngineConfig(block_tokens=4, device_blocks=6, max_batched_tokens=16, ranks=1, tiers=())
    engine = Engine(config, PolicyStack([]), reference=True)
    a = engine.state.requests
    engine.handle(Arrival(0.0, "a", 18, ()))
    # Grow "a" to 25 known tokens (24 computed in 6 blocks, one sampled), then put it back in the queue as a preemption
    # by a newer request would.
    from kvlife.lifecycle.engine.events import StepOutput, StepPlan, Tick

    t = 0.0
    while a["a"].prompt_tokens + a["a"].generated < 25:
        plans = [c for c in engine.handle(Tick(t)) if isinstance(c, StepPlan)]
        t += 1.0
        for plan in plans:
            engine.handle(StepOutput(t, plan.step_id))
    scheduler = engine.scheduler
    victim = scheduler.requests["a"]
    scheduler.running.remove(victim)
    scheduler._preempt(victim)
    engine.handle(Arrival(t, "b", 6, ()))
    for _ in range(20):
        plans = [c for c in engine.handle(Tick(t)) if isinstance(c, StepPlan)]
        t += 1.0
        for plan in plans:
            engine.handle(StepOutput(t, plan.step_id, finished=(("b", "stopped"),) if a["b"].generated else ()))
        if a["b"].state == "finished":
            break
    assert a["a"].state == "finished" and a["a"].finish_reason == "error"
    assert a["b"].state == "finished" and a["b"].finish_reason == "stopped"
