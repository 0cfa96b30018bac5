"""Invariant 11, admission: who may run, and when.

- A landed load is taken back (``load_done``) by a scheduler pass, after a step output
  told the scheduler its loads finished (vLLM's ``finished_recving``, then the next
  ``schedule()``), never at the report itself.
- Live (``Settings.fifo``): admission is FIFO over the engine's queue (landed loads first,
  then the waiting queue, a preempted request in front): a request is admitted past one
  ahead of it only if that one waits on something: a lookup (pending, or submitted by this
  pass), its load, its prefetch while its patience lasts, its admission policy (defer),
  or a step output of the epoch it was preempted in. A request whose prefetch is in flight
  is not admitted while its patience lasts, and is not passed over once it ran out (the
  pass gives up on the prefetch). A request whose known tokens and the next can never fit
  the device is never admitted.
- A load joins loads in flight (a join job) only when its request's admission decision
  said ``join`` (a ``go`` loads its own copy, even of blocks in flight: no sharing). A
  request with no admission decision recorded (another connector's trace) is not judged.
"""

from __future__ import annotations

from kvlife.specs.observers.base import Context, Event, Observer, cdiv
from kvlife.specs.observers.picture import Req


class Admission(Observer):
    invariants = (11,)

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.looked_up: set[str] = set()  # requests that submitted a lookup in this handling
        self.admission: dict[str, str] = {}  # rid -> its last admission decision

    def on_decision(self, ev: Event) -> None:
        if ev.get("point") == "admission" and isinstance(ev.get("value"), str):
            self.admission[str(ev.get("req"))] = str(ev.get("value"))

    def on_transition(self, ev: Event) -> None:
        req, trigger = ev.req, ev.get("trigger")
        assert req is not None
        if trigger == "lookup_submitted":
            self.looked_up.add(req.rid)
        elif trigger == "load_done":
            self._promoted(req)
        elif trigger in ("admitted", "load_started") and ev.source == "waiting" and self.settings.fifo:
            self._admitted(req, str(trigger))

    def _promoted(self, req: Req) -> None:
        if not self.picture.input_is("tick"):
            self.fail(11, f"{req.rid}'s load was taken back (load_done) outside a scheduler pass: vLLM promotes a "
                          f"landed load at its next schedule()")
        elif not req.landed:
            self.fail(11, f"{req.rid}'s load was taken back (load_done) before a step output reported it finished "
                          f"(finished_recving)")

    def _admitted(self, req: Req, trigger: str) -> None:
        live = self.picture.live_prefetch(req)
        t = self.ctx.t
        if live is not None and t is not None and t < live[1]:
            self.fail(11, f"{req.rid} admitted ({trigger}) at t={t:g} while its prefetch job {live[0].job_id} is in "
                          f"flight and its patience lasts until t={live[1]:g}")
        blocks = self.settings.device_blocks
        if blocks is not None and cdiv(req.prompt + req.generated + 1, self.bt) > blocks:
            self.fail(11, f"{req.rid} admitted ({trigger}) though it needs "
                          f"{cdiv(req.prompt + req.generated + 1, self.bt)} blocks for its known tokens and the next, "
                          f"and the device has {blocks}: it can never run")
        for rid in self._ahead(req.rid):
            why = self._blocks_the_queue(self.picture.requests[rid])
            if why is not None:
                self.fail(11, f"{req.rid} admitted ({trigger}) ahead of {rid}, which {why} (admission is FIFO: a "
                              f"request short of memory stops it)")
                return

    def _ahead(self, rid: str) -> list[str]:
        """The requests the pass reached before ``rid``: the kv-holding ones (loads), then
        the waiting queue up to it."""
        holding, waiting = self.picture.holding, self.picture.waiting
        if rid in holding:
            return holding[:holding.index(rid)]
        return holding + waiting[:waiting.index(rid)] if rid in waiting else []

    def _blocks_the_queue(self, other: Req) -> str | None:
        """Why ``other``, ahead in the queue, should have gone first; None if it may be passed.
        A request that started a load keeps its place among the kv-holding requests only
        while it loads: once its load failed, the scheduler may move it (vLLM skips it into
        the waiting queue, or keeps it holding blocks), so the order is not judged."""
        if other.state == "loading":
            return "landed its load and was not taken back" if other.landed else None
        if other.rid in self.picture.holding:
            return None
        if other.state != "waiting" or other.rid in self.looked_up or other.stale > 0 or other.unreceived \
                or self.admission.get(other.rid) == "defer":
            return None
        live = self.picture.live_prefetch(other)
        if live is None:
            return "was first in line and waits on nothing"
        t = self.ctx.t
        if t is not None and t >= live[1]:
            return (f"still waits on prefetch job {live[0].job_id}, whose patience ran out at t={live[1]:g}: the "
                    f"pass must give up on it")
        return None

    def on_job(self, ev: Event) -> None:
        job = ev.job
        if job is None or job.kind != "load" or not job.join:
            return
        said = self.admission.get(job.rid)
        if said is not None and said != "join":
            self.fail(11, f"load job {job.job_id} of {job.rid} joins loads in flight, but its admission decision was "
                          f"{said!r}: only a join decision shares a load")

    def on_end(self, ev: Event) -> None:
        self.looked_up = set()
