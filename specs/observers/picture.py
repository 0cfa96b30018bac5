"""The picture: what the observers know of the run, rebuilt from the stream alone.

``Picture`` holds the requests (their spec state and the observer's own epoch count, their
tokens), the jobs (moves, per-rank reports) and the steps in flight. ``Tracker`` is the
pipeline's first and last stage for every event: ``admit`` reads the event (a malformed
record is a finding of invariant 0 and goes no further) and names what it refers to
(``Event.req``, ``Event.job``, the request's state before a transition); once every
observer has seen it, ``commit`` applies it to the picture and yields the events it
implies, each seen by the observers before it is applied in turn:

- ``plan``: a step was planned (live: the engine's ``StepPlan``, every entry with its
  block table; a trace: the ``step`` record's prompt chunks and fills);
- ``output``: the output of the oldest step in flight arrived (an output for any other
  step must be ignored by the engine: ``Picture.ignored_output``);
- ``job_complete``: the last rank reported a job (a ``transfer_report`` input, or a
  step output's ``reports``, applied after its tokens as vLLM applies them).

The picture follows the engine's documented protocol, never the engine's state: the
observers judge the engine against it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import attrs

from kvlife.specs.observers.base import Context, Event, is_int, is_number

# Triggers after which a request is in a new epoch (docs/design.md: epochs).
EPOCH_BUMPS = frozenset({"preempted", "load_failed", "completed", "aborted", "failed", "lookup_expired",
                         "send_started", "turn_ended"})
# The engine's commands, by class name (the observers import no engine code to read them).
COMMAND_KINDS = {"StepPlan": "plan_command", "SubmitLookup": "submit_lookup", "DiscardLookup": "discard_lookup",
                 "StartLoad": "start_load", "StartStore": "start_store", "StartPrefetch": "start_prefetch",
                 "FreeBlocks": "free_blocks"}
_CHUNK_FIELDS = ("prompt", "fills")


@attrs.define(slots=True, eq=False)
class Req:
    rid: str
    prompt: int = 0
    arrived: bool = False  # (a record may name a request that never arrived)
    hashes: tuple[int, ...] = ()  # the full prompt blocks' hashes, then derived ones as needed
    max_tokens: int | None = None
    arrival_blocks: int = 0  # block hashes its arrival named
    state: str = "waiting"
    epoch: int = 0
    seen_end: int = 0  # the furthest token a step computed for it (any epoch)
    computed: int = 0  # tokens computed or in flight in this epoch (a trace: the listed chunks)
    generated: int = 0  # sampled tokens delivered (live)
    in_flight: int = 0  # samples of this epoch whose step output has not come (live)
    stale: int = 0  # samples of an older epoch whose step output has not come (live)
    preemptions: int = 0
    # Tokens of its current epoch vouched for: its prefix hit (where the first chunk after an
    # admission starts) and the chunks whose step output came while it ran.
    confirmed: int = 0
    fresh: bool = False  # admitted: its next chunk starts at its hit
    hit_known: bool = False  # a chunk told its hit in this epoch
    ever_blocks: int = 0  # full blocks a delivered step output completed, in any epoch
    loads: list[Job] = attrs.Factory(list)  # its load jobs (joins included) of its current epoch
    landed: bool = False  # its loads all completed and a step output since told the scheduler (finished_recving)
    # After a failed load: the loads the scheduler has not heard of yet (it holds the request
    # until finished_recving, as vLLM holds one in WAITING_FOR_REMOTE_KVS).
    unreceived: list[Job] = attrs.Factory(list)
    index: dict[int, int] | None = None  # hash -> first block position (built when needed)

    @property
    def known(self) -> int:
        """Its tokens as the scheduler knows them: prompt, delivered and in-flight samples."""
        return self.prompt + self.generated + self.in_flight

    def hit_candidates(self, bt: int) -> int:
        """How many of its leading blocks a prefix hit may cover: the full blocks of its
        known tokens but the last token, always computed to sample the next (vLLM's
        ``num_tokens - 1``; the engine's ``CoreState.hit_candidates``)."""
        return (self.prompt + self.generated - 1) // bt

    def hash_at(self, i: int) -> int:
        """The hash of its block ``i`` (a prompt block, or derived past the prompt)."""
        if i >= len(self.hashes):
            from kvlife.lifecycle.engine.blocks import extend_hashes

            start = len(self.hashes)
            self.hashes = extend_hashes(self.hashes, self.rid, i + 1)
            if self.index is not None:
                for j in range(start, len(self.hashes)):
                    self.index.setdefault(self.hashes[j], j)
        return self.hashes[i]

    def name_block(self, i: int, block_hash: int) -> None:
        """Block ``i`` of generated tokens is named ``block_hash`` (a trace written inside
        vLLM names them by vLLM's hashes, which no reader can derive)."""
        if i < 0:
            return
        if i >= len(self.hashes):
            self.hash_at(i)
        if self.hashes[i] != block_hash:
            self.hashes = (*self.hashes[:i], block_hash, *self.hashes[i + 1:])
            if self.index is not None:
                self.index.setdefault(block_hash, i)

    def position(self, block_hash: int, block_tokens: int) -> int | None:
        """The block ``block_hash`` names in this request: a prompt block, or a block of
        generated tokens up to the furthest token a step computed."""
        if self.index is None:
            self.index = {}
            for i, h in enumerate(self.hashes):
                self.index.setdefault(h, i)
        found = self.index.get(block_hash)
        reach = -(-max(self.seen_end, self.prompt) // block_tokens)
        if found is None and reach > len(self.hashes):
            self.hash_at(reach - 1)
            found = self.index.get(block_hash)
        return found


@attrs.define(slots=True)
class Move:
    """One block of a job: a load or store (``device`` block, ``tier``; a join's tier is
    "device"), or a prefetch (no device block; ``tier`` its source, ``dst`` its target)."""

    block_hash: int
    device: int | None
    tier: str
    dst: str | None = None
    slot: int | None = None  # a join's source device block (live: from the command)


@attrs.define(slots=True, eq=False)
class Job:
    job_id: int
    kind: str  # "load" | "store" | "prefetch"
    rid: str
    epoch: int  # the request's epoch (the observer's count) when it started
    t: float | None  # when it started
    moves: tuple[Move, ...] | None = None  # None: the record named none
    after: int | None = None  # a join: the load whose device blocks it copies
    reported: set[int] = attrs.Factory(set)
    heard: set[int] = attrs.Factory(set)  # ranks that reported it at all (late ones too: the worker is done)
    failed: set[int] = attrs.Factory(set)
    complete: bool = False  # every rank reported (the observer's own count)
    done_recorded: bool = False  # the engine said job_done
    timed_out: bool = False  # given up at its transfer deadline (rank_timeout)
    reclaimed: bool = False  # reclaimed at its reclaim deadline: ended, a later report changes nothing
    abandoned: bool = False  # a prefetch its request stopped waiting for
    flushed_in: int | None = None  # a store flushed by a preemption: the step whose plan says so
    # Given up at a deadline: the step whose metadata tells the workers (they then count it done).
    abandoned_in: int | None = None
    received: bool = False  # a load the scheduler heard of (finished_recving) with a step output

    @property
    def open(self) -> bool:
        return not self.complete and not self.reclaimed

    @property
    def join(self) -> bool:
        return self.after is not None or bool(self.moves and self.moves[0].tier == "device")


class Entry(NamedTuple):
    """One request's share of a planned step. A trace names only prompt chunks and chunks
    that fill a block (``samples``, ``table`` and ``hashes`` None)."""

    rid: str
    epoch: int
    before: int
    n: int
    samples: bool | None = None
    table: tuple[int, ...] | None = None
    hashes: tuple[int, ...] | None = None


@attrs.define(slots=True, eq=False)
class Step:
    step_id: int
    entries: list[Entry]
    flush: tuple[int, ...] = ()
    complete: bool = True  # every entry is listed (live); a trace lists only some
    t: float | None = None
    prefill: int | None = None  # the prefill tokens its record or plan states
    failed_ranks: tuple[int, ...] = ()  # its output says it wrote no KV on these ranks (the live runtime)


class Picture:
    def job(self, key: Any) -> Job | None:
        """The job a record names (None: none, or a field that is no job id)."""
        return self.jobs.get(key) if is_int(key) else None

    def request(self, key: Any) -> Req | None:
        """The request a record names (None: none, or a field that is no request id)."""
        return self.requests.get(key) if isinstance(key, str) else None

    def __init__(self) -> None:
        self.requests: dict[str, Req] = {}
        self.jobs: dict[int, Job] = {}
        self.open: dict[int, Job] = {}  # jobs not ended (complete or reclaimed), in start order
        # Joins by the load they copy from, registered while that load was still open.
        self.readers: dict[int, list[Job]] = {}
        self.loading: dict[int, list[Job]] = {}  # block hash -> the tier loads bringing it (not given up)
        self.steps: dict[int, Step] = {}  # planned, output not yet delivered, in plan order
        self.max_planned = -1
        self.last_output = -1  # the last step whose output was delivered
        self.input: Any = None  # the input event being handled
        self.handlings = 0
        self.ticks = 0
        self.cut: dict[str, Any] | None = None  # the interrupted record, once seen
        self.completed_now: list[Job] = []  # jobs the last rank reported in this handling
        self.ignored_output: int | None = None  # a step output the engine must ignore (not the oldest)
        self.chunks_known = True  # every step record named its prompt chunks (5 from a trace)
        # Early prefetch: a request's patience answer (policy, ms) until its prefetch job
        # record; then its prefetch: (job, its epoch, the patience deadline, the policy).
        self.patience: dict[str, tuple[str, float]] = {}
        self.prefetch_of: dict[str, tuple[Job, int, float, str]] = {}
        # The scheduler's queue as the engine's protocol keeps it: requests that started a
        # load (vLLM's kv-holding requests, promoted first), then the waiting queue
        # (arrivals at the back, a preempted request in front).
        self.holding: list[str] = []
        self.waiting: list[str] = []
        self.running: dict[str, int] = {}  # rid -> when it began to run (vLLM's running list, in order)
        self.ran = 0
        self.preempted_now: list[tuple[int, str]] = []  # (place in running, id) preempted by this pass

    def input_is(self, kind: str) -> bool:
        return self.input is not None and self.input.type == kind

    def live_prefetch(self, req: Req) -> tuple[Job, float] | None:
        """``req``'s prefetch of its current epoch, in flight and not given up, with its
        patience deadline; None if it has none."""
        wait = self.prefetch_of.get(req.rid)
        if wait is None:
            return None
        job, epoch, deadline, _policy = wait
        if epoch != req.epoch or not job.open or job.abandoned or job.timed_out:
            return None
        return job, deadline



class Tracker:
    """Reads every event into the picture (see the module docstring)."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.pic = ctx.picture
        self.settings = ctx.settings

    def fail(self, message: str) -> None:
        self.ctx.fail(0, message)

    # ---- admit: read the event, name what it refers to ------------------------------------
    def admit(self, ev: Event) -> bool:
        """False: the event is malformed (a finding of 0) and goes no further."""
        reader = getattr(self, "_admit_" + ev.kind, None)
        return True if reader is None else bool(reader(ev))

    def _admit_input(self, ev: Event) -> bool:
        from kvlife.lifecycle.engine.events import BadEvent, input_from_record

        # Live records still hold tuples; the trace format (and the parser) has lists.
        record = {k: list(v) if isinstance(v, tuple) else v for k, v in ev.data.items()}
        try:
            event: Any = input_from_record(record)
        except BadEvent as exc:
            self.pic.input = None
            self.fail(f"bad input record: {exc}")
            return False
        ev.kind, ev.data = event.type, event
        self.pic.input = event
        self.pic.handlings += 1
        self.ctx.t = float(event.t)
        ev.req = self.pic.requests.get(getattr(event, "request_id", ""))
        if event.type == "tick":
            self.pic.ticks += 1
        elif event.type == "arrival" and ev.req is None:
            full = event.prompt_tokens // self.settings.block_tokens
            ev.req = self.pic.requests[event.request_id] = Req(
                event.request_id, event.prompt_tokens, True, tuple(event.block_hashes[:full]), event.max_tokens,
                len(event.block_hashes))
            self.pic.waiting.append(event.request_id)
        elif event.type == "step_output":
            steps = self.pic.steps
            self.pic.ignored_output = None if steps and next(iter(steps)) == event.step_id else event.step_id
        return True

    def _admit_transition(self, ev: Event) -> bool:
        rid, source, target, trigger = (ev.get(k) for k in ("req", "from", "to", "trigger"))
        if not all(isinstance(x, str) for x in (rid, source, target, trigger)):
            self.fail("transition record lacks req/from/to/trigger")
            return False
        ev.req = self.pic.requests.get(rid)
        if ev.req is None:  # (1 says so; followed from here on)
            ev.req = self.pic.requests[rid] = Req(rid)
        ev.source = ev.req.state
        return True

    def _admit_job(self, ev: Event) -> bool:
        job_id, op, rid = ev.get("job"), ev.get("op"), ev.get("req")
        if not is_int(job_id) or op not in ("load", "store", "prefetch") or not isinstance(rid, str):
            self.fail("job record lacks job/op/req")
            return False
        assert isinstance(op, str)
        if job_id in self.pic.jobs:
            self.ctx.fail(7, f"job {job_id} started twice")
            return False
        after = ev.get("after")
        req = ev.req = self.pic.requests.get(rid)
        job = ev.job = self.pic.jobs[job_id] = Job(job_id, op, rid, req.epoch if req is not None else 0, self.ctx.t,
                                                   after=after if is_int(after) else None)
        job.moves = self._moves(ev.get("moves"), job)
        self.pic.open[job_id] = job
        self._register_join(job)
        return True

    def _register_join(self, job: Job) -> None:
        owner = self.pic.jobs.get(job.after) if job.after is not None else None
        if owner is not None and owner.open:
            self.pic.readers.setdefault(owner.job_id, []).append(job)

    def _moves(self, raw: Any, job: Job) -> tuple[Move, ...] | None:
        if raw is None:
            self.ctx.note("job records without moves: invariants 2, 5 and 6 were not checked for them", 2, 5, 6, 10)
            return None
        moves = [self._move(item, job) for item in (raw if isinstance(raw, list) else [None])]
        if all(move is not None for move in moves):
            return tuple(m for m in moves if m is not None)
        shape = ("[block_hash, src_tier, dst_tier]" if job.kind == "prefetch"
                 else "[block_hash, device_block, tier(, position)]")
        self.fail(f"{job.kind} job {job.job_id}: field 'moves' must be a list of {shape}")
        return None

    def _move(self, item: Any, job: Job) -> Move | None:
        """One move of a job record, or None if it is malformed. A stored block of generated
        tokens whose name no reader can derive (vLLM's hash) comes with its position."""
        if not isinstance(item, list) or len(item) not in (3, 4) or not is_int(item[0]) \
                or not isinstance(item[2], str):
            return None
        if len(item) == 4:
            if job.kind != "store" or not is_int(item[3]):
                return None
            req = self.pic.request(job.rid)
            if req is not None:
                req.name_block(item[3], item[0])
        if job.kind == "prefetch":
            return Move(item[0], None, item[1], item[2]) if isinstance(item[1], str) else None
        return Move(item[0], item[1], item[2]) if is_int(item[1]) else None

    def _admit_job_done(self, ev: Event) -> bool:
        ev.job = self.pic.job(ev.get("job"))
        return True

    _admit_reclaim = _admit_job_done

    def _admit_abandon(self, ev: Event) -> bool:
        ev.job = self.pic.job(ev.get("job"))
        if ev.job is None or ev.job.kind != "prefetch":
            self.fail(f"abandon record for job {ev.get('job')}, which is not a prefetch that started")
            return False
        return True

    def _admit_free(self, ev: Event) -> bool:
        blocks = ev.get("blocks")
        if not isinstance(blocks, list) or not all(is_int(b) for b in blocks):
            self.fail("free record lacks a list of device blocks")
            return False
        if not blocks:
            self.fail("a free of no device blocks: a release that frees nothing tells the driver nothing")
        return True

    def _admit_evict(self, ev: Event) -> bool:
        if not isinstance(ev.get("tier"), str) or not (
                isinstance(ev.get("blocks"), list) and all(is_int(h) for h in ev.get("blocks"))):
            self.fail("evict record lacks a tier name and a list of block hashes")
            return False
        return True

    def _admit_step(self, ev: Event) -> bool:
        if not is_int(ev.get("step")):
            self.fail("step record lacks an integer 'step'")
            return False
        for field in _CHUNK_FIELDS:
            chunks = ev.get(field, [])
            if chunks is not None and not (isinstance(chunks, list) and all(
                    isinstance(c, list) and len(c) == 3 and isinstance(c[0], str) and is_int(c[1]) and is_int(c[2])
                    for c in chunks)):
                self.fail(f"step {ev.get('step')}: field '{field}' must be a list of "
                          f"[request_id, computed_before, tokens]")
                return False
        flush = ev.get("flush", [])
        if not isinstance(flush, list) or not all(is_int(j) for j in flush):
            self.fail(f"step {ev.get('step')}: field 'flush' must be a list of store job ids")
            return False
        return True

    def _admit_start_load(self, ev: Event) -> bool:
        """Live: a join's moves name their source block (``slot``), which its record does not."""
        command = ev.data
        ev.job = self.pic.jobs.get(command.job_id)
        if ev.job is None:  # no recorder: the command alone opens the job
            req = self.pic.requests.get(command.request_id)
            kind = "load" if ev.kind == "start_load" else "store"
            ev.job = self.pic.jobs[command.job_id] = Job(
                command.job_id, kind, command.request_id, req.epoch if req is not None else 0, self.ctx.t,
                tuple(Move(m.block_hash, m.device_block, m.tier) for m in command.moves),
                getattr(command, "after", None))
            self.pic.open[command.job_id] = ev.job
            self._register_join(ev.job)
        if ev.job.moves is not None:
            slots = {m.block_hash: m.slot for m in command.moves if m.tier == "device"}
            for move in ev.job.moves:
                move.slot = slots.get(move.block_hash, move.slot)
        return True

    _admit_start_store = _admit_start_load

    # ---- commit: apply the event, yield what it implies ------------------------------------
    def commit(self, ev: Event) -> Iterator[Event]:
        applier = getattr(self, "_commit_" + ev.kind, None)
        if applier is not None:
            yield from applier(ev) or ()

    def _commit_job(self, ev: Event) -> None:
        job = ev.job
        if job is not None and job.kind == "load" and ev.req is not None and ev.req.epoch == job.epoch:
            ev.req.loads.append(job)
        if job is not None and job.kind == "load" and not job.join:
            for move in job.moves or ():
                self.pic.loading.setdefault(move.block_hash, []).append(job)
        elif job is not None and job.kind == "prefetch":
            patience = self.pic.patience.pop(job.rid, None)
            if patience is not None and job.t is not None:
                self.pic.prefetch_of[job.rid] = (job, job.epoch, job.t + patience[1], patience[0])

    def _commit_decision(self, ev: Event) -> None:
        value, rid = ev.get("value"), ev.get("req")
        if ev.get("point") == "prefetch_patience" and is_number(value) and isinstance(rid, str):
            self.pic.patience[rid] = (str(ev.get("policy")), float(value))

    def _stop_bringing(self, job: Job | None) -> None:
        if job is None or job.kind != "load":
            return
        for move in job.moves or ():
            bringing = self.pic.loading.get(move.block_hash)
            if bringing and job in bringing:
                bringing.remove(job)
                if not bringing:
                    del self.pic.loading[move.block_hash]

    def _commit_transition(self, ev: Event) -> None:
        req, trigger = ev.req, ev.get("trigger")
        assert req is not None
        req.state = str(ev.get("to"))
        if trigger in EPOCH_BUMPS:
            req.epoch += 1
            req.stale += req.in_flight
            req.in_flight = 0
            req.computed = 0
            req.confirmed = 0
            req.fresh = req.hit_known = False
            if trigger == "load_failed":
                req.unreceived = [j for j in req.loads if not j.received]
            req.loads = []
        if trigger in ("admitted", "load_done"):
            req.fresh = True
        if trigger in EPOCH_BUMPS or trigger == "load_done":
            req.landed = False
        if trigger == "preempted":
            req.preemptions += 1
        elif trigger == "turn_ended":
            self._next_chunk(req)
        self._queue(req.rid, str(trigger), req.state)

    def _next_chunk(self, req: Req) -> None:
        """A resumable request's turn ended for its next input chunk (the arrival input of
        this handling): its prompt is the chunk's now (the last turn's kept outputs and the
        new input), its outputs start again."""
        chunk = self.pic.input
        if not (self.pic.input_is("arrival") and chunk.request_id == req.rid):
            return  # (invariant 1 says so)
        full = chunk.prompt_tokens // self.settings.block_tokens
        req.prompt, req.hashes, req.max_tokens = chunk.prompt_tokens, tuple(chunk.block_hashes[:full]), chunk.max_tokens
        req.arrival_blocks = len(chunk.block_hashes)
        req.generated = 0
        req.index = None

    def _queue(self, rid: str, trigger: str, target: str) -> None:
        pic = self.pic
        if rid in pic.running and target != "running":
            if trigger == "preempted":  # (the pass's victims go to the front in running order)
                pic.preempted_now.append((pic.running[rid], rid))
            del pic.running[rid]
        elif target == "running" and rid not in pic.running:
            pic.running[rid] = pic.ran
            pic.ran += 1
        if trigger == "load_started":
            if rid in pic.waiting:
                pic.waiting.remove(rid)
            pic.holding.append(rid)
        elif trigger in ("admitted", "load_done") or target == "finished":
            for queue in (pic.holding, pic.waiting):
                if rid in queue:
                    queue.remove(rid)

    def _commit_step(self, ev: Event) -> Iterator[Event]:
        step_id = ev.get("step")
        if self.settings.live:
            return
        prompt = ev.get("prompt")
        if prompt is None:
            self.pic.chunks_known = False
            self.ctx.note("step records without prompt chunks: invariant 5 was not checked", 5)
        entries = []
        for rid, before, n in (prompt or []) + (ev.get("fills") or []):
            req = self.pic.requests.get(rid)
            entries.append(Entry(rid, req.epoch if req is not None else 0, before, n))
        prefill = ev.get("prefill_tokens")
        yield from self._plan(Step(step_id, entries, tuple(ev.get("flush") or ()), False, self.ctx.t,
                                   prefill if is_int(prefill) else None))

    def _commit_plan_command(self, ev: Event) -> Iterator[Event]:
        plan = ev.data
        entries = []
        for e in plan.entries:
            req = self.pic.requests.get(e.request_id)
            entries.append(Entry(e.request_id, req.epoch if req is not None else 0, e.computed_before, e.num_tokens,
                                 e.samples, tuple(e.block_table), tuple(e.block_hashes)))
        yield from self._plan(Step(plan.step_id, entries, tuple(plan.flush), True, self.ctx.t,
                                   getattr(plan, "prefill_tokens", None)))

    def _plan(self, step: Step) -> Iterator[Event]:
        pic = self.pic
        if step.step_id in pic.steps or step.step_id <= pic.last_output:
            self.fail(f"step {step.step_id} planned twice")
            return
        plan = Event("plan", step)
        yield plan
        if pic.preempted_now:  # vLLM preempts from the back of running, each to the front of waiting
            front = [rid for _, rid in sorted(pic.preempted_now)]
            pic.waiting = front + [rid for rid in pic.waiting if rid not in front]
            pic.preempted_now = []
        pic.steps[step.step_id] = step
        pic.max_planned = max(pic.max_planned, step.step_id)
        for job_id in step.flush:
            job = pic.jobs.get(job_id)
            if job is not None and job.flushed_in is None:
                job.flushed_in = step.step_id
        for entry in step.entries:
            req = pic.requests.get(entry.rid)
            if req is None:
                continue
            end = entry.before + entry.n
            req.seen_end = max(req.seen_end, end)
            req.computed = max(req.computed, end)
            if entry.samples:
                req.in_flight += 1
            if req.fresh and entry.epoch == req.epoch:
                req.fresh, req.hit_known, req.confirmed = False, True, entry.before

    def _commit_step_output(self, ev: Event) -> Iterator[Event]:
        pic = self.pic
        event = ev.data
        if pic.ignored_output is not None:
            return  # the engine ignores it: nothing of it applies (its reports neither)
        step = pic.steps.pop(event.step_id)
        step.failed_ranks = tuple(getattr(event, "failed_ranks", ()) or ())
        yield Event("output", step)
        pic.last_output = step.step_id
        if not step.failed_ranks:  # (a failed step's requests are aborted: none takes its token)
            self._deliver(step)
        for job_id, rank, failed in event.reports:
            yield from self._report(job_id, rank, failed)

    def _deliver(self, step: Step) -> None:
        """The step's sampled tokens: delivered to the epoch that sampled them, and to a
        request preempted since, which waits (vLLM appends its token all the same)."""
        for entry in step.entries:
            req = self.pic.requests.get(entry.rid)
            if req is None:
                continue
            end = entry.before + entry.n
            req.ever_blocks = max(req.ever_blocks, end // self.settings.block_tokens)
            if entry.epoch == req.epoch and req.state == "running":
                req.confirmed = max(req.confirmed, end)
            if not entry.samples:
                continue
            if entry.epoch == req.epoch:
                req.in_flight -= 1
                req.generated += 1
            else:
                req.stale -= 1
                if req.state == "waiting":
                    req.generated += 1

    def _commit_transfer_report(self, ev: Event) -> Iterator[Event]:
        event = ev.data
        yield from self._report(event.job_id, event.rank, event.failed)

    def _report(self, job_id: int, rank: int, failed: Any) -> Iterator[Event]:
        job = self.pic.jobs.get(job_id)
        if job is not None and 0 <= rank < self.settings.ranks:
            job.heard.add(rank)
        if job is None or not job.open or not 0 <= rank < self.settings.ranks or rank in job.reported:
            return  # unknown, ended, a bad rank or a duplicate: it must change nothing (3)
        job.reported.add(rank)
        job.failed.update(failed)
        if len(job.reported) == self.settings.ranks:
            job.complete = True
            self.pic.open.pop(job_id, None)
            self.pic.completed_now.append(job)
            yield Event("job_complete", job=job, req=self.pic.requests.get(job.rid))
            self._stop_bringing(job)

    def _commit_warning(self, ev: Event) -> None:
        if ev.get("what") != "rank_timeout":
            return
        job = self.pic.job(ev.get("job"))
        if job is not None and job.open:
            job.timed_out = True
            job.abandoned_in = self.pic.max_planned + 1  # the step this pass plans carries it
            self._stop_bringing(job)

    def _commit_reclaim(self, ev: Event) -> None:
        if ev.job is not None and ev.job.open:
            ev.job.reclaimed = True
            ev.job.timed_out = True
            if ev.job.abandoned_in is None:
                ev.job.abandoned_in = self.pic.max_planned + 1
            self.pic.open.pop(ev.job.job_id, None)
            self._stop_bringing(ev.job)

    def _commit_abandon(self, ev: Event) -> None:
        assert ev.job is not None
        ev.job.abandoned = True

    def _commit_job_done(self, ev: Event) -> None:
        if ev.job is not None:
            ev.job.done_recorded = True

    def _commit_interrupted(self, ev: Event) -> None:
        signal = ev.get("signal")
        # A run an error ended part-way names the error instead of a signal (drivers.runner.error_record).
        if signal not in ("SIGINT", "SIGTERM") and not (signal is None and isinstance(ev.get("error"), str)):
            self.fail(f"interrupted record: field 'signal' must be 'SIGINT' or 'SIGTERM' (or null, with an "
                      f"'error'), got {signal!r}")
        if not is_number(ev.get("t")):
            self.fail(f"interrupted record: field 't' must be a number, got {ev.get('t')!r}")
        self.pic.cut = ev.data

    def _read(self, job: Job, step: int) -> bool:
        """Joins still copy ``job``'s blocks: the workers report its request's loads
        finished only after them (``WorkerBook``)."""
        return any(j.open and not (j.abandoned_in is not None and j.abandoned_in <= step)
                   for j in self.pic.readers.get(job.job_id, ()))

    def end(self) -> None:
        """The handling ended: a step output told the scheduler of the loads that ended."""
        pic = self.pic
        if pic.input_is("step_output") and pic.ignored_output is None:
            for rid in pic.holding:
                self._received(pic.requests[rid], pic.last_output)
        pic.completed_now = []
        pic.input = None
        pic.ignored_output = None

    def _received(self, req: Req, step: int) -> None:
        for job in (*req.loads, *req.unreceived):
            if not job.received and (job.complete or (job.abandoned_in is not None and job.abandoned_in <= step)) \
                    and not self._read(job, step):
                job.received = True
        if req.state == "loading" and req.loads and all(j.received for j in req.loads):
            req.landed = True
        if req.unreceived and all(j.received for j in req.unreceived):
            req.unreceived = []
