"""The recorded world: kvlife's own engine, its connector recorded as vLLM's would be.

Inside vLLM, ``RecordingConnector`` wraps another connector and hands each scheduler-side
call, with that connector's answer, to ``kvlife.lifecycle.engine.recorder.ConnectorRecorder``,
which writes the lifecycle it observes as a kvlife trace. Here the recorded connector is
kvlife's own (the engine's ``ConnectorAPI``), so what the recording says can be held against
what the engine did. ``RecordingTee`` stands where the connector stands between kvlife's
scheduler and its core: it forwards every call to the engine's ``ConnectorAPI`` (the inner
connector, which decides) and mirrors it, with the answer, to a recorder. ``RecordingCheck``
then judges the recording (``findings``):

- the recorder never raised (inside vLLM that would stop the recording);
- the recorded records pass the trace observers as ``kvlife validate`` runs them on a
  recording of another connector (``validate.trace_settings``), with no finding;
- per request, the recorded transitions are the engine's (from, to), except where the
  recorder cannot know by design: when the connector looks a request's blocks up, and when
  the answer comes, is the connector's own; the recorder sees only ``None`` answers to
  ``get_num_new_matched_tokens`` and the answer that ends them. And whether a finished
  request whose blocks the connector holds waits in ``sending`` is the connector's own
  (its ``hold_at_finish``); the recorder sees only the hold, and records ``sending``. So
  ``lookup_pending`` is read as ``waiting`` and ``sending`` as ``finished`` on both sides
  (a transition into or out of one becomes one from or to the other; one that then stays
  in place is dropped);
- after each input, a request both know has the same tokens computed, confirmed and
  generated, placeholders and preemptions, and as many loads in flight; after each pass
  and when inputs stop, the jobs counted (loads, stores and their blocks, preemptions) are
  the engine's (a store the engine starts at a finish or a step output reaches the
  recorder only with the next step's metadata). An answer the recorder makes up for a
  pending lookup is never dropped as stale;
- the recorded jobs name the blocks the engine's jobs move (through the names below).

A share of recorded worlds (``model_check.World.vllm_names``) names blocks as vLLM does:
inside vLLM, the scheduler's request names every block by vLLM's own hash of its tokens,
so the blocks generated tokens fill have names the connector core cannot derive (its
``blocks.derived_block_hash``); the recorder reads them off the request as they grow
(``ConnectorAPI(refresh_hashes=True)``), derives none past what it was told, and its
trace carries the position of each such block it stores (a job's ``moves``), for a reader
that could not place it otherwise. There the tee hands the recorder every block hash the
engine's scheduler shows it through one map, kvlife's name -> vLLM's (``VllmNames``): the
requests' ``block_hashes`` (prompt blocks, and generated ones as they fill), the jobs'
block names and the blocks the workers' reports say failed, and the blocks a warm tier
held; the recorded jobs are then compared through that map.

What the recorder cannot see: a job the engine reclaims at its reclaim deadline (ranks
silent on it) ends the judging (the recording is judged up to then); a prefetch (a pull
between tiers, no device block moved) leaves the recording not knowing which copies a tier
holds, so its provenance findings (10) are not judged from then on.

``kvlife check`` draws a recorded world for a quarter of its examples
(``model_check.World.recorded``), half of them with vLLM's block names
(``model_check.World.vllm_names``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from kvlife.lifecycle.config import EngineConfig, TierConfig
from kvlife.lifecycle.engine.connector import ConnectorMeta
from kvlife.lifecycle.engine.connector_api import ConnectorAPI
from kvlife.lifecycle.engine.recorder import ConnectorRecorder, ObservedJob
from kvlife.lifecycle.engine.vllm_shapes import WorkerMeta
from kvlife.lifecycle.traces.validate import trace_settings
from kvlife.specs.findings import Violation
from kvlife.specs.observers.pipeline import Pipeline

# Read as one state by the comparison (see the module docstring).
_SAME = {"lookup_pending": "waiting", "sending": "finished"}
# What a request's two records must agree on after every input (the core's ``Request`` fields).
_TOKENS = ("computed", "confirmed", "generated", "placeholders", "preemptions")
# The job counters the recording must agree on (``Stats`` fields).
_COUNTERS = ("loads", "stores", "blocks_loaded", "blocks_stored", "preemptions")
TIER = "host"  # where the recording says the recorded connector keeps its copies


def observed_jobs(meta: ConnectorMeta, name: Callable[[int], int] | None = int) -> list[ObservedJob]:
    """The step's load and store jobs as a connector's metadata names them (the device
    blocks of each; the hashes its moves carry, by ``name``; None: the jobs name no block
    hash, as vLLM's OffloadingConnector's, and the recorder reads them off the requests)."""
    return [ObservedJob(job.job_id, job.kind, job.request_id, tuple(m.device_block for m in job.moves),
                        None if name is None else tuple(name(m.block_hash) for m in job.moves),
                        tuple(m.tier for m in job.moves))
            for job in (*meta.loads, *meta.stores)]


def vllm_name(block_hash: int) -> int:
    """vLLM's name of the block kvlife's engine names ``block_hash``: a stand-in for vLLM's
    hash of the block's tokens and its parent's hash (kvlife's names are chained on the
    parent's too, so one block, one name), which no reader derives from kvlife's; below
    2**63, as every block name in a trace."""
    digest = hashlib.blake2b(f"vllm/{block_hash}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


class VllmNames:
    """The one map from kvlife's block names to vLLM's (``vllm_name``), as a recorded world
    with vLLM's names shows blocks to the recorder."""

    def __init__(self) -> None:
        self.names: dict[int, int] = {}
        # Per request: the scheduler's hashes last renamed, and their names (a request's
        # hashes are read before most calls; they change only when a block fills).
        self._renamed: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}

    def __call__(self, block_hash: int) -> int:
        name = self.names.get(block_hash)
        if name is None:
            name = self.names[block_hash] = vllm_name(block_hash)
        return name

    def hashes(self, request_id: str, hashes: tuple[int, ...]) -> tuple[int, ...]:
        last = self._renamed.get(request_id)
        if last is not None and last[0] is hashes:
            return last[1]
        names = tuple(self(h) for h in hashes)
        self._renamed[request_id] = (hashes, names)
        return names

    def request(self, request: Any) -> Any:
        return _VllmNamedRequest(request, self)

    def output(self, output: Any) -> Any:
        """A step's connector output, the blocks its reports say failed named by vLLM."""
        meta = output.kv_connector_worker_meta
        if meta is None:
            return output
        reports = tuple((job, rank, tuple(self(h) for h in failed)) for job, rank, failed in meta.reports)
        return attrs.evolve(output, kv_connector_worker_meta=WorkerMeta(reports))


class _VllmNamedRequest:
    """A scheduler's request as vLLM's shows its blocks: by vLLM's names, read as they grow."""

    def __init__(self, request: Any, names: VllmNames) -> None:
        self._request = request
        self._names = names

    @property
    def block_hashes(self) -> tuple[int, ...]:
        request = self._request
        return self._names.hashes(request.request_id, request.block_hashes)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._request, attr)


def recording_config(config: EngineConfig) -> EngineConfig:
    """The config the recording's header carries, as ``RecordingConnector`` builds it from
    vLLM's: the scheduler's limits, no deadlines of kvlife's own; the engine's tiers (the
    jobs of kvlife's connector name theirs), or one if it has none."""
    return EngineConfig(block_tokens=config.block_tokens, device_blocks=config.device_blocks,
                        max_batched_tokens=config.max_batched_tokens, max_running=config.max_running,
                        ranks=config.ranks, async_scheduling=config.async_scheduling,
                        kv_load_failure_policy=config.kv_load_failure_policy,
                        tiers=config.tiers or (TierConfig(TIER, capacity_blocks=config.device_blocks),))


class RecordingTee:
    """The scheduler-side connector calls of kvlife's scheduler: each forwarded to ``inner``
    (which answers) and mirrored, with the answer, to ``recorder``. An error in the recorder
    is kept (``error``) and ends the mirroring; the engine never sees it.

    A step output's connector output comes right before its ``take_events``; one that does
    not (kvlife's drivers deliver a transfer report as soon as it comes, between step
    outputs) is mirrored as such (``observe_reports``) at the next call or ``settle``.

    ``names``: the recorder sees the blocks by vLLM's names (``VllmNames``; None: kvlife's)."""

    def __init__(self, inner: ConnectorAPI, recorder: ConnectorRecorder, names: VllmNames | None = None,
                 unnamed_jobs: bool = False) -> None:
        self.inner = inner
        self.core = inner.core
        self.recorder: ConnectorRecorder | None = recorder
        self.names = names
        self.unnamed_jobs = unnamed_jobs  # the jobs name their device blocks only
        self.error: str | None = None
        self._output: Any = None  # a connector output not yet mirrored
        # A finish comes with a step output, unless it comes in a pass or right at the
        # request's arrival (kvlife's scheduler fails a request that can never fit).
        self._in_pass = False
        self._arrived: str | None = None
        self.built = False  # the last call was build_connector_meta: every job started so far went out

    def _mirror(self, call: str, *args: Any) -> None:
        recorder = self.recorder
        if recorder is None:
            return
        try:
            if self._output is not None and call != "take_events":
                output, self._output = self._output, None
                recorder.observe_reports(output)
            if call != "_settled":
                getattr(recorder, call)(*args)
            self.built = call == "build_connector_meta"
        except Exception as exc:  # the recording stops; the engine goes on, as inside vLLM
            self.recorder = None
            self.error = f"the recorder raised at {call}: {type(exc).__name__}: {exc}"

    def _shown(self, request: Any) -> Any:
        """``request`` as the recorder sees it."""
        return request if self.names is None else self.names.request(request)

    def settle(self) -> None:
        """The end of a handling: a connector output still unmirrored came on its own."""
        recorder = self.recorder
        if self._output is not None and recorder is not None:
            self._mirror("_settled")

    def begin_pass(self) -> None:
        self.inner.begin_pass()  # (inside vLLM a pass begins at its first connector call)
        self._in_pass = True
        self._arrived = None

    def begin_output(self) -> None:
        self.inner.begin_output()  # (inside vLLM an output begins at its first connector call)

    def on_new_request(self, request: Any, early: bool = True) -> None:
        self.inner.on_new_request(request, early)
        self._mirror("on_new_request", self._shown(request))
        self._arrived = request.request_id

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        answer = self.inner.get_num_new_matched_tokens(request, num_computed_tokens)
        deferred = answer[0] is None and self.inner.core.pending_reason(request.request_id) == "defer"
        self._mirror("get_num_new_matched_tokens", self._shown(request), num_computed_tokens, answer, deferred)
        return answer

    def update_state_after_alloc(self, request: Any, block_ids: Sequence[int], num_external_tokens: int) -> None:
        self.inner.update_state_after_alloc(request, block_ids, num_external_tokens)
        self._mirror("update_state_after_alloc", self._shown(request), list(block_ids), num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> ConnectorMeta:
        meta = self.inner.build_connector_meta(scheduler_output)
        self._in_pass = False
        jobs = observed_jobs(meta, None if self.unnamed_jobs else self.names or int)
        self._mirror("build_connector_meta", scheduler_output, jobs, meta.abandon, meta.flush)
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        self.inner.update_connector_output(connector_output)
        if self.recorder is not None:
            if self._output is not None:
                self._mirror("_settled")
            self._output = connector_output if self.names is None else self.names.output(connector_output)

    def request_finished(self, request: Any, block_ids: Sequence[int] = (),
                         held: bool | None = None) -> tuple[bool, dict[str, Any] | None]:
        hold, params = self.inner.request_finished(request, block_ids, held)
        in_output = not self._in_pass and self._arrived != request.request_id
        self._mirror("request_finished", self._shown(request), list(block_ids), hold, in_output)
        return hold, params

    def take_events(self) -> tuple[()]:
        events = self.inner.take_events()
        recorder = self.recorder
        if recorder is not None and self._output is not None:
            output, self._output = self._output, None
            self._mirror("update_connector_output", output)
        self._mirror("take_events")
        return events


class RecordingCheck:
    """A recorded world: ``install`` puts the tee between an engine's scheduler and its
    connector; ``findings`` judges the recording so far (module docstring)."""

    def __init__(self, config: EngineConfig, sharing: bool, warm: dict[str, Sequence[int]] | None = None,
                 vllm_names: bool = False, unnamed_jobs: bool = False) -> None:
        self.records: list[dict[str, Any]] = []
        self.unnamed_jobs = unnamed_jobs  # the recorded jobs name only their device blocks
        # vLLM's block names (module docstring); None: kvlife's, as the engine names them.
        self.names = VllmNames() if vllm_names else None
        name = self.names or int
        config = recording_config(config)
        self.pipeline = Pipeline(trace_settings(config, sharing=sharing, recorded=True))
        for tier, hashes in (warm or {}).items():
            # (a recording's header names what a tier held)
            self.pipeline.seed_tier(tier, [name(h) for h in hashes])
        # Each load and store job the engine started: the blocks it moves, as the recorder
        # is shown them; compared with the recorded job, then dropped.
        self.engine_jobs: dict[int, list[int]] = {}
        self.misnamed: str | None = None  # the first recorded job that names other blocks
        self.recorder = ConnectorRecorder(config, self._recorded, TIER, inner_name="kvlife's connector")
        self.engine_moves: dict[str, list[tuple[str, str]]] = {}
        self.recorded_moves: dict[str, list[tuple[str, str]]] = {}
        self.tee: RecordingTee | None = None
        self.engine: Any = None
        # The engine reclaimed a job at its reclaim deadline (ranks silent on it): no call a
        # scheduler makes on its connector says so, so the recorder cannot know it, and the
        # recording is judged only up to then.
        self.reclaimed = False
        # The connector pulled blocks between tiers (a prefetch): the recorder sees no such
        # job, so which copies a tier holds is not known to the recording from then on.
        self.prefetched = False

    def install(self, engine: Any) -> None:
        """Between ``engine``'s scheduler and its connector, and beside its trace recorder."""
        self.engine = engine
        self.tee = RecordingTee(engine.connector, self.recorder, self.names, self.unnamed_jobs)
        name = self.names or int
        engine.connector = engine.scheduler.connector = self.tee
        state = engine.core.state
        sink = state.recorder

        def record(record: dict[str, Any]) -> None:
            kind = record.get("kind")
            if kind == "reclaim":
                self.reclaimed = True
            elif kind == "job" and record.get("op") == "prefetch":
                self.prefetched = True
            elif kind == "job":
                self.engine_jobs[int(record["job"])] = [name(int(move[0])) for move in record["moves"]]
            _note(self.engine_moves, record)
            if sink is not None:
                sink(record)

        state.recorder = record

    def _recorded(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        if record.get("kind") == "job" and self.misnamed is None:
            moved = self.engine_jobs.pop(int(record["job"]), None)
            named = [int(move[0]) for move in record["moves"]]
            if moved != named:
                self.misnamed = (f"recording: {record['op']} job {record['job']} of {record['req']} names blocks "
                                 f"{named}, the engine's job {moved}"
                                 + (" (as vLLM names them)" if self.names is not None else ""))
        _note(self.recorded_moves, record)
        self.pipeline.feed_record(record)

    def findings(self, t: float | None = None, final: bool = False) -> Violation | None:
        """What the recording got wrong so far (the first thing); ``final``: inputs stopped."""
        tee = self.tee
        assert tee is not None
        tee.settle()
        if self.reclaimed:
            return None
        if tee.error is not None:
            return Violation(0, f"recording: {tee.error}", t=t)
        if self.misnamed is not None:
            return Violation(13, self.misnamed, t=t)
        if final:
            self.pipeline.finish()
        for v in self.pipeline.violations:
            if v.invariant == 10 and self.prefetched:
                continue  # (what the tiers hold is not known to the recorder: module docstring)
            return Violation(v.invariant, f"recording of kvlife's connector: {v.message}", t=t)
        return self._transitions(t, final) or self._tokens(t, final)

    def _transitions(self, t: float | None, final: bool) -> Violation | None:
        for rid in sorted(set(self.engine_moves) | set(self.recorded_moves)):
            engine = _read(self.engine_moves.get(rid, []))
            recorded = _read(self.recorded_moves.get(rid, []))
            n = len(recorded) if not final else max(len(engine), len(recorded))
            if engine[:n] != recorded[:n] or len(recorded) > len(engine) or (final and engine != recorded):
                return Violation(1, f"recording: {rid}'s transitions {_show(recorded)}, the engine's {_show(engine)} "
                                    f"(lookup_pending read as waiting, sending as finished)", t=t)
        return None

    def _tokens(self, t: float | None, final: bool) -> Violation | None:
        engine = self.engine.core.state
        recorded = self.recorder.core.state
        for rid, req in recorded.requests.items():
            mine = engine.requests.get(rid)
            if mine is None or mine.state == "finished":
                continue
            for name in _TOKENS:
                if getattr(req, name) != getattr(mine, name):
                    return Violation(13, f"recording: {rid} ({req.state}) has {name} {getattr(req, name)}, the "
                                         f"engine's {getattr(mine, name)}", t=t)
            if len(req.load_jobs) != len(mine.load_jobs):
                return Violation(13, f"recording: {rid} waits for {len(req.load_jobs)} loads, the engine's for "
                                     f"{len(mine.load_jobs)}", t=t)
        for name in _COUNTERS if final or self.tee is not None and self.tee.built else ():
            theirs = getattr(engine.stats, name)
            if name == "blocks_loaded":
                theirs += engine.stats.joined_blocks  # (a join is a load to the recorder: it reads no tier)
            if getattr(recorded.stats, name) != theirs:
                return Violation(13, f"recording: counted {name} {getattr(recorded.stats, name)}, the engine "
                                     f"{theirs}", t=t)
        if recorded.stats.stale_lookup_answers:
            return Violation(4, f"recording: {recorded.stats.stale_lookup_answers} answer(s) it made for a pending "
                                f"lookup dropped as stale", t=t)
        return None


def _note(moves: dict[str, list[tuple[str, str]]], record: dict[str, Any]) -> None:
    if record.get("kind") == "transition":
        moves.setdefault(str(record["req"]), []).append((str(record["from"]), str(record["to"])))


def _read(moves: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """The transitions as the comparison reads them: lookup_pending as waiting, and the
    moves that then stay in place dropped."""
    out = []
    for source, target in moves:
        source, target = _SAME.get(source, source), _SAME.get(target, target)
        if source != target:
            out.append((source, target))
    return out


def _show(moves: Sequence[tuple[str, str]]) -> str:
    return "[" + ", ".join(f"{a}->{b}" for a, b in moves) + "]"
