"""The sans-IO engine: input events in, commands out.

Like h11 for HTTP, the ``Engine`` never reads a clock, starts a thread, touches torch or
opens a socket. Drivers (the simulator, the live runtime) feed it ``kvlife.lifecycle.engine.events``
inputs and carry out the commands it returns. Every state change goes through the
compiled spec table (``kvlife.specs.table``) and is recorded with its trigger and reason.

Follow one request through four files: ``Arrival`` puts it in ``waiting`` (here,
``_on_arrival``); a ``Tick`` runs the scheduler (``lifecycle/scheduler.py``: running
requests first, then FIFO admission, which looks the request up in the tiers, sync or
async through ``lookup_pending``, asks the admission policy, and either starts a load,
``loading``, or schedules compute, ``running``); ``StepOutput`` confirms computed tokens,
starts stores and finishes requests (here, ``_on_step_output``); a finished request
whose blocks a store still reads waits in ``sending``; ``TransferReport``s from every
rank complete jobs (``lifecycle/transfers.py``). Shared state and primitives live in
``lifecycle/state.py``.
"""

from __future__ import annotations

import bisect

from kvlife.lifecycle.engine.events import (
    Abort,
    Arrival,
    Command,
    DiscardLookup,
    InputEvent,
    LookupAnswer,
    StepOutput,
    Tick,
    TransferReport,
    input_to_record,
)
from kvlife.lifecycle.engine.request import Request
from kvlife.lifecycle.engine.scheduler import Scheduler
from kvlife.lifecycle.engine.state import EngineState, Job, PrefetchJob, Recorder, Stats, _seq
from kvlife.specs.table import ReferenceRequest

__all__ = ["Engine", "EngineState", "Job", "PrefetchJob", "Recorder", "Stats"]


class Engine(Scheduler):
    """The engine: dispatches each input event to its handler."""

    def handle(self, event: InputEvent) -> list[Command]:
        """Apply one input event; return the commands the driver must carry out."""
        if event.t < self.now:
            raise ValueError(f"time went backwards: {event.t} < {self.now}")
        self.now = event.t
        if self.recorder is not None:
            self.recorder(input_to_record(event))
        self._commands = []
        if isinstance(event, Tick):
            self._on_tick()
        elif isinstance(event, StepOutput):
            self._on_step_output(event)
        elif isinstance(event, TransferReport):
            self._transfer_version += 1
            if event.job_id in self.prefetches:
                self._on_prefetch_report(event)
            else:
                self._on_transfer_report(event)
        elif isinstance(event, LookupAnswer):
            self._on_lookup_answer(event)
        elif isinstance(event, Arrival):
            self._on_arrival(event)
        elif isinstance(event, Abort):
            self._on_abort(event)
        else:  # pragma: no cover - the union is closed
            raise TypeError(f"not an input event: {event!r}")
        return self._commands

    def _on_arrival(self, event: Arrival) -> None:
        if event.request_id in self.requests:
            self._warn("duplicate_arrival", req=event.request_id)
            return
        full_blocks = event.prompt_tokens // self.config.block_tokens
        req = Request(
            request_id=event.request_id,
            seq=self._next_seq,
            arrival_ms=event.t,
            prompt_tokens=event.prompt_tokens,
            hashes=tuple(event.block_hashes[:full_blocks]),
            resumable=event.resumable,
            block_tokens=self.config.block_tokens,
        )
        self._next_seq += 1
        self.requests[req.request_id] = req
        self.state_counts["waiting"] += 1
        if self.reference is not None:
            self.reference[req.request_id] = ReferenceRequest(req.request_id)
        if self._blocks_for(req.prompt_tokens + 1) > self.pool.capacity:
            self._finish(req, "failed", "error", f"prompt needs more than the {self.pool.capacity} device blocks")
            return
        bisect.insort(self.waiting, req, key=_seq)
        action = self._ask(req, "on_arrival") if self.tiers else "none"
        if action in ("lookup", "prefetch"):
            if action == "prefetch":
                self._wants_prefetch[req.request_id] = req.epoch
            self.waiting.remove(req)
            self._submit_lookup(req, f"early {action} at arrival")

    def _on_lookup_answer(self, event: LookupAnswer) -> None:
        req = self.requests.get(event.request_id)
        if req is None or req.state != "lookup_pending" or req.epoch != event.epoch:
            self.stats.stale_lookup_answers += 1
            self._record(
                {
                    "kind": "stale_lookup",
                    "t": self.now,
                    "req": event.request_id,
                    "epoch": event.epoch,
                    "current_epoch": None if req is None else req.epoch,
                    "state": None if req is None else req.state,
                }
            )
            return
        if event.tiers is None:
            self.stats.failed_lookups += 1
            req.lookup = ()
            reason = "lookup failed: treated as a miss"
        else:
            req.lookup = tuple(t for t in event.tiers if t in self.tiers)
            reason = f"lookup answered: {len(req.lookup)} blocks in tiers"
        self._move(req, "lookup_answered", reason)
        bisect.insort(self.waiting, req, key=_seq)
        if self._wants_prefetch.pop(req.request_id, None) == req.epoch:
            self._start_prefetch(req)

    def _on_abort(self, event: Abort) -> None:
        req = self.requests.get(event.request_id)
        if req is None or req.state == "finished":
            self._warn("abort_ignored", req=event.request_id, state=None if req is None else req.state)
            return
        if req.state == "lookup_pending":
            self._commands.append(DiscardLookup(req.request_id, req.epoch))
        self._sync_lookup_version.pop(req.request_id, None)
        self._wants_prefetch.pop(req.request_id, None)
        self.prefetch_waits.pop(req.request_id, None)
        self._finish(req, "aborted", "aborted", "client aborted")

    def _on_step_output(self, event: StepOutput) -> None:
        entries = self.steps.pop(event.step_id, None)
        if entries is None:
            self._warn("unknown_step", step=event.step_id)
            return
        finished = dict(event.finished)
        for req, epoch, n, samples in entries:
            if req.state != "running" or req.epoch != epoch:
                continue  # preempted or aborted while the step ran: its output is void
            req.confirmed += n
            if samples:
                req.placeholders -= 1
                req.generated += 1
                if req.first_token_ms is None:
                    req.first_token_ms = self.now
            if req.registered_blocks < len(req.hashes):
                self._register_computed(req)
            if req.stored_blocks < len(req.hashes):
                self._maybe_store(req)  # before finishing: the last step's blocks are stored too
            reason = finished.pop(req.request_id, None)
            if reason is not None:
                self._finish_generation(req, reason)
        for rid in finished:
            self._warn("finish_for_unscheduled_request", req=rid, step=event.step_id)

    def _register_computed(self, req: Request) -> None:
        full = min(req.confirmed // self.config.block_tokens, len(req.hashes))
        while req.registered_blocks < full:
            i = req.registered_blocks
            self.pool.register(req.block_table[i], req.hashes[i])
            req.registered_blocks += 1

    def _finish_generation(self, req: Request, reason: str) -> None:
        self.running.remove(req)
        if req.store_jobs and self._ask(req, "hold_at_finish", req.store_jobs):
            req.finish_reason = reason
            req.finish_ms = self.now
            self._move(req, "send_started", f"finished ({reason}); {req.store_jobs} stores still read its blocks")
            return
        self._finish(req, "completed", reason, f"finished ({reason})")
