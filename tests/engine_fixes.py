"""Engine bugs the rebuilt checker found in the one-lifecycle engine (commit 87804b2), each
with a minimal fix as a subclass, so that the checker's other findings can be tested on
an engine without them (the bug zoo's variants build on ``FixedEngine``). The real code
is not edited: the fixes are proposals for issue 22; ``tests/test_model_check.py`` keeps a
strict xfail on the real engine that starts to pass once they land.

0. With no tier (plain vLLM, no connector) no request ever leaves ``waiting``: the
   scheduler calls the connector only when one is configured, and the request states are
   the connector core's. Steps schedule requests in ``waiting`` and ``completed`` moves them
   from there (invariant 1; ``kvlife run --tier host=0 --limit 20 --trace T; kvlife
   validate T``: 31 findings). Not fixed here; the checker's no-tier worlds are drawn with
   weight 0 until it is (``specs/model_check.py``).

1. A pass that preempts a request runs the connector core's deadlines (``core.tick``, at
   the pass's first connector call: after the running loop) after the scheduler freed the
   preempted request's blocks. A store of that request given up at its deadline in that
   pass is then not flushed (``flush_stores`` skips given-up stores) and its quarantine
   hold falls on a block already free ("hold of unreferenced device block": invariant 8)
   or already another request's (that request's step writes the block while the silent
   rank's store still reads it: invariant 2). Likewise a store flushed by a preemption and
   given up at its deadline later: its hold falls on the blocks freed at the preemption.
   Fix: the core's clock ticks at the start of kvlife's own pass, before the scheduler
   frees anything; a flushed store's blocks are not held (they went back at the flush).
2. Under async scheduling a step plan names no block hash for a block completed by an
   output placeholder (``Scheduled.block_hashes`` are the full blocks of the delivered
   tokens only), so the live runtime (``drivers/live.py``, ``fill_block`` up to
   ``len(entry.block_hashes)``) never writes that block's KV content, which is later
   stored and loaded (invariant 11: "fills N full blocks but names only M block hashes").
   Fix: name the derived hashes of every block the step fills.
3. A request whose async load was cut to nothing when it landed (``Scheduler._landed``:
   its blocks freed) stays in ``inflight_prefills``: its whole sequence stays reserved
   (``_reserved``), every later async-load admission needs those blocks too, and with the
   request queued behind such an admission nothing moves again (invariant 11, "the tick
   left the device idle"; then 7). Fix: forget its reservation when its blocks are freed.
4. A load given up at its deadline marks every block of its request's table invalid
   (``job_outcome``: ``invalid_blocks.update(req.block_table)``), prefix-cache hits shared
   with other requests included: the scheduler then cuts another request's landed load
   (``_invalid_blocks``) that the connector promoted as landed; at its re-admission the
   connector takes the scheduler's new load for the promotion (``update_state_after_alloc``
   with the request still ``loading``: ``load_done``, no job started) and the scheduler
   waits in WAITING_FOR_REMOTE_KVS for ever (invariant 7, a livelock). The same set names
   device blocks until the next step output: a given-up load's blocks reclaimed and handed
   to another request meanwhile get that request's good load cut, or it failed (invariant
   1: "failed in loading though no load of it failed"). Not fixed here (a fix decides how
   a given-up load cuts its own request: the lead's call); the checker's worlds with a
   transfer deadline reach it.
5. A join copies its owner's device blocks once the owner landed, on each rank; nothing
   holds those blocks meanwhile: the owner aborted after its own load landed frees them
   while a rank may still be copying (invariant 2: "device block B freed while load job J
   still moves it"), and the joiner reads whatever they hold by then. Fix: a join holds
   its source blocks until it ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvlife.lifecycle.engine.blocks import extend_hashes
from kvlife.lifecycle.engine.connector import ConnectorMeta
from kvlife.lifecycle.engine.core import Engine
from kvlife.lifecycle.engine.events import BlockMove, StepPlan
from kvlife.lifecycle.engine.jobs import Transfers
from kvlife.lifecycle.engine.request import SchedRequest
from kvlife.lifecycle.engine.scheduler import Scheduler
from kvlife.lifecycle.engine.state import Job


class FixedScheduler(Scheduler):
    def schedule(self) -> tuple[StepPlan, ConnectorMeta]:
        self.connector._pass()  # 1: deadlines first, before the running loop frees anything
        plan, meta = super().schedule()
        bt = self.block_tokens
        entries = tuple(e._replace(block_hashes=extend_hashes(e.block_hashes, e.request_id,
                                                              (e.computed_before + e.num_tokens) // bt))
                        for e in plan.entries)  # 2: every block the step fills is named
        return StepPlan(plan.step_id, entries, plan.sync_lookups, plan.sync_lookup_keys, plan.flush), meta

    def _landed(self, req: SchedRequest) -> None:
        super()._landed(req)
        if not req.blocks:
            self.inflight_prefills.pop(req, None)  # 3: nothing left to reserve for


class FixedTransfers(Transfers):
    def start_load(self, req: Any, moves: Sequence[BlockMove], after: int | None = None) -> Job:
        job = super().start_load(req, moves, after)
        if after is not None and self.hold_blocks is not None:
            sources = tuple(m.slot for m in moves)  # 5: the owner's blocks it copies, held until it ends
            self.hold_blocks(sources)
            self.state.held_blocks[job.job_id] = sources
        return job

    def give_up(self, job: Job, note: str, cause: str) -> None:
        hold, sources = self.hold_blocks, self.state.held_blocks.pop(job.job_id, ())
        if job.flushed:
            self.hold_blocks = None  # 1: its blocks went back at the preemption that flushed it
        try:
            super().give_up(job, note, cause)
        finally:
            self.hold_blocks = hold
        if sources:
            self.state.held_blocks[job.job_id] = sources + self.state.held_blocks.get(job.job_id, ())


class FixedEngine(Engine):
    scheduler_class = FixedScheduler
    transfers_class = FixedTransfers


def fixed(engine: type[Engine]) -> Any:
    """``engine`` (a zoo variant naming its own broken parts) with the fixes of the parts
    it does not replace."""
    parts: dict[str, Any] = {}
    if engine.scheduler_class is Scheduler:
        parts["scheduler_class"] = FixedScheduler
    if engine.transfers_class is Transfers:
        parts["transfers_class"] = FixedTransfers
    return type(engine.__name__, (engine,), parts) if parts else engine
