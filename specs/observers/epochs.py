"""Invariant 4: an input applies only to the epoch (and the step) it was issued for.

- A lookup answer is applied (``lookup_answered``) only to the request whose lookup is
  pending, and only if it is for that lookup's epoch; an answer dropped as stale
  (``stale_lookup``) is never the one for the pending lookup. Live: a lookup is
  submitted with the request's epoch, discarded only while one is in flight, and
  discarded when its request leaves ``lookup_pending`` by an abort or its deadline.
- A step output applies to the oldest step in flight only (vLLM's outputs come in
  order): the output of any other step (one delivered already, one never planned) is
  ignored, warned ``unknown_step``, and changes nothing.
- Live: a request preempted while a step of it was in flight is not admitted again
  before that step's output came (the token it samples belongs to the epoch that
  scheduled it; vLLM appends it to the preempted request before it runs again).
"""

from __future__ import annotations

from kvlife.specs.observers.base import Context, Event, Observer


class Epochs(Observer):
    invariants = (4,)

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.lookup_epoch: dict[str, int] = {}  # rid -> the epoch of its pending lookup
        self.outstanding: set[str] = set()  # live: a SubmitLookup not yet answered or discarded
        self.discard_due: list[tuple[str, int]] = []
        self.discarded: set[tuple[str, int]] = set()
        self.ignored: int | None = None  # an output the engine must ignore, in this handling
        self.warned_unknown = False

    # ---- lookups --------------------------------------------------------------------------
    def on_transition(self, ev: Event) -> None:
        req, trigger = ev.req, ev.get("trigger")
        assert req is not None
        if self.ignored is not None:
            self.fail(4, f"the output of step {self.ignored}, which is not the oldest step in flight, moved "
                         f"{req.rid} ({trigger}): it must be ignored")
        if trigger == "lookup_answered":
            self._answered(req.rid)
        elif trigger == "lookup_submitted":
            self.lookup_epoch[req.rid] = req.epoch
        elif trigger in ("admitted", "load_started") and req.stale > 0:
            self.fail(4, f"{req.rid} admitted ({trigger}) while {req.stale} step output(s) of the epoch it was "
                         f"preempted in are in flight: their tokens would be applied to its new epoch")
        if ev.source == "lookup_pending" and trigger != "lookup_answered":
            epoch = self.lookup_epoch.pop(req.rid, None)
            if trigger in ("aborted", "lookup_expired") and epoch is not None:
                self.discard_due.append((req.rid, epoch))
            self.outstanding.discard(req.rid)

    def _answered(self, rid: str) -> None:
        answer = self.picture.input
        pending = self.lookup_epoch.pop(rid, None)
        self.outstanding.discard(rid)
        if not (self.picture.input_is("lookup_answer") and answer.request_id == rid):
            self.fail(4, f"{rid}: lookup answered without a lookup answer for it")
        elif answer.epoch != pending:
            self.fail(4, f"{rid}: answer of epoch {answer.epoch} applied to the lookup of epoch {pending} (stale)")

    def on_stale_lookup(self, ev: Event) -> None:
        answer = self.picture.input
        if not self.picture.input_is("lookup_answer"):
            self.fail(4, f"stale_lookup record for {ev.get('req')} outside a lookup answer")
            return
        req = self.picture.requests.get(answer.request_id)
        if req is not None and req.state == "lookup_pending" \
                and self.lookup_epoch.get(req.rid) == answer.epoch == req.epoch:
            self.fail(4, f"the answer to {req.rid}'s pending lookup (epoch {req.epoch}) is dropped as stale: an "
                         f"answer for the epoch that asked must be applied")

    def on_submit_lookup(self, ev: Event) -> None:
        command = ev.data
        req = self.picture.requests.get(command.request_id)
        # Fed as issued (before its transition) or after the handling (after it).
        epoch = None if req is None else self.lookup_epoch.get(req.rid, req.epoch) \
            if req.state == "lookup_pending" else req.epoch
        if req is None or epoch != command.epoch:
            self.fail(4, f"lookup for {command.request_id} submitted with epoch {command.epoch}, request epoch is "
                         f"{None if req is None else req.epoch}")
            return
        self.outstanding.add(req.rid)

    def on_discard_lookup(self, ev: Event) -> None:
        command = ev.data
        self.discarded.add((command.request_id, command.epoch))
        req = self.picture.requests.get(command.request_id)
        if req is not None and req.rid not in self.outstanding and req.state != "lookup_pending":
            self.fail(4, f"{command.request_id}: lookup of epoch {command.epoch} discarded, but it has no lookup in "
                         f"flight (in {req.state})")
        self.outstanding.discard(command.request_id)

    # ---- step outputs ---------------------------------------------------------------------
    def on_step_output(self, ev: Event) -> None:
        if self.picture.ignored_output is None:
            return
        if self.picture.max_planned < 0:
            self.ctx.note("a trace without step records: step outputs were not matched to steps", 4)
            return
        self.ignored = ev.data.step_id

    def on_warning(self, ev: Event) -> None:
        if ev.get("what") != "unknown_step":
            return
        if self.ignored is None:
            self.fail(4, f"the output of step {ev.get('step')}, the oldest step in flight, is ignored as "
                         f"unknown_step")
        self.warned_unknown = True

    def on_job(self, ev: Event) -> None:
        if self.ignored is not None and ev.job is not None:
            self.fail(4, f"the output of step {self.ignored}, which is not the oldest step in flight, started "
                         f"{ev.job.kind} job {ev.job.job_id}: it must be ignored")

    def on_end(self, ev: Event) -> None:
        if self.ignored is not None and not self.warned_unknown and self.picture.cut is None:
            self.fail(4, f"the output of step {self.ignored} is not for the oldest step in flight, yet it was not "
                         f"warned unknown_step")
        self.ignored, self.warned_unknown = None, False
        if self.settings.live:
            for rid, epoch in self.discard_due:
                if (rid, epoch) not in self.discarded:
                    self.fail(4, f"{rid} left lookup_pending (aborted or expired) but its lookup (epoch {epoch}) "
                                 f"was not discarded")
        self.discard_due = []
        self.discarded = set()
