"""Invariant 11, the end of a request: finished only after its stores, released at the
step output that reports them.

A request that finishes with stores still reading its blocks is held: the scheduler keeps
its blocks, and the workers hear of the hold with the next step's metadata (the step
planned after the finish). Each rank reports it in ``finished_sending`` with a step
output of that step or a later one, once it has no store of the request left: it
reported each (a late report too: the worker is done with it), or was told one was given
up at its deadline (with a step planned after it was given up). So:

- ``completed`` comes with a store still in flight only when the ``hold_at_finish``
  answer said not to hold (its blocks are held all the same: invariant 2), never from
  ``sending``;
- a request leaves ``sending`` only at such a step output, and at the first one.
"""

from __future__ import annotations

import attrs

from kvlife.specs.observers.base import Context, Event, Observer, missing_ranks
from kvlife.specs.observers.picture import Job, Req


@attrs.define(slots=True)
class _Hold:
    stores: list[Job]
    hold_step: int  # the first step planned after it finished: its metadata announces the hold


class Release(Observer):
    invariants = (11,)

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.stores: dict[str, list[Job]] = {}  # rid -> its store jobs not ended
        self.hold_said: dict[str, bool] = {}  # rid -> the last hold_at_finish answer
        self.sending: dict[str, _Hold] = {}

    def on_decision(self, ev: Event) -> None:
        if ev.get("point") == "hold_at_finish" and isinstance(ev.get("value"), bool):
            self.hold_said[str(ev.get("req"))] = bool(ev.get("value"))

    def on_job(self, ev: Event) -> None:
        if ev.job is not None and ev.job.kind == "store":
            self.stores.setdefault(ev.job.rid, []).append(ev.job)
            hold = self.sending.get(ev.job.rid)
            if hold is not None and self.picture.max_planned <= hold.hold_step:
                # A recording of another connector learns of a finishing request's last
                # stores with the step metadata that announces its hold: the hold waits
                # for them too.
                hold.stores.append(ev.job)

    def _open(self, rid: str) -> list[Job]:
        stores = [job for job in self.stores.get(rid, ()) if job.open and not job.timed_out]
        self.stores[rid] = stores
        return stores

    def on_transition(self, ev: Event) -> None:
        req, trigger = ev.req, ev.get("trigger")
        assert req is not None
        if trigger == "send_started":
            self.sending[req.rid] = _Hold(list(self.stores.get(req.rid, ())), self.picture.max_planned + 1)
        elif trigger == "completed" and self.settings.finish_after_stores:
            self._completed(req, ev.source)
        if ev.source == "sending":
            self.sending.pop(req.rid, None)

    def _completed(self, req: Req, source: str | None) -> None:
        open_stores = self._open(req.rid)
        if source == "sending":
            why = self._not_releasable(self.sending.get(req.rid))
            if why is not None:
                self.fail(11, f"{req.rid} completed from sending, but {why}")
        elif open_stores and self.hold_said.get(req.rid) is not False:
            jobs = ", ".join(f"{job.job_id} (ranks {missing_ranks(self.settings.ranks, job.reported)} to report)"
                             for job in open_stores)
            said = "never asked hold_at_finish" if req.rid not in self.hold_said else "hold_at_finish said hold"
            self.fail(11, f"{req.rid} completed with store jobs {jobs} still in flight ({said})")

    def _not_releasable(self, hold: _Hold | None) -> str | None:
        """Why the step output being handled cannot release a request held ``hold``."""
        pic = self.picture
        if hold is None:
            return None
        if not pic.input_is("step_output") or pic.ignored_output is not None:
            return "a held request is released only with a step output (finished_sending)"
        step = pic.input.step_id
        if step < hold.hold_step:
            return (f"the output of step {step} came before the hold was announced (with step {hold.hold_step}, the "
                    f"first planned after it finished)")
        for job in hold.stores:
            done = len(job.heard) == self.settings.ranks or (job.abandoned_in is not None and job.abandoned_in <= step)
            if not done:
                return (f"store job {job.job_id} is still in flight on ranks "
                        f"{missing_ranks(self.settings.ranks, job.heard)} (none reported it, nor was it abandoned "
                        f"with a step up to {step})")
        return None

    def on_end(self, ev: Event) -> None:
        pic = self.picture
        if not self.sending or pic.cut is not None or not pic.input_is("step_output") or pic.ignored_output is not None:
            return
        for rid, hold in sorted(self.sending.items()):
            if self._not_releasable(hold) is None:
                self.fail(11, f"{rid} stays in sending though the output of step {pic.input.step_id} came after its "
                              f"hold was announced and every store of it was reported (finished_sending)")
                return
