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
  it before each call that needs them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from kvlife.lifecycle.engine.connector import ConnectorCore, ConnectorMeta, StepInfo
from kvlife.lifecycle.engine.events import DiscardLookup, LookupAnswer, SubmitLookup, TransferReport, input_to_record

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
                 hash_of: Callable[[Any], int] | None = None, lookups: LookupClient | None = None) -> None:
        self.core = core
        self.clock = clock  # the driver's time, ms
        self.hash_of = hash_of  # a scheduler's block hash -> kvlife's (None: already an int)
        self.lookups = lookups
        self.passes = 0  # scheduler passes begun
        self.builds = 0  # build_connector_meta calls (a step each)
        self._in_pass = False
        self._requests: dict[str, Any] = {}  # the scheduler's request objects, by id

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
        core.tick(now)
        if self.lookups is not None:
            recorder = core.state.recorder
            for answer in self.lookups.due(self.passes, now):
                if recorder is not None:
                    recorder(input_to_record(answer))  # an input, as a driver's answer would be
                core.on_lookup_answer(answer.request_id, answer.epoch, answer.tiers)
            self._route()

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
        core.on_new_request(rid, request.num_prompt_tokens, self._hashes(request),
                            getattr(request, "max_tokens", None), bool(getattr(request, "resumable", False)), early)
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
        self.core.update_state_after_alloc(request.request_id, block_ids, num_external_tokens)

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
        reports = getattr(meta, "reports", None) or ()
        t = core.state.now
        core.update_connector_output([TransferReport(t, int(job), int(rank), tuple(failed))
                                      for job, rank, failed in reports],
                                     sorted(connector_output.finished_sending or ()))
        self._route()

    def request_finished(self, request: Any, block_ids: Sequence[int] = ()) -> tuple[bool, dict[str, Any] | None]:
        """True: the scheduler must hold the request's blocks until ``finished_sending``."""
        rid = request.request_id
        self._refresh(rid)
        self._requests.pop(rid, None)
        reason = FINISH_REASONS.get(request.status.name, "error")
        hold = self.core.request_finished(rid, reason, getattr(request, "finish_note", None))
        self._route()
        return hold, None

    def take_events(self) -> tuple[()]:
        """The end of a step's output: the core confirms the oldest step's tokens (the
        blocks they fill named as the scheduler's requests now name them)."""
        steps = self.core.state.steps
        if steps:
            for entry in steps[0][1]:
                self._refresh(entry[0].request_id)
        self.core.take_events()
        self._route()
        return ()
