"""Model checking: Hypothesis drives the engine through every interleaving it can find.

``LifecycleMachine`` is a ``RuleBasedStateMachine`` that plays the driver as an adversary
within the protocol's rules. Each example draws a world (``World``) as large as the
engine's: a host tier alone, or host and disk, or host, disk and remote, the lowest one
warm (so early prefetch has something to pull); 1 to 4 ranks; async scheduling on or off;
a transfer deadline or none; ``kv_load_failure_policy`` recompute or fail. For every hook
the stack under test leaves to the baseline, the checker's *explorer* policy gives a legal
answer per request (early lookup or prefetch, async lookups, kept answers, prefetch
patience, finishing before the stores, failing on a bad load; joining or deferring
in-flight loads per example), so the engine paths a stack may open are reached whatever
the stack.

Its inputs (``ACTIONS``, picked by weight among those enabled): arrivals with shared
prefixes (some with an output limit, some that can never fit), revisits of earlier
prefixes (after a long request took the device, so they come from the tiers), bursts that
force preemption, ticks (each a step, possibly empty), the clock jumping past deadlines,
step outputs in order (two in flight with async scheduling), carrying the workers'
reports or not, and outputs the engine must ignore (a later step's before its turn, one
delivered already, one never planned); lookup answers (true, missing, failed, computed at
submission, and old-epoch answers while a newer lookup is pending); per-rank transfer
reports in any order the workers may send them (joins after their owners, flushed stores
with their step; failures, prefetches that fail to land, persistently corrupt tier
blocks, duplicates that carry failures, the late reports of a job given up at its
deadline, unknown jobs and ranks); and aborts in every state. The workers' side is
``kvlife.specs.worker_model``.

The engine's commands are fed to the independent observer (``kvlife.specs.invariants``)
as the engine issues them, between its records, so the observer sees each handling in its
true order; what it needs of the engine's internals comes through
``kvlife.specs.engine_probe``. After every input the observer checks invariants 1-8 and
10-13. At the end a drain stops inputs, optionally drives the clock past every deadline
and keeps misbehaving (old answers, late reports, early outputs, failed stores), answers
everything outstanding and ticks, and checks liveness (7): every request, in whatever
state, finishes within a bound; no request stays parked while nothing runs (a head that
can never fit must not block the queue); every device block is free at the end. Then, on
one example in ``REPLAY_EVERY``, the example's trace must replay exactly (15,
``kvlife.specs.replay_check``).

One line in a user's suite model-checks their policy::

    from kvlife.specs.model_check import check_policy
    def test_my_policy(): check_policy("mypkg.mod:MyPolicy")

``kvlife check`` runs the same thing from the command line.
"""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import hypothesis
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    get_state_machine_test,
    initialize,
    rule,
    run_state_machine_as_test,
)

from kvlife.lifecycle.drivers.vllm_order import DelayedLookups
from kvlife.specs.engine_probe import EngineProbe
from kvlife.specs.invariants import IO_WAIT_STATES, InvariantObserver, InvariantViolation, Settings, Violation
from kvlife.specs.recording_check import RecordingCheck
from kvlife.specs.table import TABLE, IllegalTransition
from kvlife.specs.worker_model import Report, WorkerModel

EngineFactory = Callable[..., Any]  # (EngineConfig, PolicyStack, tiers=..., recorder=...) -> Engine
StackSpec = Sequence[str] | Callable[[], Any]

DEFAULT_EXAMPLES = 200
DEFAULT_STEPS = 50
# The drain gives up when no request finished for this many ticks (a livelock).
STALL_ROUNDS = 150
# ... or when a waiting request fits the device while nothing runs for this many ticks.
PARKED_ROUNDS = 3
# Liveness bound of the drain, in ticks: DRAIN_BASE + DRAIN_PER_TOKEN x the tokens (prompt
# plus output) of the requests not finished when inputs stop. A tick computes up to 16
# tokens of the running requests, so a bound of one tick per token leaves room for
# preemption (a request computing its tokens again), failed and timed-out loads and the
# drain's own deadlines.
DRAIN_BASE = 30
DRAIN_PER_TOKEN = 1
# The replay check (15) runs on the examples whose seed is a multiple of this. On every
# example it added 24-31 % to `kvlife check --no-shrink` (CPU 9.6 -> 11.9 s; wall 8.3 ->
# 10.9 s); on one in three, about 11 % (CPU 9.5 -> 10.5 s).
REPLAY_EVERY = 3
WORLDS: tuple[tuple[str, ...], ...] = (("host",), ("host", "disk"), ("host", "disk", "remote"), ())
# (A world with no tier is plain vLLM: the scheduler still calls the connector core, which
# answers no hit and stores nothing.)
WORLD_WEIGHTS = (1, 4, 5, 1)
TIER_CAPACITY = {"host": 6, "disk": 24, "remote": 32}


# ---- policies that open code paths the baseline never takes ------------------------------
class AsyncLookups:
    """Look up asynchronously (at arrival when the input is not resumable)."""

    name = "async-lookups"

    def on_arrival(self, req: Any, engine: Any) -> Any:
        from kvlife.policies.base import Decision

        if req.resumable:
            return Decision("none", "resumable input: no early lookup")
        return Decision("lookup", "early lookup at arrival")

    def lookup_mode(self, req: Any, engine: Any) -> Any:
        from kvlife.policies.base import Decision

        return Decision("async", "lookup off the scheduler path")


class ShareLoads:
    """Join an in-flight load of the same blocks instead of loading them again."""

    name = "share-loads"
    shares_loads = True

    def admission(self, req: Any, load: Any, engine: Any) -> Any:
        from kvlife.policies.base import Decision

        if load.in_flight:
            return Decision("join", f"join {len(load.in_flight)} blocks already in flight")
        return None


# The explorer's choices for each request (one is drawn per request and hook).
EXPLORER_CHOICES: dict[str, tuple[Any, ...]] = {
    "on_arrival": ("none", "lookup", "prefetch", "prefetch"),
    "lookup_mode": ("sync", "async"),
    "lookup_reuse": ("consume", "consume", "keep"),
    "prefetch_patience": (None, None, 0.0, 3.0),  # ms; None: the fallback (wait for completion)
    "hold_at_finish": (True, True, False),
    "on_load_failure": ("recompute", "recompute", "recompute", "fail"),
}


def _full_prompt_blocks(record: dict[str, Any], block_tokens: int) -> dict[str, Any]:
    """An arrival record as one written from vLLM's calls has it: the hashes of its full
    prompt blocks (the driver may name the partial block too)."""
    full = int(record["prompt_tokens"]) // block_tokens
    return {**record, "block_hashes": tuple(record["block_hashes"])[:full]}


class OwnLookups(DelayedLookups):
    """The connector's own lookup client (``DelayedLookups``, as ``KVLifeConnector`` answers
    lookups inside vLLM: with what the tiers hold then), watched: the connector must ask it
    for the answers due at the start of every pass, and each lookup is answered ``delay``
    passes after it went out (the pass after, for 0), counting the asks, not the pass
    index the connector hands it."""

    def __init__(self, delay: int, answer: Callable[[Sequence[int]], tuple[str, ...]],
                 applied: Callable[[], None]) -> None:
        super().__init__(delay, answer)
        self.applied = applied  # called as the connector asks for the next answer: the last one is applied
        self.asks = 0
        self.waiting: dict[tuple[str, int], int] = {}  # (request, epoch) -> the ask it is due at
        self.late: str | None = None

    def submit(self, command: Any) -> None:
        self.waiting.setdefault((command.request_id, command.epoch), self.asks + max(self.delay, 1))
        super().submit(command)

    def due(self, pass_index: int, now: float) -> Iterator[Any]:  # type: ignore[override]
        self.asks += 1
        answers = super().due(pass_index, now)
        for answer in answers:
            self.waiting.pop((answer.request_id, answer.epoch), None)
        late = sorted((due, key) for key, due in self.waiting.items() if due <= self.asks)
        if late and self.late is None:
            due, (rid, epoch) = late[0]
            self.late = (f"the connector's own lookup of {rid} (epoch {epoch}) is due at pass {due} of its lookup "
                         f"client ({self.delay} after it went out) and was not answered at pass {self.asks} "
                         f"(the connector handed it pass index {pass_index})")
        for answer in answers:
            yield answer
            self.applied()

    def overdue(self) -> str | None:
        return self.late


@attrs.frozen
class Explorer:
    """The checker's own policy, under the stack being checked and above the baseline: it
    answers the hooks the stack leaves to the baseline with legal answers, so that every
    engine path is reached whatever the stack. Each request gets its own answers (early
    lookup or prefetch, async lookups, kept answers, prefetch patience, finishing before
    its stores, failing on a bad load), drawn from a hash of the example's seed and the
    request id; whether loads are joined or deferred is one choice for the example
    (invariant 6 applies to a stack that joins). An answer of ``None`` leaves the hook to
    the baseline."""

    name = "checker-explorer"
    seed: int = 0
    admit: str = "go"  # go | join (an in-flight load) | defer (while its blocks are in flight)

    def pick(self, request_id: str, hook: str) -> Any:
        import hashlib

        options = EXPLORER_CHOICES[hook]
        digest = hashlib.blake2b(f"{self.seed}/{request_id}/{hook}".encode(), digest_size=8).digest()
        return options[int.from_bytes(digest, "big") % len(options)]

    def on_arrival(self, req: Any, engine: Any) -> Any:
        from kvlife.policies.base import Decision

        action = self.pick(req.request_id, "on_arrival")
        if action == "none" or req.resumable:
            return None
        return Decision(action, f"checker: {action} at arrival")

    def lookup_mode(self, req: Any, engine: Any) -> Any:
        from kvlife.policies.base import Decision

        return None if self.pick(req.request_id, "lookup_mode") == "sync" else Decision("async", "checker: async")

    def lookup_reuse(self, req: Any, engine: Any) -> Any:
        from kvlife.policies.base import Decision

        keep = self.pick(req.request_id, "lookup_reuse") == "keep"
        return Decision("keep", "checker: keep answers") if keep else None

    def admission(self, req: Any, load: Any, engine: Any) -> Any:
        from kvlife.policies.base import Decision

        if self.admit == "go" or not load.in_flight:
            return None
        if self.admit == "join":
            return Decision("join", f"checker: join {len(load.in_flight)} blocks in flight")
        return Decision("defer", f"checker: defer while {len(load.in_flight)} blocks are in flight")

    def prefetch_patience(self, req: Any, prefetch: Any, engine: Any) -> Any:
        from kvlife.policies.base import Decision

        patience = self.pick(req.request_id, "prefetch_patience")
        return None if patience is None else Decision(patience, f"checker: wait {patience} ms")

    def hold_at_finish(self, req: Any, stores_in_flight: int, engine: Any) -> Any:
        from kvlife.policies.base import Decision

        if self.pick(req.request_id, "hold_at_finish"):
            return None
        return Decision(False, "checker: finish now, the stores keep their blocks")

    def on_load_failure(self, req: Any, failed_blocks: int, engine: Any) -> Any:
        from kvlife.policies.base import Decision

        fail = self.pick(req.request_id, "on_load_failure") == "fail"
        return Decision("fail", "checker: fail on a bad load") if fail else None


@attrs.frozen
class World:
    """What one example runs on. Drawn from one integer (``World.draw``): Hypothesis's
    choices among a dozen small options repeat a handful of combinations, while a seeded
    draw spreads the examples over all of them."""

    tiers: tuple[str, ...]
    ranks: int
    eviction: str
    async_scheduling: bool
    deadline: float | None
    warm: bool
    drain_late: bool
    drain_chaos: bool
    explorer: Explorer | None
    swarm: tuple[tuple[str, int], ...] = ()  # weight multipliers of the rare actions (swarm testing)
    # engine.lookup_deadline_ms and engine.reclaim_deadline_ms: the defaults, or short ones
    # that the clock (time_passes, the drain) passes often.
    lookup_deadline: float = 5000.0
    reclaim_deadline: float = 480_000.0
    max_async_lookups: int = 1024  # engine.max_async_lookups: small ones are reached
    # The engine lets go of finished requests once nothing refers to them (the simulator's
    # retention); at the end none may be left.
    retention: bool = False
    kv_load_failure_policy: str = "recompute"  # vLLM's: a failed load recomputes, or fails the request
    # How many inputs share a millisecond (a driver's clock is coarse: vLLM's calls of one
    # pass read one time; 8: the first few jobs start at t=0, a boundary of the deadlines;
    # 64: all but the clock's jumps within one ms, so a job given up at its deadline
    # started at t=0).
    inputs_per_ms: int = 1
    # The connector answers its own async lookups, this many scheduler passes after they
    # went out (as ``KVLifeConnector`` does inside vLLM: ``DelayedLookups``); None: the
    # driver answers them (``LookupAnswer`` inputs, the adversary's).
    connector_lookups: int | None = None
    # With the connector answering its own lookups: the trace's inputs are written from the
    # connector calls they cause, as inside vLLM (``Engine(record_calls=True)``), in a shadow
    # run of the same inputs at the end; the adversary sends only inputs vLLM's calls show.
    calls_recorded: bool = False
    recorded: bool = False  # the connector is recorded as inside vLLM, and the recording judged (recording_check)
    # A recorded world's scheduler shows the recorder vLLM's block names (recording_check.VllmNames).
    vllm_names: bool = False
    # A recorded world's jobs name only their device blocks (as vLLM's OffloadingConnector's
    # transfer specs): the recorder reads each block's name off its request's table.
    unnamed_jobs: bool = False

    @classmethod
    def draw(cls, seed: int) -> World:
        rng = random.Random(seed)
        explorer = None
        if rng.random() < 0.85:
            explorer = Explorer(seed, rng.choice(["go", "join", "join", "defer"]))
        return cls(
            tiers=rng.choices(WORLDS, weights=WORLD_WEIGHTS)[0],
            ranks=rng.randint(1, 4),
            eviction=rng.choice(["lru", "lru", "arc"]),
            async_scheduling=rng.random() < 0.5,
            deadline=rng.choice([None, 25.0, 25.0, 25.0]),
            warm=rng.random() < 0.85,
            drain_late=rng.random() < 0.5,
            drain_chaos=rng.random() < 0.7,
            explorer=explorer,
            swarm=tuple((a.name, rng.choice((0, 1, 1, 3))) for a in ACTIONS if a.swarm),
            # Drawn last: the draws above stay what they were for a given seed.
            lookup_deadline=rng.choice([5000.0, 20.0, 20.0]),
            reclaim_deadline=rng.choice([480_000.0, 60.0, 60.0]),
            max_async_lookups=rng.choice([1024, 1, 2, 3]),
            retention=rng.random() < 0.3,
            kv_load_failure_policy=rng.choice(["recompute", "recompute", "fail"]),
            inputs_per_ms=rng.choice([1, 1, 1, 1, 3, 8, 64]),
            connector_lookups=rng.choice([None, None, None, 0, 1, 2]),
            calls_recorded=rng.random() < 0.5,
            recorded=rng.random() < 0.25,
            vllm_names=rng.random() < 0.5,
            unnamed_jobs=rng.random() < 0.5,
        )

    @property
    def vllm_calls(self) -> bool:
        """Only inputs vLLM's calls show, recorded from them (its own lookups answered)."""
        return self.calls_recorded and self.connector_lookups is not None

    def config(self, base: Any) -> Any:
        """The engine config of this world (``base``: a fixed config, or None: the world's)."""
        config = base if base is not None else _world_config(self.tiers, self.ranks, self.eviction)
        return attrs.evolve(config, async_scheduling=self.async_scheduling, transfer_deadline_ms=self.deadline,
                            lookup_deadline_ms=self.lookup_deadline, reclaim_deadline_ms=self.reclaim_deadline,
                            max_async_lookups=self.max_async_lookups,
                            kv_load_failure_policy=self.kv_load_failure_policy)

    def describe(self, config: Any, stack: Any, sharing: bool, warmed: Sequence[int]) -> str:
        tiers = [t.name for t in config.tiers]
        return (f"engine: {config.device_blocks} device blocks of {config.block_tokens} tokens, {config.ranks} ranks, "
                f"tiers {tiers}, async scheduling {self.async_scheduling}, deadline {self.deadline}, lookup deadline "
                f"{self.lookup_deadline}, reclaim deadline {self.reclaim_deadline}, lookups {self.max_async_lookups}, "
                f"kv_load_failure_policy {self.kv_load_failure_policy}, stack {list(stack.names)}, sharing {sharing}, "
                f"warm {tiers[-1] if warmed else 'none'} {list(warmed)}" + (", retention on" if self.retention else "")
                + (f", {self.inputs_per_ms} inputs per ms" if self.inputs_per_ms > 1 else "")
                + (f", the connector answers lookups after {self.connector_lookups} passes"
                   if self.connector_lookups is not None else "")
                + (", inputs recorded from the connector's calls" if self.vllm_calls else "")
                + ((", recorded with vLLM's block names" if self.vllm_names else ", recorded")
                   + (", its jobs naming device blocks only" if self.unnamed_jobs else "") if self.recorded else "")
                + (f", explorer {attrs.asdict(self.explorer)}" if self.explorer is not None else ""))


def default_engine_config(**overrides: Any) -> Any:
    """Small on purpose: few device blocks force preemption, 2 ranks, a small host tier.
    (The checker draws its own world per example unless a config is given.)"""
    from kvlife.lifecycle.config import EngineConfig, TierConfig

    values: dict[str, Any] = {
        "block_tokens": 4,
        "device_blocks": 12,
        "max_batched_tokens": 16,
        "max_running": 4,
        "ranks": 2,
        "lookup_latency_ms": 1.0,
        "tiers": (TierConfig("host", capacity_blocks=8),),
    }
    values.update(overrides)
    return EngineConfig(**values)


def _world_config(tiers: tuple[str, ...], ranks: int, eviction: str) -> Any:
    from kvlife.lifecycle.config import TierConfig

    # Device: 10 blocks of 4 tokens. The largest request the actions make is 19 prompt
    # tokens + 12 output (+1 placeholder under async scheduling: 32 tokens, 8 blocks), so
    # none outgrows the device, yet two of them force preemption, and the device cache
    # turns over fast enough that the tiers are read, not only written.
    return default_engine_config(
        device_blocks=10, ranks=ranks,
        tiers=tuple(TierConfig(n, capacity_blocks=TIER_CAPACITY[n], eviction=eviction) for n in tiers))


def _tier_indexes(config: Any, warmed: Sequence[int]) -> list[Any]:
    """The engine's tiers, empty but for ``warmed`` in the lowest (a previous life's copies)."""
    from kvlife.transfer.index import TierIndex

    tiers = [TierIndex(t.name, t.capacity_blocks, t.eviction) for t in config.tiers]
    if warmed:
        lowest = tiers[-1]
        lowest.complete_store([h for h, _ in lowest.prepare_store(warmed).accepted])
    return tiers


def _warm_blocks(world: World, config: Any) -> list[int]:
    """A previous life left prefixes in the lowest tier: the first requests load them (or,
    with early prefetch, pull them up into the host tier first)."""
    if not world.warm or not config.tiers:
        return []
    return sorted({f * 1000 + (0 if i == 0 else b * 100) + i for f in range(3) for b in range(3)
                   for i in range(4)})[: config.tiers[-1].capacity_blocks]


def _build_stack(stack: StackSpec) -> Any:
    from kvlife.policies.loading import load_stack

    return stack() if callable(stack) else load_stack(list(stack))


def _with_explorer(stack: Any, explorer: Explorer | None) -> Any:
    """The stack with the explorer between its own policies and the baseline."""
    from kvlife.policies.stack import PolicyStack

    if explorer is None:
        return stack
    return PolicyStack([*stack.policies[:-1], explorer])


def detect_sharing(stack: Any) -> bool:
    """Does this stack join in-flight loads? (invariant 6 applies only then)"""
    from kvlife.policies.base import EngineView, LoadView, PolicyError, RequestView

    if any(getattr(p, "shares_loads", False) for p in stack.policies):
        return True
    view = RequestView("probe", "waiting", 0.0, 8, 0, 0, 0, 0, 4, (1, 2), 0, False, 0)
    load = LoadView(0, 2, ("host", "host"), ((1, "other"), (2, "other")))
    engine = EngineView(0.0, 1, 1, 1, 8, 12)
    try:
        return bool(stack.ask("admission", view, load, engine).value == "join")
    except (PolicyError, Exception):  # a probe must never break the check itself
        return False


# The store policies whose store_limit the observer knows as a rule (13: stores offered).
# The engine clamps every limit to the tokens step outputs confirmed (``jobs.maybe_store``),
# so even naive-stores-unsafe's limit (every scheduled token) stores up to those.
STORE_RULES = {"baseline": "confirmed", "naive-stores-unsafe": "confirmed"}


def store_rule(stack: Any) -> str | None:
    """The rule of the policy that answers ``store_limit`` first in this stack (None: a
    policy the checker does not know, whose limit it cannot judge)."""
    chains = getattr(stack, "_chains", None)
    if not isinstance(chains, dict) or not chains.get("store_limit"):
        return None
    return STORE_RULES.get(chains["store_limit"][0][0])


def describe_input(event: Any) -> str:
    kind = event.type
    if kind == "arrival":
        limit = f", max_tokens {event.max_tokens}" if event.max_tokens is not None else ""
        return (f"arrival {event.request_id}: {event.prompt_tokens} tokens, "
                f"hashes {list(event.block_hashes)}{limit}{' (resumable)' if event.resumable else ''}")
    if kind == "lookup_answer":
        tiers = "failed" if event.tiers is None else list(event.tiers)
        return f"lookup answer {event.request_id} epoch {event.epoch}: {tiers}"
    if kind == "transfer_report":
        return f"report job {event.job_id} rank {event.rank}:{_failed(event.failed)}"
    if kind == "step_output":
        fin = f" finished {[r for r, _ in event.finished]}" if event.finished else ""
        reports = "".join(f", report job {j} rank {r}:{_failed(f)}" for j, r, f in event.reports)
        return f"step output {event.step_id}{fin}{reports}"
    return f"abort {event.request_id}" if kind == "abort" else kind


def _failed(failed: Sequence[int]) -> str:
    return f" failed {list(failed)}" if failed else " ok"


def describe_commands(commands: Sequence[Any]) -> str:
    return "; ".join(text for c in commands if (text := _describe_command(c)))


def _describe_command(c: Any) -> str:
    kind = type(c).__name__
    if kind == "StepPlan":
        flush = f" flush {list(c.flush)}" if c.flush else ""
        return f"step {c.step_id} [" + ", ".join(
            f"{e.request_id} {e.num_tokens}@{e.computed_before} blocks {list(e.block_table)}" for e in c.entries) \
            + "]" + flush
    if kind in ("StartLoad", "StartStore"):
        after = f" after job {c.after}" if getattr(c, "after", None) is not None else ""
        return f"{'load' if kind == 'StartLoad' else 'store'} job {c.job_id} {c.request_id}{after} " + ", ".join(
            f"{m.block_hash}@{m.tier}->dev{m.device_block}" for m in c.moves)
    if kind == "StartPrefetch":
        return f"prefetch job {c.job_id} {c.request_id} " + ", ".join(
            f"{m.block_hash}@{m.src_tier}->{m.dst_tier}" for m in c.moves)
    if kind == "FreeBlocks":
        return f"free dev{list(c.device_blocks)}"
    if kind in ("SubmitLookup", "DiscardLookup"):
        return f"{'lookup' if kind == 'SubmitLookup' else 'discard lookup'} {c.request_id} epoch {c.epoch}"
    return ""


class LifecycleMachine(RuleBasedStateMachine):
    """The driver as an adversary. Subclasses set the class attributes (see make_machine)."""

    stack: StackSpec = ()
    engine_factory: EngineFactory | None = None
    engine_config: Any = None
    sharing: bool | None = None

    def __init__(self) -> None:
        super().__init__()
        self.engine: Any = None
        self.probe: EngineProbe = EngineProbe(None)
        self.observer: InvariantObserver | None = None
        self.log: list[str] = []
        self.t = -1.0  # the first input comes at t=0
        self.inputs_per_ms = 1
        self.clock_reads = 0
        self.outputs: dict[str, int] = {}
        self.request_ids: list[str] = []
        # (request, block position, hash) whose load, store or prefetch failed: revisit them.
        self.failed_copies: list[tuple[str, int, int]] = []
        # Lookups in flight: (request, epoch, hashes, what the tiers said at submission).
        self.lookups: list[tuple[str, int, tuple[int, ...], tuple[str, ...]]] = []
        self.old_lookups: list[tuple[str, int, tuple[str, ...] | None]] = []  # answered or discarded
        self.workers = WorkerModel(1)
        self.steps: list[Any] = []  # step plans whose output has not come, in order
        self.delivered_steps: list[int] = []
        self.max_in_flight = 1
        self.deadline: float | None = None
        self.seed = 0
        self.drain_late = False
        self.drain_chaos = False
        self.broken = False
        self.swarm: dict[str, int] = {}  # per-example weight multipliers of the rare actions
        self.arrival_hashes: dict[str, tuple[int, ...]] = {}
        self.retired: dict[str, Any] = {}  # requests the engine retired, as they left
        self.retention = False  # the engine retires finished requests (Engine(retire=...))
        self.own_lookups: OwnLookups | None = None  # the connector answers its own lookups
        self.handling: str | None = None  # the type of the input being handled, once its record is fed
        self.vllm_calls = False  # only inputs vLLM's calls show (World.vllm_calls)
        self.inputs: list[Any] = []  # every input fed, in order (the vLLM-calls trace's shadow run)
        self.records: list[dict[str, Any]] = []  # every record the engine made (the replay check)
        self.world: World | None = None
        self.warmed: list[int] = []
        self.stack_names: tuple[str, ...] = ()
        self.recording: RecordingCheck | None = None  # a recorded world's recording of the connector

    # ---- setup -------------------------------------------------------------------------
    @initialize(seed=st.integers(0, 2**32 - 1))
    def start(self, seed: int) -> None:
        from kvlife.lifecycle.engine.core import Engine

        cls = type(self)
        world = World.draw(seed)
        config = world.config(cls.engine_config)
        stack = _with_explorer(_build_stack(cls.stack), world.explorer)
        sharing = cls.sharing if cls.sharing is not None else detect_sharing(stack)
        self.observer = InvariantObserver(Settings.of(config, sharing=sharing, tier_content_known=True,
                                                      store_rule=store_rule(stack), fifo=True, accounting=True))
        warmed = _warm_blocks(world, config)
        tiers = _tier_indexes(config, warmed)
        if warmed:
            self.observer.seed_tier(tiers[-1].name, warmed)
        self.retention = world.retention and cls.engine_factory is None
        extra: dict[str, Any] = {"retire": self._on_retire} if self.retention else {}
        self.own_lookups = None
        if world.connector_lookups is not None and cls.engine_factory is None:
            self.own_lookups = extra["lookups"] = OwnLookups(world.connector_lookups, self._truthful,
                                                             self._answer_applied)
        self.engine = (cls.engine_factory or Engine)(config, stack, tiers=tiers, recorder=self._on_record, **extra)
        self.world, self.warmed, self.stack_names = world, warmed, stack.names
        if world.recorded:
            self.recording = RecordingCheck(config, sharing, {tiers[-1].name: warmed} if warmed else None,
                                            world.vllm_names, world.unnamed_jobs)
            self.recording.install(self.engine)
        self.probe = EngineProbe(self.engine, self.retired)
        self.probe.watch_admissions()
        self.observer.attach(self.probe)
        self.workers = WorkerModel(config.ranks)
        self.max_in_flight = 2 if world.async_scheduling else 1
        self.deadline = world.deadline
        self.inputs_per_ms = world.inputs_per_ms
        self.drain_late, self.drain_chaos = world.drain_late, world.drain_chaos
        self.vllm_calls = world.vllm_calls and self.own_lookups is not None
        if self.vllm_calls:
            self.drain_chaos = False  # (its misbehaviours are inputs vLLM never sends)
        self.seed = seed
        self.swarm = dict(world.swarm)
        self.log.append(f"world {seed}: {world.describe(config, stack, sharing, warmed)}")

    def _answer_applied(self) -> None:
        """The connector applied an answer of its own client: the nested input ends."""
        assert self.observer is not None
        commands = self.probe.commands()
        if commands is not None:
            self.observer.feed_new_commands(commands)
        self.observer.end_nested()

    def _truthful(self, hashes: Sequence[int]) -> tuple[str, ...]:
        return tuple(self.probe.sync_lookup(hashes))

    def _on_retire(self, req: Any) -> None:
        """The engine lets go of a finished request: its metrics stay readable here."""
        self.retired[req.request_id] = req

    # ---- feeding -------------------------------------------------------------------------
    def _on_record(self, record: dict[str, Any]) -> None:
        """The engine's recorder: commands issued so far in this handling go to the
        observer first, so it sees them in the order the engine produced them."""
        assert self.observer is not None
        self.records.append(record)
        commands = self.probe.commands() if self.probe.engine is not None else None
        if commands is not None:
            self.observer.feed_new_commands(commands)
        # A lookup answer the connector's own client hands it as a pass begins: an input
        # inside the tick's handling (its end: ``OwnLookups`` calls ``end_nested``).
        is_input = record.get("kind") == "input"
        self.observer.feed_record(record, nested=self.own_lookups is not None and is_input and self.handling == "tick")
        if is_input and self.handling is None:
            self.handling = str(record.get("type"))

    def feed(self, event: Any) -> list[Any]:
        assert self.observer is not None
        if event.type == "arrival":
            self.arrival_hashes.setdefault(event.request_id, tuple(event.block_hashes))
        self.log.append(f"t={event.t:g} {describe_input(event)}")
        self.inputs.append(event)
        self.handling = None
        try:
            commands = self.engine.handle(event)
        except Exception as exc:
            self._crashed(exc, event.t)
        finally:
            self.handling = None
        if commands:
            self.log[-1] += "  -> " + describe_commands(commands)
        self.observer.feed_new_commands(commands)  # the rest of them, or all of a list of its own
        routed = ("SubmitLookup", "DiscardLookup") if self.own_lookups is not None else ()
        lost = [c for c in self.observer.taken_out(commands) if type(c).__name__ not in routed]
        if lost:  # (only lookups go to the connector's own client)
            self._raise(Violation(7, f"the engine issued {describe_commands(lost)} but never handed it to the "
                                     f"driver, which carries out only the commands a handling returns", t=event.t))
        self.observer.end_input()
        self._judge(event, commands)
        self._track(commands)
        return list(commands)

    def _crashed(self, exc: Exception, t: float) -> None:
        assert self.observer is not None
        # What the observer saw go wrong before the engine gave up comes first.
        commands = self.probe.commands()
        if commands is not None:
            self.observer.feed_new_commands(commands)
        if self.observer.violations:
            self._raise(self.observer.violations[0])
        if isinstance(exc, IllegalTransition):
            self._raise(Violation(1, f"engine raised IllegalTransition: {exc}", t=t))
        if isinstance(exc, AssertionError):
            self._raise(Violation(8, f"engine raised AssertionError: {exc}", t=t))
        self._raise(Violation(0, f"engine raised {type(exc).__name__}: {exc}", t=t))

    def _judge(self, event: Any, commands: Sequence[Any]) -> None:
        assert self.observer is not None
        if self.observer.violations:
            self._raise(self.observer.violations[0])
        if self.recording is not None and (found := self.recording.findings(event.t)) is not None:
            self._raise(found)
        if self.retention:
            kept = self.probe.kept_for_nothing()
            if kept is not None:
                self._raise(Violation(7, kept, t=event.t))
        if event.type == "tick" and self.own_lookups is not None:
            late = self.own_lookups.overdue()
            if late is not None:
                self._raise(Violation(7, late, t=event.t))
        if event.type == "tick" and not any(type(c).__name__ == "FreeBlocks" for c in commands):
            # (Blocks freed in the tick may have been freed after its admission pass.)
            idle = self._idle_with_room()
            if idle is not None:
                self._raise(Violation(11, f"the tick left the device idle: {idle}", t=event.t))

    def _raise(self, violation: Violation) -> Any:
        self.broken = True
        events = "\n".join(f"  {i:3d}. {line}" for i, line in enumerate(self.log))
        exc = InvariantViolation(violation)
        exc.args = (f"{violation}\nevents:\n{events}",)
        exc.events = list(self.log)  # type: ignore[attr-defined]
        raise exc

    def _track(self, commands: Sequence[Any]) -> None:
        """What the driver must do next: answer lookups, report jobs, deliver outputs."""
        for c in commands:
            kind = type(c).__name__
            if kind == "SubmitLookup":
                self.lookups.append((c.request_id, c.epoch, c.block_hashes, self.probe.sync_lookup(c.block_hashes)))
            elif kind == "DiscardLookup":
                found = [i for i, (rid, epoch, _, _) in enumerate(self.lookups)
                         if rid == c.request_id and epoch == c.epoch]
                for i in found[:1]:
                    del self.lookups[i]
                    self.old_lookups.append((c.request_id, c.epoch, None))
            elif kind in ("StartLoad", "StartStore", "StartPrefetch"):
                self.workers.start(c, kind[5:].lower())
            elif kind == "StepPlan":
                self.steps.append(c)
                self.workers.flush(c.flush, c.step_id)

    def _advances(self) -> bool:
        """Will the next input come a millisecond after the last one?"""
        return self.t < 0 or self.clock_reads % self.inputs_per_ms == self.inputs_per_ms - 1

    def _now(self) -> float:
        if self._advances():
            self.t += 1.0
        self.clock_reads += 1
        return self.t

    # ---- actions -----------------------------------------------------------------------------
    @rule(data=st.data())
    def act(self, data: st.DataObject) -> None:
        """One input from the adversary: an action among those enabled now, in proportion
        to its weight (``ACTIONS``, scaled per example by the world's swarm weights), with
        its arguments. A single rule, so that rare but enabled actions (a report, a second
        step output) come as often as their weight says, not as Hypothesis's rule order
        and filters happen to favour them."""
        enabled = [(a, w) for a in ACTIONS if (w := a.weight * self.swarm.get(a.name, 1)) and a.enabled(self)
                   and not (self.vllm_calls and a.name in NOT_FROM_VLLM)]
        # Hypothesis draws small integers far more often than large ones; a Fibonacci hash
        # of a wide draw spreads them over [0, 1) (a draw of 0, its simplest, is a tick).
        raw = data.draw(st.integers(0, 2**32 - 1), label="action")
        x = ((raw * 0x9E3779B97F4A7C15) % 2**64) * sum(w for _, w in enabled) // 2**64
        index = 0
        while x >= enabled[index][1]:
            x -= enabled[index][1]
            index += 1
        action = enabled[index][0]
        kwargs = {name: data.draw(strategy, label=name) for name, strategy in action.args}
        getattr(self, action.name)(**kwargs)

    def arrive(self, family: int, blocks: int, extra: int, branch: int, output: int, resumable: bool,
               limit: bool = False) -> None:
        from kvlife.lifecycle.engine.events import Arrival

        bt = self.probe.config.block_tokens
        tokens = max(1, blocks * bt + extra)
        count = blocks + (1 if extra else 0)
        # Same family and branch: same chained hashes (a shared prefix); another branch
        # shares only the first block.
        hashes = tuple(family * 1000 + (0 if i == 0 else branch * 100) + i for i in range(count))
        rid = f"r{len(self.request_ids)}"
        self.request_ids.append(rid)
        self.outputs[rid] = output
        # With its output limit known, the engine never schedules past it (async scheduling).
        self.feed(Arrival(self._now(), rid, tokens, hashes, resumable, max_tokens=output if limit else None))

    def pressure(self, count: int, family: int) -> None:
        """Long requests with long outputs: the device runs out and someone is preempted.
        The same prefix arriving together: with a warm tier, their loads can be joined."""
        for _ in range(count):
            self.arrive(family, 4, 2, 0, 12, False)

    def revisit(self, i: int, blocks: int, extra: int, output: int) -> None:
        """A request that continues an earlier one (a conversation's next turn, a retry):
        its prompt repeats the first blocks of an earlier request's tokens, prompt and
        generated, preferring blocks whose load, store or prefetch failed; by now the
        device may well have dropped them, so they come from the tiers (or are computed)."""
        from kvlife.lifecycle.engine.events import Arrival

        bt = self.probe.config.block_tokens
        if self.failed_copies:
            rid, position, h = self.failed_copies[i % len(self.failed_copies)]
            blocks = max(blocks, position + 1)
            if self.probe.published(h):
                # The device still caches it: a long request with a prompt of its own
                # goes first and takes the device's blocks, so the revisit reads the tiers.
                flush = f"r{len(self.request_ids)}"
                self.request_ids.append(flush)
                self.outputs[flush] = 1
                count = self.probe.config.device_blocks - 3
                self.feed(Arrival(self._now(), flush, count * bt + 1,
                                  tuple(9000 + 10 * len(self.request_ids) + k for k in range(count))))
        else:
            rid = self.request_ids[i % len(self.request_ids)]
        hashes = (self.probe.hashes(rid) or self.arrival_hashes.get(rid, ()))[: min(blocks, 5)]
        new = f"r{len(self.request_ids)}"
        self.request_ids.append(new)
        self.outputs[new] = output
        self.feed(Arrival(self._now(), new, len(hashes) * bt + extra, tuple(hashes)))

    def oversized_arrival(self, extra: int = 1) -> None:
        """A prompt at the device's size: larger than the device (``extra`` 1), or filling it
        exactly, with no block left for its first output token (``extra`` 0): it can never
        run and must not block the queue; or one token less (``extra`` -1): it just fits its
        first output token, and then, wanting more, its known tokens fill the device: it can
        never run again, and fails once preempted (vLLM would loop preempting it)."""
        from kvlife.lifecycle.engine.events import Arrival

        config = self.probe.config
        tokens = config.device_blocks * config.block_tokens + extra
        rid = f"r{len(self.request_ids)}"
        self.request_ids.append(rid)
        self.outputs[rid] = 1 if extra >= 0 else 3
        self.feed(Arrival(self._now(), rid, tokens, tuple(7000 + i for i in range(tokens // config.block_tokens))))

    def tick(self) -> None:
        from kvlife.lifecycle.engine.events import Tick

        self.feed(Tick(self._now()))

    def first_step_finishes(self, blocks: int) -> None:
        """A boundary the random walk seldom reaches: a request that finishes at the output
        of the engine's very first step, its stores in flight, every store reported before
        the next step's output. It may leave ``sending`` only with the output of a step
        planned after it finished (11)."""
        self.arrive(0, blocks, 0, 1, 1, False)
        self.tick()
        if not self.steps:
            return
        self._step_output(0)
        if len(self.steps) < self.max_in_flight:
            self.tick()  # the stores go to the workers with this step
        for job_id in self.workers.jobs_of("store"):
            while self.workers.reportable_job(job_id):
                self._report(job_id, 0, False)

    def time_passes(self, exact: bool = False) -> None:
        """Nothing happens for a while: the next input comes after the transfer deadline
        (or after the engine's next deadline: a prefetch patience, a lookup, a reclaim);
        ``exact``: at that very deadline (a boundary: at its deadline, patience is over)."""
        jump = (self.deadline or 0.0) + 1.0
        wake = self.probe.next_wakeup()
        if wake is not None:
            jump = max(jump, wake - self.t)
            if exact:
                jump = max(0.0, wake - self.t - (1.0 if self._advances() else 0.0))  # the next input lands on it
        self.t += jump
        self.log.append(f"(time passes: {jump:g} ms)")

    def step_output(self, attach: int = 0, fail: bool = False) -> None:
        self._step_output(attach, fail)

    def _step_output(self, attach: int = 0, fail: bool = False) -> None:
        """The oldest step's output, with the reports the workers send with it: those of
        the stores it flushed, and ``attach`` more (the first failing a block if ``fail``)."""
        from kvlife.lifecycle.engine.events import StepOutput

        plan = self.steps.pop(0)
        reports = [self._take(job, rank, False) for job, rank in self.workers.due_with(plan.step_id)]
        for n, (job, rank) in enumerate(self.workers.reportable()[:attach]):
            reports.append(self._take(job, rank, fail and n == 0))
        self.delivered_steps.append(plan.step_id)
        self.feed(StepOutput(self._now(), plan.step_id, self._finishes(plan), tuple(reports)))

    def _finishes(self, plan: Any) -> tuple[tuple[str, str], ...]:
        """The model's side: sampling requests whose token is their last (a token a
        preempted request's step still delivers counts, as vLLM appends it). Under
        ``vllm_calls``, none for a request already finished (vLLM stops only those it still
        has; elsewhere the engine must ignore it)."""
        done = []
        for entry in plan.entries:
            if self.vllm_calls and self.probe.state(entry.request_id) in ("finished", "sending"):
                continue
            produced = self.probe.output_tokens(entry.request_id) if entry.samples else None
            if produced is not None and produced + 1 >= self.outputs.get(entry.request_id, 1):
                done.append((entry.request_id, "stopped"))
        return tuple(done)

    def _failed_step(self, rank: int) -> None:
        """The oldest step's output says it raised on a rank and wrote no KV there (the live
        runtime's): its requests, and any holding a block it was to write, are aborted, and
        no hit serves those blocks again (10: nothing reads them)."""
        from kvlife.lifecycle.engine.events import StepOutput

        plan = self.steps.pop(0)
        reports = [self._take(job, r, False) for job, r in self.workers.due_with(plan.step_id)]
        self.delivered_steps.append(plan.step_id)
        failed = (rank % self.probe.config.ranks,)
        self.feed(StepOutput(self._now(), plan.step_id, (), tuple(reports), failed_ranks=failed))

    def early_output(self) -> None:
        """The output of the second step in flight arrives before the first's: the engine
        takes outputs in order and must ignore it (``unknown_step``); it comes again in turn."""
        from kvlife.lifecycle.engine.events import StepOutput

        plan = self.steps[1]
        self.feed(StepOutput(self._now(), plan.step_id, self._finishes(plan)))

    def stale_step_output(self, i: int, unknown: bool) -> None:
        """A step output that already came (or names a step never planned) arrives again,
        claiming a running request finished: it must change nothing."""
        from kvlife.lifecycle.engine.events import StepOutput

        step_id = 10_000 + i if unknown else self.delivered_steps[i % len(self.delivered_steps)]
        running = [rid for rid in self.request_ids if self.probe.state(rid) == "running"]
        finished = ((running[i % len(running)], "stopped"),) if running else ()
        self.feed(StepOutput(self._now(), step_id, finished))

    def answer_lookup(self, i: int, mode: str) -> None:
        self._answer(i % len(self.lookups), mode)

    def _answer(self, index: int, mode: str) -> None:
        from kvlife.lifecycle.engine.events import LookupAnswer

        rid, epoch, hashes, then = self.lookups.pop(index)
        tiers: tuple[str, ...] | None = {"failed": None, "miss": (), "at_submit": then}.get(mode, ())
        if mode == "truthful":
            tiers = self.probe.sync_lookup(hashes)
        self.old_lookups.append((rid, epoch, tiers))
        self.feed(LookupAnswer(self._now(), rid, epoch, tiers))

    def stale_lookup_answer(self, i: int) -> None:
        """An answer that already came, or whose lookup was discarded, arrives (again)."""
        from kvlife.lifecycle.engine.events import LookupAnswer

        # Half the time, an answer its request already took while that request now loads (a
        # duplicate of the current epoch, the rarest case), if there is one.
        loading = [old for old in self.old_lookups
                   if self.probe.state(old[0]) == "loading" and self.probe.epoch(old[0]) == old[1]]
        rid, epoch, tiers = (loading[(i // 2) % len(loading)] if loading and i % 2 == 0
                             else self.old_lookups[i % len(self.old_lookups)])
        if tiers is None:
            tiers = self.probe.sync_lookup(self.probe.hashes(rid))
        self.feed(LookupAnswer(self._now(), rid, epoch, tiers))

    def _superseded(self) -> list[tuple[str, int, tuple[str, ...] | None]]:
        """Answers already given for requests whose newer lookup is pending: those of an
        older epoch if there are any (the rarer case), else those the last admission consumed."""
        pending = {rid for rid, _, _, _ in self.lookups}
        found = [old for old in self.old_lookups if old[0] in pending and self.probe.state(old[0]) == "lookup_pending"]
        older = [old for old in found if old[1] < (self.probe.epoch(old[0]) or 0)]
        return older or found

    def old_answer_while_pending(self, i: int) -> None:
        """The answer to an earlier lookup of a request (an older epoch, or an answer the
        last admission consumed) arrives while its newer lookup is pending."""
        from kvlife.lifecycle.engine.events import LookupAnswer

        candidates = self._superseded()
        rid, epoch, tiers = candidates[i % len(candidates)]
        self.feed(LookupAnswer(self._now(), rid, epoch, tiers if tiers is not None else ("host",)))

    def report(self, i: int, rank: int, fail: bool) -> None:
        jobs = sorted({job for job, _ in self.workers.reportable()})
        self._report(jobs[i % len(jobs)], rank, fail)

    def load_deadline(self) -> None:
        """A load stalls: the clock passes the transfer deadline and the scheduler runs."""
        self.time_passes()
        if len(self.steps) < self.max_in_flight:
            self.tick()

    def pull_fails(self, i: int, rank: int) -> None:
        """One rank of a prefetch in flight fails to land its first block."""
        pulls = self.workers.jobs_of("prefetch")
        self._report(pulls[i % len(pulls)], rank, True)

    def _take(self, job_id: int, rank: int, fail: bool) -> Report:
        report = self.workers.take_rank(job_id, rank, fail)
        self._note_failed(job_id, report[2])
        return report

    def _note_failed(self, job_id: int, failed: tuple[int, ...]) -> None:
        command = self.workers.commands.get(job_id)
        if not failed or command is None:
            return
        hashes = self.probe.hashes(command.request_id)
        if failed[0] in hashes:
            self.failed_copies.append((command.request_id, hashes.index(failed[0]), failed[0]))

    def _report(self, job_id: int, rank_pick: int, fail: bool) -> None:
        from kvlife.lifecycle.engine.events import TransferReport

        job, rank, failed = self.workers.take(job_id, rank_pick, fail)
        self._note_failed(job, failed)
        self.feed(TransferReport(self._now(), job, rank, failed))

    def lose_lookup(self, i: int) -> None:
        """The lookup service loses a lookup: its answer never comes (or, much later, as
        a stale one). Only the lookup deadline gets its request going again."""
        rid, epoch, _, then = self.lookups.pop(i % len(self.lookups))
        self.old_lookups.append((rid, epoch, then))
        self.log.append(f"(the lookup of {rid} epoch {epoch} is lost)")

    def silence_rank(self, i: int, rank: int) -> None:
        """A rank of a job in flight goes silent on it: its report never comes (unless
        late). Only the transfer or reclaim deadline ends the job and gives its blocks back."""
        jobs = self.workers.silenceable()
        job_id = jobs[i % len(jobs)]
        silent = self.workers.silence(job_id, rank)
        self.log.append(f"(rank {silent} goes silent on job {job_id})")

    def silent_rank_reports(self, i: int) -> None:
        """A rank that went silent reports after all: a late report if its job was given
        up or reclaimed meanwhile, else just a slow one."""
        from kvlife.lifecycle.engine.events import TransferReport

        job_id, rank = self.workers.late(i)
        self.feed(TransferReport(self._now(), job_id, rank, ()))

    def _late_jobs(self) -> list[int]:
        """Jobs the engine gave up on at their deadline, some rank still to report, whose
        requests have moved on: those with a request running again if any, else those
        with one waiting to."""
        running: list[int] = []
        waiting: list[int] = []
        for job_id in sorted({job for job, _ in self.workers.reportable()}):
            if not self.probe.job_given_up(job_id):
                continue
            state = self.probe.state(self.probe.job_request(job_id) or "")
            if state == "running":
                running.append(job_id)
            elif state == "waiting":
                waiting.append(job_id)
        return running or waiting

    def late_report(self, i: int) -> None:
        """The ranks of a job given up at its deadline report it after all, now that its
        request runs (or waits) again."""
        late = self._late_jobs()
        job_id = late[i % len(late)]
        while self.workers.reportable_job(job_id):
            self._report(job_id, 0, False)

    def duplicate_report(self, i: int, fail: bool) -> None:
        """A rank reports a job again, possibly claiming a failure: it must change nothing."""
        from kvlife.lifecycle.engine.events import TransferReport

        job_id, rank = self.workers.sent[i % len(self.workers.sent)]
        command = self.workers.commands.get(job_id)
        failed = (command.moves[-1].block_hash,) if fail and command is not None and command.moves else ()
        self.feed(TransferReport(self._now(), job_id, rank, failed))

    def bogus_report(self, kind: str) -> None:
        from kvlife.lifecycle.engine.events import TransferReport

        owed = sorted(self.workers.owed)
        if kind == "unknown_job" or not owed:
            self.feed(TransferReport(self._now(), 10_000 + len(self.log), 0, ()))
        else:
            self.feed(TransferReport(self._now(), owed[0], self.probe.config.ranks, ()))

    def abort(self, k: int, i: int) -> None:
        """Abort a request: first pick one of the states some request is in, so that rare
        states (loading, sending, lookup_pending) get aborted as often as common ones."""
        from kvlife.lifecycle.engine.events import Abort

        states = {self.probe.state(rid) for rid in self.request_ids}
        if self.vllm_calls:  # (vLLM tells a connector only of the abort of a request it still schedules)
            states -= {"sending", "finished", None}
        if not states:
            return
        present = [s for s in TABLE.states if s in states]
        state = present[k % len(present)]
        pool = [rid for rid in self.request_ids if self.probe.state(rid) == state]
        self.feed(Abort(self._now(), pool[i % len(pool)]))

    def abort_waiting_on_io(self, i: int) -> None:
        """Abort a request that waits on IO (a lookup, a load, its stores)."""
        from kvlife.lifecycle.engine.events import Abort

        pool = [rid for rid in self.request_ids if self.probe.state(rid) in IO_WAIT_STATES
                and not (self.vllm_calls and self.probe.state(rid) == "sending")]
        if pool:
            self.feed(Abort(self._now(), pool[i % len(pool)]))

    def corrupt_block(self, i: int) -> None:
        """A tier copy goes bad: every load of it fails until it is stored again."""
        stored = sorted({(name, h) for rid in self.request_ids for h in self.probe.hashes(rid)
                         for name in self.probe.tier_names() if self.probe.tier_holds(name, h)})
        if not stored:
            return
        name, h = stored[i % len(stored)]
        self.workers.corrupt.add((name, h))
        self.log.append(f"(block {h} is now corrupt in {name})")

    # ---- liveness ------------------------------------------------------------------------------
    def _idle_with_room(self) -> str | None:
        """11 after a tick: if nothing runs, loads, stores or pulls and no step computes
        anything, the first request in line that waits on nothing (no lookup, no prefetch,
        not deferred by its admission policy) was admitted, or it does not fit the free
        device blocks (admission is FIFO: it stops at a head short of memory). A head that
        can never fit fails and the pass goes on (vllm#57841)."""
        if self.probe.in_flight_work() or any(step.entries for step in self.steps):
            return None
        free, capacity, _ = self.probe.device()
        for rid, need, deferred in self.probe.waiting_line():
            if deferred:
                continue
            if need <= free:
                return (f"{rid}, first in line and waiting on nothing, needs {need} blocks and {free} of {capacity} "
                        f"are free, yet it was not admitted")
            return None
        return None

    def _parked(self) -> str | None:
        """Nothing runs, loads, stores or pulls, yet requests wait: either one of them fits
        the free device blocks and waits for nothing (a head that can never fit parks the
        queue), or none fits though nothing holds the device (its blocks leaked)."""
        if self.probe.in_flight_work() or self.steps:
            return None
        line = self.probe.waiting_line()
        if not line:
            return None
        free, capacity, _ = self.probe.device()
        fits = [(rid, need) for rid, need, _ in line if need <= free]
        head, need = line[0][0], line[0][1]
        if not fits:
            return (f"nothing runs, loads or stores and {free} of {capacity} device blocks are free, yet {head} "
                    f"(first of {len(line)} waiting) needs {need}")
        why = f"behind {head}, which needs {need} blocks" if need > free else f"{head} first in line"
        names = ", ".join(f"{rid} ({n} blocks)" for rid, n in fits)
        return f"nothing runs and {free} device blocks are free, yet {names} wait ({why})"

    def _silent_open(self) -> bool:
        """A job some rank went silent on is still open in the observer (not reclaimed)."""
        assert self.observer is not None
        return self.workers.silent_open({job_id for job_id, job in self.observer.picture.jobs.items() if job.open})

    # ---- the end -------------------------------------------------------------------------------
    def teardown(self) -> None:
        if self.broken or self.engine is None:
            return
        self.drain()
        self._replays()
        self._refuses_altered()
        self._calls_recorded()

    def _replays(self) -> None:
        """The example's trace replays exactly (``kvlife.specs.replay_check``): its records,
        written as a run writes them, re-fed to a fresh engine built as this one was. On the
        examples whose seed is a multiple of ``REPLAY_EVERY``."""
        from kvlife.specs.replay_check import replays_exactly

        if self.seed % REPLAY_EVERY:
            return
        if self.own_lookups is not None:
            # Not replayable by design: the connector's own client hands it answers inside a
            # tick's handling, which a trace records as inputs after the tick (as a trace made
            # inside vLLM has them), and a replay feeds after it. Its trace is checked
            # against the one written from vLLM's calls instead (``_calls_recorded``).
            return
        differs = replays_exactly(self.records, self.probe.config, self.stack_names, self._fresh_engine, self.seed)
        if differs is not None:
            self._raise(Violation(15, differs))

    def _refuses_altered(self) -> None:
        """The trace reader refuses the example's input records altered one value at a
        time, naming the field (``kvlife.specs.refusal_check``; 15)."""
        from kvlife.specs.refusal_check import refuses_altered

        taken = refuses_altered(self.records)
        if taken is not None:
            self._raise(Violation(15, taken))

    def _calls_recorded(self) -> None:
        """Under ``vllm_calls``: the example's inputs again, into an engine that writes the
        trace's inputs from the connector calls they cause, as ``KVLifeConnector`` does inside
        vLLM (``Engine(record_calls=True)``): its trace must be the example's, line for line
        (an arrival names the hashes of its full prompt blocks only: vLLM's request knows no
        more). A trace from inside vLLM is what ``validate``, ``explain`` and ``plot`` read."""
        from kvlife.lifecycle.drivers.vllm_order import DelayedLookups
        from kvlife.lifecycle.engine.events import Arrival

        if not self.vllm_calls or self.world is None or self.world.connector_lookups is None:
            return
        written: list[dict[str, Any]] = []
        lookups = DelayedLookups(self.world.connector_lookups, lambda hashes: tuple(engine.sync_lookup(hashes)))
        engine = self._fresh_engine(self.probe.config, written.append, lookups=lookups, record_calls=True)
        bt = self.probe.config.block_tokens
        for event in self.inputs:
            engine.handle(event)
        expected = [_full_prompt_blocks(r, bt) if r.get("type") == Arrival.type else r for r in self.records]
        for line, (want, got) in enumerate(zip(expected, written, strict=False)):
            if want != got:
                self._raise(Violation(15, f"the trace written from vLLM's calls differs from the engine's at record "
                                          f"{line}: {got} where the engine's has {want}"))
        if len(expected) != len(written):
            self._raise(Violation(15, f"the trace written from vLLM's calls has {len(written)} records, the engine's "
                                      f"{len(expected)}"))

    def _fresh_engine(self, config: Any, recorder: Any, **more: Any) -> Any:
        """An engine as this example's: the stack built again, the same explorer (it answers
        from its seed and the request ids only), the same warmed tiers, retention."""
        from kvlife.lifecycle.engine.core import Engine

        cls = type(self)
        assert self.world is not None
        stack = _with_explorer(_build_stack(cls.stack), self.world.explorer)
        extra: dict[str, Any] = {"retire": lambda req: None} if self.retention else {}
        return (cls.engine_factory or Engine)(config, stack, tiers=_tier_indexes(config, self.warmed),
                                              recorder=recorder, **extra, **more)

    def _past_deadlines(self) -> None:
        """Move the clock past the transfer deadline and the next prefetch patience."""
        jump = (self.deadline or 0.0) + 1.0
        wake = self.probe.next_wakeup()
        if wake is not None and math.isfinite(wake):
            jump = max(jump, wake - self.t)
        self.t += jump

    def _chaos(self, rng: random.Random) -> None:
        """The drain's own adversary (seeded by the example): before everything is
        delivered, the inputs a late phase of a run sees when the driver misbehaves within
        the protocol: old lookup answers while a newer lookup is pending, the remaining
        reports of a job given up at its deadline now that its requests run again, a later
        step's output before its turn, stale step outputs, duplicate reports with
        failures, reports of ranks that went silent (late), and now and then the clock
        jumping past the transfer deadline."""
        moves: list[tuple[bool, float, Callable[[], None]]] = [
            (bool(self._superseded() and self.lookups), 0.7, lambda: self.old_answer_while_pending(rng.randrange(8))),
            (bool(self._late_jobs()), 0.7, lambda: self.late_report(rng.randrange(8))),
            (len(self.steps) >= 2, 0.5, self.early_output),
            (bool(self.delivered_steps), 0.1, lambda: self.stale_step_output(rng.randrange(8), rng.random() < 0.3)),
            (bool(self.workers.sent), 0.1, lambda: self.duplicate_report(rng.randrange(16), rng.random() < 0.5)),
            (bool(self.workers.silent), 0.2, lambda: self.silent_rank_reports(rng.randrange(8))),
            (self.deadline is not None, 0.1, self.load_deadline),
        ]
        for enabled, chance, move in moves:
            if enabled and rng.random() < chance:
                move()

    def _deliver_all(self, chaos: random.Random | None = None) -> None:
        """Answer every lookup, report every job on every rank, deliver every step output.
        With ``chaos``, a store or prefetch now and then fails on a rank (the drain reads
        back what the run stored: a failed copy must never be read), and a step now and then
        fails on a rank (the live runtime's: the requests still waiting may hit its blocks)."""
        while self.lookups:
            self._answer(0, "truthful")
        while self.vllm_calls and self.workers.reportable():  # (vLLM's come with a step's output)
            if not self.steps:
                self.tick()
            self._step_output(len(self.workers.reportable()))
        while reportable := self.workers.reportable():
            job_id = reportable[0][0]
            owed = self.workers.owed[job_id]
            fail = (chaos is not None and self.workers.kinds.get(job_id) != "load"
                    and len(owed.ranks) == 1 and chaos.random() < 0.25)
            self._report(job_id, 0, fail)
        while self.steps:
            if chaos is not None and chaos.random() < 0.1:  # (no chaos under vllm_calls: vLLM's engine dies)
                self._failed_step(chaos.randrange(4))
            else:
                self._step_output()

    def drain(self) -> None:
        """Stop new inputs; answer everything outstanding; tick until idle, within a bound."""
        from kvlife.lifecycle.engine.events import Tick

        assert self.observer is not None
        late = " after the clock passes every deadline" if self.drain_late else ""
        chaotic = " (with stale, early, duplicated and late inputs)" if self.drain_chaos else ""
        self.log.append(f"--- drain: inputs stop; every outstanding answer, report and output is delivered{late}"
                        f"{chaotic}")
        self._same_unfinished()
        bound = DRAIN_BASE + DRAIN_PER_TOKEN * sum(r.prompt_tokens + self.outputs.get(r.request_id, 1)
                                                   for r in self.probe.unfinished_requests())
        watch = _DrainWatch(bound)
        chaos = random.Random(self.seed)
        while True:
            if self.drain_late:
                self._past_deadlines()
                if len(self.steps) < self.max_in_flight:
                    self.feed(Tick(self._now()))
            if self.drain_chaos:
                self._chaos(chaos)
            self._deliver_all(chaos if self.drain_chaos else None)
            if watch.done(self):
                break
            why = watch.stuck(self)
            if why is not None:
                self._raise(Violation(7, f"stranded: {why}"))
            wake = self.probe.next_wakeup()
            if wake is not None and wake > self.t:
                self.t = wake
            self.feed(Tick(self._now()))
        self._drained()

    def _same_unfinished(self) -> None:
        """What the engine reports as unfinished (its ``stranded`` list) is what the observer saw."""
        assert self.observer is not None
        said = self.probe.unfinished()
        seen = sorted(rid for rid, state in self.observer.states().items() if state != "finished")
        if said != seen:
            self._raise(Violation(7, f"the engine reports {said or 'nothing'} unfinished, the trace has "
                                     f"{seen or 'nothing'}"))

    def _drained(self) -> None:
        """Inputs stopped and everything was delivered: nothing may be left held."""
        assert self.observer is not None
        self.observer.finish()
        if self.observer.violations:
            self._raise(self.observer.violations[0])
        if self.recording is not None and (found := self.recording.findings(final=True)) is not None:
            self._raise(found)
        stranded = self.probe.stranded()
        if stranded:
            self._raise(Violation(7, f"engine.stranded() after drain: {stranded}"))
        held_requests = self.probe.held_requests()
        if self.retention and held_requests:
            held = held_requests[:5]
            self._raise(Violation(7, f"stranded: requests {held} ({len(held_requests)} in all) are still held "
                                     f"after every request finished and every job ended: retention never let go of "
                                     f"them"))
        for name, busy in self.probe.busy_tiers().items():
            self._raise(Violation(7, f"stranded: tier {name} still holds blocks {busy[:5]} for a transfer after every "
                                     f"job ended (a store never completed or a load never let go)"))
        free, capacity, held_blocks = self.probe.device()
        if held_blocks:
            self._raise(Violation(7, f"stranded: device blocks {held_blocks} are still held after every request "
                                     f"finished and every job ended (a leak: {free} of {capacity} free)"))


class _DrainWatch:
    """When the drain may stop, and when it is stuck (7)."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self.ticks = self.stalled = self.parked = 0
        self.finished = -1
        self.last: tuple[Any, ...] = ()
        self.overdue_ticked = False

    def done(self, machine: LifecycleMachine) -> bool:
        # A job a rank went silent on ends only at its reclaim deadline: tick to it. Its
        # deadline may have passed while outputs and reports were delivered (the engine
        # names only future wakeups): one tick acts on it; after that, no wakeup for an
        # open job is the engine's fault, which the observer's end check reports.
        probe = machine.probe
        idle = not probe.busy() and probe.next_wakeup() is None
        if not probe.busy() and (not machine._silent_open() or (idle and self.overdue_ticked)):
            return True
        self.overdue_ticked = idle
        return False

    def stuck(self, machine: LifecycleMachine) -> str | None:
        probe = machine.probe
        now = probe.progress()
        why = machine._parked() if now == self.last else None  # nothing moved, started or changed
        self.last = now
        self.parked = self.parked + 1 if why else 0
        if self.parked >= PARKED_ROUNDS:
            return f"after {self.ticks} drain ticks {why}"
        finished = probe.counts()["finished"]
        self.stalled = 0 if finished != self.finished else self.stalled + 1
        self.finished = finished
        self.ticks += 1
        if self.stalled >= STALL_ROUNDS or self.ticks > self.bound:
            unfinished = [f"{r.request_id} in {r.state} (preempted {r.preemptions}x)"
                          for r in probe.unfinished_requests()]
            what = (f"no request finished in {STALL_ROUNDS} drain ticks (livelock)" if self.stalled >= STALL_ROUNDS
                    else f"requests still unfinished after {self.ticks - 1} drain ticks (bound {self.bound})")
            return f"{what}: {', '.join(unfinished) or 'jobs still in flight'}"
        return None


@attrs.frozen
class Action:
    """One kind of input the adversary may send (a method of ``LifecycleMachine``)."""

    name: str
    weight: int
    enabled: Callable[[LifecycleMachine], bool] = lambda self: True
    args: tuple[tuple[str, st.SearchStrategy[Any]], ...] = ()
    swarm: bool = True  # its weight is scaled per example (0 switches it off)


# Inputs that no vLLM call shows a connector: a report outside a step output (vLLM's come in
# its kv_connector_output), outputs out of turn, a driver's lookup answer.
NOT_FROM_VLLM = frozenset({"report", "late_report", "pull_fails", "silent_rank_reports", "duplicate_report",
                           "bogus_report", "early_output", "stale_step_output", "first_step_finishes"})
ACTIONS: tuple[Action, ...] = (
    Action("tick", 16, lambda self: len(self.steps) < self.max_in_flight, swarm=False),
    Action("arrive", 6, args=(
        ("family", st.integers(0, 2)), ("blocks", st.integers(0, 4)), ("extra", st.integers(0, 3)),
        ("branch", st.integers(0, 2)), ("output", st.integers(1, 8)), ("resumable", st.booleans()),
        ("limit", st.booleans())), swarm=False),
    Action("pressure", 2, args=(("count", st.integers(2, 3)), ("family", st.integers(0, 1)))),
    Action("revisit", 3, lambda self: bool(self.request_ids), (
        ("i", st.integers(0, 15)), ("blocks", st.integers(1, 5)), ("extra", st.integers(1, 3)),
        ("output", st.integers(1, 8)))),
    Action("oversized_arrival", 1, args=(("extra", st.integers(-1, 1)),)),
    Action("first_step_finishes", 3, lambda self: not self.steps and not self.request_ids,
           (("blocks", st.integers(1, 3)),)),
    Action("time_passes", 3, lambda self: self.deadline is not None or self.probe.next_wakeup() is not None,
           (("exact", st.booleans()),)),
    Action("step_output", 14, lambda self: bool(self.steps),
           (("attach", st.sampled_from([0, 0, 1, 4])), ("fail", st.sampled_from([False, False, False, True]))),
           swarm=False),
    Action("early_output", 3, lambda self: len(self.steps) >= 2),
    Action("stale_step_output", 2, lambda self: bool(self.delivered_steps),
           (("i", st.integers(0, 7)), ("unknown", st.booleans()))),
    Action("answer_lookup", 8, lambda self: bool(self.lookups),
           (("i", st.integers(0, 7)), ("mode", st.sampled_from(["truthful", "truthful", "miss", "failed",
                                                                "at_submit"]))), swarm=False),
    Action("stale_lookup_answer", 2, lambda self: bool(self.old_lookups), (("i", st.integers(0, 7)),)),
    Action("old_answer_while_pending", 10, lambda self: bool(self.lookups) and bool(self._superseded()),
           (("i", st.integers(0, 7)),), swarm=False),
    Action("report", 14, lambda self: bool(self.workers.reportable()),
           (("i", st.integers(0, 7)), ("rank", st.integers(0, 3)),
            ("fail", st.sampled_from([False, False, False, True]))), swarm=False),
    Action("late_report", 10, lambda self: bool(self._late_jobs()), (("i", st.integers(0, 7)),), swarm=False),
    Action("pull_fails", 8, lambda self: bool(self.workers.jobs_of("prefetch")),
           (("i", st.integers(0, 7)), ("rank", st.integers(0, 3))), swarm=False),
    Action("load_deadline", 3, lambda self: self.deadline is not None and bool(self.workers.jobs_of("load")),
           swarm=False),
    Action("lose_lookup", 2, lambda self: bool(self.lookups), (("i", st.integers(0, 7)),)),
    Action("silence_rank", 2, lambda self: bool(self.workers.silenceable()),
           (("i", st.integers(0, 7)), ("rank", st.integers(0, 3)))),
    Action("silent_rank_reports", 2, lambda self: bool(self.workers.silent), (("i", st.integers(0, 7)),)),
    Action("duplicate_report", 3, lambda self: bool(self.workers.sent),
           (("i", st.integers(0, 15)), ("fail", st.booleans()))),
    Action("bogus_report", 1, args=(("kind", st.sampled_from(["unknown_job", "bad_rank"])),)),
    Action("abort", 3, lambda self: bool(self.request_ids), (("k", st.integers(0, 5)), ("i", st.integers(0, 15)))),
    Action("abort_waiting_on_io", 2, lambda self: any(
        self.probe.state(rid) in IO_WAIT_STATES for rid in self.request_ids), (("i", st.integers(0, 15)),)),
    Action("corrupt_block", 2, lambda self: bool(self.request_ids), (("i", st.integers(0, 15)),)),
)


def make_machine(
    stack: StackSpec = (),
    *,
    engine_factory: EngineFactory | None = None,
    engine_config: Any = None,
    sharing: bool | None = None,
    name: str = "KvlifeMachine",
) -> type[LifecycleMachine]:
    """A LifecycleMachine for one policy stack (names/paths, or a PolicyStack factory)
    and optionally a different engine (a subclass, or a factory that swaps parts)."""
    if not callable(stack):
        stack = tuple(stack)
        _build_stack(stack)  # fail early on a bad policy name, not inside Hypothesis
    attrs_ = {"stack": staticmethod(stack) if callable(stack) else stack,
              "engine_factory": staticmethod(engine_factory) if engine_factory else None,
              "engine_config": engine_config, "sharing": sharing}
    return type(name, (LifecycleMachine,), attrs_)


@attrs.frozen
class CheckResult:
    ok: bool
    violation: Violation | None = None
    events: tuple[str, ...] = ()
    reproduce: str | None = None
    error: str | None = None

    def report(self) -> str:
        if self.ok:
            return "no invariant violated"
        lines = [f"FAILED: {self.violation if self.violation else self.error}", "counterexample (shrunk):"]
        lines += [f"  {i:3d}. {e}" for i, e in enumerate(self.events)]
        if self.reproduce:
            lines.append(self.reproduce)
        return "\n".join(lines)


def check_settings(examples: int = DEFAULT_EXAMPLES, steps: int = DEFAULT_STEPS, *,
                   derandomize: bool = True, shrink: bool = True) -> settings:
    phases = [Phase.explicit, Phase.generate] + ([Phase.shrink] if shrink else [])
    return settings(
        max_examples=examples,
        stateful_step_count=steps,
        derandomize=derandomize,
        database=None,
        deadline=None,
        print_blob=True,
        phases=phases,
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=False,
    )


def run_check(
    stack: StackSpec = (),
    *,
    examples: int = DEFAULT_EXAMPLES,
    steps: int = DEFAULT_STEPS,
    engine_factory: EngineFactory | None = None,
    engine_config: Any = None,
    sharing: bool | None = None,
    derandomize: bool = True,
    shrink: bool = True,
    seed: int | None = None,
) -> CheckResult:
    """Model-check a stack; returns the (shrunk) counterexample instead of raising. Its
    built-in policies are first checked against their documented properties
    (``kvlife.specs.policy_contracts``). ``seed``: Hypothesis draws from this seed (over
    ``derandomize``), so the same seed finds and shrinks the same counterexample again."""
    from kvlife.specs.policy_contracts import contract_problems

    problems = contract_problems(_build_stack(stack))
    if problems:
        return CheckResult(False, None, (), None, f"policy contract: {problems[0]}")
    machine = make_machine(stack, engine_factory=engine_factory, engine_config=engine_config, sharing=sharing)
    try:
        chosen = check_settings(examples, steps, derandomize=derandomize, shrink=shrink)
        with no_source_constants():
            if seed is None:
                run_state_machine_as_test(machine, settings=chosen)
            else:
                hypothesis.seed(seed)(get_state_machine_test(machine, settings=chosen))()
    except InvariantViolation as exc:
        return CheckResult(False, exc.violation, tuple(getattr(exc, "events", ())), _reproduce_line(exc))
    except Exception as exc:  # a driver-level bug: still a counterexample, never a traceback
        return CheckResult(False, None, (), _reproduce_line(exc), f"{type(exc).__name__}: {exc}")
    return CheckResult(True)


@contextlib.contextmanager
def no_source_constants() -> Iterator[None]:
    """While a check runs, Hypothesis draws no integer from the literals of the loaded
    local modules. It does by default (about 5 % of its draws, since Hypothesis 6.131), so
    a check's examples would change with every literal added anywhere in kvlife and with
    which modules a process happened to import: importing ``kvlife.lifecycle.traces.header``
    before the check (it adds the literal 256) made the derandomized check miss the zoo's
    ``completion_for_running_request``. The checker's inputs mean nothing as literals (a
    seed, an action's pick). There is no setting for it: this swaps Hypothesis's internal
    ``_get_local_constants`` for an empty set and restores it after (a Hypothesis without
    it is left alone)."""
    try:
        from hypothesis.internal.conjecture import providers
    except ImportError:  # pragma: no cover - another Hypothesis layout
        yield
        return
    found = getattr(providers, "_get_local_constants", None)
    cache: Any = getattr(getattr(providers, "CONSTANTS_CACHE", None), "cache", None)
    if found is None or not hasattr(providers, "Constants") or not hasattr(cache, "clear"):
        yield
        return
    empty = providers.Constants()
    providers._get_local_constants = lambda: empty
    cache.clear()  # the permitted constants of earlier draws, local ones included
    try:
        yield
    finally:
        providers._get_local_constants = found
        cache.clear()


def _reproduce_line(exc: BaseException) -> str | None:
    for note in getattr(exc, "__notes__", ()):
        if "reproduce_failure" in note:
            return str(note).strip()
    return None


def check_policy(*policies: str, examples: int = DEFAULT_EXAMPLES, steps: int = DEFAULT_STEPS,
                 sharing: bool | None = None, engine_factory: EngineFactory | None = None) -> None:
    """One line in a user's suite: raise AssertionError with a readable counterexample
    if the stack (``"pkg.mod:Class"``, file paths or built-in names) breaks an invariant,
    or its guards fail against hostile policies (``kvlife.specs.guards``)."""
    from kvlife.specs.guards import guard_problems

    if guards := guard_problems(_build_stack(policies)):
        raise AssertionError(f"FAILED: policy guard: {guards[0]}")
    result = run_check(policies, examples=examples, steps=steps, sharing=sharing, engine_factory=engine_factory)
    if not result.ok:
        raise AssertionError(result.report())


def make_test_case(*policies: str, examples: int = DEFAULT_EXAMPLES, steps: int = DEFAULT_STEPS,
                   engine_factory: EngineFactory | None = None) -> type:
    """A unittest TestCase class running the model checker on this stack (pytest collects it)."""
    machine = make_machine(policies, engine_factory=engine_factory)
    case = machine.TestCase
    case.settings = check_settings(examples, steps)
    return case
