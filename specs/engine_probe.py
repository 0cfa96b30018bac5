"""The one adapter between the checkers and a live engine's internals.

The invariant observers (``kvlife.specs.observers``) judge a run from its records and
commands; what those cannot tell (the engine's counters, its device prefix cache, its
tiers' contents, the metrics it keeps per request, its block accounting, its next
wakeup) a live check reads through ``EngineProbe``, and only through it. The model
checker (``kvlife.specs.model_check``) drives the engine as an adversary and reads the
engine's state to choose its inputs and to judge liveness at the end; those reads are
here too. Every read is of the engine's documented parts (``Engine.core``,
``Engine.scheduler``, ``Engine.requests``, ...); a variant engine of the bug zoo has the
same parts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class EngineProbe:
    """Reads of one engine. ``retired``: requests the engine let go of (retention on), by id."""

    def __init__(self, engine: Any, retired: Mapping[str, Any] | None = None) -> None:
        self.engine = engine
        self.retired: Mapping[str, Any] = retired if retired is not None else {}
        # With watch_admissions: each request's last admission answer and the pass it came in.
        self._admissions: dict[str, tuple[int, Any]] | None = None
        # With watch_admissions: the asks not yet looked at: (request, hook, the views past
        # the request's and before the engine's), noted as each ask begins.
        self._shown: list[tuple[str, str, tuple[Any, ...]]] = []

    def watch_admissions(self) -> None:
        """Note each admission answer with the pass (step id) it was given in. A request
        whose lookup brings nothing is not asked at all, so its last recorded decision may
        be a deferral of an earlier pass; only this tells it from one of the last pass."""
        lifecycle, scheduler = self.engine.core.lifecycle, self.engine.scheduler
        ask = lifecycle.ask
        admissions: dict[str, tuple[int, Any]] = {}
        self._admissions = admissions
        shown = self._shown

        def watched(req: Any, hook: str, *args: Any) -> Any:
            shown.append((req.request_id, hook, args))
            answer = ask(req, hook, *args)
            if hook == "admission":
                admissions[req.request_id] = (scheduler.next_step_id, answer)
            return answer

        lifecycle.ask = watched

    # ---- what the observers read --------------------------------------------------------------
    def take_shown(self) -> list[tuple[str, str, tuple[Any, ...]]]:
        """The policy asks begun since the last call (with watch_admissions): each request,
        hook and the hook's own views (a ``LoadView``, a ``PrefetchView``, a count)."""
        shown = list(self._shown)
        self._shown.clear()
        return shown

    def commands(self) -> list[Any] | None:
        """The commands of the handling under way, as the engine issues them."""
        commands = getattr(getattr(self.engine, "state", None), "commands", None)
        return commands if isinstance(commands, list) else None

    def request(self, rid: str) -> Any:
        """The engine's record of ``rid`` (or the one it retired); None if it has none."""
        req = self.engine.requests.get(rid)
        return req if req is not None else self.retired.get(rid)

    def recorded_hit(self, rid: str) -> int | None:
        """The prefix hit its metrics keep (device and tier blocks); None: not known."""
        req = self.request(rid)
        if req is None or not hasattr(req, "tier_hit_blocks"):
            return None
        return int(req.device_hit_blocks + sum(req.tier_hit_blocks.values()))

    def finish_time(self, rid: str) -> float | None:
        finish = getattr(self.request(rid), "finish_ms", None)
        return float(finish) if isinstance(finish, int | float) else None

    def generated(self, rid: str) -> int | None:
        """Tokens its metrics count as generated (None: not known)."""
        count = getattr(self.request(rid), "generated", None)
        return count if isinstance(count, int) else None

    def preemptions(self, rid: str) -> int | None:
        count = getattr(self.request(rid), "preemptions", None)
        return count if isinstance(count, int) else None

    def stats(self) -> Any:
        return getattr(self.engine, "stats", None)

    def published(self, block_hash: int) -> bool:
        """Is ``block_hash`` in the device prefix cache?"""
        return self.engine.pool.block_of(block_hash) is not None

    def cached_blocks(self, block_hash: int) -> tuple[int, ...]:
        """Every device block the prefix cache holds ``block_hash`` in, oldest first."""
        return tuple(self.engine.pool.cached.get(block_hash, ()))

    def in_tier(self, tier: str, block_hash: int) -> bool:
        """Does ``tier`` hold ``block_hash``? True if the engine has no such tier."""
        tiers = self.engine.tiers
        return tier not in tiers or bool(tiers[tier].contains(block_hash))

    def next_wakeup(self) -> float | None:
        wake = self.engine.next_wakeup()
        return float(wake) if wake is not None else None

    def check_accounting(self) -> None:
        """Invariant 8: raises AssertionError if the device pool or a tier is off."""
        self.engine.check_invariants()

    # ---- what the model checker's driver reads -----------------------------------------------
    @property
    def config(self) -> Any:
        return self.engine.config

    def state(self, rid: str) -> str:
        """A request's state; one the engine retired (or never had) is finished."""
        req = self.engine.requests.get(rid)
        return "finished" if req is None else str(req.state)

    def epoch(self, rid: str) -> int | None:
        req = self.engine.requests.get(rid)
        return None if req is None else int(req.epoch)

    def hashes(self, rid: str) -> tuple[int, ...]:
        req = self.engine.requests.get(rid)
        return tuple(req.hashes) if req is not None else ()

    def lookup(self, rid: str) -> tuple[tuple[str, ...], int]:
        """The lookup answer ``rid`` is admitted on (the tier of each leading block) and the
        block from which a failed load forbids tier hits."""
        req = self.engine.requests.get(rid)
        if req is None:
            return (), 0
        return tuple(req.lookup or ()), int(req.external_hit_limit)

    def output_tokens(self, rid: str) -> int | None:
        """Tokens the scheduler has output for ``rid`` (None: it left the scheduler)."""
        return self.engine.output_tokens(rid)

    def sync_lookup(self, hashes: Any) -> tuple[str, ...]:
        return tuple(self.engine.sync_lookup(hashes))

    def tier_names(self) -> list[str]:
        return list(self.engine.tiers)

    def tier_holds(self, tier: str, block_hash: int) -> bool:
        return bool(self.engine.tiers[tier].contains(block_hash))

    def tier_has_room(self, tier: str) -> bool:
        return bool(self.engine.tiers[tier].has_room())

    def busy_tiers(self) -> dict[str, list[int]]:
        """Blocks each tier still holds for a transfer (pinned or being written)."""
        out = {}
        for name, tier in self.engine.tiers.items():
            busy = tier.busy() if hasattr(tier, "busy") else []
            if busy:
                out[name] = list(busy)
        return out

    def job_given_up(self, job_id: int) -> bool:
        job = self.engine.jobs.get(job_id)
        return job is not None and bool(job.timed_out)

    def job_request(self, job_id: int) -> str | None:
        job = self.engine.jobs.get(job_id)
        return None if job is None else str(job.request_id)

    def busy(self) -> bool:
        return bool(self.engine.busy())

    def unfinished(self) -> list[str]:
        return sorted(r.request_id for r in self.engine.state.unfinished())

    def stranded(self) -> list[str]:
        return list(self.engine.stranded())

    def counts(self) -> dict[str, int]:
        return dict(self.engine.state_counts)

    def in_flight_work(self) -> bool:
        """Something runs, loads, stores or pulls (a job not given up, a prefetch), or the
        scheduler still holds a request for its load's outcome (finished_recving to come)."""
        counts = self.engine.state_counts
        return bool(counts["running"] or counts["loading"] or counts["sending"] or self.engine.prefetches
                    or any(not job.timed_out for job in self.engine.jobs.values())
                    or any(r.status.name == "WAITING_FOR_REMOTE_KVS" for r in self.engine.scheduler.kv_holding))

    def queue(self) -> list[Any]:
        """The connector's records of the waiting requests, in the scheduler's queue order
        (landed loads first, then the waiting queue)."""
        scheduler = self.engine.scheduler
        order = [*scheduler.kv_holding, *scheduler.waiting]
        requests = self.engine.requests
        return [requests[r.request_id] for r in order if r.request_id in requests]

    def waiting_line(self) -> list[tuple[str, int, bool]]:
        """The requests waiting to be admitted, in queue order: (id, device blocks its known
        tokens still need beyond those it holds, deferred by its admission policy in the last
        pass; without watch_admissions, by its last recorded admission decision)."""
        scheduler, requests, bt = self.engine.scheduler, self.engine.requests, self.engine.config.block_tokens
        line = []
        for sched in [*scheduler.kv_holding, *scheduler.waiting]:
            req = requests.get(sched.request_id)
            if req is None or req.state != "waiting" or sched.status.name == "WAITING_FOR_REMOTE_KVS" \
                    or sched.num_stale_output_tokens:
                continue  # (the scheduler waits for its load's or its preempted step's output)
            need = -(-req.known_tokens // bt) - len(sched.blocks)
            line.append((req.request_id, need, self._deferred(req)))
        return line

    def _deferred(self, req: Any) -> bool:
        if self._admissions is None:
            decided = req.last_decisions.get("admission")
            return decided is not None and decided[1] == "defer"
        return self._admissions.get(req.request_id) == (self.engine.scheduler.next_step_id - 1, "defer")

    def unfinished_requests(self) -> list[Any]:
        return [r for r in self.engine.requests.values() if r.state != "finished"]

    def device(self) -> tuple[int, int, list[int]]:
        """(free blocks, capacity, the blocks still referenced)."""
        pool = self.engine.pool
        return pool.free, pool.capacity, [b for b in range(pool.capacity) if pool.refs[b] > 0]

    def views(self) -> tuple[Any, dict[str, Any]]:
        """What a policy asked now would be shown: the engine view, and each unfinished
        request's view, by id (built as ``Lifecycle.ask`` builds them)."""
        engine = self.engine
        return (engine.core.lifecycle.engine_view(),
                {rid: r.view() for rid, r in engine.requests.items() if r.state != "finished"})

    def progress(self) -> tuple[Any, ...]:
        """What changes whenever something happens (a move, a job or step started)."""
        state = self.engine.state
        return ((state.next_job_id, self.engine.scheduler.next_step_id)
                + tuple((r.state, r.epoch, r.computed) for r in self.engine.requests.values()))

    def held_requests(self) -> list[str]:
        """The requests the engine still holds (with retention on, none once all finished)."""
        return sorted(self.engine.requests)

    def kept_for_nothing(self) -> str | None:
        """Retention on: a finished request the engine still holds though nothing refers to
        it any more (no hold, no store or load of it, no prefetch it waits on)."""
        state = self.engine.state
        for rid, req in state.requests.items():
            if req.state == "finished" and not req.hold and not req.store_jobs and not req.load_jobs \
                    and rid not in state.prefetch_waits and rid not in state.wants_prefetch:
                return f"{rid} finished and nothing refers to it, yet the engine still holds it (retention)"
        return None
