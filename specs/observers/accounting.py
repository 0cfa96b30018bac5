"""Invariant 13, accounting: the figures a user reads agree with what happened; and 8,
block accounting, through the engine's own check. Three observers: ``Hits`` (what a request
found and what the device cache holds), ``Tiers`` (what was offered to and kept in the
tiers) and ``Counters`` (the engine's counters and per-request metrics).

Live, through the probe (``kvlife.specs.engine_probe``):

- the prefix hit the engine records for a request (device and tier blocks) is what its
  first admission skipped (where its first chunk starts; unknown if that load failed);
- an admission straight to running takes the longest prefix the device cache held: the
  first block it computes was cached in no block but its own (hit maximality);
- every full block a step computes is published in the device prefix cache by the end of
  the pass (vLLM caches a block when the step that computes it is scheduled);
- every block within the store limit (``Settings.store_rule``) of a request a step output
  confirmed, or finished, was offered to every tier: stored, already there, evicted, or
  refused by a full tier (``store_rejected``);
- a prefetch's landed blocks are in its tier; a tier keeps what was stored in it until an
  ``evict`` record (or a failed load) says otherwise;
- once inputs stop: the engine's counters (``engine.stats``) agree with its records, the
  finish time and preemptions its metrics keep for each request with the trace's, and
  every admission pass that passed over a request waiting on its prefetch was counted;
- after every handling, the engine's device pool and tiers pass ``check_accounting`` (8).

From records alone: a ``lookup_reuse`` record counts the uses of its answer, and says
when the answer came and how old it is (the time of its ``lookup_answered`` or
``lookup_expired`` transition); a prefetch's ``job_done`` says whether it was abandoned.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from kvlife.specs.observers.base import Context, Event, Observer, is_int
from kvlife.specs.observers.picture import Entry, Req, Step

# After these, a request's next answer is a new one (its uses count again).
_NEW_ANSWER = frozenset({"lookup_answered", "lookup_expired", "preempted", "load_failed", "turn_ended"})



def cached_prefix(probe: Any, req: Req, bt: int) -> list[frozenset[int]]:
    """The device blocks each of ``req``'s leading hit candidates is cached in now (live,
    through the probe), up to the first the device's prefix cache does not hold."""
    out: list[frozenset[int]] = []
    for i in range(req.hit_candidates(bt)):
        blocks = frozenset(probe.cached_blocks(req.hash_at(i)))
        if not blocks:
            break
        out.append(blocks)
    return out

class Hits(Observer):
    """13: recorded hits, hit maximality, blocks published when computed."""

    invariants = (13,)

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.hit_state: dict[str, str] = {}  # rid -> "pending" | "checked" | "unknown"
        self.hits_due: list[tuple[str, int]] = []
        self.cached_at_admit: dict[str, list[frozenset[int]]] = {}
        self.failed_load: set[str] = set()  # its next admission recomputes on the blocks it kept
        self.held_at_admit: dict[str, frozenset[int]] = {}  # rid -> blocks its answer's tiers held at admission
        self.published: dict[str, tuple[int, int]] = {}  # rid -> (epoch, leading blocks checked published)
        self.publish_due: list[tuple[str, int, int]] = []

    def on_transition(self, ev: Event) -> None:
        req, trigger = ev.req, str(ev.get("trigger"))
        assert req is not None
        if trigger in ("admitted", "load_started") and req.rid not in self.hit_state:
            self.hit_state[req.rid] = "pending"
        if trigger == "load_failed":
            self.failed_load.add(req.rid)
            self.held_at_admit.pop(req.rid, None)
            if self.hit_state.get(req.rid) == "pending":
                self.hit_state[req.rid] = "unknown"  # the first admission's load failed: no figure to check
        elif trigger in ("admitted", "load_started") and ev.source == "waiting":
            if self.ctx.probe is not None and req.rid not in self.failed_load:
                if trigger == "admitted":
                    self.cached_at_admit[req.rid] = self._cached(req)
                self.held_at_admit[req.rid] = self._tier_held(req)
            self.failed_load.discard(req.rid)

    def _tier_held(self, req: Req) -> frozenset[int]:
        """The leading blocks that, by the lookup answer ``req`` is admitted on, a tier holds
        now, below the last token (always computed) and, after a failed load, before its
        first failed block."""
        probe = self.ctx.probe
        assert probe is not None
        lookup, limit = probe.lookup(req.rid)
        end = min(len(lookup), req.hit_candidates(self.bt), limit)
        return frozenset(i for i in range(end)
                         if lookup[i] in self.settings.tiers and probe.tier_holds(lookup[i], req.hash_at(i)))

    def _cached(self, req: Req) -> list[frozenset[int]]:
        assert self.ctx.probe is not None
        return cached_prefix(self.ctx.probe, req, self.bt)

    def on_plan(self, ev: Event) -> None:
        step: Step = ev.data
        if not step.complete or self.ctx.probe is None:
            return
        for entry in step.entries:
            req = self.picture.requests.get(entry.rid)
            if req is None or entry.epoch != req.epoch:
                continue
            if req.fresh:
                self._first_chunk(req, entry)
            self._due_published(req, min(entry.before + entry.n, req.prompt + req.generated))

    def _first_chunk(self, req: Req, entry: Entry) -> None:
        """Where its first chunk after an admission starts is what the admission skipped."""
        if self.hit_state.get(req.rid) == "pending":
            self.hit_state[req.rid] = "checked"
            self.hits_due.append((req.rid, entry.before // self.bt))
        held = self.held_at_admit.pop(req.rid, None)
        if held is not None and entry.before // self.bt in held:
            self.fail(13, f"{req.rid}'s first step computes its block {entry.before // self.bt}, which the tier its "
                          f"lookup answer names held at its admission: a hit takes every block the tiers hold, "
                          f"after the device's")
        cached = self.cached_at_admit.pop(req.rid, None)
        first, table = entry.before // self.bt, entry.table or ()
        own = {table[first]} if first < len(table) else set()
        if cached is not None and first < len(cached) and cached[first] - own:
            self.fail(13, f"{req.rid} was admitted while device blocks {sorted(cached[first])} cached its block "
                          f"{first}, yet its first step computes from token {entry.before}: a hit takes the longest "
                          f"cached prefix")

    def _due_published(self, req: Req, end: int) -> None:
        epoch, done = self.published.get(req.rid, (req.epoch, 0))
        if epoch != req.epoch:
            done = 0
        full = end // self.bt
        self.publish_due += [(req.rid, i, req.hash_at(i)) for i in range(done, full)]
        self.published[req.rid] = (req.epoch, max(done, full))

    def on_end(self, ev: Event) -> None:
        probe = self.ctx.probe
        due, self.hits_due = self.hits_due, []
        publish, self.publish_due = self.publish_due, []
        if probe is None or self.picture.cut is not None:
            return
        for rid, hit in due:
            recorded = probe.recorded_hit(rid)
            if recorded is not None and recorded != hit:
                self.fail(13, f"{rid}: the engine records a prefix hit of {recorded} blocks, its first admission "
                              f"skipped {hit} (tokens 0..{hit * self.bt} were not computed)")
        missing = [(rid, i, h) for rid, i, h in publish if not probe.published(h)]
        if missing:
            rid, i, h = missing[0]
            self.fail(13, f"{rid}: block {i} (hash {h}) was computed by a step but is not published in the device "
                          f"prefix cache ({len(missing)} such blocks)")


class Tiers(Observer):
    """13: every block within the store limit offered to every tier; a tier keeps what was
    stored or prefetched into it until an evict record (or a failed load) says otherwise."""

    invariants = (13,)

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.offered: set[tuple[str, int]] = set()  # (tier, hash) stored, held, evicted or refused
        self.watch: set[str] = set()  # requests whose offers are checked at the end of the handling
        self.checked: dict[tuple[str, str], int] = {}  # (rid, tier) -> leading blocks checked
        self.present: set[tuple[str, int]] = set()  # (tier, hash) the tier should hold
        self.touched: list[tuple[str, int, str]] = []  # (tier, hash, why) to check at the end of the handling

    def seed_tier(self, tier: str, hashes: Any) -> None:
        for h in hashes:
            self.present.add((tier, h))
            self.offered.add((tier, h))

    def on_transition(self, ev: Event) -> None:
        if ev.get("trigger") in ("completed", "send_started") and ev.req is not None:
            self.watch.add(ev.req.rid)

    def on_output(self, ev: Event) -> None:
        for entry in ev.data.entries:
            req = self.picture.requests.get(entry.rid)
            if req is not None and req.state == "running" and entry.epoch == req.epoch:
                self.watch.add(req.rid)

    def on_job(self, ev: Event) -> None:
        job = ev.job
        if job is not None and job.kind in ("store", "prefetch"):
            self.offered.update((m.tier if job.kind == "store" else str(m.dst), m.block_hash) for m in job.moves or ())

    def on_job_complete(self, ev: Event) -> None:
        job = ev.job
        assert job is not None
        for move in job.moves or ():
            failed = move.block_hash in job.failed or job.timed_out
            if job.kind == "store":
                self._holds((move.tier, move.block_hash), not failed, f"store job {job.job_id} wrote it")
            elif job.kind == "prefetch":
                self._holds((str(move.dst), move.block_hash), not failed and not job.abandoned,
                            f"prefetch job {job.job_id} landed it")
            if move.block_hash in job.failed and job.kind != "store" and not job.join:
                self.present.discard((move.tier, move.block_hash))  # a block that failed to be read leaves its tier

    def _holds(self, key: tuple[str, int], holds: bool, why: str) -> None:
        if holds:
            self.present.add(key)
            self.touched.append((*key, why))
        else:
            self.present.discard(key)

    def on_reclaim(self, ev: Event) -> None:
        job = ev.job
        if job is not None and job.kind in ("store", "prefetch"):
            for move in job.moves or ():
                self.present.discard((str(move.dst) if job.kind == "prefetch" else move.tier, move.block_hash))

    def on_evict(self, ev: Event) -> None:
        tier, blocks = ev.get("tier"), ev.get("blocks")
        if isinstance(tier, str) and isinstance(blocks, list):
            for h in blocks:
                self.present.discard((tier, h))
                self.offered.add((tier, h))

    def on_store_rejected(self, ev: Event) -> None:
        req, tier = self.picture.request(ev.get("req")), ev.get("tier")
        if req is not None and isinstance(tier, str):
            key = (req.rid, tier)  # a full tier refused the offer: what is due now counts as offered to it
            self.checked[key] = max(self.checked.get(key, 0), self._due(req))

    def _due(self, req: Req) -> int:
        limit = req.confirmed if self.settings.store_rule == "confirmed" else req.computed
        return min(limit, max(req.computed, req.confirmed)) // self.bt

    def on_end(self, ev: Event) -> None:
        probe = self.ctx.probe
        touched, self.touched = self.touched, []
        if probe is None or self.picture.cut is not None:
            return
        for tier, h, why in touched:
            if (tier, h) in self.present and not probe.in_tier(tier, h):
                self.fail(13, f"{why} in {tier}, yet {tier} does not hold block {h} (and no evict record said so)")
                break
        if self.settings.store_rule is not None and self.picture.input_is("step_output"):
            self._offers()

    def _offers(self) -> None:
        """Every block within the store limit of a request watched now was offered to every tier."""
        probe = self.ctx.probe
        assert probe is not None
        watch, self.watch = self.watch, set()
        for rid in sorted(watch):
            req = self.picture.requests[rid]
            due = self._due(req)
            for tier in self.settings.tiers:
                i = self.checked.get((rid, tier), 0)
                while i < due:
                    h = req.hash_at(i)
                    if (tier, h) not in self.offered and not probe.in_tier(tier, h):
                        self.fail(13, f"{rid}: block {i} (hash {h}) is within its store limit ({due} blocks), yet it "
                                      f"was never offered to the {tier} tier")
                        return
                    i += 1
                self.checked[(rid, tier)] = i

    def on_finish(self, ev: Event) -> None:
        probe = self.ctx.probe
        if probe is None or self.picture.cut is not None:
            return
        for tier, h in sorted(self.present):
            if not probe.in_tier(tier, h):
                self.fail(13, f"the {tier} tier no longer holds block {h}, yet no evict record said so")
                break


class Counters(Observer):
    """13: the engine's counters, its per-request metrics (finish time, preemptions, tokens
    generated), lookup_reuse counts and prefetch waits agree with the records; 8: the
    engine's block accounting holds."""

    invariants = (8, 13)

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.tally = CounterTally()
        self.waited: dict[int, str] = {}  # prefetch job -> patience policy: an admission passed its request
        self.finished_at: dict[str, float | None] = {}
        self.reuses: dict[str, int] = {}
        self.answered: dict[str, float | None] = {}  # the time of each request's last async answer (or expiry)

    def on_record(self, ev: Event) -> None:  # every record as written, inputs included
        self.tally.feed(ev.data)
        for problem in self.tally.problems:
            self.fail(0, problem)
        self.tally.problems.clear()

    def on_transition(self, ev: Event) -> None:
        req, trigger = ev.req, str(ev.get("trigger"))
        assert req is not None
        if trigger in ("admitted", "load_started") and ev.source == "waiting":
            self._passed_prefetches(req)
        if ev.get("to") == "finished" and ev.source != "sending" or trigger == "send_started":
            self.finished_at[req.rid] = self.ctx.t
        if trigger in _NEW_ANSWER:
            self.reuses.pop(req.rid, None)  # its answer's uses count from 1 again
        if trigger in ("lookup_answered", "lookup_expired"):
            self.answered[req.rid] = self.ctx.t

    def _passed_prefetches(self, req: Req) -> None:
        """Requests ahead of ``req`` waiting on their prefetch while its patience lasts were
        deferred for it by this pass (the engine counts each prefetch once)."""
        waiting, t = self.picture.waiting, self.ctx.t
        for rid in waiting[:waiting.index(req.rid)] if req.rid in waiting else ():
            other = self.picture.requests[rid]
            live = self.picture.live_prefetch(other) if other.state == "waiting" else None
            if live is not None and t is not None and t < live[1]:
                self.waited[live[0].job_id] = self.picture.prefetch_of[rid][3]

    def on_job(self, ev: Event) -> None:
        job = ev.job
        if job is not None and job.kind == "load" and not job.join:
            self.tally.counts["redundant_block_loads"] += sum(
                1 for m in job.moves or () if self.picture.loading.get(m.block_hash))

    def on_job_done(self, ev: Event) -> None:
        job = ev.job
        if job is not None and job.kind == "prefetch" and bool(ev.get("abandoned", False)) != job.abandoned:
            self.fail(13, f"prefetch job {job.job_id}: job_done says abandoned={bool(ev.get('abandoned', False))}, "
                          f"but it was {'' if job.abandoned else 'not '}abandoned when its request's patience ran out")

    def on_lookup_reuse(self, ev: Event) -> None:
        rid, uses = str(ev.get("req")), ev.get("uses")
        self.reuses[rid] = self.reuses.get(rid, 0) + 1
        if not is_int(uses) or uses != self.reuses[rid] + 1:
            self.fail(13, f"{rid}: the lookup_reuse record counts {uses!r} uses of its answer, this is use "
                          f"{self.reuses[rid] + 1} (the first use writes no such record)")
        answered, age, t = self.answered.get(rid), ev.get("age_ms"), self.ctx.t
        if answered is not None and t is not None and (ev.get("answered") != answered or age != t - answered):
            self.fail(13, f"{rid}: the lookup_reuse record says its answer came at t={ev.get('answered')!r}, "
                          f"{age!r} ms ago; it came at t={answered:g}, {t - answered:g} ms ago")

    def on_end(self, ev: Event) -> None:
        probe = self.ctx.probe
        if probe is None or self.picture.cut is not None or not self.settings.accounting:
            return
        try:
            probe.check_accounting()
        except AssertionError as exc:
            self.fail(8, f"engine accounting: {exc}")

    def on_finish(self, ev: Event) -> None:
        probe = self.ctx.probe
        if probe is None or self.picture.cut is not None:
            return
        stats = probe.stats()
        for problem in self.tally.compare(stats):
            self.fail(13, f"engine counters disagree with its trace: {problem}")
        self._prefetch_waits(stats)
        for rid, req in self.picture.requests.items():
            if self._metrics_differ(rid, req):
                return

    def _metrics_differ(self, rid: str, req: Req) -> bool:
        probe = self.ctx.probe
        assert probe is not None
        kept, counted, generated = probe.finish_time(rid), probe.preemptions(rid), probe.generated(rid)
        if req.state == "finished" and kept is not None and kept != self.finished_at.get(rid):
            self.fail(13, f"{rid}: the engine's metrics keep finish time {kept}, the trace says it finished at "
                          f"t={self.finished_at.get(rid)}")
            return True
        if counted is not None and counted != req.preemptions:
            self.fail(13, f"{rid}: the engine counts {counted} preemptions of it, the trace has {req.preemptions}")
            return True
        if self.settings.live and generated is not None and generated != req.generated:
            self.fail(13, f"{rid}: the engine counts {generated} generated tokens, its step outputs delivered "
                          f"{req.generated}")
            return True
        return False

    def _prefetch_waits(self, stats: Any) -> None:
        waits, deferrals = getattr(stats, "prefetch_waits", None), getattr(stats, "deferrals", None)
        if isinstance(waits, int) and waits < len(self.waited):
            self.fail(13, f"stats.prefetch_waits is {waits}, but admissions passed requests waiting on "
                          f"{len(self.waited)} prefetches in flight (jobs {sorted(self.waited)})")
        elif isinstance(deferrals, dict):
            for policy, n in Counter(self.waited.values()).items():
                if deferrals.get(policy, 0) < n:
                    self.fail(13, f"stats.deferrals[{policy!r}] is {deferrals.get(policy, 0)}, but {n} requests "
                                  f"waited on their prefetches under its patience")


class CounterTally:
    """What the engine's records say its counters (``engine.stats``, which ``kvlife run``
    reports) must be. Each counter is incremented where the engine writes the record
    counted here; a counter that drifts from its records misreports the run."""

    JOBS = {"load": ("loads", "blocks_loaded"), "store": ("stores", "blocks_stored"),
            "prefetch": ("prefetches", "blocks_prefetched")}
    COUNTED = ("ticks", "steps", "sync_lookups", "async_lookups", "stale_lookup_answers", "failed_lookups",
               "preemptions", "prefetch_gave_up", "loads", "blocks_loaded", "stores", "blocks_stored",
               "prefetches", "blocks_prefetched", "redundant_block_loads", "expired_lookups", "failed_blocks",
               "joined_blocks", "flushed_stores", "reclaimed_jobs", "late_reports", "failed_loads", "failed_stores")

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.warnings: Counter[str] = Counter()
        self.defers: Counter[str] = Counter()
        self._failed_answer = False  # the lookup answer being handled says the lookup failed
        self.problems: list[str] = []  # values that are no count, since the last record was fed

    def feed(self, record: dict[str, Any]) -> None:
        kind = record.get("kind")
        handler = getattr(self, "_" + str(kind), None)
        if handler is not None:
            handler(record)

    def _input(self, record: dict[str, Any]) -> None:
        kind = record.get("type")
        if kind == "tick":
            self.counts["ticks"] += 1
        self._failed_answer = kind == "lookup_answer" and record.get("tiers") is None

    def _step(self, record: dict[str, Any]) -> None:
        self.counts["steps"] += 1 if record.get("requests") else 0
        self.counts["sync_lookups"] += self._count(record, "sync_lookups")
        flush = record.get("flush") or []
        if isinstance(flush, list):
            self.counts["flushed_stores"] += len(flush)
        else:
            self.problems.append(f"step record: field 'flush': expected a list of store jobs, got {flush!r}")

    def _stale_lookup(self, record: dict[str, Any]) -> None:
        self.counts["stale_lookup_answers"] += 1

    def _transition(self, record: dict[str, Any]) -> None:
        trigger = record.get("trigger")
        if trigger == "lookup_answered" and self._failed_answer:
            self.counts["failed_lookups"] += 1
        elif trigger == "preempted":
            self.counts["preemptions"] += 1
        elif trigger == "lookup_expired":
            self.counts["expired_lookups"] += 1
        elif trigger == "lookup_submitted":
            self.counts["async_lookups"] += 1

    def _job(self, record: dict[str, Any]) -> None:
        op = record.get("op")
        if isinstance(op, str) and op in self.JOBS:  # (an edited trace's op may be any JSON value)
            jobs, blocks = self.JOBS[op]
            self.counts[jobs] += 1
            # A join's device copies cross no tier link: joined, not loaded, blocks.
            self.counts["joined_blocks" if record.get("after") is not None else blocks] += \
                self._count(record, "blocks")

    def _job_done(self, record: dict[str, Any]) -> None:
        failed = self._count(record, "failed")
        self.counts["failed_blocks"] += failed
        if failed and record.get("op") in ("load", "store"):  # device jobs some block of which failed
            self.counts[f"failed_{record.get('op')}s"] += 1

    def _count(self, record: dict[str, Any], field: str) -> int:
        """A record's count (of blocks, of lookups); a value that is no count (an edited trace)
        is a finding."""
        value = record.get(field) or 0
        if is_int(value):
            return value
        self.problems.append(f"{record.get('kind')} record: field '{field}': expected a count, got {value!r}")
        return 0

    def _reclaim(self, record: dict[str, Any]) -> None:
        self.counts["reclaimed_jobs"] += 1

    def _warning(self, record: dict[str, Any]) -> None:
        what = str(record.get("what"))
        self.warnings[what] += 1
        if what == "late_report":
            self.counts["late_reports"] += 1

    def _decision(self, record: dict[str, Any]) -> None:
        point, value = record.get("point"), record.get("value")
        if point == "admission" and value == "defer":
            self.defers[str(record.get("policy"))] += 1
        elif point == "prefetch_patience" and value == "compute":
            self.counts["prefetch_gave_up"] += 1

    def compare(self, stats: Any) -> list[str]:
        problems = []
        for name in self.COUNTED:
            value = getattr(stats, name, None)
            if isinstance(value, int) and value != self.counts[name]:
                problems.append(f"stats.{name} is {value}, the trace says {self.counts[name]}")
        warnings = getattr(stats, "warnings", None)
        if isinstance(warnings, dict) and {k: v for k, v in warnings.items() if v} != dict(self.warnings):
            problems.append(f"stats.warnings is {dict(warnings)}, the trace has {dict(self.warnings)}")
        timeouts = getattr(stats, "rank_timeouts", None)
        if isinstance(timeouts, int) and timeouts != self.warnings["rank_timeout"]:
            problems.append(f"stats.rank_timeouts is {timeouts}, the trace warns {self.warnings['rank_timeout']}")
        deferrals, waits = getattr(stats, "deferrals", None), getattr(stats, "prefetch_waits", None)
        # A deferral is an admission decision to defer (recorded when it changes) or a wait
        # for a prefetch (stats.prefetch_waits, by the patience policy).
        if isinstance(deferrals, dict) and isinstance(waits, int) and (
                sum(deferrals.values()) != sum(self.defers.values()) + waits
                or any(deferrals.get(p, 0) < n for p, n in self.defers.items())):
            problems.append(f"stats.deferrals is {dict(deferrals)}: the trace has {dict(self.defers)} admission "
                            f"deferrals and stats.prefetch_waits is {waits}")
        return problems
