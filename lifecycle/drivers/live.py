"""The live driver: the same engine in wall-clock time with real KV bytes.

Each tensor-parallel rank is a thread that owns its KV shard (``kvlife.transfer.layout.DeviceKV``),
its own tier bytes (host pool, disk file, Redis keys with its rank) and a
``kvlife.transfer.copy_engine.CopyEngine``. The main thread owns the engine: it feeds arrivals,
ticks, step outputs, lookup answers and per-rank transfer reports, and sends each
command to every rank's inbox. A rank runs a synthetic forward step that writes KV
content determined by (block hash, layer, position, rank), so with ``verify`` every
loaded block is compared byte for byte with what was computed for it (invariant 9).

Async lookups run on a single-thread executor and come back as futures; the engine's
tier indexes are read only on the main thread. Torch copies release the GIL, so rank
threads do overlap. The core still takes time only from its inputs: the driver reads
the monotonic clock and passes the value in.

Nothing hangs or fails unnoticed (docs/design.md, "Live runtime"): rank reports have a
deadline (``DEFAULT_REPORT_DEADLINE_MS`` unless the config sets one); a stall watchdog
(``live.stall_timeout_s``) stops a run that has work but makes no progress, naming its
unfinished requests as stranded; rank threads catch everything and report a failing
step as a failed step; every Redis client shares one circuit breaker; shutdown is
bounded, and leaves the temporary directory to a rank thread that is still alive.
"""

from __future__ import annotations

import queue
import secrets
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import attrs
import torch

from kvlife.lifecycle.config import ConfigError, LiveConfig, RunConfig
from kvlife.lifecycle.drivers import interrupts
from kvlife.lifecycle.drivers.simulator import SimResult, cut_record, step_finishes, stop_rule
from kvlife.lifecycle.engine import records
from kvlife.lifecycle.engine.core import Engine, Recorder
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
    TransferReport,
)
from kvlife.lifecycle.workloads.mooncake import WorkloadRequest
from kvlife.policies.stack import PolicyStack
from kvlife.policies.watchdog import Overrun, Watch
from kvlife.transfer.breaker import CircuitBreaker
from kvlife.transfer.content import fill_block, verify_block
from kvlife.transfer.copy_engine import CopyEngine, Move
from kvlife.transfer.disk_tier import DiskTier
from kvlife.transfer.host_pool import HostPool
from kvlife.transfer.index import TierIndex
from kvlife.transfer.layout import BlockGeometry, DeviceKV, ModelShape
from kvlife.transfer.redis_tier import RedisTier

TierBytes = HostPool | DiskTier | RedisTier


class LoopStalled(Overrun):
    """The live loop stood still past ``live.stall_timeout_s`` (raised in it by the watchdog)."""

    message = "the live run's loop stood still"


@attrs.define
class LiveStats:
    blocks_verified: int = 0
    mismatches: int = 0
    tier_events: list[dict[str, Any]] = attrs.Factory(list)


def model_shape(live: LiveConfig, block_tokens: int) -> ModelShape:
    try:
        return ModelShape(live.num_layers, live.num_kv_heads, live.head_dim, live.dtype, block_tokens)
    except (TypeError, ValueError) as exc:
        raise ConfigError("live", f"bad model shape: {exc}") from None


class RankWorker(threading.Thread):
    """One tensor-parallel rank: its KV shard, its tiers' bytes, its copy engine.

    The loop never dies on an error: whatever raises (a forward step, a submission, a
    flush, the poll of copies in flight, the drain of tier events) is caught and reported,
    a failed step as a failed step and every job it held as failed, so the main thread
    always gets an answer for what it sent.
    """

    def __init__(self, rank: int, geometry: BlockGeometry, device_blocks: int,
                 tiers: dict[str, TierBytes], outbox: queue.Queue[tuple[Any, ...]], verify: bool,
                 silent: Callable[[int, Any], bool] | None = None) -> None:
        super().__init__(name=f"kvlife-rank-{rank}", daemon=True)
        self.rank = rank
        self.kv = DeviceKV(geometry, device_blocks)
        self.tiers = tiers
        self.copies = CopyEngine(self.kv, rank, tiers)
        self.inbox: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self.outbox = outbox
        self.verify = verify
        # Set by the main thread at shutdown: leave at once, whatever is still queued.
        self.stopping = threading.Event()
        # Fault injection: a rank that never reports some jobs (tests of the deadline).
        self.silent = silent
        self.stats = LiveStats()
        self._staging = torch.zeros((1, geometry.block_bytes), dtype=torch.uint8)
        # Moves of each load in flight, kept (only with verify) to check its blocks once
        # the copy has landed; every path that ends a job removes it.
        self._moves_of: dict[Any, tuple[Move, ...]] = {}
        self._open: dict[Any, tuple[int, ...]] = {}  # submitted, not yet reported
        # Joins (a load copying device blocks another load fills): load job -> the joins
        # waiting for it on this rank; and each load's failed blocks once it reported here.
        self._joins: dict[Any, list[tuple[Any, tuple[Move, ...]]]] = {}
        self._loaded: dict[Any, tuple[int, ...]] = {}

    def run(self) -> None:
        while not self.stopping.is_set():
            message: tuple[Any, ...] | None = None
            try:
                message = self._next_message()
                if message is not None:
                    if message[0] == "stop":
                        return
                    self._handle(message)
            except Exception as exc:  # a rank must report, never die silently
                self._failed(message, exc)
            try:
                self._drain_tier_events()
            except Exception as exc:
                self._error("tier events", exc)

    def _next_message(self) -> tuple[Any, ...] | None:
        """The next command; None after polling copies in flight (CUDA events not done
        yet) when nothing came in, so completions are reported without a new message."""
        if self.copies.pending_jobs:
            try:
                return self.inbox.get(timeout=0.0005)
            except queue.Empty:
                self._report_completions()
                return None
        try:
            return self.inbox.get(timeout=0.1)  # wakes up to see ``stopping``
        except queue.Empty:
            return None

    def _handle(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "step":
            try:
                if message[1].flush:
                    # Stores of requests preempted in this pass: their blocks may be reused by
                    # this step, so every copy in flight ends first.
                    self.copies.synchronize()
                    self._report_completions()
                self._forward(message[1])
            except Exception as exc:
                # The step's KV was not (all) written on this rank: a failed step.
                self.outbox.put(("step_done", message[1].step_id, self.rank, f"{type(exc).__name__}: {exc}"))
                return
            self.outbox.put(("step_done", message[1].step_id, self.rank, None))
        elif kind == "join":
            job_id, after, moves = message[1], message[2], tuple(_move(m) for m in message[3])
            if after in self._loaded:
                self._copy_join(job_id, moves, self._loaded[after])
            else:
                self._joins.setdefault(after, []).append((job_id, moves))
        elif kind in ("load", "store"):
            job_id, moves = message[1], tuple(_move(m) for m in message[2])
            hashes = tuple(m.block_hash for m in moves)
            try:
                if kind == "load":
                    self.copies.submit_load(job_id, moves)
                else:
                    self.copies.submit_store(job_id, moves)
            except Exception as exc:  # refused (a bad move, a block already under transfer): this job fails
                self._error(kind, exc)
                self.outbox.put(("report", job_id, self.rank, hashes))
                return
            self._open[job_id] = hashes
            if kind == "load" and self.verify:
                self._moves_of[job_id] = moves
        elif kind == "flush":
            # One batched submission per direction for everything one engine call asked
            # for, issued after that call's step was computed.
            self.copies.flush()
            self._report_completions()
        elif kind == "prefetch":
            try:
                failed = self._prefetch(message[2])
            except Exception as exc:
                self._error("prefetch", exc)
                failed = tuple(m.block_hash for m in message[2])
            self.outbox.put(("report", message[1], self.rank, failed))

    def _failed(self, message: tuple[Any, ...] | None, exc: Exception) -> None:
        """Something raised outside a step: report it, and every job this rank holds
        (submitted, flushed or in flight) as failed, so nothing waits for it."""
        where = "poll" if message is None else str(message[0])
        self._error(where, exc)
        self._fail_open()

    def _error(self, where: str, exc: Exception) -> None:
        self.outbox.put(("rank_error", self.rank, f"{where}: {type(exc).__name__}: {exc}"))

    def _fail_open(self) -> None:
        open_jobs, self._open = self._open, {}
        self._moves_of.clear()
        try:
            self.copies.abandon()
        except Exception as exc:  # the copy engine is beyond repair: a fresh one
            self._error("abandon", exc)
            self.copies = CopyEngine(self.kv, self.rank, self.tiers)
        for job_id, hashes in open_jobs.items():
            self.outbox.put(("report", job_id, self.rank, hashes))

    def forget(self) -> None:
        """Drop the per-job maps once the thread has ended (nothing reports them now)."""
        self._moves_of.clear()
        self._open.clear()

    def _drain_tier_events(self) -> None:
        for tier in self.tiers.values():
            drain = getattr(tier, "drain_events", None)
            if drain is not None:
                for event in drain():
                    self.outbox.put(("tier_event", self.rank, event))

    def _forward(self, plan: StepPlan) -> None:
        """The synthetic model: write the KV of every prompt block this step completes."""
        for entry in plan.entries:
            bt = self.kv.geometry.shape.block_tokens
            first = entry.computed_before // bt
            end = min((entry.computed_before + entry.num_tokens) // bt, len(entry.block_hashes))
            for i in range(first, end):
                fill_block(self.kv, entry.block_table[i], entry.block_hashes[i], self.rank)

    def _report_completions(self) -> None:
        for done in self.copies.poll():
            self._open.pop(done.job_id, None)
            moves = self._moves_of.pop(done.job_id, ())
            if done.kind == "load" and self.verify:
                self._verify(moves, set(done.failed_hashes))
            if done.kind == "load":
                self._loaded[done.job_id] = tuple(done.failed_hashes)
                for join_id, join_moves in self._joins.pop(done.job_id, ()):
                    self._copy_join(join_id, join_moves, tuple(done.failed_hashes))
            if self.silent is not None and self.silent(self.rank, done.job_id):
                continue
            self.outbox.put(("report", done.job_id, self.rank, done.failed_hashes))

    def _copy_join(self, job_id: Any, moves: tuple[Move, ...], source_failed: tuple[int, ...]) -> None:
        """A join: copy the device blocks the load it follows filled (each move's ``slot``
        is the source block) into the joiner's own; a block that failed there fails here."""
        bad = set(source_failed)
        failed = []
        for move in moves:
            if move.block_hash in bad:
                failed.append(move.block_hash)
                continue
            self.kv.block(move.device_block).copy_(self.kv.block(move.slot))
        if self.verify:
            self._verify(moves, bad)
        if self.silent is None or not self.silent(self.rank, job_id):
            self.outbox.put(("report", job_id, self.rank, tuple(failed)))

    def _verify(self, moves: tuple[Move, ...], failed: set[int]) -> None:
        for move in moves:
            if move.block_hash in failed:
                continue
            self.stats.blocks_verified += 1
            if not verify_block(self.kv, move.device_block, move.block_hash, self.rank):
                self.stats.mismatches += 1

    def _prefetch(self, moves: tuple[Any, ...]) -> tuple[int, ...]:
        """Pull blocks from a lower tier into the host tier, through one staging row."""
        failed = []
        for move in moves:
            source, target = self.tiers[move.src_tier], self.tiers[move.dst_tier]
            ok = True
            if isinstance(source, HostPool):
                source.read_many([move.src_slot], self._staging)
            else:
                ok = source.read_blocks([(move.block_hash, move.src_slot)], self._staging)[0]
            if ok:
                if isinstance(target, HostPool):
                    target.write_many([move.dst_slot], self._staging)
                else:
                    ok = target.write_blocks([(move.block_hash, move.dst_slot)], self._staging)[0]
            if not ok:
                failed.append(move.block_hash)
        return tuple(failed)


def _move(m: Any) -> Move:
    return Move(m.block_hash, m.device_block, m.tier, m.slot)


# A rank report still missing this long after its job started is given up on
# (``engine.transfer_deadline_ms``) in every live run, with a config that sets none too:
# a lost report must end by a deadline, never hang the run.
DEFAULT_REPORT_DEADLINE_MS = 5000.0
# Shutdown waits this long, in all, for the rank threads to leave (one blocked on Redis
# leaves within one socket timeout).
_JOIN_S = 5.0
# The main loop's wait for a message when nothing happened; longer once nothing has
# happened for a while (a stuck run should not spin ticks until the watchdog stops it).
_WAIT_S = 0.005
_IDLE_WAIT_S = 0.05


def with_report_deadline(config: RunConfig) -> RunConfig:
    """``config`` with ``engine.transfer_deadline_ms`` set (``DEFAULT_REPORT_DEADLINE_MS``
    unless it is)."""
    if config.engine.transfer_deadline_ms is not None:
        return config
    return attrs.evolve(config, engine=attrs.evolve(config.engine, transfer_deadline_ms=DEFAULT_REPORT_DEADLINE_MS))


@attrs.define
class _Step:
    plan: StepPlan
    done: set[int] = attrs.Factory(set)  # ranks that ran it
    errors: list[str] = attrs.Factory(list)  # ranks on which it raised
    failed_ranks: list[int] = attrs.Factory(list)


class LiveRuntime:
    """Runs a workload against real KV bytes; returns the same result shape as the simulator.

    The run's config is ``with_report_deadline(config)``: a caller that writes the trace
    header itself should write that config, as ``run_live`` does, so a replay uses the
    same deadline.
    """

    def __init__(self, config: RunConfig, workload: list[WorkloadRequest], policies: PolicyStack,
                 recorder: Recorder | None = None, time_scale: float = 1.0,
                 progress: Callable[[int, int], None] | None = None,
                 silent: Callable[[int, Any], bool] | None = None) -> None:
        config = with_report_deadline(config)
        self.config = config
        self.live = config.live
        self.workload = sorted(workload, key=lambda w: w.arrival_ms)
        self.time_scale = time_scale
        self.progress = progress
        engine_config = config.engine
        self.engine = Engine(engine_config, policies, recorder=recorder)
        shape = model_shape(self.live, engine_config.block_tokens)
        try:
            self.geometry = BlockGeometry(shape, engine_config.ranks)
        except ValueError as exc:
            raise ConfigError("engine.ranks", str(exc)) from None
        self.block_bytes = self.geometry.block_bytes * engine_config.ranks
        # Redis keys of this run: {prefix}:{layout}:{rank}:{hash}, deleted at shutdown (and
        # expiring after live.redis_ttl_s anyway, should the process die before it gets there).
        self.redis_prefix = f"kvlife:{secrets.token_hex(6)}"
        # One breaker for the server: every rank's tier and the lookup probe judge it together.
        self.breaker = CircuitBreaker(self.live.redis_breaker_failures, self.live.redis_breaker_backoff_s)
        self.tier_events: list[dict[str, Any]] = []
        self.driver_warnings: Counter[str] = Counter()
        self.rank_errors: list[str] = []
        self.failed_steps = 0
        self.failed_requests: list[str] = []
        # Set when the watchdog stopped the run: why, and what was left unfinished.
        self.stalled: dict[str, Any] | None = None
        self.stranded: list[str] = []
        self.outbox: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self.ranks: list[RankWorker] = []
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._remote_probe: RedisTier | None = None
        self._lookups: ThreadPoolExecutor | None = None
        self._pending_lookups: dict[tuple[str, int], Future[tuple[str, ...] | None]] = {}
        self._steps: dict[int, _Step] = {}
        self._next_arrival = 0
        self._shut = False
        self._cut = False  # the interrupted record is written: the trace has ended
        try:
            self._open_tiers(silent)
        except BaseException:
            self.shutdown()  # what was opened before the error: files, sockets, the temp dir
            raise
        self._stops = {w.request_id: stop_rule(w.output_length, config.sim.max_output_tokens) for w in workload}
        # A named disk path is recovered on open: the blocks every rank recovered, in the same
        # slot, are in the engine's disk index from the start (the trace header lists them, so
        # a replay starts from the same index); corrupt slots dropped are warnings now.
        self.recovered = self._recovered()
        if self.recovered:
            tiers = [TierIndex.adopting(t.name, t.capacity_blocks, t.eviction, self.recovered.get(t.name, ()))
                     for t in engine_config.tiers]
            self.engine = Engine(engine_config, policies, tiers=tiers, recorder=recorder)
        for worker in self.ranks:
            self._drain_tiers(worker)

    def _recovered(self) -> dict[str, list[tuple[int, int]]]:
        """Per tier, the (block hash, slot) pairs every rank's tier recovered from an earlier
        run into the same slot, by slot: what the engine may serve (a block some rank lacks
        is not served; its slots are written over)."""
        found: dict[str, list[tuple[int, int]]] = {}
        for name in ("disk",):
            tiers = [w.tiers.get(name) for w in self.ranks]
            if not tiers or not all(isinstance(t, DiskTier) for t in tiers):
                continue
            per_rank = [cast(DiskTier, t).recovered for t in tiers]
            common = set(per_rank[0].items())
            for recovered in per_rank[1:]:
                common &= set(recovered.items())
            if common:
                found[name] = sorted(common, key=lambda pair: pair[1])
        return found

    @property
    def uses_redis(self) -> bool:
        return self._remote_probe is not None

    @property
    def disk_dir(self) -> Path | None:
        """Where the disk tier's files are (a temporary directory unless live.disk_path)."""
        if self._tmp is not None:
            return Path(self._tmp.name)
        return Path(self.live.disk_path) if self.live.disk_path is not None else None

    def _redis(self, rank: int, ttl: int | None) -> RedisTier:
        assert self.live.redis_url is not None
        timeout = self.live.redis_timeout_s
        return RedisTier(self.live.redis_url, self.geometry, rank=rank, key_prefix=self.redis_prefix,
                         ttl_seconds=ttl, socket_timeout=timeout, connect_timeout=timeout, name="remote",
                         breaker=self.breaker)

    def _open_tiers(self, silent: Callable[[int, Any], bool] | None) -> None:
        engine_config = self.config.engine
        disk_dir = self.live.disk_path
        if disk_dir is None and any(t.name == "disk" for t in engine_config.tiers):
            self._tmp = tempfile.TemporaryDirectory(prefix="kvlife-disk-")
            disk_dir = self._tmp.name
        if disk_dir is not None:
            path = Path(disk_dir)
            try:
                path.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ConfigError("live.disk_path", f"cannot create {path}: {exc.strerror}") from None
        ttl = self.live.redis_ttl_s or None  # 0: no TTL, only when configured so
        for rank in range(engine_config.ranks):
            tiers: dict[str, TierBytes] = {}
            try:
                for tier in engine_config.tiers:
                    if tier.name == "host":
                        tiers["host"] = HostPool(self.geometry, tier.capacity_blocks, tier.eviction)
                    elif tier.name == "disk":
                        assert disk_dir is not None
                        try:
                            tiers["disk"] = DiskTier(Path(disk_dir) / f"rank{rank}.kvblocks", self.geometry,
                                                     tier.capacity_blocks, tier.eviction, rank=rank)
                        except OSError as exc:
                            raise ConfigError("live.disk_path", str(exc)) from None
                    else:
                        if self.live.redis_url is None:
                            raise ConfigError("live.redis_url", "a remote tier needs a Redis URL")
                        tiers["remote"] = self._redis(rank, ttl)
            except BaseException:
                for opened in tiers.values():
                    close = getattr(opened, "close", None)
                    if close is not None:
                        close()
                raise
            worker = RankWorker(rank, self.geometry, engine_config.device_blocks, tiers, self.outbox,
                                self.live.verify, silent)
            self.ranks.append(worker)
        self._lookups = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvlife-lookup")
        if self.live.redis_url is not None and any(t.name == "remote" for t in engine_config.tiers):
            self._remote_probe = self._redis(0, ttl)

    # ---- main loop ---------------------------------------------------------------------
    def run(self) -> SimResult:
        """Run the workload to the end, or until the watchdog stops it. Ctrl-C / SIGTERM:
        shut down, write the ``interrupted`` record last, re-raise."""
        stuck = False
        with interrupts.held() as gate:
            try:
                events = self._loop(gate)
            except LoopStalled as exc:  # the loop itself was stuck (see _loop): cut where it stood
                stuck, events = True, 0
                self._stop_stuck(exc)
            except KeyboardInterrupt as exc:
                open_work = {"steps": len(self._steps), "lookups": len(self._pending_lookups)}
                try:
                    self.shutdown()  # its tier events are still written before the cut...
                finally:  # ...and the cut is written even if a second Ctrl-C cuts the shutdown short
                    self._cut = True
                    if self.engine.recorder is not None:
                        self.engine.recorder(cut_record(self.engine, exc, len(self.workload), gate.clean,
                                                        **open_work))
                raise
            finally:
                self.shutdown()
        if not stuck:  # (a loop stopped inside an engine call left it half-way)
            self.engine.check_invariants()
        stranded = self.stranded if self.stalled is not None else self.engine.stranded()
        return SimResult(self.engine, self.workload, self.engine.now, events, stranded)

    def _stop_stuck(self, exc: LoopStalled) -> None:
        """The watchdog thread stopped a loop that stood still (a stall the loop cannot see
        itself): everything unfinished is stranded, and the trace ends with a cut that names
        why (the engine may be half-way through a call: it is not fed again)."""
        from kvlife.lifecycle.drivers.runner import error_record

        unfinished = [f"{rid}:{req.state}" for rid, req in self.engine.requests.items() if req.state != "finished"]
        self.stranded = unfinished + [f"{w.request_id}:not_arrived" for w in self.workload[self._next_arrival:]]
        self.stalled = {"reason": str(exc), "idle_s": self.live.stall_timeout_s, "stranded": len(self.stranded),
                        "steps_in_flight": len(self._steps),
                        "jobs_open": sum(1 for job in self.engine.jobs.values() if not job.timed_out)}
        try:
            self.shutdown()
        finally:
            self._cut = True
            if self.engine.recorder is not None:
                self.engine.recorder(error_record(self.engine.now, exc))

    def _loop(self, gate: interrupts.StopGate) -> int:
        for worker in self.ranks:
            worker.start()
        start = time.monotonic()
        stall_s = self.live.stall_timeout_s
        # The watchdog thread (kvlife.policies.watchdog) stops a loop that stands still: one
        # iteration longer than the stall timeout (seq odd from here, +2 per iteration).
        main = threading.get_ident()
        watch = Watch(stall_s, LoopStalled, lambda: (main, f"no progress for {stall_s:g} s of wall time: the run's "
                                                             f"loop stood still (live.stall_timeout_s)")
                      if watch.seq & 1 else None)
        watch.seq = 1
        try:
            return self._iterate(gate, start, watch)
        finally:
            watch.seq += 1  # even: not watched any more

    def _iterate(self, gate: interrupts.StopGate, start: float, watch: Watch) -> int:
        events = 0
        arrivals = self.workload
        engine = self.engine
        max_in_flight = 2 if self.config.engine.async_scheduling else 1
        reported = 0  # finished requests last told to the progress callback
        idle: tuple[int, int, int] | None = None  # the engine's progress after a pass that did nothing
        stall_s = self.live.stall_timeout_s
        last_progress = start
        while True:
            watch.seq += 2
            gate.check()
            wall = time.monotonic()
            now = (wall - start) * 1000.0
            # What the watchdog counts as progress: an arrival, a transfer report, a step
            # output. Lookup answers and ticks are not: a request that is deferred
            # forever gets both without ever moving on.
            progressed = False
            while self._next_arrival < len(arrivals) and self._due(arrivals[self._next_arrival]) <= now:
                w = arrivals[self._next_arrival]
                self._next_arrival += 1
                at = max(now, engine.now)
                self._dispatch(engine.handle(Arrival(at, w.request_id, w.input_length, w.hash_ids)), at)
                events += 1
                progressed = True
            handled = self._drain_outbox(now)
            answered = self._deliver_lookups(now)
            events += handled + answered
            progressed = progressed or handled > 0
            if answered:
                idle = None
            computing = False
            if progressed or handled:
                idle = None
            wake = engine.next_wakeup()
            # With async scheduling the next step is planned while one still runs,
            # so placeholders really are in flight, as in vLLM. A pass that did nothing
            # (an empty step, nothing changed) is not repeated until an input or a
            # deadline comes: the loop does not spin.
            if len(self._steps) < max_in_flight and engine.busy() and (
                    idle is None or engine.progress() != idle or (wake is not None and wake <= now)):
                before = engine.progress()
                commands = engine.handle(Tick(max(now, engine.now)))
                events += 1
                self._dispatch(commands, now)
                computing = any(isinstance(c, StepPlan) and c.entries for c in commands)
                quiet = len(commands) == 1 and not computing and engine.progress() == before
                idle = engine.progress() if quiet else None
            if self._next_arrival >= len(arrivals) and not engine.busy() and not self._steps:
                return events
            if progressed or computing or (not engine.busy() and not self._steps):
                last_progress = wall  # moving, or idle until the next arrival
            elif wall - last_progress > stall_s:
                self._stall(f"no progress for {stall_s:g} s of wall time", wall - last_progress)
                return events
            dead = [w.rank for w in self.ranks if not w.is_alive()]
            if dead:
                self._stall(f"rank thread(s) {dead} ended", wall - last_progress)
                return events
            if not (progressed or computing):
                wait = _WAIT_S if wall - last_progress < 1.0 else _IDLE_WAIT_S
                if self._next_arrival < len(arrivals):
                    due = self._due(arrivals[self._next_arrival]) - now
                    wait = max(0.0, min(wait, due / 1000.0))
                try:
                    message = self.outbox.get(timeout=wait) if wait > 0 else None
                except queue.Empty:
                    message = None
                if message is not None:
                    handled = self._handle_message(message, (time.monotonic() - start) * 1000.0)
                    events += handled
                    idle = None
                    if handled:
                        last_progress = time.monotonic()
            if self.progress is not None and engine.state_counts["finished"] != reported:
                reported = engine.state_counts["finished"]
                self.progress(reported, len(arrivals))

    def _due(self, request: WorkloadRequest) -> float:
        """When ``request`` arrives, in ms of the run's wall clock."""
        return request.arrival_ms / self.time_scale

    def _stall(self, reason: str, idle_s: float) -> None:
        """The watchdog: the run has work but makes no progress. Name what is unfinished
        (a ``stalled`` warning, the summary's stranded requests), then abort it, so the
        trace ends with every request finished and still validates."""
        engine = self.engine
        unfinished = [(rid, req.state) for rid, req in engine.requests.items() if req.state != "finished"]
        not_arrived = [w.request_id for w in self.workload[self._next_arrival:]]
        self.stranded = [f"{rid}:{state}" for rid, state in unfinished] + [f"{rid}:not_arrived" for rid in not_arrived]
        self.stalled = {
            "reason": reason,
            "idle_s": round(idle_s, 3),
            "stranded": len(self.stranded),
            "steps_in_flight": len(self._steps),
            "jobs_open": sum(1 for job in engine.jobs.values() if not job.timed_out),
        }
        self._warn("stalled", None, {**self.stalled, "requests": self.stranded,
                                     "note": "the run was stopped; its unfinished requests are aborted"})
        for rid, _ in unfinished:
            self._dispatch(engine.handle(Abort(engine.now, rid)), engine.now)

    def shutdown(self) -> None:
        """Stop and join the rank threads and the lookup thread, record the tier events
        still queued, delete this run's Redis keys, close every tier and remove the
        temporary disk directory (a named ``live.disk_path`` is kept, to be recovered).
        A rank thread still alive after the join keeps its tiers and the directory (they
        go when the process exits), with a ``rank_still_running`` warning. Idempotent;
        runs whatever way the run ends, in bounded time."""
        if self._shut:
            return
        for worker in self.ranks:
            worker.stopping.set()
            if worker.ident is not None:
                worker.inbox.put(("stop",))
        deadline = time.monotonic() + _JOIN_S
        for worker in self.ranks:
            if worker.ident is not None:
                worker.join(timeout=max(0.0, deadline - time.monotonic()))
        for future in self._pending_lookups.values():
            future.cancel()
        self._pending_lookups.clear()
        if self._lookups is not None:
            self._lookups.shutdown(wait=True, cancel_futures=True)  # a probe waits one socket timeout at most
        self._steps.clear()
        # The engine is not fed any more: only what the tiers and ranks said is kept.
        while True:
            try:
                message = self.outbox.get_nowait()
            except queue.Empty:
                break
            if message[0] in ("tier_event", "rank_error"):
                self._handle_message(message, self.engine.now)
        stuck = [worker.rank for worker in self.ranks if worker.is_alive()]
        for worker in self.ranks:
            if worker.is_alive():
                continue  # a rank stuck in a copy still owns its tiers: leave them be
            worker.forget()
            for tier in worker.tiers.values():
                if isinstance(tier, RedisTier):
                    tier.delete_all()
            self._drain_tiers(worker)
            for tier in worker.tiers.values():
                close = getattr(tier, "close", None)
                if close is not None:
                    close()
        if self._remote_probe is not None:
            for event in self._remote_probe.drain_events():
                self._tier_event(None, event)
            self._remote_probe.close()
        if stuck:
            self._warn("rank_still_running", None, {
                "ranks": stuck, "note": "its tiers and temporary files are left until the process exits"})
        elif self._tmp is not None:
            self._tmp.cleanup()
        self._shut = True  # only now: a shutdown cut short by a second Ctrl-C is retried

    def stats(self) -> LiveStats:
        total = LiveStats()
        for worker in self.ranks:
            total.blocks_verified += worker.stats.blocks_verified
            total.mismatches += worker.stats.mismatches
        total.tier_events = list(self.tier_events)
        return total

    # ---- tier events -------------------------------------------------------------------
    def _drain_tiers(self, worker: RankWorker) -> None:
        """Main thread, while the rank's thread is not running: its tiers' events."""
        for tier in worker.tiers.values():
            drain = getattr(tier, "drain_events", None)
            if drain is not None:
                for event in drain():
                    self._tier_event(worker.rank, event)

    def _tier_event(self, rank: int | None, event: dict[str, Any]) -> None:
        """A tier event (Redis down, a foreign or corrupt block, a failed disk write...):
        kept in ``tier_events`` and warned about."""
        fields = dict(event)
        what = str(fields.pop("event", "tier_event"))
        fields.pop("level", None)
        self.tier_events.append({"event": what, "rank": rank, **fields})
        self._warn(what, rank, fields)

    def _warn(self, what: str, rank: int | None, fields: dict[str, Any]) -> None:
        """A ``warning`` record (``"origin": "driver"``) at the engine's time, always written
        between two engine calls, and one more in the summary's ``warnings``."""
        self.driver_warnings[what] += 1
        if self.engine.recorder is not None and not self._cut:  # nothing follows the cut
            self.engine.recorder(records.warning(self.engine.now, what, origin="driver", rank=rank, **fields))

    # ---- commands out ------------------------------------------------------------------
    def _dispatch(self, commands: list[Any], now: float) -> None:
        transfers = False
        for command in commands:
            if isinstance(command, StepPlan):
                if command.entries:
                    self._steps[command.step_id] = _Step(command)
                    for worker in self.ranks:
                        worker.inbox.put(("step", command))
                else:  # only lookups were paid: nothing for the ranks to compute
                    self._steps[command.step_id] = _Step(command, {w.rank for w in self.ranks})
                    self._complete_step(command.step_id, now)
            elif isinstance(command, StartLoad) and command.after is not None:
                for worker in self.ranks:
                    worker.inbox.put(("join", command.job_id, command.after, command.moves))
            elif isinstance(command, StartLoad):
                transfers = True
                for worker in self.ranks:
                    worker.inbox.put(("load", command.job_id, command.moves))
            elif isinstance(command, StartStore):
                transfers = True
                for worker in self.ranks:
                    worker.inbox.put(("store", command.job_id, command.moves))
            elif isinstance(command, StartPrefetch):
                for worker in self.ranks:
                    worker.inbox.put(("prefetch", command.job_id, command.moves))
            elif isinstance(command, SubmitLookup):
                assert self._lookups is not None
                snapshot = self.engine.sync_lookup(command.block_hashes)
                future = self._lookups.submit(self._confirm_lookup, command.block_hashes, snapshot)
                self._pending_lookups[(command.request_id, command.epoch)] = future
            elif isinstance(command, DiscardLookup):
                key = (command.request_id, command.epoch)
                if key in self._pending_lookups:
                    self._pending_lookups.pop(key).cancel()
        if transfers:
            for worker in self.ranks:
                worker.inbox.put(("flush",))

    def _confirm_lookup(self, hashes: tuple[int, ...], snapshot: tuple[str, ...]) -> tuple[str, ...] | None:
        """Runs on the lookup thread: checks the remote blocks really exist (one pipelined
        round trip). Blocks the index puts in host or disk are taken as they are. The
        probe's tier events go to the outbox at once, so they are recorded even when the
        answer is discarded or the run ends first."""
        remote = [h for h, tier in zip(hashes, snapshot, strict=False) if tier == "remote"]
        probe = self._remote_probe
        if not remote or probe is None:
            return snapshot
        try:
            present = dict(zip(remote, probe.exists_many(remote), strict=True))
        finally:
            for event in probe.drain_events():
                self.outbox.put(("tier_event", None, event))
        answer: list[str] = []
        for h, tier in zip(hashes, snapshot, strict=False):
            if tier == "remote" and not present[h]:
                break
            answer.append(tier)
        return tuple(answer)

    # ---- inputs in ---------------------------------------------------------------------
    def _deliver_lookups(self, now: float) -> int:
        delivered = 0
        for key in [k for k, f in self._pending_lookups.items() if f.done()]:
            future = self._pending_lookups.pop(key)
            tiers: tuple[str, ...] | None = None
            try:
                if not future.cancelled():
                    tiers = future.result()
            except Exception as exc:  # a lookup that fails is a miss, said so by tiers=None
                self._warn("lookup_failed", None, {"error": f"{type(exc).__name__}: {exc}"})
                tiers = None
            self._dispatch(self.engine.handle(LookupAnswer(max(now, self.engine.now), key[0], key[1], tiers)), now)
            delivered += 1
        return delivered

    def _drain_outbox(self, now: float) -> int:
        handled = 0
        while True:
            try:
                message = self.outbox.get_nowait()
            except queue.Empty:
                return handled
            handled += self._handle_message(message, now)

    def _handle_message(self, message: tuple[Any, ...], now: float) -> int:
        """Feed one rank message to the engine; 1 when it moved the run on (a report, a
        step output), else 0."""
        now = max(now, self.engine.now)
        kind = message[0]
        if kind == "report":
            _, job_id, rank, failed = message
            self._dispatch(self.engine.handle(TransferReport(now, job_id, rank, tuple(failed))), now)
            return 1
        if kind == "step_done":
            _, step_id, rank, error = message
            step = self._steps.get(step_id)
            if step is None:
                return 0
            step.done.add(rank)
            if error is not None:
                step.errors.append(f"rank {rank}: {error}")
                step.failed_ranks.append(rank)
                self.rank_errors.append(f"rank {rank}: step {step_id}: {error}")
            return self._complete_step(step_id, now)
        if kind == "tier_event":
            self._tier_event(message[1], message[2])
        elif kind == "rank_error":
            self.rank_errors.append(f"rank {message[1]}: {message[2]}")
            self._warn("rank_error", message[1], {"error": message[2]})
        return 0

    def _complete_step(self, step_id: int, now: float) -> int:
        """Step ``step_id`` ran on a rank. Outputs reach the engine in plan order, as vLLM's
        come: a step every rank ran waits for the steps before it (an empty step, which no
        rank runs, is done at once, behind a step still computing under async scheduling)."""
        if len(self._steps[step_id].done) < len(self.ranks):
            return 0
        delivered = 0
        while self._steps:
            oldest = min(self._steps)
            step = self._steps[oldest]
            if len(step.done) < len(self.ranks):
                break
            del self._steps[oldest]
            finished: tuple[tuple[str, str], ...] = ()
            if step.errors:
                self._fail_step(step)
            else:
                finished = step_finishes(step.plan, self.engine, self._stops)
            output = StepOutput(now, oldest, finished, failed_ranks=tuple(sorted(step.failed_ranks)))
            self._dispatch(self.engine.handle(output), now)
            delivered = 1
        return delivered

    def _fail_step(self, step: _Step) -> None:
        """A step that raised on some rank did not write its KV there: its output says so
        (``StepOutput.failed``: the engine aborts its requests and withdraws the blocks it
        was to write from the prefix cache), and a ``step_failed`` warning names them."""
        self.failed_steps += 1
        requests = self.engine.requests
        victims = list(dict.fromkeys(e.request_id for e in step.plan.entries
                                     if requests[e.request_id].state != "finished"))
        self._warn("step_failed", None, {"step": step.plan.step_id, "errors": step.errors, "requests": victims,
                                         "note": "the step's KV was not written: its requests are aborted"})
        self.failed_requests.extend(victims)


# A live run's own defaults (sized for a laptop): (config key, value). Each applies where
# neither the config file nor a flag set the key.
LIVE_DEFAULTS: tuple[tuple[str, Any], ...] = (
    ("engine.device_blocks", 64),
    ("engine.max_running", 16),
    ("engine.ranks", 2),
    ("engine.transfer_deadline_ms", DEFAULT_REPORT_DEADLINE_MS),
    ("tiers", None),  # a host tier of 96 blocks and a disk tier of 384 in a temporary directory
    ("sim.max_output_tokens", 24),
)


def live_defaults(config: RunConfig, given: Collection[str] = ()) -> RunConfig:
    """A live run's config: a small model shape, two ranks, a host tier and a disk tier in a
    temporary directory, short outputs (``LIVE_DEFAULTS``), each where ``given`` (the keys
    the config file sets: ``kvlife.lifecycle.config.given_keys``) does not set it; an empty
    config file changes nothing. The engine's device size and ranks are resolved here, once."""
    from kvlife.lifecycle.config import TierConfig

    engine_values: dict[str, Any] = {}
    sim_values: dict[str, Any] = {}
    for key, value in LIVE_DEFAULTS:
        if key in given:
            continue
        section, _, name = key.partition(".")
        if key == "tiers":
            engine_values["tiers"] = (TierConfig("host", capacity_blocks=96), TierConfig("disk", capacity_blocks=384))
        elif section == "engine":
            engine_values[name] = value
        else:
            sim_values[name] = value
    engine = attrs.evolve(config.engine, **engine_values)
    # Resolved once: set in the file, else the live default above.
    engine = attrs.evolve(engine, device_blocks=engine.device_blocks, ranks=engine.ranks)
    return attrs.evolve(config, engine=engine, sim=attrs.evolve(config.sim, **sim_values))


@attrs.define
class LiveOutcome:
    result: SimResult
    summary: dict[str, Any]
    stats: LiveStats
    rank_errors: list[str]
    trace_lines: int
    verify: bool = True

    def problems(self) -> list[str]:
        """What makes the run a failure (exit code 1), one line each."""
        out = []
        if self.verify and self.stats.mismatches:
            out.append(f"{self.stats.mismatches} loaded blocks do not match what was computed for them")
        stalled = self.summary["live"].get("stalled")
        if stalled is not None:
            out.append(f"stopped: {stalled['reason']}")
        if self.result.stranded:
            names = ", ".join(self.result.stranded[:10]) + (", ..." if len(self.result.stranded) > 10 else "")
            out.append(f"{len(self.result.stranded)} requests stranded: {names}")
        if self.summary["live"]["failed_steps"]:
            out.append(f"{self.summary['live']['failed_steps']} forward steps failed; their requests were aborted")
        if self.rank_errors:
            out.append(f"{len(self.rank_errors)} rank errors, the first: {self.rank_errors[0]}")
        return out

    @property
    def exit_code(self) -> int:
        return 1 if self.problems() else 0


def run_live(config: RunConfig, workload: list[WorkloadRequest], stack: PolicyStack | None = None,
             trace_path: str | Path | None = None, time_scale: float = 1.0,
             progress: Callable[[int, int], None] | None = None, workload_name: str = "live",
             inputs: Collection[str | Path | None] = ()) -> LiveOutcome:
    from kvlife.lifecycle.drivers.runner import recording, require_requests
    from kvlife.lifecycle.metrics import summarize
    from kvlife.policies.loading import load_stack

    require_requests(workload, workload_name)
    # A hook runs at most half the stall watchdog's wait: one that never returns is named as such.
    stack = stack if stack is not None else load_stack(config.policies,
                                                        min(config.hook_budget_s, config.live.stall_timeout_s / 2))
    config = with_report_deadline(config)  # before the header: a replay uses the same deadline
    started = time.perf_counter()
    meta = {"name": workload_name, "requests": len(workload)}
    # The runtime opens (and recovers) its tiers before the header is written: the header
    # lists the disk slots it recovered. What it records meanwhile waits for the header.
    early: list[dict[str, Any]] = []
    sink: list[Callable[[dict[str, Any]], None]] = [early.append]
    with interrupts.held():
        runtime = LiveRuntime(config, workload, stack, (lambda record: sink[0](record)) if trace_path else None,
                              time_scale, progress)
        try:
            header: dict[str, Any] = {"workload": meta, "driver": "live"}
            if runtime.recovered:
                header["recovered"] = {tier: [list(pair) for pair in pairs]
                                       for tier, pairs in runtime.recovered.items()}
            with recording(trace_path, config, stack, inputs, **header) as writer:
                if writer is not None:
                    for record in early:
                        writer.record(record)
                    sink[0] = writer.record
                result = runtime.run()
        finally:
            runtime.shutdown()
    wall = time.perf_counter() - started
    summary = summarize(result, wall, runtime.block_bytes)
    # The engine's warnings and the driver's (tier events, rank errors), one count per name.
    warnings = Counter(summary["warnings"])
    warnings.update(runtime.driver_warnings)
    summary["warnings"] = dict(sorted(warnings.items()))
    stats = runtime.stats()
    summary["live"] = {
        "ranks": config.engine.ranks,
        "block_bytes": runtime.block_bytes,
        "blocks_verified": stats.blocks_verified,
        "mismatches": stats.mismatches,
        "tier_events": len(stats.tier_events),
        "rank_errors": len(runtime.rank_errors),
        "failed_steps": runtime.failed_steps,
        "failed_requests": len(runtime.failed_requests),
        "stalled": runtime.stalled,
        "stranded_requests": list(result.stranded),
        "redis_breaker": {"opened": runtime.breaker.times_opened, "state": runtime.breaker.state}
        if runtime.uses_redis else None,
        "device": str(runtime.ranks[0].kv.device),
    }
    return LiveOutcome(result, summary, stats, runtime.rank_errors, writer.lines if writer else 0,
                       config.live.verify)
