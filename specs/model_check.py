"""Model checking: Hypothesis drives the engine through every interleaving it can find.

``LifecycleMachine`` is a ``RuleBasedStateMachine`` that plays the driver as an adversary
within the protocol's rules. Each example draws a world (``World``) as large as the
engine's: a host tier alone, or host and disk, or host, disk and remote, the lowest one
warm (so early prefetch has something to pull); 1 to 4 ranks; async scheduling on or off;
a transfer deadline or none. For every hook the stack under test leaves to the baseline,
the checker's *explorer* policy gives a legal answer per request (early lookup or
prefetch, async lookups, kept answers, prefetch patience, finishing before the stores,
failing on a bad load; joining or deferring in-flight loads per example), so the engine
paths a stack may open are reached whatever the stack.

Its inputs (``ACTIONS``, picked by weight among those enabled): arrivals with shared
prefixes (some with an output limit, some that can never fit), revisits of earlier
prefixes (after a long request took the device, so they come from the tiers), bursts that
force preemption, ticks, the clock jumping past deadlines, step outputs (two in flight
with async scheduling; the later first; repeated and unknown ones), lookup answers (true,
missing, failed, computed at submission, and old-epoch answers while a newer lookup is
pending), per-rank transfer reports in any order (with failures, prefetches that fail to
land, persistently corrupt tier blocks, duplicates that carry failures, the late reports
of a job given up at its deadline, unknown jobs and ranks), and aborts in every state.

The engine's commands are fed to the independent observer (``kvlife.specs.invariants``)
as the engine issues them, between its records, so the observer sees each handling in
its true order. After every input the observer checks invariants 1-8 and 10-14. At the
end a drain stops inputs, optionally drives the clock past every deadline and keeps
misbehaving (old answers, late reports, reordered outputs, failed stores), answers
everything outstanding and ticks, and checks liveness (7): every request, in whatever
state, finishes within a bound; no request stays parked while nothing runs (a head that
can never fit must not block the queue); every device block is free at the end.

One line in a user's suite model-checks their policy::

    from kvlife.specs.model_check import check_policy
    def test_my_policy(): check_policy("mypkg.mod:MyPolicy")

``kvlife check`` runs the same thing from the command line.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
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

from kvlife.specs.fast_twin import FastTwin, StopRules
from kvlife.specs.invariants import IO_WAIT_STATES, InvariantObserver, InvariantViolation, Violation
from kvlife.specs.table import TABLE, IllegalTransition

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
# drain's own deadlines; the worst case measured on the engine (1,200 random examples over
# four stacks) took 34 % of it (81 ticks for 210 tokens).
DRAIN_BASE = 30
DRAIN_PER_TOKEN = 1
WORLDS: tuple[tuple[str, ...], ...] = (("host",), ("host", "disk"), ("host", "disk", "remote"))
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
    # A second engine on the decode fast path, given the stop rules, checked against this
    # one input by input (14; ``fast_twin.FastTwin``). As the simulator: not under async
    # scheduling.
    fast_twin: bool = False
    # The engine lets go of finished requests once nothing refers to them (the simulator's
    # retention); at the end none may be left.
    retention: bool = False

    @classmethod
    def draw(cls, seed: int) -> World:
        rng = random.Random(seed)
        explorer = None
        if rng.random() < 0.85:
            explorer = Explorer(seed, rng.choice(["go", "join", "join", "defer"]))
        return cls(
            tiers=rng.choices(WORLDS, weights=(1, 4, 5))[0],
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
            fast_twin=rng.random() < 0.6,
            retention=rng.random() < 0.3,
        )


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
    # none outgrows the device (docs/replay-and-check.md: the engine parks a request that
    # outgrows the device for good), yet two of them force preemption, and the device
    # cache turns over fast enough that the tiers are read, not only written.
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
STORE_RULES = {"baseline": "confirmed", "placeholder-safe-stores": "confirmed", "naive-stores-unsafe": "computed"}


def store_rule(stack: Any) -> str | None:
    """The rule of the policy that answers ``store_limit`` first in this stack (None: a
    policy the checker does not know, whose limit it cannot judge). A confirmed token is
    never a placeholder, so placeholder-safe-stores' limit is the confirmed tokens too."""
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
    if kind == "abort":
        return f"abort {event.request_id}"
    if kind == "tick":
        return "tick"
    if kind == "lookup_answer":
        tiers = "failed" if event.tiers is None else list(event.tiers)
        return f"lookup answer {event.request_id} epoch {event.epoch}: {tiers}"
    if kind == "transfer_report":
        failed = f" failed {list(event.failed)}" if event.failed else " ok"
        return f"report job {event.job_id} rank {event.rank}:{failed}"
    if kind == "step_output":
        fin = f" finished {[r for r, _ in event.finished]}" if event.finished else ""
        return f"step output {event.step_id}{fin}"
    return repr(event)


def describe_commands(commands: Sequence[Any]) -> str:
    from kvlife.lifecycle.engine.events import (
        DiscardLookup,
        FreeBlocks,
        StartLoad,
        StartPrefetch,
        StartStore,
        StepPlan,
        SubmitLookup,
    )

    parts = []
    for c in commands:
        if isinstance(c, StepPlan):
            parts.append(f"step {c.step_id} [" + ", ".join(
                f"{e.request_id} {e.num_tokens}@{e.computed_before} blocks {list(e.block_table)}"
                for e in c.entries) + "]")
        elif isinstance(c, StartLoad | StartStore):
            op = "load" if isinstance(c, StartLoad) else "store"
            parts.append(f"{op} job {c.job_id} {c.request_id} " + ", ".join(
                f"{m.block_hash}@{m.tier}->dev{m.device_block}" for m in c.moves))
        elif isinstance(c, StartPrefetch):
            parts.append(f"prefetch job {c.job_id} {c.request_id} " + ", ".join(
                f"{m.block_hash}@{m.src_tier}->{m.dst_tier}" for m in c.moves))
        elif isinstance(c, FreeBlocks):
            parts.append(f"free dev{list(c.device_blocks)}")
        elif isinstance(c, SubmitLookup):
            parts.append(f"lookup {c.request_id} epoch {c.epoch}")
        elif isinstance(c, DiscardLookup):
            parts.append(f"discard lookup {c.request_id} epoch {c.epoch}")
    return "; ".join(parts)


class LifecycleMachine(RuleBasedStateMachine):
    """The driver as an adversary. Subclasses set the class attributes (see make_machine)."""

    stack: StackSpec = ()
    engine_factory: EngineFactory | None = None
    engine_config: Any = None
    sharing: bool | None = None

    def __init__(self) -> None:
        super().__init__()
        self.engine: Any = None
        self.observer: InvariantObserver | None = None
        self.log: list[str] = []
        self.t = 0.0
        self.outputs: dict[str, int] = {}
        self.request_ids: list[str] = []
        # (request, block position, hash) whose load, store or prefetch failed: revisit them.
        self.failed_copies: list[tuple[str, int, int]] = []
        # Lookups in flight: (request, epoch, hashes, what the tiers said at submission).
        self.lookups: list[tuple[str, int, tuple[int, ...], tuple[str, ...]]] = []
        self.old_lookups: list[tuple[str, int, tuple[str, ...] | None]] = []  # answered or discarded
        self.jobs: dict[int, tuple[Any, list[int]]] = {}
        self.sent_reports: list[tuple[int, int]] = []
        # Reports the driver lost (a silent rank): (job, rank, command). Only a deadline ends
        # their jobs; some come late (a late report after a reclaim must change nothing).
        self.silent: list[tuple[int, int, Any]] = []
        self.steps: list[Any] = []
        self.delivered_steps: list[int] = []
        self.corrupt: set[tuple[str, int]] = set()
        self.max_in_flight = 1
        self.deadline: float | None = None
        self.seed = 0
        self.drain_late = False
        self.drain_chaos = False
        self.broken = False
        self.swarm: dict[str, int] = {}  # per-example weight multipliers of the rare actions
        self.twin: FastTwin | None = None  # the fast-path engine fed the same inputs (14)
        self.arrival_hashes: dict[str, tuple[int, ...]] = {}
        self.retired: dict[str, Any] = {}  # requests the engine retired, as they left
        self.retention = False  # the engine retires finished requests (Engine(retire=...))
        self.records: list[dict[str, Any]] = []  # this input's records, for the twin

    # ---- setup -------------------------------------------------------------------------
    @initialize(seed=st.integers(0, 2**32 - 1))
    def start(self, seed: int) -> None:
        from kvlife.lifecycle.engine.core import Engine

        cls = type(self)
        world = World.draw(seed)
        explorer, deadline, async_scheduling = world.explorer, world.deadline, world.async_scheduling
        config = cls.engine_config if cls.engine_config is not None else _world_config(
            world.tiers, world.ranks, world.eviction)
        config = attrs.evolve(config, async_scheduling=async_scheduling, transfer_deadline_ms=deadline,
                              lookup_deadline_ms=world.lookup_deadline, reclaim_deadline_ms=world.reclaim_deadline,
                              max_async_lookups=world.max_async_lookups)
        stack = _with_explorer(_build_stack(cls.stack), explorer)
        sharing = cls.sharing if cls.sharing is not None else detect_sharing(stack)
        observer = InvariantObserver(config.ranks, config.block_tokens, sharing=sharing,
                                     max_batched_tokens=config.max_batched_tokens, max_running=config.max_running,
                                     tier_content_known=True, hit_probe=self._recorded_hit,
                                     lookup_deadline_ms=config.lookup_deadline_ms,
                                     transfer_deadline_ms=config.transfer_deadline_ms,
                                     reclaim_deadline_ms=config.reclaim_deadline_ms,
                                     stats_probe=self._stats, published_probe=self._published,
                                     tier_probe=self._in_tier, max_async_lookups=config.max_async_lookups,
                                     store_rule=store_rule(stack), store_tiers=[t.name for t in config.tiers],
                                     deferred_frees=config.async_scheduling and bool(config.tiers), fifo=True,
                                     finish_probe=self._finish_time, device_blocks=config.device_blocks,
                                     wakeup_probe=self._next_wakeup, preemptions_probe=self._preemptions)
        warmed: list[int] = []
        if world.warm and config.tiers:
            # A previous life left prefixes in the lowest tier: the first requests load
            # (or, with early prefetch, pull them up into the host tier first).
            warmed = sorted({f * 1000 + (0 if i == 0 else b * 100) + i for f in range(3) for b in range(3)
                             for i in range(4)})[: config.tiers[-1].capacity_blocks]
        tiers = _tier_indexes(config, warmed)
        if warmed:
            observer.seed_tier(tiers[-1].name, warmed)
        factory = cls.engine_factory or Engine
        self.observer = observer
        self.retention = world.retention and cls.engine_factory is None
        retire = self._on_retire if self.retention else None
        self.engine = factory(config, stack, tiers=tiers, recorder=self._on_record, retire=retire) \
            if self.retention else factory(config, stack, tiers=tiers, recorder=self._on_record)
        self.twin = None
        if world.fast_twin and not async_scheduling and cls.engine_factory is None:
            twin_records: list[dict[str, Any]] = []
            twin_engine = Engine(config, _with_explorer(_build_stack(cls.stack), explorer),
                                 tiers=_tier_indexes(config, warmed),
                                 recorder=twin_records.append, retire=retire)
            twin_engine.state.fast_limits = StopRules(self.outputs)
            self.twin = FastTwin(twin_engine, twin_records)
        observer.accounting = self.engine.check_invariants
        self.max_in_flight = 2 if async_scheduling else 1
        self.deadline = deadline
        self.drain_late = world.drain_late
        self.drain_chaos = world.drain_chaos
        self.seed = seed
        self.swarm = dict(world.swarm)
        self.log.append(f"world {seed}: engine: {config.device_blocks} device blocks of {config.block_tokens} tokens, "
                        f"{config.ranks} ranks, tiers {[t.name for t in config.tiers]}, async scheduling "
                        f"{async_scheduling}, deadline {deadline}, lookup deadline {world.lookup_deadline}, "
                        f"reclaim deadline {world.reclaim_deadline}, lookups {world.max_async_lookups}, "
                        f"stack {list(stack.names)}, sharing {sharing}, "
                        f"warm {tiers[-1].name if warmed else 'none'} {warmed}"
                        + (", fast-path twin" if self.twin is not None else "")
                        + (", retention on" if self.retention else "")
                        + (f", explorer {attrs.asdict(explorer)}" if explorer is not None else ""))

    def _on_retire(self, req: Any) -> None:
        """The engine lets go of a finished request: its metrics stay readable here."""
        self.retired[req.request_id] = req

    def _request(self, rid: str) -> Any:
        """The engine's request, or the one it retired."""
        req = self.engine.requests.get(rid) if self.engine is not None else None
        return req if req is not None else self.retired.get(rid)

    def _state(self, rid: str) -> str:
        """A request's state; a request the engine retired (retention on) is finished."""
        req = self.engine.requests.get(rid)
        return "finished" if req is None else str(req.state)

    def _hashes(self, rid: str) -> tuple[int, ...]:
        """A request's block hashes (derived ones included while the engine holds it; its
        arrival's once retired)."""
        req = self.engine.requests.get(rid)
        return tuple(req.hashes) if req is not None else self.arrival_hashes.get(rid, ())

    def _in_tier(self, tier: str, block_hash: int) -> bool:
        """Does the engine's ``tier`` hold ``block_hash`` (13)? True if it cannot tell."""
        tiers = getattr(getattr(self.engine, "state", None), "tiers", None)
        return not isinstance(tiers, dict) or tier not in tiers or bool(tiers[tier].contains(block_hash))

    def _published(self, block_hash: int) -> bool:
        """Is ``block_hash`` in the engine's device prefix cache (13)? True if it has none."""
        pool = getattr(getattr(self.engine, "state", None), "pool", None)
        return pool is None or pool.block_of(block_hash) is not None

    def _stats(self) -> Any:
        """The engine's counters (13 checks them against its records), None if it has none."""
        return getattr(getattr(self.engine, "state", None), "stats", None)

    def _preemptions(self, rid: str) -> int | None:
        req = self._request(rid)
        count = getattr(req, "preemptions", None)
        return count if isinstance(count, int) else None

    def _next_wakeup(self) -> float | None:
        wakeup = getattr(self.engine, "next_wakeup", None)
        return wakeup() if callable(wakeup) else None

    def _finish_time(self, rid: str) -> float | None:
        """When the engine's metrics say ``rid`` finished (13); None if it keeps none."""
        req = self._request(rid)
        finish = getattr(req, "finish_ms", None)
        return float(finish) if isinstance(finish, (int, float)) else None

    def _recorded_hit(self, rid: str) -> int | None:
        """The prefix hit the engine recorded for ``rid`` (device + tier blocks), for 13."""
        req = self._request(rid)
        if req is None or not hasattr(req, "tier_hit_blocks"):
            return None
        return int(req.device_hit_blocks + sum(req.tier_hit_blocks.values()))

    # ---- feeding -------------------------------------------------------------------------
    def _on_record(self, record: dict[str, Any]) -> None:
        """The engine's recorder: commands issued so far in this handling go to the
        observer first, so it sees them in the order the engine produced them."""
        assert self.observer is not None
        if self.twin is not None:
            self.records.append(record)
        self._feed_new_commands()
        self.observer.feed_record(record)

    def _feed_new_commands(self) -> None:
        assert self.observer is not None
        commands = getattr(getattr(self.engine, "state", None), "commands", None)
        if not isinstance(commands, list):
            return  # an engine without a visible command list: fed when handle returns
        self.observer.feed_new_commands(commands)

    def feed(self, event: Any) -> list[Any]:
        from kvlife.lifecycle.engine.events import FreeBlocks

        assert self.observer is not None
        if event.type == "arrival":
            self.arrival_hashes.setdefault(event.request_id, tuple(event.block_hashes))
        self.log.append(f"t={event.t:g} {describe_input(event)}")
        try:
            commands = self.engine.handle(event)
        except Exception as exc:
            # What the observer saw go wrong before the engine gave up comes first.
            self._feed_new_commands()
            if self.observer.violations:
                self._raise(self.observer.violations[0])
            if isinstance(exc, IllegalTransition):
                self._raise(Violation(1, f"engine raised IllegalTransition: {exc}", t=event.t))
            if isinstance(exc, AssertionError):
                self._raise(Violation(8, f"engine raised AssertionError: {exc}", t=event.t))
            self._raise(Violation(0, f"engine raised {type(exc).__name__}: {exc}", t=event.t))
        if commands:
            self.log[-1] += "  -> " + describe_commands(commands)
        self.observer.feed_new_commands(commands)  # the rest of them, or all of a list of its own
        self.observer.end_input()
        if self.observer.violations:
            self._raise(self.observer.violations[0])
        if self.retention:
            kept = self._kept_for_nothing()
            if kept is not None:
                self._raise(Violation(7, kept, t=event.t))
        if event.type == "tick" and not any(isinstance(c, FreeBlocks) for c in commands):
            # (Blocks freed in the tick may have been freed after its admission pass.)
            idle = self._idle_with_room()
            if idle is not None:
                self._raise(Violation(11, f"the tick left the device idle: {idle}", t=event.t))
        if self.twin is not None:
            differs = self.twin.compare(event, commands, self.records, self.engine.next_wakeup)
            self.records.clear()
            if differs is not None:
                self._raise(Violation(14, f"the decode fast path is not the step-by-step path: {differs}",
                                      t=event.t))
        self._track(commands)
        return list(commands)

    def _raise(self, violation: Violation) -> Any:
        self.broken = True
        events = "\n".join(f"  {i:3d}. {line}" for i, line in enumerate(self.log))
        exc = InvariantViolation(violation)
        exc.args = (f"{violation}\nevents:\n{events}",)
        exc.events = list(self.log)  # type: ignore[attr-defined]
        raise exc

    def _track(self, commands: Sequence[Any]) -> None:
        from kvlife.lifecycle.engine.events import (
            DiscardLookup,
            StartLoad,
            StartPrefetch,
            StartStore,
            StepPlan,
            SubmitLookup,
        )

        for c in commands:
            if isinstance(c, SubmitLookup):
                self.lookups.append((c.request_id, c.epoch, c.block_hashes, self.engine.sync_lookup(c.block_hashes)))
            elif isinstance(c, DiscardLookup):
                for i, (rid, epoch, _, _) in enumerate(self.lookups):
                    if rid == c.request_id and epoch == c.epoch:
                        del self.lookups[i]
                        self.old_lookups.append((rid, epoch, None))
                        break
            elif isinstance(c, StartLoad | StartStore | StartPrefetch):
                self.jobs[c.job_id] = (c, list(range(self.engine.config.ranks)))
            elif isinstance(c, StepPlan):
                self.steps.append(c)

    def _now(self) -> float:
        self.t += 1.0
        return self.t

    # ---- actions -----------------------------------------------------------------------------
    @rule(data=st.data())
    def act(self, data: st.DataObject) -> None:
        """One input from the adversary: an action among those enabled now, in proportion
        to its weight (``ACTIONS``, scaled per example by the world's swarm weights), with
        its arguments. A single rule, so that rare but enabled actions (a report, a second
        step output) come as often as their weight says, not as Hypothesis's rule order
        and filters happen to favour them."""
        enabled = [(a, w) for a in ACTIONS if (w := a.weight * self.swarm.get(a.name, 1)) and a.enabled(self)]
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

        bt = self.engine.config.block_tokens
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

        engine = self.engine
        bt = engine.config.block_tokens
        if self.failed_copies:
            rid, position, h = self.failed_copies[i % len(self.failed_copies)]
            blocks = max(blocks, position + 1)
            if engine.pool.block_of(h) is not None:
                # The device still caches it: a long request with a prompt of its own
                # goes first and takes the device's blocks, so the revisit reads the tiers.
                flush = f"r{len(self.request_ids)}"
                self.request_ids.append(flush)
                self.outputs[flush] = 1
                count = engine.config.device_blocks - 3
                self.feed(Arrival(self._now(), flush, count * bt + 1,
                                  tuple(9000 + 10 * len(self.request_ids) + k for k in range(count))))
        else:
            rid = self.request_ids[i % len(self.request_ids)]
        hashes = self._hashes(rid)[: min(blocks, 5)]
        new = f"r{len(self.request_ids)}"
        self.request_ids.append(new)
        self.outputs[new] = output
        self.feed(Arrival(self._now(), new, len(hashes) * bt + extra, tuple(hashes)))

    def oversized_arrival(self, extra: int = 1) -> None:
        """A prompt at the device's size: larger than the device (``extra`` 1), or filling it
        exactly, with no block left for its first output token (``extra`` 0): it can never
        run and must not block the queue; or one token less (``extra`` -1): it just fits."""
        from kvlife.lifecycle.engine.events import Arrival

        config = self.engine.config
        tokens = config.device_blocks * config.block_tokens + extra
        rid = f"r{len(self.request_ids)}"
        self.request_ids.append(rid)
        self.outputs[rid] = 1
        self.feed(Arrival(self._now(), rid, tokens, tuple(7000 + i for i in range(tokens // config.block_tokens))))

    def tick(self) -> None:
        from kvlife.lifecycle.engine.events import Tick

        self.feed(Tick(self._now()))

    def first_step_finishes(self, blocks: int) -> None:
        """A boundary the random walk seldom reaches: a request that finishes at the output
        of the engine's very first step (step 0), its stores in flight, and every store
        reported before the next tick. It may leave ``sending`` only with a later step's
        output or at a later tick (11), whatever the first step's number."""
        from kvlife.lifecycle.engine.events import StartStore

        self.arrive(0, blocks, 0, 1, 1, False)
        self.tick()
        if not self.steps:
            return
        self._step_output(0)
        for job_id, (command, remaining) in list(self.jobs.items()):
            if isinstance(command, StartStore):
                for _ in list(remaining):
                    self._report(job_id, 0, False)

    def time_passes(self, exact: bool = False) -> None:
        """Nothing happens for a while: the next input comes after the transfer deadline
        (or after the engine's next deadline: a prefetch patience, a lookup, a reclaim);
        ``exact``: at that very deadline (a boundary: at its deadline, patience is over)."""
        jump = (self.deadline or 0.0) + 1.0
        wake = self.engine.next_wakeup()
        if wake is not None:
            jump = max(jump, wake - self.t)
            if exact:
                jump = max(0.0, wake - self.t - 1.0)  # the next input (_now) lands on it
        self.t += jump
        self.log.append(f"(time passes: {jump:g} ms)")

    def step_output(self) -> None:
        self._step_output(0)

    def step_output_reordered(self) -> None:
        """The later of two steps in flight reports first (the device ran both in order; a
        driver may deliver a step that paid sync lookups after the next one)."""
        self._step_output(1)

    def _step_output(self, index: int) -> None:
        from kvlife.lifecycle.engine.events import StepOutput

        plan = self.steps.pop(index)
        finished = []
        for entry in plan.entries:
            req = self.engine.requests.get(entry.request_id)
            if entry.samples and req is not None and req.state == "running" \
                    and req.generated + 1 >= self.outputs.get(entry.request_id, 1):
                finished.append((entry.request_id, "stopped"))
        self.delivered_steps.append(plan.step_id)
        self.feed(StepOutput(self._now(), plan.step_id, tuple(finished)))

    def stale_step_output(self, i: int, unknown: bool) -> None:
        """A step output that already came (or names a step never planned) arrives again,
        claiming a running request finished: it must change nothing."""
        from kvlife.lifecycle.engine.events import StepOutput

        step_id = 10_000 + i if unknown else self.delivered_steps[i % len(self.delivered_steps)]
        running = [rid for rid in self.request_ids if self._state(rid) == "running"]
        finished = ((running[i % len(running)], "stopped"),) if running else ()
        self.feed(StepOutput(self._now(), step_id, finished))

    def answer_lookup(self, i: int, mode: str) -> None:
        self._answer(i % len(self.lookups), mode)

    def _answer(self, index: int, mode: str) -> None:
        from kvlife.lifecycle.engine.events import LookupAnswer

        rid, epoch, hashes, then = self.lookups.pop(index)
        tiers: tuple[str, ...] | None
        if mode == "failed":
            tiers = None
        elif mode == "miss":
            tiers = ()
        elif mode == "at_submit":
            tiers = then  # what the tiers held when it was submitted: possibly evicted since
        else:
            tiers = self.engine.sync_lookup(hashes)
        self.old_lookups.append((rid, epoch, tiers))
        self.feed(LookupAnswer(self._now(), rid, epoch, tiers))

    def stale_lookup_answer(self, i: int) -> None:
        """An answer that already came, or whose lookup was discarded, arrives (again)."""
        from kvlife.lifecycle.engine.events import LookupAnswer

        # Half the time, an answer its request already took while that request now loads (a
        # duplicate of the current epoch, the rarest case), if there is one.
        loading = [old for old in self.old_lookups if (r := self.engine.requests.get(old[0])) is not None
                   and r.state == "loading" and r.epoch == old[1]]
        rid, epoch, tiers = (loading[(i // 2) % len(loading)] if loading and i % 2 == 0
                             else self.old_lookups[i % len(self.old_lookups)])
        req = self.engine.requests.get(rid)
        if tiers is None:
            tiers = self.engine.sync_lookup(req.hashes if req is not None else ())
        self.feed(LookupAnswer(self._now(), rid, epoch, tiers))

    def _superseded(self) -> list[tuple[str, int, tuple[str, ...] | None]]:
        """Answers already given for requests whose newer lookup is pending: those of an
        older epoch if there are any (the rarer case), else those the last admission consumed."""
        pending = {rid for rid, _, _, _ in self.lookups}
        found = [old for old in self.old_lookups if old[0] in pending
                 and self._state(old[0]) == "lookup_pending"]
        older = [old for old in found if old[1] < self.engine.requests[old[0]].epoch]
        return older or found

    def old_answer_while_pending(self, i: int) -> None:
        """The answer to an earlier lookup of a request (an older epoch, or an answer the
        last admission consumed) arrives while its newer lookup is pending."""
        from kvlife.lifecycle.engine.events import LookupAnswer

        candidates = self._superseded()
        rid, epoch, tiers = candidates[i % len(candidates)]
        self.feed(LookupAnswer(self._now(), rid, epoch, tiers if tiers is not None else ("host",)))

    def report(self, i: int, rank: int, fail: bool) -> None:
        job_id = sorted(self.jobs)[i % len(self.jobs)]
        self._report(job_id, rank, fail)

    def _pulls(self) -> list[int]:
        from kvlife.lifecycle.engine.events import StartPrefetch

        return [job_id for job_id, (command, _) in self.jobs.items() if isinstance(command, StartPrefetch)]

    def _loads(self) -> list[int]:
        from kvlife.lifecycle.engine.events import StartLoad

        return [job_id for job_id, (command, _) in self.jobs.items() if isinstance(command, StartLoad)]

    def load_deadline(self) -> None:
        """A load stalls: the clock passes the transfer deadline and the scheduler runs."""
        self.time_passes()
        if len(self.steps) < self.max_in_flight:
            self.tick()

    def pull_fails(self, i: int, rank: int) -> None:
        """One rank of a prefetch in flight fails to land its first block."""
        pulls = self._pulls()
        self._report(pulls[i % len(pulls)], rank, True)

    def _report(self, job_id: int, rank_pick: int, fail: bool) -> None:
        from kvlife.lifecycle.engine.events import StartLoad, StartPrefetch, TransferReport

        command, remaining = self.jobs[job_id]
        rank = remaining.pop(rank_pick % len(remaining))
        if not remaining:
            del self.jobs[job_id]
        moves = command.moves
        failed = {moves[0].block_hash} if fail and moves else set()
        if failed:
            owner = self.engine.requests.get(command.request_id)
            if owner is not None and moves[0].block_hash in owner.hashes:
                self.failed_copies.append((command.request_id, owner.hashes.index(moves[0].block_hash),
                                           moves[0].block_hash))
        if isinstance(command, StartLoad):
            failed.update(m.block_hash for m in moves if (m.tier, m.block_hash) in self.corrupt)
        elif isinstance(command, StartPrefetch):
            failed.update(m.block_hash for m in moves if (m.src_tier, m.block_hash) in self.corrupt)
            if not remaining:
                for m in moves:
                    if m.block_hash not in failed:
                        self.corrupt.discard((m.dst_tier, m.block_hash))
        elif not remaining:
            # A good store rewrites the slot: the tier's copy is sound again.
            for m in moves:
                if m.block_hash not in failed:
                    self.corrupt.discard((m.tier, m.block_hash))
        self.sent_reports.append((job_id, rank))
        self.feed(TransferReport(self._now(), job_id, rank, tuple(sorted(failed))))

    def lose_lookup(self, i: int) -> None:
        """The lookup service loses a lookup: its answer never comes (or, much later, as
        a stale one). Only the lookup deadline gets its request going again."""
        rid, epoch, _, then = self.lookups.pop(i % len(self.lookups))
        self.old_lookups.append((rid, epoch, then))
        self.log.append(f"(the lookup of {rid} epoch {epoch} is lost)")

    def silence_rank(self, i: int, rank: int) -> None:
        """A rank of a job in flight goes silent on it: its report never comes (unless
        late). Only the transfer or reclaim deadline ends the job and gives its blocks back."""
        job_id = sorted(self.jobs)[i % len(self.jobs)]
        command, remaining = self.jobs[job_id]
        silent = remaining.pop(rank % len(remaining))
        if not remaining:
            del self.jobs[job_id]
        self.silent.append((job_id, silent, command))
        self.log.append(f"(rank {silent} goes silent on job {job_id})")

    def silent_rank_reports(self, i: int) -> None:
        """A rank that went silent reports after all: a late report if its job was given
        up or reclaimed meanwhile, else just a slow one."""
        from kvlife.lifecycle.engine.events import TransferReport

        job_id, rank, _ = self.silent.pop(i % len(self.silent))
        self.sent_reports.append((job_id, rank))
        self.feed(TransferReport(self._now(), job_id, rank, ()))

    def _late_jobs(self) -> list[int]:
        """Jobs the engine gave up on at their deadline, some rank still to report, whose
        requests have moved on: those with a request running again if any, else those
        with one waiting to."""
        running: list[int] = []
        waiting: list[int] = []
        for job_id in self.jobs:
            job = self.engine.jobs.get(job_id)
            if job is None or not job.timed_out:
                continue
            states = {self._state(rid) for rid, _ in job.waiters}
            if "running" in states:
                running.append(job_id)
            elif "waiting" in states:
                waiting.append(job_id)
        return running or waiting

    def late_report(self, i: int) -> None:
        """The ranks of a job given up at its deadline report it after all, now that its
        requests run (or wait) again."""
        late = self._late_jobs()
        job_id = late[i % len(late)]
        while job_id in self.jobs:
            self._report(job_id, 0, False)

    def duplicate_report(self, i: int, fail: bool) -> None:
        """A rank reports a job again, possibly claiming a failure: it must change nothing."""
        from kvlife.lifecycle.engine.events import TransferReport

        job_id, rank = self.sent_reports[i % len(self.sent_reports)]
        failed: tuple[int, ...] = ()
        if fail and job_id in self.jobs and self.jobs[job_id][0].moves:
            failed = (self.jobs[job_id][0].moves[-1].block_hash,)
        self.feed(TransferReport(self._now(), job_id, rank, failed))

    def bogus_report(self, kind: str) -> None:
        from kvlife.lifecycle.engine.events import TransferReport

        if kind == "unknown_job" or not self.jobs:
            self.feed(TransferReport(self._now(), 10_000 + len(self.log), 0, ()))
        else:
            self.feed(TransferReport(self._now(), sorted(self.jobs)[0], self.engine.config.ranks, ()))

    def abort(self, k: int, i: int) -> None:
        """Abort a request: first pick one of the states some request is in, so that rare
        states (loading, sending, lookup_pending) get aborted as often as common ones."""
        from kvlife.lifecycle.engine.events import Abort

        states = {self._state(rid) for rid in self.request_ids}
        present = [s for s in TABLE.states if s in states]
        state = present[k % len(present)]
        pool = [rid for rid in self.request_ids if self._state(rid) == state]
        self.feed(Abort(self._now(), pool[i % len(pool)]))

    def abort_waiting_on_io(self, i: int) -> None:
        """Abort a request that waits on IO (a lookup, a load, its stores)."""
        from kvlife.lifecycle.engine.events import Abort

        pool = [rid for rid in self.request_ids if self._state(rid) in IO_WAIT_STATES]
        self.feed(Abort(self._now(), pool[i % len(pool)]))

    def corrupt_block(self, i: int) -> None:
        """A tier copy goes bad: every load of it fails until it is stored again."""
        stored = sorted({(name, h) for rid in self.request_ids for h in self._hashes(rid)
                         for name, tier in self.engine.tiers.items() if tier.contains(h)})
        if not stored:
            return
        name, h = stored[i % len(stored)]
        self.corrupt.add((name, h))
        self.log.append(f"(block {h} is now corrupt in {name})")

    # ---- the end -------------------------------------------------------------------------------
    def teardown(self) -> None:
        if self.broken or self.engine is None:
            return
        self.drain()

    def _past_deadlines(self) -> None:
        """Move the clock past the transfer deadline and the next prefetch patience."""
        jump = (self.deadline or 0.0) + 1.0
        wake = self.engine.next_wakeup()
        if wake is not None and math.isfinite(wake):
            jump = max(jump, wake - self.t)
        self.t += jump

    def _chaos(self, rng: random.Random) -> None:
        """The drain's own adversary (seeded by the example): before everything is
        delivered, the inputs a late phase of a run sees when the driver misbehaves within
        the protocol: old lookup answers while a newer lookup is pending, the remaining
        reports of a job given up at its deadline now that its requests run again, a
        later step's output first, stale step outputs, duplicate reports with failures,
        reports of ranks that went silent (late), and now and then the clock jumping past
        the transfer deadline."""
        if self._superseded() and self.lookups and rng.random() < 0.7:
            self.old_answer_while_pending(rng.randrange(8))
        if self._late_jobs() and rng.random() < 0.7:
            self.late_report(rng.randrange(8))
        if len(self.steps) >= 2 and rng.random() < 0.5:
            self.step_output_reordered()
        if self.delivered_steps and rng.random() < 0.1:
            self.stale_step_output(rng.randrange(8), rng.random() < 0.3)
        if self.sent_reports and rng.random() < 0.1:
            self.duplicate_report(rng.randrange(16), rng.random() < 0.5)
        if self.silent and rng.random() < 0.2:
            self.silent_rank_reports(rng.randrange(8))  # late, most likely: after a deadline
        if self.deadline is not None and rng.random() < 0.1:
            self.time_passes()
            if len(self.steps) < self.max_in_flight:
                self.tick()

    def _deliver_all(self, chaos: random.Random | None = None) -> None:
        """Answer every lookup, report every job on every rank, deliver every step output.
        With ``chaos``, a store or prefetch now and then fails on a rank (the drain reads
        back what the run stored: a failed copy must never be read)."""
        from kvlife.lifecycle.engine.events import StartLoad

        while self.lookups:
            self._answer(0, "truthful")
        while self.jobs:
            job_id = min(self.jobs)
            command, remaining = self.jobs[job_id]
            fail = (chaos is not None and not isinstance(command, StartLoad)
                    and len(remaining) == 1 and chaos.random() < 0.25)
            self._report(job_id, 0, fail)
        while self.steps:
            self._step_output(0)

    def _progress(self) -> tuple[Any, ...]:
        engine = self.engine
        state = getattr(engine, "state", None)
        started = (getattr(state, "next_job_id", None), getattr(state, "next_step_id", None))
        return started + tuple((r.state, r.epoch, r.computed) for r in engine.requests.values())

    def _parked(self) -> str | None:
        """Nothing runs, loads, stores or pulls, yet requests wait: either one of them fits
        the free device blocks and waits for nothing (a head that can never fit parks the
        queue), or none fits though nothing holds the device (its blocks leaked)."""
        engine = self.engine
        if (engine.state_counts["running"] or engine.state_counts["loading"] or engine.state_counts["sending"]
                or any(not job.timed_out for job in engine.jobs.values()) or engine.prefetches or self.steps):
            return None
        waiting = sorted((r for r in engine.requests.values() if r.state == "waiting"), key=lambda r: r.seq)
        if not waiting:
            return None
        bt = engine.config.block_tokens
        free = engine.pool.free
        fits = [r for r in waiting if -(-r.known_tokens // bt) <= free]
        head, need = waiting[0], -(-waiting[0].known_tokens // bt)
        if not fits:
            return (f"nothing runs, loads or stores and {free} of {engine.pool.capacity} device blocks are free, "
                    f"yet {head.request_id} (first of {len(waiting)} waiting) needs {need}")
        why = (f"behind {head.request_id}, which needs {need} blocks" if need > free
               else f"{head.request_id} first in line")
        names = ", ".join(f"{r.request_id} ({-(-r.known_tokens // bt)} blocks)" for r in fits)
        return f"nothing runs and {free} device blocks are free, yet {names} wait ({why})"

    def _kept_for_nothing(self) -> str | None:
        """7 with retention: a finished request leaves the engine at the end of the handling
        in which nothing refers to it any more (no store of it in flight, no prefetch it
        waits on, no load in flight that will tell it its outcome)."""
        state = self.engine.state
        told = {w for job in state.jobs.values() if job.kind == "load" and not job.timed_out for w, _ in job.waiters}
        for rid, req in state.requests.items():
            if req.state == "finished" and not req.store_jobs and rid not in state.prefetch_waits \
                    and rid not in state.wants_prefetch and rid not in told:
                return f"{rid} finished and nothing refers to it, yet the engine still holds it (retention)"
        return None

    def _idle_with_room(self) -> str | None:
        """11 after a tick: if nothing runs, loads, stores or pulls and no step is in flight,
        the first request in line that waits on nothing (no lookup, no prefetch, not
        deferred by its admission policy) was admitted, or it does not fit the free device
        blocks (admission is FIFO: it stops at a head short of memory). A head that can
        never fit fails and the pass goes on (vllm#57841)."""
        engine = self.engine
        counts = engine.state_counts
        if (counts["running"] or counts["loading"] or counts["sending"] or engine.prefetches or self.steps
                or any(not job.timed_out for job in engine.jobs.values())):
            return None
        bt = engine.config.block_tokens
        queue = getattr(getattr(engine, "state", None), "waiting", None)
        if queue is None:  # an engine without a visible queue: arrival order
            queue = sorted(engine.requests.values(), key=lambda r: r.seq)
        for req in [r for r in queue if r.state == "waiting"]:  # (a preempted one is first in line)
            decided = req.last_decisions.get("admission")
            if decided is not None and decided[1] == "defer":
                continue
            need = -(-req.known_tokens // bt)
            if need <= engine.pool.free:
                return (f"{req.request_id}, first in line and waiting on nothing, needs {need} blocks and "
                        f"{engine.pool.free} of {engine.pool.capacity} are free, yet it was not admitted")
            return None
        return None

    def _silent_open(self) -> bool:
        """A job some rank went silent on is still open in the observer (not reclaimed)."""
        assert self.observer is not None
        jobs = self.observer.jobs
        return any((job := jobs.get(job_id)) is not None and not job.complete and not job.reclaimed
                   for job_id, _, _ in self.silent)

    def drain(self) -> None:
        """Stop new inputs; answer everything outstanding; tick until idle, within a bound."""
        from kvlife.lifecycle.engine.events import Tick

        assert self.observer is not None
        engine = self.engine
        late = " after the clock passes every deadline" if self.drain_late else ""
        chaotic = " (with stale, reordered, duplicated and late inputs)" if self.drain_chaos else ""
        self.log.append(f"--- drain: inputs stop; every outstanding answer, report and output is delivered{late}"
                        f"{chaotic}")
        outstanding = [r for r in engine.requests.values() if r.state != "finished"]
        # What the engine reports as unfinished (its `stranded` list) is what the observer saw.
        unfinished = getattr(getattr(engine, "state", None), "unfinished", None)
        if callable(unfinished):
            said = sorted(r.request_id for r in unfinished())
            seen = sorted(rid for rid, state in self.observer.states().items() if state != "finished")
            if said != seen:
                self._raise(Violation(7, f"the engine reports {said or 'nothing'} unfinished, the trace has "
                                         f"{seen or 'nothing'}"))
        bound = DRAIN_BASE + DRAIN_PER_TOKEN * sum(r.prompt_tokens + self.outputs.get(r.request_id, 1)
                                                   for r in outstanding)
        stalled = parked = ticks = 0
        overdue_ticked = False
        finished = -1
        last: tuple[Any, ...] = ()
        chaos = random.Random(self.seed)
        while True:
            if self.drain_late:
                self._past_deadlines()
                if len(self.steps) < self.max_in_flight:
                    self.feed(Tick(self._now()))
            if self.drain_chaos:
                self._chaos(chaos)
            self._deliver_all(chaos if self.drain_chaos else None)
            # A job a rank went silent on ends only at its reclaim deadline: tick to it. Its
            # deadline may have passed while outputs and reports were delivered (the engine
            # names only future wakeups): one tick acts on it; after that, no wakeup for an
            # open job is the engine's fault, which the observer's end check reports.
            idle = not engine.busy() and engine.next_wakeup() is None
            if not engine.busy() and (not self._silent_open() or (idle and overdue_ticked)):
                break
            overdue_ticked = idle
            now_finished = engine.state_counts["finished"]
            # Parked: nothing changed since the last round (no request moved, no job or
            # step started), though nothing runs and a request waits.
            now = self._progress()
            why = self._parked() if now == last else None
            last = now
            parked = parked + 1 if why else 0
            if parked >= PARKED_ROUNDS:
                self._raise(Violation(7, f"stranded: after {ticks} drain ticks {why}"))
            stalled = 0 if now_finished != finished else stalled + 1
            finished = now_finished
            if stalled >= STALL_ROUNDS or ticks >= bound:
                unfinished = [f"{rid} in {r.state} (preempted {r.preemptions}x)"
                              for rid, r in engine.requests.items() if r.state != "finished"]
                what = (f"no request finished in {STALL_ROUNDS} drain ticks (livelock)" if stalled >= STALL_ROUNDS
                        else f"requests still unfinished after {ticks} drain ticks (bound {bound})")
                self._raise(Violation(7, f"stranded: {what}: {', '.join(unfinished) or 'jobs still in flight'}"))
            wake = engine.next_wakeup()
            if wake is not None and wake > self.t:
                self.t = wake
            self.feed(Tick(self._now()))
            ticks += 1
        self.observer.finish()
        if self.observer.violations:
            self._raise(self.observer.violations[0])
        stranded = engine.stranded()
        if stranded:
            self._raise(Violation(7, f"engine.stranded() after drain: {stranded}"))
        if self.retention and engine.requests:
            held = sorted(engine.requests)[:5]
            self._raise(Violation(7, f"stranded: requests {held} ({len(engine.requests)} in all) are still held after "
                                     f"every request finished and every job ended: retention never let go of them"))
        for name, tier in getattr(engine, "tiers", {}).items():
            busy = tier.busy() if hasattr(tier, "busy") else []
            if busy:
                self._raise(Violation(7, f"stranded: tier {name} still holds blocks {busy[:5]} for a transfer after "
                                         f"every job ended (a store never completed or a load never let go)"))
        pool = getattr(engine, "pool", None)
        if pool is not None and pool.used:
            held = [b for b in range(pool.capacity) if pool.refs[b] > 0]
            self._raise(Violation(7, f"stranded: device blocks {held} are still held after every request "
                                     f"finished and every job ended (a leak: {pool.free} of {pool.capacity} free)"))


@attrs.frozen
class Action:
    """One kind of input the adversary may send (a method of ``LifecycleMachine``)."""

    name: str
    weight: int
    enabled: Callable[[LifecycleMachine], bool] = lambda self: True
    args: tuple[tuple[str, st.SearchStrategy[Any]], ...] = ()
    swarm: bool = True  # its weight is scaled per example (0 switches it off)


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
    Action("time_passes", 3, lambda self: self.deadline is not None or self.engine.next_wakeup() is not None,
           (("exact", st.booleans()),)),
    Action("step_output", 14, lambda self: bool(self.steps), swarm=False),
    Action("step_output_reordered", 3, lambda self: len(self.steps) >= 2),
    Action("stale_step_output", 2, lambda self: bool(self.delivered_steps),
           (("i", st.integers(0, 7)), ("unknown", st.booleans()))),
    Action("answer_lookup", 8, lambda self: bool(self.lookups),
           (("i", st.integers(0, 7)), ("mode", st.sampled_from(["truthful", "truthful", "miss", "failed",
                                                                "at_submit"]))), swarm=False),
    Action("stale_lookup_answer", 2, lambda self: bool(self.old_lookups), (("i", st.integers(0, 7)),)),
    Action("old_answer_while_pending", 10, lambda self: bool(self.lookups) and bool(self._superseded()),
           (("i", st.integers(0, 7)),), swarm=False),
    Action("report", 14, lambda self: bool(self.jobs),
           (("i", st.integers(0, 7)), ("rank", st.integers(0, 3)),
            ("fail", st.sampled_from([False, False, False, True]))), swarm=False),
    Action("late_report", 10, lambda self: bool(self._late_jobs()), (("i", st.integers(0, 7)),), swarm=False),
    Action("pull_fails", 8, lambda self: bool(self._pulls()), (("i", st.integers(0, 7)), ("rank", st.integers(0, 3))),
           swarm=False),
    Action("load_deadline", 3, lambda self: self.deadline is not None and bool(self._loads()), swarm=False),
    Action("lose_lookup", 2, lambda self: bool(self.lookups), (("i", st.integers(0, 7)),)),
    Action("silence_rank", 2, lambda self: bool(self.jobs), (("i", st.integers(0, 7)), ("rank", st.integers(0, 3)))),
    Action("silent_rank_reports", 2, lambda self: bool(self.silent), (("i", st.integers(0, 7)),)),
    Action("duplicate_report", 3, lambda self: bool(self.sent_reports),
           (("i", st.integers(0, 15)), ("fail", st.booleans()))),
    Action("bogus_report", 1, args=(("kind", st.sampled_from(["unknown_job", "bad_rank"])),)),
    Action("abort", 3, lambda self: bool(self.request_ids), (("k", st.integers(0, 5)), ("i", st.integers(0, 15)))),
    Action("abort_waiting_on_io", 2, lambda self: any(
        self._state(rid) in IO_WAIT_STATES for rid in self.request_ids), (("i", st.integers(0, 15)),)),
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
        if seed is None:
            run_state_machine_as_test(machine, settings=chosen)
        else:
            hypothesis.seed(seed)(get_state_machine_test(machine, settings=chosen))()
    except InvariantViolation as exc:
        return CheckResult(False, exc.violation, tuple(getattr(exc, "events", ())), _reproduce_line(exc))
    except Exception as exc:  # a driver-level bug: still a counterexample, never a traceback
        return CheckResult(False, None, (), _reproduce_line(exc), f"{type(exc).__name__}: {exc}")
    return CheckResult(True)


def _reproduce_line(exc: BaseException) -> str | None:
    for note in getattr(exc, "__notes__", ()):
        if "reproduce_failure" in note:
            return str(note).strip()
    return None


def check_policy(*policies: str, examples: int = DEFAULT_EXAMPLES, steps: int = DEFAULT_STEPS,
                 sharing: bool | None = None) -> None:
    """One line in a user's suite: raise AssertionError with a readable counterexample
    if the stack (``"pkg.mod:Class"``, file paths or built-in names) breaks an invariant."""
    result = run_check(policies, examples=examples, steps=steps, sharing=sharing)
    if not result.ok:
        raise AssertionError(result.report())


def make_test_case(*policies: str, examples: int = DEFAULT_EXAMPLES, steps: int = DEFAULT_STEPS) -> type:
    """A unittest TestCase class running the model checker on this stack (pytest collects it)."""
    machine = make_machine(policies)
    case = machine.TestCase
    case.settings = check_settings(examples, steps)
    return case
