"""vLLM's KV connector API (the scheduler side) over the connector core.

``ConnectorAPI`` takes the calls vLLM 0.33's scheduler makes on a ``KVConnectorBase_V1``,
with the objects it passes (a ``Request``, a ``SchedulerOutput``, a ``KVConnectorOutput``,
read by vLLM's attribute names), and turns them into the core's inputs. It is the one path
into the core: kvlife's scheduler calls it with its own objects of the same shapes
(``vllm_shapes``), and ``KVLifeConnector`` calls it with vLLM's, so what runs inside vLLM is
what the simulator runs and ``kvlife check`` checks. It imports no vLLM.

What it adds to the core is what a connector learns only from the order of vLLM's calls:

- a scheduler pass begins with its first connector call: the driver's clock is read then
  (``core.tick``: deadlines), and the async lookups due are answered (``lookups``, when the
  connector answers its own, as inside vLLM; otherwise the driver does);
- a step's output ends with ``take_events`` (vLLM calls it at the end of every
  ``update_from_output``; ``update_connector_output`` only when the step's output carries a
  connector output): that is where the core confirms the step's tokens;
- block hashes grow on the scheduler's request as tokens are generated: they are read from
  it before each call that needs them;
- a resumable request (a streaming input session) that the scheduler admits again while
  the core has it running is admitted for its next input chunk: its prompt, hashes and kept
  tokens are read off it then (``NextChunk``), as no call told the connector of the chunk
  before, and the trace records the chunk as an ``arrival`` input of the same request.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

from kvlife.lifecycle.engine.connector import ConnectorCore, ConnectorMeta, NextChunk, StepInfo
from kvlife.lifecycle.engine.events import (
    Abort,
    Arrival,
    DiscardLookup,
    LookupAnswer,
    StepOutput,
    SubmitLookup,
    Tick,
    TransferReport,
    input_to_record,
)

# vLLM's RequestStatus names of a finished request -> the core's finish reason.
FINISH_REASONS = {
    "FINISHED_STOPPED": "stopped",
    "FINISHED_LENGTH_CAPPED": "length",
    "FINISHED_ABORTED": "aborted",
    "FINISHED_ERROR": "error",
    "FINISHED_IGNORED": "error",
}


class LookupClient(Protocol):
    """A connector's own async lookups (inside vLLM): submitted and discarded as the core
    asks, answered at the start of a later pass."""

    def submit(self, command: SubmitLookup) -> None: ...

    def discard(self, command: DiscardLookup) -> None: ...

    def due(self, pass_index: int, now: float) -> list[LookupAnswer]: ...


class ConnectorAPI:
    def __init__(self, core: ConnectorCore, clock: Callable[[], float],
                 hash_of: Callable[[Any], int] | None = None, lookups: LookupClient | None = None,
                 record_inputs: bool = False, refresh_hashes: bool = True) -> None:
        self.core = core
        self.clock = clock  # the driver's time, ms
        self.hash_of = hash_of  # a scheduler's block hash -> kvlife's (None: already an int)
        self.lookups = lookups
        self.passes = 0  # scheduler passes begun
        self.builds = 0  # build_connector_meta calls (a step each)
        self._in_pass = False
        self._requests: dict[str, Any] = {}  # the scheduler's request objects, by id
        # Read block hashes off the scheduler's requests (vLLM names generated blocks by their
        # tokens); False: the scheduler derives them as the core does (kvlife's).
        self.refresh_hashes = refresh_hashes
        # ``record_inputs``: no engine records this driver's inputs (inside vLLM): they are
        # written to the core's trace from the calls (a pass begins: a tick; a step output
        # ends with take_events: the step output, with the stops and reports it brought,
        # before what it caused, as an engine trace has it).
        self._inputs = record_inputs and core.state.recorder is not None
        self._sink = core.state.recorder
        self._output: list[dict[str, Any]] | None = None  # records of the step output under way
        self._stops: list[tuple[str, str]] = []
        self._reports: list[tuple[int, int, tuple[int, ...]]] = []
        if self._inputs:
            core.state.recorder = self._record

    def _record(self, record: dict[str, Any]) -> None:
        if self._output is not None:
            self._output.append(record)
        elif self._sink is not None:
            self._sink(record)

    def _input(self, event: Any) -> None:
        if self._inputs and self._sink is not None:
            self._sink(input_to_record(event))

    def _begin_output(self) -> None:
        if self._inputs and self._output is None:
            self._output = []

    def begin_output(self) -> None:
        """kvlife's own scheduler starts each step's output here (``update_from_output``),
        so that all it causes is recorded after the output, blocks freed before any
        connector call included. Inside vLLM the output begins at its first connector call."""
        self._begin_output()

    @property
    def pass_index(self) -> int:
        """The index (from 0) of the scheduler pass under way, or of the next one between
        passes: a clock of one ms per pass reads it (``KVLifeConnector``'s ``"steps"``)."""
        return self.passes - 1 if self._in_pass else self.passes

    # ---- what vLLM's order tells ----------------------------------------------------------------
    def _pass(self) -> None:
        """The first connector call of a scheduler pass."""
        if self._in_pass:
            return
        self._in_pass = True
        self.passes += 1
        core = self.core
        now = self.clock()
        self._input(Tick(now))
        core.tick(now)
        if self.lookups is not None:
            recorder = core.state.recorder
            for answer in self.lookups.due(self.passes, now):
                if recorder is not None:
                    recorder(input_to_record(answer))  # an input, as a driver's answer would be
                core.on_lookup_answer(answer.request_id, answer.epoch, answer.tiers)
            self._route()

    def begin_pass(self) -> None:
        """kvlife's own scheduler starts each pass here, before its running loop frees
        anything, so deadlines act first: a store given up at its deadline is quarantined
        before a preemption could free (and hand out) the blocks it still reads. Inside vLLM
        the pass begins at its first connector call, after vLLM's running loop."""
        self._pass()

    def _route(self) -> None:
        """Hand the core's lookup commands to the connector's own lookup client."""
        lookups = self.lookups
        if lookups is None:
            return
        commands = self.core.state.commands
        keep = []
        for command in commands:
            if type(command) is SubmitLookup:
                lookups.submit(command)
            elif type(command) is DiscardLookup:
                lookups.discard(command)
            else:
                keep.append(command)
        commands[:] = keep

    def _hashes(self, request: Any) -> tuple[int, ...]:
        hashes = request.block_hashes
        convert = self.hash_of
        return tuple(hashes) if convert is None else tuple(convert(h) for h in hashes)

    def _refresh(self, request_id: str) -> None:
        """The scheduler's request named more blocks (generated tokens filled them)."""
        if not self.refresh_hashes:
            return
        request = self._requests.get(request_id)
        req = self.core.state.requests.get(request_id)
        if request is not None and req is not None and len(request.block_hashes) > len(req.hashes):
            req.hashes = self._hashes(request)

    # ---- vLLM's calls ----------------------------------------------------------------------------
    def on_new_request(self, request: Any, early: bool = True) -> None:
        rid = request.request_id
        self._requests[rid] = request
        core = self.core
        core.state.now = max(core.state.now, self.clock())
        hashes = self._hashes(request)
        max_tokens = getattr(request, "max_tokens", None)
        resumable = bool(getattr(request, "resumable", False))
        self._input(Arrival(core.state.now, rid, request.num_prompt_tokens, hashes, resumable, max_tokens))
        core.on_new_request(rid, request.num_prompt_tokens, hashes, max_tokens, resumable, early)
        self._route()

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        self._pass()
        rid = request.request_id
        if rid not in self.core.state.requests:
            self.on_new_request(request)
        self._refresh(rid)
        answer = self.core.get_num_new_matched_tokens(rid, num_computed_tokens)
        self._route()
        return answer

    def update_state_after_alloc(self, request: Any, block_ids: Sequence[int], num_external_tokens: int) -> None:
        self._pass()
        rid = request.request_id
        chunk = None
        req = self.core.state.requests.get(rid)
        if req is not None and req.state == "running" and getattr(request, "resumable", False):
            # A streaming input session's next input chunk (vLLM's add_request of a known id,
            # which no connector call told): read off the request now, and recorded as that
            # request's arrival, with its prompt now.
            chunk = NextChunk(request.num_prompt_tokens, self._hashes(request), getattr(request, "max_tokens", None),
                              request.num_computed_tokens)
            self._input(Arrival(self.core.state.now, rid, chunk.prompt_tokens, chunk.hashes, True, chunk.max_tokens))
        self.core.update_state_after_alloc(rid, block_ids, num_external_tokens, chunk)

    def build_connector_meta(self, scheduler_output: Any) -> ConnectorMeta:
        self._pass()
        self._in_pass = False
        scheduled = []
        new_blocks: dict[str, tuple[tuple[int, ...], bool]] = {}
        tokens = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            scheduled.append((new.req_id, new.num_computed_tokens, tokens[new.req_id]))
            new_blocks[new.req_id] = (tuple(new.block_ids[0]), True)
        cached = scheduler_output.scheduled_cached_reqs
        resumed = cached.resumed_req_ids
        for i, rid in enumerate(cached.req_ids):
            scheduled.append((rid, cached.num_computed_tokens[i], tokens[rid]))
            ids = cached.new_block_ids[i]
            if ids is not None or rid in resumed:
                new_blocks[rid] = (tuple(ids[0]) if ids is not None else (), rid in resumed)
        for rid, _, _ in scheduled:
            self._refresh(rid)
        step = StepInfo(self.builds, tuple(scheduled), new_blocks,
                        tuple(sorted(scheduler_output.preempted_req_ids or ())))
        self.builds += 1
        return self.core.build_connector_meta(step)

    def update_connector_output(self, connector_output: Any) -> None:
        """The workers' output of a step: their per-rank reports, and the held requests
        whose blocks the scheduler gives back now (``finished_sending``)."""
        core = self.core
        meta = connector_output.kv_connector_worker_meta
        reports = [(int(job), int(rank), tuple(failed)) for job, rank, failed in getattr(meta, "reports", None) or ()]
        self._begin_output()
        self._reports.extend(reports)
        t = core.state.now
        core.update_connector_output([TransferReport(t, *report) for report in reports],
                                     sorted(connector_output.finished_sending or ()))
        self._route()

    def request_finished(self, request: Any, block_ids: Sequence[int] = (),
                         held: bool | None = None) -> tuple[bool, dict[str, Any] | None]:
        """True: the scheduler must hold the request's blocks until ``finished_sending``
        (``held``: another connector's answer, when recording it)."""
        rid = request.request_id
        self._refresh(rid)
        self._requests.pop(rid, None)
        status = request.status.name
        reason = FINISH_REASONS.get(status, "error")
        if reason == "aborted":
            self._input(Abort(self.core.state.now, rid))
        elif status != "FINISHED_IGNORED":  # (ignored: the scheduler's own doing, in the input under way)
            # Finished by a step's output: its tokens (a stop), or what its reports say (an
            # error: a load failed under kv_load_failure_policy fail), recorded with it.
            self._begin_output()
            if self._inputs and reason != "error":
                self._stops.append((rid, reason))
        hold = self.core.request_finished(rid, reason, getattr(request, "finish_note", None), held)
        self._route()
        return hold, None

    def observe_matched(self, request: Any, num_computed_tokens: int, answer: tuple[int | None, bool], tier: str,
                        deferred: bool = False) -> None:
        """Another connector answered ``get_num_new_matched_tokens`` (recording it)."""
        self._pass()
        rid = request.request_id
        if rid not in self.core.state.requests:
            self.on_new_request(request, early=False)
        self._refresh(rid)
        self.core.observe_answer(rid, num_computed_tokens, answer[0], answer[1], tier, deferred)
        self.core.state.commands.clear()  # (its lookups are its own)

    def take_events(self) -> tuple[()]:
        """The end of a step's output: the core confirms the oldest step's tokens (the
        blocks they fill named as the scheduler's requests now name them)."""
        steps = self.core.state.steps
        step_id = steps[0][0] if steps else self.builds - 1
        if steps:
            for entry in steps[0][1]:
                self._refresh(entry[0].request_id)
        self._begin_output()
        self.core.take_events()
        self._route()
        if self._output is not None:
            buffered, self._output = self._output, None
            self._input(StepOutput(self.core.state.now, step_id, tuple(self._stops), tuple(self._reports)))
            for record in buffered:
                cast(Callable[[dict[str, Any]], None], self._sink)(record)
            self._stops, self._reports = [], []
        return ()
