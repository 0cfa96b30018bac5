"""The recorded world of ``kvlife check`` (``specs/recording_check.py``): kvlife's engine with
its connector recorded as ``RecordingConnector`` records one inside vLLM. The recording of the
real engine agrees with it; a recorder that gets something wrong is a counterexample."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import attrs
import pytest

from kvlife.lifecycle.config import EngineConfig, TierConfig
from kvlife.lifecycle.engine import jobs
from kvlife.lifecycle.engine.connector import ConnectorCore
from kvlife.lifecycle.engine.connector_api import ConnectorAPI
from kvlife.lifecycle.engine.core import Engine
from kvlife.lifecycle.engine.events import Arrival, StepOutput, Tick, TransferReport
from kvlife.lifecycle.engine.jobs import Transfers
from kvlife.lifecycle.engine.recorder import ConnectorRecorder
from kvlife.policies.loading import load_stack
from kvlife.specs import recording_check
from kvlife.specs.model_check import World, run_check
from kvlife.specs.recording_check import RecordingCheck


@pytest.fixture
def recorded_worlds(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[RecordingCheck]]:
    """Every example of the checker in a recorded world; the checks it built, listed."""
    draw = World.draw.__func__  # type: ignore[attr-defined]
    built: list[RecordingCheck] = []
    monkeypatch.setattr(World, "draw", classmethod(lambda cls, seed: attrs.evolve(draw(cls, seed), recorded=True)))
    init = RecordingCheck.__init__

    def note(self: RecordingCheck, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        built.append(self)

    monkeypatch.setattr(RecordingCheck, "__init__", note)
    yield built


@pytest.fixture
def vllm_named_worlds(monkeypatch: pytest.MonkeyPatch, recorded_worlds: list[RecordingCheck]) -> list[RecordingCheck]:
    """Every example in a recorded world whose scheduler shows the recorder vLLM's block names."""
    draw = World.draw.__func__  # type: ignore[attr-defined]
    monkeypatch.setattr(World, "draw", classmethod(lambda cls, seed: attrs.evolve(draw(cls, seed), recorded=True,
                                                                                  vllm_names=True)))
    return recorded_worlds


def _check(stack: tuple[str, ...] = ("baseline",), examples: int = 30) -> Any:
    return run_check(stack, examples=examples, steps=30, shrink=False)


def test_the_real_engine_s_recording_agrees_with_it(recorded_worlds: list[RecordingCheck]) -> None:
    result = _check()
    assert result.ok, result.report()
    assert len(recorded_worlds) >= 30
    # Something was recorded and compared: transitions of many requests, loads and stores.
    moves = sum(len(m) for check in recorded_worlds for m in check.recorded_moves.values())
    assert moves > 100
    assert any(check.recorder.core.state.stats.loads for check in recorded_worlds)
    assert any(check.recorder.core.state.stats.stores for check in recorded_worlds)


def test_a_recording_of_a_tier_hit_has_the_engine_s_transitions() -> None:
    """One request stores its prompt, a second one loads it back: the recording says what the
    engine did, transition by transition, and passes the trace observers."""
    config = EngineConfig(block_tokens=4, device_blocks=4, max_batched_tokens=16, max_running=2, ranks=1,
                          tiers=(TierConfig("host", capacity_blocks=8),))
    engine = Engine(config, load_stack(["baseline"]))
    check = RecordingCheck(config, sharing=False)
    check.install(engine)
    t = 0.0

    def feed(event: Any) -> list[Any]:
        commands = engine.handle(event)
        assert check.findings(event.t) is None
        for c in commands:  # every rank reports every job at once
            if type(c).__name__ in ("StartLoad", "StartStore"):
                engine.handle(TransferReport(event.t, c.job_id, 0, ()))
                assert check.findings(event.t) is None
        return commands

    # a stores its prompt; the filler takes the whole device; b finds a's blocks in the host tier.
    for rid, tokens, hashes in (("a", 9, (1, 2)), ("filler", 15, (50, 51, 52)), ("b", 9, (1, 2))):
        t += 1
        feed(Arrival(t, rid, tokens, hashes, max_tokens=1))
        for _ in range(6):
            t += 1
            plan = [c for c in feed(Tick(t)) if type(c).__name__ == "StepPlan"][0]
            t += 1
            stops = tuple((e.request_id, "stopped") for e in plan.entries if e.samples)
            feed(StepOutput(t, plan.step_id, stops))
    assert check.findings(t, final=True) is None
    assert check.recorded_moves["b"] == check.engine_moves["b"]
    assert ("waiting", "loading") in check.recorded_moves["b"]
    assert check.recorder.core.state.stats.loads == engine.stats.loads == 1


class _Ignores:
    """Broken recorders, each wrong in one way."""

    @staticmethod
    def external_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
        real = ConnectorRecorder.update_state_after_alloc
        monkeypatch.setattr(ConnectorRecorder, "update_state_after_alloc",
                            lambda self, request, block_ids, external: real(self, request, block_ids, 0))

    @staticmethod
    def step_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(ConnectorRecorder, "take_events", lambda self: None)

    @staticmethod
    def held_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
        real = ConnectorRecorder.request_finished
        monkeypatch.setattr(ConnectorRecorder, "request_finished",
                            lambda self, request, block_ids, held, in_output=True:
                            real(self, request, block_ids, False, in_output))

    @staticmethod
    def store_count(monkeypatch: pytest.MonkeyPatch) -> None:
        real = Transfers.observe_job

        def twice(self: Transfers, req: Any, job_id: int, kind: str, moves: Any) -> None:
            real(self, req, job_id, kind, moves)
            if kind == "store":
                self.state.stats.stores += 1

        monkeypatch.setattr(Transfers, "observe_job", twice)


@pytest.mark.parametrize("broken", ["external_tokens", "step_outputs", "held_blocks", "store_count"])
def test_a_broken_recorder_is_a_counterexample(recorded_worlds: list[RecordingCheck], broken: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    getattr(_Ignores, broken)(monkeypatch)
    result = _check(examples=100)  # (a dropped hold needs a held request's blocks reused: 30 seldom do)
    assert not result.ok
    assert result.violation is not None and "recording" in result.violation.message, result.report()


def test_the_comparison_reads_lookup_pending_as_waiting_and_sending_as_finished() -> None:
    read = recording_check._read
    assert read([("waiting", "lookup_pending"), ("lookup_pending", "waiting"), ("waiting", "running"),
                 ("running", "sending"), ("sending", "finished")]) == [("waiting", "running"),
                                                                       ("running", "finished")]
    assert read([("lookup_pending", "finished")]) == [("waiting", "finished")]


def _stored_moves(checks: list[RecordingCheck]) -> list[list[Any]]:
    return [move for check in checks for record in check.records
            if record.get("kind") == "job" and record["op"] == "store" for move in record["moves"]]


def test_a_recording_under_vllm_s_block_names_agrees_with_the_engine(
        vllm_named_worlds: list[RecordingCheck]) -> None:
    """The recorder reads the names of generated blocks off the scheduler's requests: its
    stores name them as vLLM does (the engine's jobs' blocks, through the map), each with
    its position, which no trace reader could derive, and the recording passes every check."""
    result = _check()
    assert result.ok, result.report()
    assert len(vllm_named_worlds) >= 30 and all(check.names is not None for check in vllm_named_worlds)
    moves = _stored_moves(vllm_named_worlds)
    placed = [move for move in moves if len(move) == 4]
    assert len(placed) > 20, "no stored block of generated tokens came with its position"
    # Every recorded name is vLLM's, none kvlife's own (a tee that renamed nothing fails here).
    vllm = {name for check in vllm_named_worlds for name in check.names.names.values()}  # type: ignore[union-attr]
    assert all(move[0] in vllm for move in moves)


class _DerivesNames:
    """Recorders that name generated blocks their own way, not as the scheduler's request does."""

    @staticmethod
    def no_refresh(monkeypatch: pytest.MonkeyPatch) -> None:
        """The recorder never reads the names off the request (ConnectorAPI's default off)."""
        init = ConnectorAPI.__init__

        def derive(self: ConnectorAPI, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            self.refresh_hashes = False

        monkeypatch.setattr(ConnectorAPI, "__init__", derive)

    @staticmethod
    def names_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
        """The core names the block its confirmed tokens only began to fill (a derived name,
        which the request's, read once the block fills, does not replace)."""
        confirm = ConnectorCore._confirm

        def ahead(self: ConnectorCore, req: Any, before: int, n: int, samples: bool) -> None:
            confirm(self, req, before, n, samples)
            self.state.ensure_hashes(req, req.confirmed // self.state.config.block_tokens + 1)

        monkeypatch.setattr(ConnectorCore, "_confirm", ahead)

    @staticmethod
    def no_positions(monkeypatch: pytest.MonkeyPatch) -> None:
        """A stored block of generated tokens goes into the trace without its position."""
        monkeypatch.setattr(jobs, "_underivable", lambda req, positions, among=None: {})


# A block misnamed is found when its job is recorded, or sooner by the trace's reader (a
# request that revisits it names it as vLLM does, so the store wrote a block it never computed).
MISNAMED = "names blocks|not a block r\\d+ has computed"


@pytest.mark.parametrize(("broken", "phrase"), [("no_refresh", MISNAMED), ("names_ahead", MISNAMED),
                                                ("no_positions", "not a block r\\d+ has computed")])
def test_a_recorder_that_names_generated_blocks_its_own_way_is_a_counterexample(
        vllm_named_worlds: list[RecordingCheck], monkeypatch: pytest.MonkeyPatch, broken: str, phrase: str) -> None:
    getattr(_DerivesNames, broken)(monkeypatch)
    result = _check()
    assert not result.ok
    assert result.violation is not None and "recording" in result.violation.message, result.report()
    assert re.search(phrase, result.violation.message), result.violation.message


def test_under_kvlife_s_own_names_the_same_recorders_pass(recorded_worlds: list[RecordingCheck],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """What only vLLM's names reveal: kvlife's scheduler names generated blocks as the core
    derives them, so a recorder that derives them too records the same trace."""
    draw = World.draw.__func__  # type: ignore[attr-defined]
    monkeypatch.setattr(World, "draw", classmethod(lambda cls, seed: attrs.evolve(draw(cls, seed), vllm_names=False)))
    _DerivesNames.no_refresh(monkeypatch)
    result = _check()
    assert result.ok, result.report()


@pytest.fixture
def unnamed_job_worlds(monkeypatch: pytest.MonkeyPatch, recorded_worlds: list[RecordingCheck]) -> list[RecordingCheck]:
    """Every example in a recorded world whose jobs name only their device blocks (as vLLM's
    OffloadingConnector's transfer specs), half of them with vLLM's block names."""
    draw = World.draw.__func__  # type: ignore[attr-defined]
    monkeypatch.setattr(World, "draw", classmethod(lambda cls, seed: attrs.evolve(draw(cls, seed), recorded=True,
                                                                                  unnamed_jobs=True)))
    return recorded_worlds


def test_jobs_that_name_only_device_blocks_are_recorded_by_the_requests_tables(
        unnamed_job_worlds: list[RecordingCheck]) -> None:
    result = _check()
    assert result.ok, result.report()
    assert len(unnamed_job_worlds) >= 30 and all(check.unnamed_jobs for check in unnamed_job_worlds)
    moves = [move for check in unnamed_job_worlds for record in check.records if record.get("kind") == "job"
             for move in record["moves"]]
    assert len(moves) > 100 and all(move[0] != -1 for move in moves)


def test_a_recorder_that_cannot_place_a_jobs_device_blocks_is_a_counterexample(
        unnamed_job_worlds: list[RecordingCheck], monkeypatch: pytest.MonkeyPatch) -> None:
    """A recorder that looks a block up in no table (as one that reads the wrong request's,
    or past the names it has) names it -1: its job is not the engine's."""
    jobs_of = ConnectorRecorder._jobs

    def tableless(self: ConnectorRecorder, jobs: Any, released: Any) -> Any:
        tables, self.blocks.tables = self.blocks.tables, {}
        try:
            return jobs_of(self, jobs, {})
        finally:
            self.blocks.tables = tables

    monkeypatch.setattr(ConnectorRecorder, "_jobs", tableless)
    result = _check()
    assert result.violation is not None and "recording" in result.violation.message, result.report()
    assert re.search(r"job \d+ of r\d+ names blocks \[-1", result.violation.message), result.violation.message
