"""Invariant 13, what policies are shown: a policy decides from the views it is handed
(``EngineView``, ``RequestView``), so they must tell the truth.

Live, in the checker's small worlds (``Settings.accounting``), after every handling: the
engine view a policy asked now would get counts the requests the records put in each state
(running; waiting and lookup_pending; loading) and the device's free blocks; each unfinished
request's view (but one in ``sending``: vLLM finished it) has the picture's state, tokens
generated (delivered by step outputs), and placeholders: the sampling steps of its current
epoch whose output has not come (under async scheduling, positions whose token is not known
yet; vllm#27644).

Live, at each ask (the probe notes it as it begins, and the observer looks at the record
the ask makes, or the next one): an admission's ``LoadView`` counts as its device hit the
leading blocks of the request's known tokens (its last one always computed) that the
device's prefix cache holds; names one tier per external hit block (the blocks after the
device hit); and names among them as in flight exactly the blocks a load (not given up) is
bringing in, each with a request loading it.
"""

from __future__ import annotations

from typing import Any

from kvlife.specs.observers.accounting import cached_prefix
from kvlife.specs.observers.base import Event, Observer


class Views(Observer):
    invariants = (13,)

    def on_record(self, ev: Event) -> None:
        self._asks()

    def _asks(self) -> None:
        probe = self.ctx.probe
        if probe is None or not self.settings.accounting:
            return
        for rid, hook, args in probe.take_shown():
            problem = self._load_view(rid, args[0]) if hook == "admission" and args else None
            if problem is not None:
                self.fail(13, f"a policy was shown {problem}")

    def _load_view(self, rid: str, load: Any) -> str | None:
        req = self.picture.requests.get(rid)
        probe = self.ctx.probe
        if req is None or probe is None:
            return None
        cached = len(cached_prefix(probe, req, self.bt))
        if load.device_hit_blocks != cached:
            return (f"device_hit_blocks={load.device_hit_blocks!r} in {rid}'s load view at its admission, the device's "
                    f"prefix cache holds its first {cached} blocks")
        if len(load.tiers) != load.external_hit_blocks:
            return (f"external_hit_blocks={load.external_hit_blocks!r} in {rid}'s load view at its admission, with "
                    f"{len(load.tiers)} tiers named")
        shown = dict(load.in_flight)
        for block_hash, owner in load.in_flight:
            if not any(job.rid == owner for job in self.picture.loading.get(block_hash, ())):
                return (f"block {block_hash} in flight for {owner} in {rid}'s load view at its admission, but no "
                        f"load of {owner} is bringing it in")
        for i in range(cached, cached + load.external_hit_blocks):
            block_hash = req.hash_at(i)
            loads = self.picture.loading.get(block_hash)
            if loads and block_hash not in shown:
                return (f"{rid}'s load view at its admission does not name its hit block {i} in flight, which "
                        f"{loads[0].rid}'s load job {loads[0].job_id} is bringing in")
        return None

    def on_end(self, ev: Event) -> None:
        probe = self.ctx.probe
        if probe is None or not self.settings.accounting or self.picture.cut is not None:
            return
        self._asks()
        engine, requests = probe.views()
        problem = self._engine_view(engine, probe.device()[0])
        if problem is None:
            problem = next((p for rid, view in requests.items() if (p := self._request_view(rid, view))), None)
        if problem is not None:
            self.fail(13, f"a policy would be shown {problem}")

    def _engine_view(self, view: Any, free: int) -> str | None:
        counts = {"running": 0, "waiting": 0, "loading": 0}
        for req in self.picture.requests.values():
            if not req.arrived:
                continue
            key = "waiting" if req.state == "lookup_pending" else req.state
            if key in counts:
                counts[key] += 1
        for field, n in counts.items():
            if getattr(view, field) != n:
                return f"{field}={getattr(view, field)} in its engine view, the records have {n} requests {field}"
        if view.free_device_blocks != free:
            return f"free_device_blocks={view.free_device_blocks} in its engine view, the device has {free} free"
        return None

    def _request_view(self, rid: str, view: Any) -> str | None:
        req = self.picture.requests.get(rid)
        if req is None or req.state == "sending":  # finished: its epoch's steps no longer count
            return None
        for field, want in (("state", req.state), ("generated_tokens", req.generated),
                            ("placeholder_tokens", req.in_flight)):
            if getattr(view, field) != want:
                return (f"{field}={getattr(view, field)!r} for {rid}, the records say {want!r} (placeholders: its "
                        f"sampling steps of this epoch whose output has not come)")
        return None
