"""The vLLM-order driver: kvlife's engine stepped exactly as vLLM's engine core steps vLLM.

No vLLM is needed. One ``step`` is one ``schedule()`` pass (a ``Tick``), its step's jobs run
on simulated ranks at once (``SimulatedRank``: each job reports after a scripted number of
steps, a flushed or abandoned one in this step), and the step's output, with those ranks'
reports, is applied right after the pass (synchronous scheduling) or after the next pass
(async scheduling: one step in flight), as ``harness.VllmDriver`` does for vLLM's real
scheduler. Async lookups are answered by the connector itself, ``lookup_delay_steps`` passes
after they went out, as ``KVLifeConnector``'s lookup client answers them inside vLLM
(``DelayedLookups``). Requests arrive and abort at scripted steps. Each step is observed as
``StepObs``, the terms the differential comparison (``kvlife vllm-diff``) compares.

``SimulatedRank`` and ``DelayedLookups`` are shared with vLLM's side: the simulated worker
inside vLLM (``drivers.vllm.worker.SimulatedWorker``) is a ``SimulatedRank``, and
``KVLifeConnector`` answers its lookups with ``DelayedLookups``; only the schedulers differ.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from kvlife.lifecycle.config import EngineConfig
from kvlife.lifecycle.engine.core import Engine
from kvlife.lifecycle.engine.events import (
    Abort,
    Arrival,
    DiscardLookup,
    LookupAnswer,
    StartLoad,
    StartPrefetch,
    StartStore,
    StepOutput,
    StepPlan,
    SubmitLookup,
    Tick,
)
from kvlife.lifecycle.engine.worker_book import WorkerBook
from kvlife.policies.stack import PolicyStack

# (job id, kind, request id) -> steps until the job reports (0: in this step's output;
# None: never, a transfer that hangs).
DelayFn = Callable[[int, str, str], int | None]
# (rank, kind, request id, block hashes) -> the block hashes of the job that fail on that rank.
FailFn = Callable[[int, str, str, Sequence[int]], Sequence[int]]


@attrs.frozen
class RankJob:
    """One load or store as a worker is given it."""

    job_id: int
    kind: str  # "load" or "store"
    request_id: str
    block_hashes: tuple[int, ...]
    device_blocks: tuple[int, ...]
    after: int | None = None  # a join: reports with this load, once it has


class SimulatedRank:
    """One rank with no bytes: a job reports after a scripted delay in steps (a join with
    the load it copies from), with the blocks ``fail`` names failed. A flushed job reports in
    this step, an abandoned one too, every block failed; a delay of None never reports."""

    def __init__(self, rank: int = 0, load_delay: int | DelayFn | None = 1, store_delay: int | DelayFn | None = 0,
                 fail: FailFn | None = None) -> None:
        self.rank = rank
        self._load_delay = load_delay
        self._store_delay = store_delay
        self.fail = fail
        self.step = 0
        self._due: dict[int, tuple[int | None, RankJob]] = {}  # job -> (due step or never, job)
        self._followers: dict[int, list[RankJob]] = {}  # load -> the joins copying from it
        self._done: dict[int, tuple[int, ...]] = {}  # loads reported: their failed blocks
        self.book = WorkerBook()

    def _delay(self, job: RankJob) -> int | None:
        delay = self._store_delay if job.kind == "store" else self._load_delay  # a prefetch reads as a load
        return delay(job.job_id, job.kind, job.request_id) if callable(delay) else delay

    def run_step(self, jobs: Sequence[RankJob], flush: Sequence[int] = (), abandon: Sequence[int] = (),
                 holds: Sequence[str] = ()) -> list[tuple[int, int, tuple[int, ...]]]:
        """Take one step's jobs; return this rank's reports of the step, (job, rank, failed)."""
        self.step += 1
        for job in sorted(jobs, key=lambda j: j.job_id):
            self.book.add(job.job_id, job.kind, job.request_id, job.block_hashes, job.device_blocks, job.after)
            if job.after is not None:
                if job.after in self._done:
                    self._due[job.job_id] = (self.step, job)
                else:
                    self._followers.setdefault(job.after, []).append(job)
                continue
            delay = self._delay(job)
            self._due[job.job_id] = (None if delay is None else self.step + delay, job)
        for job_id in flush:
            if job_id in self._due:
                self._due[job_id] = (self.step, self._due[job_id][1])
        abandoned = {j for j in abandon if j in self._due}
        for job_id in abandoned:
            self._due[job_id] = (self.step, self._due[job_id][1])
        self.book.hold(holds)
        reports: list[tuple[int, int, tuple[int, ...]]] = []
        while True:
            due = sorted(j for j, (when, _) in self._due.items() if when is not None and when <= self.step)
            if not due:
                break
            for job_id in due:
                _, job = self._due.pop(job_id)
                if job_id in abandoned:
                    failed = job.block_hashes
                elif job.after is not None:
                    source = set(self._done.get(job.after, ()))
                    failed = tuple(h for h in job.block_hashes if h in source)
                else:
                    failed = tuple(self.fail(self.rank, job.kind, job.request_id, job.block_hashes)) \
                        if self.fail is not None else ()
                reports.append((job_id, self.rank, failed))
                self.book.done(job_id, failed)
                if job.kind == "load" and job.after is None:
                    self._done[job_id] = failed
                    for follower in self._followers.pop(job_id, ()):
                        self._due[follower.job_id] = (self.step, follower)
        return reports

    @property
    def busy(self) -> bool:
        return bool(self._due) or bool(self._followers)


class DelayedLookups:
    """A connector's own async lookups: each answered ``delay`` scheduler passes after it
    went out, with what the tiers hold then (``answer``)."""

    def __init__(self, delay: int, answer: Callable[[Sequence[int]], tuple[str, ...]]) -> None:
        self.delay = delay
        self.answer = answer
        self._pending: dict[tuple[str, int], tuple[int, tuple[int, ...]]] = {}  # (req, epoch) -> (due pass, hashes)
        self._passes = 0

    def submit(self, command: SubmitLookup) -> None:
        self._pending.setdefault((command.request_id, command.epoch),
                                 (self._passes + self.delay, command.block_hashes))

    def discard(self, command: DiscardLookup) -> None:
        """The answer still comes (and is recorded as stale): a client cannot recall it."""

    def due(self, pass_index: int, now: float) -> list[LookupAnswer]:
        self._passes = pass_index
        due = sorted((k for k, (when, _) in self._pending.items() if when <= pass_index),
                     key=lambda k: self._pending[k][0])
        out = []
        for key in due:
            _, hashes = self._pending.pop(key)
            out.append(LookupAnswer(now, key[0], key[1], self.answer(hashes)))
        return out

    @property
    def busy(self) -> bool:
        return bool(self._pending)


@attrs.frozen
class Item:
    """One request of a differential workload: token ids, so vLLM hashes its blocks."""

    step: int  # the scheduler step it arrives before
    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    abort_step: int | None = None
    continues: str | None = None  # the request whose prompt and answer this one's prompt begins with
    block_hashes: tuple[int, ...] | None = None  # kvlife's names of its blocks, if not its tokens'


@attrs.define
class StepObs:
    """What one scheduler step decided, in the terms the differential comparison compares."""

    step: int
    scheduled: dict[str, tuple[int, int]]  # request -> (computed before, tokens)
    external_hits: dict[str, int]  # request -> tokens its loads started this step bring
    loads_started: int
    waiting_remote: int  # requests waiting for their KV to land
    preempted: tuple[str, ...]

    def key(self) -> tuple[Any, ...]:
        return (sorted(self.scheduled.items()), sorted(self.external_hits.items()), self.loads_started,
                self.waiting_remote, self.preempted)


def content_hashes(prompt: Sequence[int], block: int, previous: bytes = b"") -> tuple[int, ...]:
    """kvlife's names of a prompt's full blocks: chained hashes of their tokens."""
    out, prev = [], previous
    for i in range(len(prompt) // block):
        digest = hashlib.blake2b(prev + repr(tuple(prompt[i * block:(i + 1) * block])).encode(),
                                 digest_size=8).digest()
        out.append(int.from_bytes(digest, "big") >> 1)
        prev = digest
    return tuple(out)


def item_hashes(item: Item, items: dict[str, Item], block: int) -> tuple[int, ...]:
    """An item's block hashes as kvlife names them: content hashes, except that a turn
    continuing another starts with that turn's prompt blocks and then the blocks its
    answer filled, under the engine's derived names (``blocks.derived_block_hash``)."""
    from kvlife.lifecycle.engine.blocks import extend_hashes

    if item.block_hashes is not None:
        return item.block_hashes
    if item.continues is None:
        return content_hashes(item.prompt, block)
    first = items[item.continues]
    context = extend_hashes(item_hashes(first, items, block)[: len(first.prompt) // block], first.request_id,
                            (len(first.prompt) + first.max_tokens) // block)
    rest = content_hashes(item.prompt[len(context) * block:], block, context[-1].to_bytes(8, "big"))
    return context + rest


class VllmOrderDriver:
    """Steps an ``Engine`` as ``harness.VllmDriver`` steps vLLM (see the module docstring)."""

    def __init__(self, config: EngineConfig, policies: PolicyStack, ranks: Sequence[SimulatedRank],
                 lookup_delay_steps: int = 1, recorder: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.lookups = DelayedLookups(lookup_delay_steps, self._tier_answer)
        self.engine = Engine(config, policies, recorder=self._record, lookups=self.lookups)
        self.recorder = recorder
        self.ranks = list(ranks)
        self.in_flight = 1 if config.async_scheduling else 0
        self.pending: deque[tuple[StepPlan, list[tuple[int, int, tuple[int, ...]]]]] = deque()
        self.observations: list[StepObs] = []
        self.step_index = 0
        self._moves: list[tuple[str, str]] = []  # (request, trigger) of the pass being made

    def _tier_answer(self, hashes: Sequence[int]) -> tuple[str, ...]:
        return self.engine.sync_lookup(hashes)

    def _record(self, record: dict[str, Any]) -> None:
        if record["kind"] == "transition":
            self._moves.append((record["req"], record["trigger"]))
        if self.recorder is not None:
            self.recorder(record)

    def add(self, item: Item, hashes: Sequence[int]) -> None:
        self.engine.handle(Arrival(float(self.step_index), item.request_id, len(item.prompt), tuple(hashes),
                                   max_tokens=item.max_tokens))

    def abort(self, request_id: str) -> None:
        self.engine.handle(Abort(float(self.step_index), request_id))

    def finished(self, request_id: str) -> bool:
        req = self.engine.requests.get(request_id)
        return req is None or req.state == "finished"

    def step(self, stops: Callable[[StepPlan], tuple[tuple[str, str], ...]]) -> StepObs:
        """One pass; its jobs go to the ranks; its output (now or after the next pass)."""
        engine = self.engine
        t = float(self.step_index)
        self._moves = []
        commands = engine.handle(Tick(t))
        plan = next(c for c in commands if isinstance(c, StepPlan))
        jobs: list[RankJob] = []
        obs = StepObs(self.step_index + 1, {e.request_id: (e.computed_before, e.num_tokens) for e in plan.entries},
                      {}, 0, 0, ())
        for c in commands:
            if isinstance(c, StartLoad):
                jobs.append(RankJob(c.job_id, "load", c.request_id, tuple(m.block_hash for m in c.moves),
                                    tuple(m.device_block for m in c.moves), c.after))
                obs.loads_started += 1
                obs.external_hits[c.request_id] = obs.external_hits.get(c.request_id, 0) + \
                    len(c.moves) * engine.config.block_tokens
            elif isinstance(c, StartStore):
                jobs.append(RankJob(c.job_id, "store", c.request_id, tuple(m.block_hash for m in c.moves),
                                    tuple(m.device_block for m in c.moves)))
            elif isinstance(c, StartPrefetch):
                jobs.append(RankJob(c.job_id, "prefetch", c.request_id, tuple(m.block_hash for m in c.moves), ()))
        reports = [r for rank in self.ranks for r in rank.run_step(jobs, plan.flush)]
        obs.preempted = tuple(sorted(rid for rid, trigger in self._moves if trigger == "preempted"))
        obs.waiting_remote = engine.scheduler.waiting_for_remote_kvs()
        self.observations.append(obs)
        self.step_index += 1
        self.pending.append((plan, reports))
        while len(self.pending) > self.in_flight:
            self._apply(*self.pending.popleft(), stops)
        return obs

    def _apply(self, plan: StepPlan, reports: list[tuple[int, int, tuple[int, ...]]],
               stops: Callable[[StepPlan], tuple[tuple[str, str], ...]]) -> None:
        self.engine.handle(StepOutput(float(self.step_index), plan.step_id, stops(plan), tuple(reports)))

    def drain(self, stops: Callable[[StepPlan], tuple[tuple[str, str], ...]]) -> None:
        while self.pending:
            self._apply(*self.pending.popleft(), stops)

    def idle(self) -> bool:
        """Nothing left: no request the scheduler still holds, no transfer or lookup in flight."""
        return not self.engine.scheduler.requests and not any(r.busy for r in self.ranks) \
            and not self.lookups.busy


def length_stops(engine: Engine, max_tokens: dict[str, int]) -> Callable[[StepPlan], tuple[tuple[str, str], ...]]:
    """The scripted model's side of a step output: a request stops at its ``max_tokens``
    (vLLM's ``FINISHED_LENGTH_CAPPED``), counting a token a preempted request's step still
    delivers."""

    def stops(plan: StepPlan) -> tuple[tuple[str, str], ...]:
        out = []
        for entry in plan.entries:
            if entry.samples:
                produced = engine.output_tokens(entry.request_id)
                if produced is not None and produced + 1 >= max_tokens[entry.request_id]:
                    out.append((entry.request_id, "length"))
        return tuple(out)

    return stops


def run_items(driver: VllmOrderDriver, items: Sequence[Item], limit: int = 2000) -> list[StepObs]:
    """Drive ``items`` through the engine in vLLM's order, as the differential drives vLLM
    (``differential.drive``): arrivals before the pass of their step, aborts at theirs."""
    by_id = {it.request_id: it for it in items}
    block = driver.engine.config.block_tokens
    stops = length_stops(driver.engine, {it.request_id: it.max_tokens for it in items})
    pending = sorted(items, key=lambda it: it.step)
    aborts = sorted((it for it in items if it.abort_step is not None), key=lambda it: (it.abort_step, it.step))
    step = 0
    while step < limit:
        while pending and pending[0].step <= step:
            item = pending.pop(0)
            driver.add(item, item_hashes(item, by_id, block))
        for item in aborts:
            if item.abort_step == step and item.step <= step and not driver.finished(item.request_id):
                driver.abort(item.request_id)
        driver.step(stops)
        step += 1
        if not pending and driver.idle():
            break
    driver.drain(stops)
    return driver.observations
