"""Invariant 7: every transfer ends, every request finishes, and no deadline passes
unnoticed.

- After a tick (the engine acts on deadlines at ticks): no async lookup is still pending
  past ``lookup_deadline_ms``, no job or prefetch some rank owes a report past
  ``reclaim_deadline_ms`` was left unreclaimed (its blocks would leak to a silent rank).
- Live: the engine's next wakeup (a driver ticks then) is after now, and neither later
  than the first deadline ahead the observer knows (a lookup's, a job's transfer or
  reclaim deadline, a waiting request's prefetch patience) nor a wakeup for nothing.
- Once inputs stop: every job ended on every rank, every request finished, whatever its
  state. A run cut short (an ``interrupted`` record) is not held to this for the work
  open at the cut.
"""

from __future__ import annotations

import math

from kvlife.specs.observers.base import Context, Event, Observer, missing_ranks


class Liveness(Observer):
    invariants = (7,)

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.pending_lookups: dict[str, float] = {}  # rid -> when submitted, in submission order

    def on_transition(self, ev: Event) -> None:
        req = ev.req
        assert req is not None
        if ev.get("trigger") == "lookup_submitted" and self.ctx.t is not None:
            self.pending_lookups.pop(req.rid, None)
            self.pending_lookups[req.rid] = self.ctx.t
        elif ev.source == "lookup_pending":
            self.pending_lookups.pop(req.rid, None)

    def on_end(self, ev: Event) -> None:
        if self.picture.cut is not None:
            return
        if self.picture.input_is("tick"):
            self._lookups_expired()
            self._jobs_reclaimed()
        probe = self.ctx.probe
        if probe is not None and self.picture.input is not None:
            self._wakeup(probe.next_wakeup())

    def _lookups_expired(self) -> None:
        deadline, t = self.settings.lookup_deadline_ms, self.ctx.t
        if deadline is None or t is None:
            return
        for rid, submitted in self.pending_lookups.items():
            if submitted + deadline <= t:
                self.fail(7, f"{rid}: its lookup of t={submitted:g} is still pending after a tick at t={t:g}, past "
                             f"its deadline t={submitted + deadline:g} (lookup_deadline_ms {deadline:g})")
            return  # in submission order: the rest are younger

    def _jobs_reclaimed(self) -> None:
        reclaim, t = self.settings.reclaim_deadline_ms, self.ctx.t
        if reclaim is None or t is None:
            return
        for job in self.picture.open.values():  # in start order
            if job.t is None:
                continue
            if t < job.t + reclaim:
                return  # the rest started later
            self.fail(7, f"{job.kind} job {job.job_id} of {job.rid}: ranks "
                         f"{missing_ranks(self.settings.ranks, job.reported)} silent since t={job.t:g}, yet not "
                         f"reclaimed after a tick at t={t:g} (reclaim_deadline_ms {reclaim:g}): its blocks leak")
            return

    def _deadlines_ahead(self) -> list[tuple[float, str]]:
        settings, pic = self.settings, self.picture
        ahead: list[tuple[float, str]] = []
        if settings.lookup_deadline_ms is not None:
            ahead += [(t + settings.lookup_deadline_ms, f"the lookup deadline of {rid}")
                      for rid, t in self.pending_lookups.items()]
        for job in pic.open.values():
            if job.t is None:
                continue
            if settings.transfer_deadline_ms is not None and not job.timed_out and job.kind != "prefetch":
                ahead.append((job.t + settings.transfer_deadline_ms, f"the transfer deadline of {job.kind} job "
                                                                      f"{job.job_id}"))
            if settings.reclaim_deadline_ms is not None:
                ahead.append((job.t + settings.reclaim_deadline_ms, f"the reclaim deadline of {job.kind} job "
                                                                     f"{job.job_id}"))
        for rid in pic.prefetch_of:
            req = pic.requests.get(rid)
            live = pic.live_prefetch(req) if req is not None and req.state == "waiting" else None
            if live is not None:
                ahead.append((live[1], f"the prefetch patience of {rid} (job {live[0].job_id})"))
        return ahead

    def _wakeup(self, wake: float | None) -> None:
        now = self.ctx.t
        if now is None:
            return
        if wake is not None and wake <= now:
            self.fail(7, f"the engine's next wakeup is t={wake:g}, not after now (t={now:g}): a driver would tick at "
                         f"once, for ever")
            return
        future = [(t, what) for t, what in self._deadlines_ahead() if t > now and not math.isinf(t)]
        if not future:
            if wake is not None:
                self.fail(7, f"the engine's next wakeup is t={wake:g}, but no deadline is ahead: a wakeup for nothing")
            return
        due, what = min(future)
        if wake is not None and wake < due:
            self.fail(7, f"the engine's next wakeup is t={wake:g}, before the first deadline ahead ({what} at "
                         f"t={due:g}): a wakeup for nothing")
        elif wake is None or wake > due:
            self.fail(7, f"the engine's next wakeup is {wake} at t={now:g}, after {what} at t={due:g}: a driver that "
                         f"ticks only then misses it")

    def on_finish(self, ev: Event) -> None:
        pic = self.picture
        open_jobs = [job for job in pic.jobs.values() if job.open]
        if pic.cut is not None:
            waiting = sum(1 for r in pic.requests.values() if r.state in ("lookup_pending", "loading", "sending"))
            signal = pic.cut.get("signal")
            cause = f"interrupted ({signal})" if signal is not None else f"ended by an error ({pic.cut.get('error')})"
            self.ctx.unchecked.append(
                f"run {cause} at t={pic.cut.get('t')}: {len(open_jobs)} job(s) and "
                f"{waiting} request(s) waiting on IO were open at the cut; invariants 3 and 7 hold for the rest")
            return
        for job in open_jobs:
            self.fail(7, f"{job.kind} job {job.job_id} of {job.rid}: ranks "
                         f"{missing_ranks(self.settings.ranks, job.reported)} never reported")
        for rid, req in pic.requests.items():
            if req.state != "finished":
                self.fail(7, f"{rid} stranded in {req.state}: never finished")
