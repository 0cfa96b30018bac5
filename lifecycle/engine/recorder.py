"""Record another connector: kvlife's connector core observing the calls a scheduler makes
on a KV connector, with that connector's answers in place of kvlife's decisions.

``ConnectorRecorder`` drives a ``ConnectorCore(observing=True)`` through the same
``ConnectorAPI`` that kvlife's engine and ``KVLifeConnector`` use (``record_inputs``: the
trace's inputs are written from the calls), so the recorded lifecycle has the same state
machine, the same transitions at the same calls and the same records as kvlife's own. It
is given each scheduler-side call, the objects the scheduler passed (read by vLLM's
attribute names: ``vllm_shapes``) and what the recorded connector answered:

- ``on_new_request``, ``get_num_new_matched_tokens`` (with the connector's answer, and
  whether a ``None`` answer was a deferral rather than a lookup), ``update_state_after_alloc``,
  ``request_finished`` (with whether the connector holds the blocks) and ``take_events``;
- ``build_connector_meta``, with the connector's jobs of the step (``ObservedJob``: their
  device blocks; the hash of each is read off the request's block table when it can be) and
  the jobs it gave up or flushed;
- ``update_connector_output``: the workers' reports (kvlife's per-rank ones, or
  OffloadingConnector's per-step counts of completed jobs), and ``finished_sending`` /
  ``finished_recving``; ``observe_reports``: reports that came between step outputs
  (kvlife's drivers deliver them so; vLLM never does).

What the core cannot see of the scheduler, it adds: the device blocks the scheduler frees
(``BlockRefs``: a ``free`` record when no request holds a block any more), and request ids
reused after a finish (the trace names the new request ``id#2``).

It imports no vLLM and no torch: ``kvlife.lifecycle.drivers.vllm.recording`` adapts it to
vLLM's ``KVConnectorBase_V1`` (``RecordingConnector``), and ``kvlife check``'s recorded
worlds (``kvlife.specs.recording_check``) drive it from kvlife's own scheduler. An error
raised here is the caller's to handle (``RecordingConnector`` ends the recording).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs

from kvlife.lifecycle.config import EngineConfig
from kvlife.lifecycle.engine import records
from kvlife.lifecycle.engine.connector import ConnectorCore
from kvlife.lifecycle.engine.connector_api import ConnectorAPI
from kvlife.lifecycle.engine.events import BlockMove, TransferReport, input_to_record
from kvlife.policies.stack import PolicyStack

Sink = Callable[[dict[str, Any]], None]
Report = tuple[int, int, tuple[int, ...]]


@attrs.frozen
class ObservedJob:
    """One load or store job of the recorded connector, as its step's metadata names it."""

    job_id: int
    kind: str  # "load" | "store"
    request_id: str  # the scheduler's id
    device_blocks: tuple[int, ...]
    block_hashes: tuple[int, ...] | None = None  # what the job names them, if it does
    tiers: tuple[str, ...] | None = None  # each block's tier, if the job names it (else the recorder's tier)


class BlockRefs:
    """The scheduler's reference count of each device block, as the connector calls show it:
    the requests whose block tables hold it. A ``free`` record when the last one lets go."""

    def __init__(self, record: Sink) -> None:
        self.record = record
        self.refs: dict[int, int] = {}
        self.tables: dict[str, list[int]] = {}

    def hold(self, rid: str, blocks: Iterable[int], replace: bool = False) -> None:
        if replace:
            self.release(rid)
        table = self.tables.setdefault(rid, [])
        for b in blocks:
            if b not in table:
                table.append(b)
                self.refs[b] = self.refs.get(b, 0) + 1

    def release(self, rid: str, t: float | None = None) -> None:
        self._drop(reversed(self.tables.pop(rid, [])), t)

    def quarantine(self, blocks: Iterable[int]) -> None:
        """The connector keeps the blocks of a job it gave up until the job ends."""
        for b in blocks:
            self.refs[b] = self.refs.get(b, 0) + 1

    def _drop(self, blocks: Iterable[int], t: float | None) -> None:
        freed = []
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                del self.refs[b]
                freed.append(b)
        if freed and t is not None:
            self.record(records.free(t, freed))


class ConnectorRecorder:
    """kvlife's connector core recording another connector's lifecycle (module docstring).

    ``sink`` takes every trace record; ``tier`` names where the recorded connector keeps
    what it stores (its jobs' moves are recorded in it); ``hash_of`` turns the scheduler's
    block hashes into kvlife's (None: they are ints already); ``inner_name`` names the
    recorded connector in what the trace says of it. The recording's clock is the scheduler
    pass: one ms per pass."""

    def __init__(self, config: EngineConfig, sink: Sink, tier: str, hash_of: Callable[[Any], int] | None = None,
                 inner_name: str = "the connector") -> None:
        core = ConnectorCore(config, PolicyStack([]), recorder=sink, observing=True)
        self.api = ConnectorAPI(core, self._clock, hash_of=hash_of, record_inputs=True)
        self.tier = tier
        self.inner_name = inner_name
        self.blocks = BlockRefs(self.api._record)
        # A job the connector gives up (``build_connector_meta``'s ``abandon``) keeps its
        # device blocks until it ends, as kvlife's connector core quarantines them.
        core.transfers.hold_blocks = self.blocks.quarantine
        core.transfers.unhold_blocks = lambda blocks: self.blocks._drop(blocks, core.state.now)
        self.names: dict[str, str] = {}  # the scheduler's request id -> the trace's (a reused id gets a suffix)
        self.reuses: dict[str, int] = {}
        self.requests: dict[str, Any] = {}  # the scheduler's request objects, until they finish
        self.ended: dict[str, list[int]] = {}  # the tables of requests finished since the last step

    def _clock(self) -> float:
        return float(self.api.pass_index)

    @property
    def core(self) -> ConnectorCore:
        return self.api.core

    @property
    def now(self) -> float:
        return self.api.core.state.now

    def _named(self, request: Any) -> _Named:
        return _Named(request, self.names.get(request.request_id, request.request_id))

    # ---- the scheduler's calls, with the recorded connector's answers ---------------------------
    def on_new_request(self, request: Any) -> None:
        api = self.api
        rid = request.request_id
        name = rid
        if rid in self.reuses or rid in api.core.state.requests:
            count = self.reuses.get(rid, 1) + 1
            self.reuses[rid] = count
            name = f"{rid}#{count}"
        else:
            self.reuses[rid] = 1
        self.names[rid] = name
        self.requests[rid] = request
        api.on_new_request(_Named(request, name), early=False)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int, answer: tuple[int | None, bool],
                                   deferred: bool = False) -> None:
        """The connector answered ``answer``; ``deferred``: its ``None`` defers the request
        (no lookup goes out)."""
        if request.request_id not in self.names:
            self.on_new_request(request)
        self.api.observe_matched(self._named(request), num_computed_tokens, answer, self.tier, deferred)

    def update_state_after_alloc(self, request: Any, block_ids: Sequence[int], num_external_tokens: int) -> None:
        name = self.names[request.request_id]
        self.blocks.hold(name, block_ids)
        self.api.update_state_after_alloc(self._named(request), block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any, jobs: Iterable[ObservedJob],
                             abandon: Iterable[int] = (), flush: Iterable[int] = ()) -> None:
        """The step the scheduler planned, and the connector's metadata for it: its jobs, the
        jobs it gave up (a deadline) and the stores it flushed."""
        api = self.api
        api.begin_pass()  # (it may be the pass's first call: its preemptions' frees belong to the pass)
        named = _NamedOutput(scheduler_output, self.names)
        # The tables of the requests that let go of their blocks since the last step (finished)
        # or in this pass (preempted): a job the connector starts for them names those blocks.
        released, self.ended = self.ended, {}
        for rid in sorted(named.preempted_req_ids):
            released[rid] = list(self.blocks.tables.get(rid, ()))
            self.blocks.release(rid, api.core.state.now)
        for new in named.scheduled_new_reqs:
            self.blocks.hold(new.req_id, new.block_ids[0], replace=True)
        cached = named.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            ids = cached.new_block_ids[i]
            if ids is not None:
                self.blocks.hold(rid, ids[0], replace=rid in cached.resumed_req_ids)
        api.build_connector_meta(named)
        abandon, flush = sorted(int(j) for j in abandon), sorted(int(j) for j in flush)
        # The jobs it gave up or flushed before the step's new ones are recorded: it gave
        # them up before it planned the step (a load of the same blocks may follow one given
        # up); then those of the step's new jobs (a store given up or flushed at once).
        self._gave_up(abandon, flush)
        api.core.observe_jobs(self._jobs(jobs, released))
        self._gave_up(abandon, flush)

    def _gave_up(self, abandon: Sequence[int], flush: Sequence[int]) -> None:
        core = self.api.core
        for job_id in abandon:
            job = core.state.jobs.get(job_id)
            if job is not None and not job.timed_out:  # the inner connector gave it up (a deadline)
                missing = list(core.state.ranks.missing_ranks(job.job_id))
                core.transfers.give_up(job, "the connector gave it up; the workers that owe it report it failed",
                                       f"given up by {self.inner_name}: ranks {missing} silent")
        for job_id in flush:
            job = core.state.jobs.get(job_id)
            if job is not None and job.kind == "store" and not job.flushed:
                job.flushed = True
                core.state.stats.flushed_stores += 1

    def _jobs(self, jobs: Iterable[ObservedJob], released: dict[str, list[int]]
              ) -> list[tuple[int, str, str, tuple[BlockMove, ...]]]:
        """The jobs as the core records them: each block named by the request's hash of the
        block at its place in the request's table (as the step had it: a request that let go
        of its blocks since, finished or preempted, by the table it released), else by the
        job's own name for it."""
        requests = self.api.core.state.requests
        out = []
        for job in jobs:
            name = self.names.get(job.request_id, job.request_id)
            req = requests.get(name)
            if req is None:
                continue
            table = self.blocks.tables.get(name) or released.get(name, [])
            given = job.block_hashes
            moves = []
            for k, block in enumerate(job.device_blocks):
                index = table.index(block) if block in table else None
                if index is not None and index < len(req.hashes):
                    h = req.hashes[index]  # the scheduler's hash of that block of the request
                elif given is not None:
                    h = int(given[k])
                else:
                    h = -1
                tier = self.tier if job.tiers is None else job.tiers[k]
                moves.append(BlockMove(int(h), block, tier, -1))
            out.append((job.job_id, job.kind, name, tuple(moves)))
        return out

    def update_connector_output(self, connector_output: Any) -> None:
        """A step output's connector output: the workers' reports, and the requests whose
        sends (``finished_sending``) or loads (``finished_recving``) ended."""
        api = self.api
        api.update_connector_output(_NamedConnectorOutput(connector_output, self._reports(connector_output),
                                                          self.names))
        now = api.core.state.now
        for rid in sorted(connector_output.finished_sending or ()):
            self.blocks.release(self.names.get(rid, rid), now)
        for rid in sorted(connector_output.finished_recving or ()):
            name = self.names.get(rid, rid)
            req = api.core.state.requests.get(name)
            if req is not None and req.state == "finished":
                self.blocks.release(name, now)  # aborted while loading: the scheduler freed it now
            request = self.requests.get(rid)
            if request is not None and getattr(request, "num_computed_tokens", 1) == 0 \
                    and req is not None and req.state != "finished":
                self.blocks.release(name, now)  # a failed load with nothing valid: its blocks are freed

    def observe_reports(self, connector_output: Any) -> None:
        """Workers' reports that came between step outputs (kvlife's drivers deliver a report
        as soon as a transfer ends): each recorded as a ``transfer_report`` input, as an
        engine's trace has it, and applied."""
        state = self.api.core.state
        reports = [TransferReport(state.now, *report) for report in self._reports(connector_output)]
        sink = self.api._record
        for report in reports:
            sink(input_to_record(report))
        self.api.core.update_connector_output(reports, ())

    def _reports(self, output: Any) -> list[Report]:
        """The workers' per-rank reports: kvlife's, or OffloadingConnector's per-step counts."""
        meta = output.kv_connector_worker_meta
        reports = getattr(meta, "reports", None)
        if reports is not None:
            return [(int(j), int(r), tuple(f)) for j, r, f in reports]
        out: list[Report] = []
        ranks = self.api.core.state.ranks
        for job_id, count in sorted((getattr(meta, "completed_jobs", None) or {}).items()):
            job_id = int(job_id)
            missing = list(ranks.missing_ranks(job_id)) if ranks.in_flight(job_id) else []
            out += [(job_id, rank, ()) for rank in missing[:count]]
        return out

    def request_finished(self, request: Any, block_ids: Sequence[int], held: bool, in_output: bool = True) -> None:
        """The scheduler finished ``request``; ``held``: the connector keeps its blocks until
        ``finished_sending``. A finish other than an abort comes with a step output (its
        stop is recorded in that output's input record); ``in_output`` False: it came
        outside one (kvlife's scheduler fails a request that can never fit, at its arrival
        or in a pass), and is recorded where it came, as an engine's trace has it."""
        rid = request.request_id
        if rid not in self.names:
            return
        api = self.api
        name = self.names[rid]
        requests = api.core.state.requests
        was = requests[name].state if name in requests else None
        inputs = api._inputs
        api._inputs = inputs and in_output
        try:
            api.request_finished(self._named(request), block_ids, held=held)
        finally:
            api._inputs = inputs
        self.requests.pop(rid, None)
        if not held and was != "loading":  # the scheduler keeps a loading request's blocks until its load reports
            self.ended[name] = list(self.blocks.tables.get(name, ()))
            self.blocks.release(name, api.core.state.now)

    def take_events(self) -> None:
        self.api.take_events()


class _Named:
    """A scheduler's request as the trace names it (a reused id gets a suffix)."""

    def __init__(self, request: Any, name: str) -> None:
        self._request = request
        self.request_id = name

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._request, attr)


class _NamedOutput:
    """A scheduler output with the trace's request names."""

    def __init__(self, out: Any, names: dict[str, str]) -> None:
        def name(rid: str) -> str:
            return names.get(rid, rid)

        self.scheduled_new_reqs = [_NamedNew(n, name(n.req_id)) for n in out.scheduled_new_reqs]
        cached = out.scheduled_cached_reqs
        self.scheduled_cached_reqs = _NamedCached([name(r) for r in cached.req_ids], list(cached.num_computed_tokens),
                                                  list(cached.new_block_ids), {name(r) for r in cached.resumed_req_ids})
        self.num_scheduled_tokens = {name(r): n for r, n in out.num_scheduled_tokens.items()}
        self.preempted_req_ids = {name(r) for r in (out.preempted_req_ids or ())}


@attrs.define
class _NamedNew:
    base: Any
    req_id: str

    @property
    def num_computed_tokens(self) -> int:
        return int(self.base.num_computed_tokens)

    @property
    def block_ids(self) -> Any:
        return self.base.block_ids


@attrs.define
class _NamedCached:
    req_ids: list[str]
    num_computed_tokens: list[int]
    new_block_ids: list[Any]
    resumed_req_ids: set[str]


class _NamedConnectorOutput:
    def __init__(self, output: Any, reports: list[Report], names: dict[str, str]) -> None:
        self.finished_sending = {names.get(r, r) for r in (output.finished_sending or ())}
        self.finished_recving = {names.get(r, r) for r in (output.finished_recving or ())}
        self.kv_connector_worker_meta = _Reports(reports)
        self.invalid_block_ids = set(output.invalid_block_ids or ())


@attrs.define
class _Reports:
    reports: list[Report]
