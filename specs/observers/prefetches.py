"""Invariant 13, an early prefetch is carried out: a request whose ``on_arrival`` decision
was ``prefetch`` (LMCache's ``on_new_request``, kvlife's ``early-prefetch``) looks up at
its arrival, and the answer of that lookup starts a prefetch of its hits below the host
tier into the host tier (``Transfers.start_prefetch``).

Live (through the probe), when that answer is applied (same epoch): if it names a leading
hit candidate in a tier below the host that still holds it, which the host neither holds
nor is already bringing in, and the host tier has room for a block (a free slot or one it
may evict), a prefetch job of the request starts in the same handling.
"""

from __future__ import annotations

from kvlife.specs.observers.base import Context, Event, Observer
from kvlife.specs.observers.picture import Req


class Prefetches(Observer):
    invariants = (13,)

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.wanted: dict[str, int] = {}  # rid -> the epoch whose lookup answer starts a prefetch
        self.started: set[str] = set()  # requests that started a prefetch in this handling

    def on_decision(self, ev: Event) -> None:
        if ev.get("point") == "on_arrival" and ev.get("value") == "prefetch":
            req = self.picture.requests.get(str(ev.get("req")))
            if req is not None:
                self.wanted[req.rid] = req.epoch

    def on_job(self, ev: Event) -> None:
        job = ev.job
        if job is not None and job.kind == "prefetch":
            self.started.add(job.rid)

    def on_end(self, ev: Event) -> None:
        started, self.started = self.started, set()
        req = self._due(started)
        probe = self.ctx.probe
        if req is None or probe is None:
            return
        tiers = [t for t in self.picture.input.tiers if t in self.settings.tiers]
        bringing = set(probe.busy_tiers().get("host", ()))
        lower = [i for i, tier in enumerate(tiers[:req.hit_candidates(self.bt)])
                 if tier != "host" and probe.tier_holds(tier, req.hash_at(i))
                 and not probe.tier_holds("host", req.hash_at(i)) and req.hash_at(i) not in bringing]
        if lower and probe.tier_has_room("host"):
            self.fail(13, f"{req.rid} decided to prefetch at its arrival, and its lookup answer names block "
                          f"{lower[0]} in the {tiers[lower[0]]} tier, which the host tier does not hold and has "
                          f"room for, yet no prefetch started")

    def _due(self, started: set[str]) -> Req | None:
        """The request whose early prefetch this handling's lookup answer should start (an
        answer of the epoch its arrival decided in, applied, with a host tier; None if none)."""
        if self.ctx.probe is None or self.picture.cut is not None or not self.picture.input_is("lookup_answer"):
            return None
        answer = self.picture.input
        epoch = self.wanted.pop(answer.request_id, None)
        req = self.picture.requests.get(answer.request_id)
        if epoch is None or req is None or epoch != answer.epoch or req.epoch != epoch or answer.tiers is None:
            return None
        return None if req.rid in started or "host" not in self.settings.tiers else req
