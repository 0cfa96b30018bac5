"""Invariant 1: every transition is one the spec declares, ``finished`` absorbs, and a
request fails only where the spec of the run says it may.

- A transition's source is the state the request was in, and the compiled spec table
  (``kvlife.specs.table``) allows its trigger there and leads where the record says.
- A step schedules only requests that arrived and run.
- An abort is ignored (``abort_ignored``) only for a request that finished, is held in
  ``sending`` (vLLM ignores the abort of a finished request) or never came.
- A lookup expires at its deadline, not before.
- A turn ends (``turn_ended``) only for a resumable request's next input chunk: the input
  being handled is that request's resumable ``arrival``.
- A failed load leads where ``engine.kv_load_failure_policy`` says: ``recompute``: the
  request moves ``load_failed`` in the handling its last load ended in; ``fail``: it never
  moves ``load_failed`` and finishes (``failed``) by the end of the next step output (it
  may fail as soon as one rank reports a block of its load failed: vLLM unions the
  workers' ``invalid_block_ids`` at once). An
  ``on_load_failure`` answer other than the configured policy is not carried out and is
  warned ``decision_refused``.
- Live, with the device's size known: a request fails only for a failed load (above) or
  because its tokens can never fit the device, and a prompt that can never fit fails at
  its arrival.
"""

from __future__ import annotations

from kvlife.specs.observers.base import Context, Event, Observer, cdiv
from kvlife.specs.observers.picture import Job, Req
from kvlife.specs.table import TABLE

# Where an abort is ignored without a finding: vLLM ignores the abort of a finished request.
_IGNORABLE = frozenset({"finished", "sending"})


class Transitions(Observer):
    invariants = (1,)

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.failed_in: dict[str, int] = {}  # rid -> the epoch in which a load of it failed
        self.submitted: dict[str, float] = {}  # rid -> when its pending lookup was submitted
        self.must_fail: dict[str, bool] = {}  # rid -> an applied step output has come since (fail policy)
        self.must_move: set[str] = set()  # recompute policy: load_failed due in this handling
        self.refusal_due: set[str] = set()  # an on_load_failure answer the policy cannot carry out
        self.oversized: str | None = None  # a prompt that can never fit, arrived in this handling
        self.aborted_now: str | None = None  # the request the abort being handled finished

    # ---- transitions --------------------------------------------------------------------------
    def on_transition(self, ev: Event) -> None:
        req, trigger, target = ev.req, str(ev.get("trigger")), str(ev.get("to"))
        assert req is not None
        if trigger == "aborted" and self.picture.input_is("abort"):
            self.aborted_now = req.rid
        if ev.source == "finished":
            self.fail(1, f"{req.rid} moved out of finished ({trigger} -> {target}): finished absorbs")
        elif not req.arrived:
            self.fail(1, f"transition of {req.rid}, which never arrived")
        else:
            self._legal(req, ev.get("from"), trigger, target)
        step = getattr(self, "_on_" + trigger, None)
        if step is not None:
            step(req)
        if target == "finished":
            self.must_fail.pop(req.rid, None)
            self.must_move.discard(req.rid)
        if ev.source == "lookup_pending":
            self.submitted.pop(req.rid, None)

    def _legal(self, req: Req, source: object, trigger: str, target: str) -> None:
        expected = TABLE.edges.get((req.state, trigger))
        if source != req.state:
            self.fail(1, f"{req.rid}: transition from {source!r} but it was in {req.state!r}")
        elif expected is None:
            self.fail(1, f"{req.rid}: trigger {trigger!r} is not allowed in state {req.state!r}")
        elif expected != target:
            self.fail(1, f"{req.rid}: {trigger!r} from {req.state!r} leads to {expected!r}, not {target!r}")

    def _on_lookup_submitted(self, req: Req) -> None:
        if self.ctx.t is not None:
            self.submitted[req.rid] = self.ctx.t

    def _on_lookup_expired(self, req: Req) -> None:
        submitted, deadline, t = self.submitted.get(req.rid), self.settings.lookup_deadline_ms, self.ctx.t
        if deadline is not None and submitted is not None and t is not None and submitted + deadline > t:
            self.fail(1, f"{req.rid}: lookup expired at t={t:g}, before its deadline t={submitted + deadline:g} "
                         f"(submitted at t={submitted:g})")

    def _on_turn_ended(self, req: Req) -> None:
        chunk = self.picture.input
        if not (self.picture.input_is("arrival") and chunk.request_id == req.rid and chunk.resumable):
            self.fail(1, f"{req.rid}'s turn ended (turn_ended) without its next input chunk: only the arrival of a "
                         f"resumable request's next chunk ends its turn")

    def _on_load_failed(self, req: Req) -> None:
        if self.settings.kv_load_failure_policy == "fail":
            self.fail(1, f"{req.rid} moved load_failed, but kv_load_failure_policy is 'fail': a request whose "
                         f"load failed fails")
        elif req.rid not in self.must_move and self.settings.kv_load_failure_policy is not None:
            self.fail(1, f"{req.rid} moved load_failed, but no load of it ended with a failure in this handling")
        self.must_move.discard(req.rid)

    def _on_failed(self, req: Req) -> None:
        if not self.settings.live or self.settings.device_blocks is None or req.rid in self.must_fail:
            return
        if self.settings.kv_load_failure_policy == "fail" and any(j.failed or j.timed_out for j in req.loads):
            return  # a rank reported a block of its load failed (vLLM's invalid_block_ids)
        bt = self.bt
        most = max(req.prompt + req.generated, req.seen_end) + 1  # its known tokens and the next
        if cdiv(most, bt) <= self.settings.device_blocks:
            self.fail(1, f"{req.rid} failed in {req.state} though no load of it failed under kv_load_failure_policy "
                         f"'fail' and its tokens fit the device ({cdiv(most, bt)} of {self.settings.device_blocks} "
                         f"blocks at most)")

    # ---- steps, aborts, arrivals ------------------------------------------------------------
    def on_plan(self, ev: Event) -> None:
        assert ev.data is not None
        for entry in ev.data.entries:
            req = self.picture.requests.get(entry.rid)
            if req is None:
                self.fail(1, f"step {ev.data.step_id} schedules {entry.rid}, which never arrived")
            elif req.state != "running":
                self.fail(1, f"step {ev.data.step_id} schedules {entry.rid} in state {req.state}")

    def on_arrival(self, ev: Event) -> None:
        event = ev.data
        blocks = self.settings.device_blocks
        if self.settings.live and blocks is not None and cdiv(event.prompt_tokens + 1, self.bt) > blocks:
            self.oversized = event.request_id

    def _abort_ignored(self, ev: Event) -> None:
        req = self.picture.request(ev.get("req"))
        if req is not None and req.rid == self.aborted_now:
            self.fail(1, f"the abort of {req.rid} finished it (aborted), yet an abort_ignored warning says it was "
                         f"ignored")
        elif req is not None and req.state not in _IGNORABLE and self.picture.input_is("abort"):
            self.fail(1, f"the abort of {req.rid}, in {req.state}, is ignored (abort_ignored): an abort of a "
                         f"request that has not finished must finish it")

    def on_warning(self, ev: Event) -> None:
        what = ev.get("what")
        if what == "abort_ignored":
            self._abort_ignored(ev)
        elif what == "decision_refused" and ev.get("point") == "on_load_failure":
            self.refusal_due.discard(str(ev.get("req")))
            configured = self.settings.kv_load_failure_policy
            if configured is not None and (ev.get("carried_out") != configured or ev.get("value") == configured):
                self.fail(1, f"{ev.get('req')}: decision_refused says {ev.get('value')!r} was refused and "
                             f"{ev.get('carried_out')!r} carried out, but kv_load_failure_policy is {configured!r}")
        elif what == "rank_timeout":
            job = self.picture.job(ev.get("job"))
            if job is not None and job.kind == "load" and job.open and not job.timed_out:
                self._load_ended(job, failed=True)

    def on_decision(self, ev: Event) -> None:
        configured = self.settings.kv_load_failure_policy
        if ev.get("point") == "on_load_failure" and configured is not None and ev.get("value") != configured:
            self.refusal_due.add(str(ev.get("req")))

    # ---- loads ----------------------------------------------------------------------------------
    def on_job_complete(self, ev: Event) -> None:
        job = ev.job
        assert job is not None
        if job.kind == "load" and not job.timed_out:
            moved = {m.block_hash for m in job.moves or ()}
            self._load_ended(job, failed=bool(job.failed & moved) or (job.moves is None and bool(job.failed)))

    def _load_ended(self, job: Job, failed: bool) -> None:
        """A load of a loading request ended (reported, or given up at its deadline): once
        its request's last load of the epoch ended, a failure leads where the policy says."""
        req = self.picture.requests.get(job.rid)
        if req is None or req.state != "loading" or job.epoch != req.epoch or job not in req.loads:
            return
        if failed:
            self.failed_in[req.rid] = req.epoch
        if self.failed_in.get(req.rid) != req.epoch \
                or any(j is not job and j.open and not j.timed_out for j in req.loads):
            return
        policy = self.settings.kv_load_failure_policy
        if policy == "recompute":
            self.must_move.add(req.rid)
        elif policy == "fail":
            self.must_fail[req.rid] = False

    # ---- the end of a handling ------------------------------------------------------------------
    def on_output(self, ev: Event) -> None:
        for rid in self.must_fail:
            self.must_fail[rid] = True  # (finished by the end of this handling)

    def on_end(self, ev: Event) -> None:
        self.aborted_now = None
        if self.picture.cut is not None:
            return
        for rid in sorted(self.must_move):
            state = self.picture.requests[rid].state
            if state != "finished":
                self.fail(1, f"{rid}: its last load ended with failed blocks and kv_load_failure_policy is "
                             f"'recompute', yet it did not move load_failed (it is in {state})")
        self.must_move.clear()
        for rid in [r for r, due in self.must_fail.items() if due]:
            del self.must_fail[rid]
            self.fail(1, f"{rid}: its load failed under kv_load_failure_policy 'fail', yet the step output after "
                         f"it did not fail it (it is in {self.picture.requests[rid].state})")
        for rid in sorted(self.refusal_due):
            self.fail(1, f"{rid}: on_load_failure answered other than kv_load_failure_policy "
                         f"({self.settings.kv_load_failure_policy!r}), yet no decision_refused warning says it was "
                         f"not carried out")
        self.refusal_due.clear()
        if self.oversized is not None:
            rid, self.oversized = self.oversized, None
            if self.picture.requests[rid].state != "finished":
                self.fail(1, f"{rid}'s prompt and its first output token need more than the device's "
                             f"{self.settings.device_blocks} blocks, yet it did not fail at its arrival: it can "
                             f"never run")
