"""Model checking: Hypothesis drives the engine through every interleaving it can find.

``LifecycleMachine`` is a ``RuleBasedStateMachine`` that plays the driver: it feeds
``Engine.handle`` arrivals with shared prefixes, ticks, lookup answers (true, missing,
failed, stale and duplicated), per-rank transfer reports in any order (with failures,
persistently corrupt tier blocks, duplicates and unknown jobs), aborts in every state and
step outputs (two in flight with async scheduling), on a device small enough that
requests get preempted. After every input an independent observer
(``kvlife.specs.invariants``) checks invariants 1-8 from the records and commands; at the end a
drain answers everything, ticks until idle and checks that nothing is stranded and every
request finished.

One line in a user's suite model-checks their policy::

    from kvlife.specs.model_check import check_policy
    def test_my_policy(): check_policy("mypkg.mod:MyPolicy")

``kvlife check`` runs the same thing from the command line.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvlife.specs.invariants import InvariantObserver, InvariantViolation, Violation
from kvlife.specs.table import TABLE, IllegalTransition

EngineFactory = Callable[..., Any]  # (EngineConfig, PolicyStack, tiers=..., recorder=...) -> Engine
StackSpec = Sequence[str] | Callable[[], Any]

DEFAULT_EXAMPLES = 100
DEFAULT_STEPS = 50
# The drain gives up when no request finished for this many ticks (a livelock).
STALL_ROUNDS = 150


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


def default_engine_config(**overrides: Any) -> Any:
    """Small on purpose: few device blocks force preemption, 2 ranks, a small host tier."""
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


def _build_stack(stack: StackSpec) -> Any:
    from kvlife.policies.loading import load_stack

    return stack() if callable(stack) else load_stack(list(stack))


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


def describe_input(event: Any) -> str:
    kind = event.type
    if kind == "arrival":
        return (f"arrival {event.request_id}: {event.prompt_tokens} tokens, "
                f"hashes {list(event.block_hashes)}{' (resumable)' if event.resumable else ''}")
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
    from kvlife.lifecycle.engine.events import DiscardLookup, FreeBlocks, StartLoad, StartStore, StepPlan, SubmitLookup

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
        self.lookups: list[tuple[str, int, tuple[int, ...]]] = []
        self.old_lookups: list[tuple[str, int]] = []
        self.jobs: dict[int, tuple[Any, list[int]]] = {}
        self.sent_reports: list[tuple[int, int]] = []
        self.steps: list[Any] = []
        self.corrupt: set[tuple[str, int]] = set()
        self.max_in_flight = 1
        self.broken = False

    # ---- setup -------------------------------------------------------------------------
    @initialize(async_scheduling=st.booleans(), deadline=st.sampled_from([None, None, 25.0]),
                warm=st.booleans())
    def start(self, async_scheduling: bool, deadline: float | None, warm: bool = False) -> None:
        from kvlife.lifecycle.engine.core import Engine
        from kvlife.transfer.index import TierIndex

        cls = type(self)
        config = cls.engine_config if cls.engine_config is not None else default_engine_config()
        config = attrs.evolve(config, async_scheduling=async_scheduling, transfer_deadline_ms=deadline)
        stack = _build_stack(cls.stack)
        sharing = cls.sharing if cls.sharing is not None else detect_sharing(stack)
        observer = InvariantObserver(config.ranks, config.block_tokens, sharing=sharing)
        tiers = [TierIndex(t.name, t.capacity_blocks, t.eviction) for t in config.tiers]
        warmed: list[int] = []
        if warm and tiers:
            # A previous life left prefixes in the first tier: the first requests load.
            warmed = [f * 1000 + i for f in (0, 1) for i in range(4)][: tiers[0].capacity]
            plan = tiers[0].prepare_store(warmed)
            tiers[0].complete_store([h for h, _ in plan.accepted])
        factory = cls.engine_factory or Engine
        self.engine = factory(config, stack, tiers=tiers, recorder=observer.feed_record)
        observer.accounting = self.engine.check_invariants
        self.observer = observer
        self.max_in_flight = 2 if async_scheduling else 1
        self.log.append(f"engine: {config.device_blocks} device blocks of {config.block_tokens} tokens, "
                        f"{config.ranks} ranks, async scheduling {async_scheduling}, deadline {deadline}, "
                        f"stack {list(stack.names)}, sharing {sharing}, warm tier blocks {warmed}")

    # ---- feeding -------------------------------------------------------------------------
    def feed(self, event: Any) -> list[Any]:
        assert self.observer is not None
        self.log.append(f"t={event.t:g} {describe_input(event)}")
        try:
            commands = self.engine.handle(event)
        except IllegalTransition as exc:
            self._raise(Violation(1, f"engine raised IllegalTransition: {exc}", t=event.t))
        except AssertionError as exc:
            self._raise(Violation(8, f"engine raised AssertionError: {exc}", t=event.t))
        except Exception as exc:
            self._raise(Violation(0, f"engine raised {type(exc).__name__}: {exc}", t=event.t))
        if commands:
            self.log[-1] += "  -> " + describe_commands(commands)
        self.observer.feed_commands(commands)
        self.observer.end_input()
        if self.observer.violations:
            self._raise(self.observer.violations[0])
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
        from kvlife.lifecycle.engine.events import DiscardLookup, StartLoad, StartStore, StepPlan, SubmitLookup

        for c in commands:
            if isinstance(c, SubmitLookup):
                self.lookups.append((c.request_id, c.epoch, c.block_hashes))
            elif isinstance(c, DiscardLookup):
                for i, (rid, epoch, _) in enumerate(self.lookups):
                    if rid == c.request_id and epoch == c.epoch:
                        del self.lookups[i]
                        self.old_lookups.append((rid, epoch))
                        break
            elif isinstance(c, StartLoad | StartStore):
                self.jobs[c.job_id] = (c, list(range(self.engine.config.ranks)))
            elif isinstance(c, StepPlan):
                self.steps.append(c)

    def _now(self) -> float:
        self.t += 1.0
        return self.t

    # ---- rules -------------------------------------------------------------------------------
    @rule(family=st.integers(0, 2), blocks=st.integers(0, 4), extra=st.integers(0, 3),
          branch=st.integers(0, 2), output=st.integers(1, 8), resumable=st.booleans())
    def arrive(self, family: int, blocks: int, extra: int, branch: int, output: int, resumable: bool) -> None:
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
        self.feed(Arrival(self._now(), rid, tokens, hashes, resumable))

    @rule(count=st.integers(2, 3), family=st.integers(0, 2))
    def pressure(self, count: int, family: int) -> None:
        """Long requests with long outputs: the device runs out and someone is preempted."""
        for _ in range(count):
            self.arrive(family, 4, 2, 0, 12, False)

    @precondition(lambda self: len(self.steps) < self.max_in_flight)
    @rule()
    def tick(self) -> None:
        from kvlife.lifecycle.engine.events import Tick

        self.feed(Tick(self._now()))

    @precondition(lambda self: bool(self.steps))
    @rule()
    def step_output(self) -> None:
        self._step_output()

    def _step_output(self) -> None:
        from kvlife.lifecycle.engine.events import StepOutput

        plan = self.steps.pop(0)
        finished = []
        for entry in plan.entries:
            req = self.engine.requests.get(entry.request_id)
            if entry.samples and req is not None and req.state == "running" \
                    and req.generated + 1 >= self.outputs.get(entry.request_id, 1):
                finished.append((entry.request_id, "stopped"))
        self.feed(StepOutput(self._now(), plan.step_id, tuple(finished)))

    @precondition(lambda self: bool(self.lookups))
    @rule(i=st.integers(0, 7), mode=st.sampled_from(["truthful", "truthful", "miss", "failed"]))
    def answer_lookup(self, i: int, mode: str) -> None:
        self._answer(i % len(self.lookups), mode)

    def _answer(self, index: int, mode: str) -> None:
        from kvlife.lifecycle.engine.events import LookupAnswer

        rid, epoch, hashes = self.lookups.pop(index)
        self.old_lookups.append((rid, epoch))
        tiers: tuple[str, ...] | None
        if mode == "failed":
            tiers = None
        elif mode == "miss":
            tiers = ()
        else:
            tiers = self.engine.sync_lookup(hashes)
        self.feed(LookupAnswer(self._now(), rid, epoch, tiers))

    @precondition(lambda self: bool(self.old_lookups))
    @rule(i=st.integers(0, 7))
    def stale_lookup_answer(self, i: int) -> None:
        """An answer that already came, or whose lookup was discarded, arrives (again)."""
        from kvlife.lifecycle.engine.events import LookupAnswer

        rid, epoch = self.old_lookups[i % len(self.old_lookups)]
        req = self.engine.requests.get(rid)
        hashes = req.hashes if req is not None else ()
        self.feed(LookupAnswer(self._now(), rid, epoch, self.engine.sync_lookup(hashes)))

    @precondition(lambda self: bool(self.jobs))
    @rule(i=st.integers(0, 7), rank=st.integers(0, 3), fail=st.sampled_from([False, False, False, True]))
    def report(self, i: int, rank: int, fail: bool) -> None:
        job_id = sorted(self.jobs)[i % len(self.jobs)]
        self._report(job_id, rank, fail)

    def _report(self, job_id: int, rank_pick: int, fail: bool) -> None:
        from kvlife.lifecycle.engine.events import StartLoad, TransferReport

        command, remaining = self.jobs[job_id]
        rank = remaining.pop(rank_pick % len(remaining))
        if not remaining:
            del self.jobs[job_id]
        moves = command.moves
        failed = {moves[0].block_hash} if fail and moves else set()
        is_load = isinstance(command, StartLoad)
        if is_load:
            failed.update(m.block_hash for m in moves if (m.tier, m.block_hash) in self.corrupt)
        elif not remaining:
            # A good store rewrites the slot: the tier's copy is sound again.
            for m in moves:
                if m.block_hash not in failed:
                    self.corrupt.discard((m.tier, m.block_hash))
        self.sent_reports.append((job_id, rank))
        self.feed(TransferReport(self._now(), job_id, rank, tuple(sorted(failed))))

    @precondition(lambda self: bool(self.sent_reports))
    @rule(i=st.integers(0, 15))
    def duplicate_report(self, i: int) -> None:
        from kvlife.lifecycle.engine.events import TransferReport

        job_id, rank = self.sent_reports[i % len(self.sent_reports)]
        self.feed(TransferReport(self._now(), job_id, rank, ()))

    @rule(kind=st.sampled_from(["unknown_job", "bad_rank"]))
    def bogus_report(self, kind: str) -> None:
        from kvlife.lifecycle.engine.events import TransferReport

        if kind == "unknown_job" or not self.jobs:
            self.feed(TransferReport(self._now(), 10_000 + len(self.log), 0, ()))
        else:
            self.feed(TransferReport(self._now(), sorted(self.jobs)[0], self.engine.config.ranks, ()))

    @precondition(lambda self: bool(self.request_ids))
    @rule(k=st.integers(0, 5), i=st.integers(0, 15))
    def abort(self, k: int, i: int) -> None:
        """Abort a request: first pick one of the states some request is in, so that rare
        states (loading, sending, lookup_pending) get aborted as often as common ones."""
        from kvlife.lifecycle.engine.events import Abort

        states = {self.engine.requests[rid].state for rid in self.request_ids}
        present = [s for s in TABLE.states if s in states]
        state = present[k % len(present)]
        pool = [rid for rid in self.request_ids if self.engine.requests[rid].state == state]
        self.feed(Abort(self._now(), pool[i % len(pool)]))

    @precondition(lambda self: bool(self.request_ids))
    @rule(i=st.integers(0, 15))
    def corrupt_block(self, i: int) -> None:
        """A tier copy goes bad: every load of it fails until it is stored again."""
        stored = sorted({(name, h) for rid in self.request_ids for h in self.engine.requests[rid].hashes
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

    def drain(self) -> None:
        """Stop new inputs; answer everything outstanding; tick until idle (bounded)."""
        from kvlife.lifecycle.engine.events import Tick

        assert self.observer is not None
        self.log.append("--- drain: inputs stop; every outstanding answer, report and output is delivered")
        stalled = 0
        finished = -1
        while stalled < STALL_ROUNDS:
            while self.lookups:
                self._answer(0, "truthful")
            while self.jobs:
                self._report(min(self.jobs), 0, False)
            while self.steps:
                self._step_output()
            if not self.engine.busy():
                break
            now_finished = self.engine.state_counts["finished"]
            stalled = 0 if now_finished != finished else stalled + 1
            finished = now_finished
            self.feed(Tick(self._now()))
        self.observer.finish()
        if self.observer.violations:
            self._raise(self.observer.violations[0])
        stranded = self.engine.stranded()
        if stranded:
            self._raise(Violation(7, f"engine.stranded() after drain: {stranded}"))
        unfinished = [f"{rid} in {r.state} (preempted {r.preemptions}x)"
                      for rid, r in self.engine.requests.items() if r.state != "finished"]
        if unfinished:
            self._raise(Violation(7, f"no request finished in {STALL_ROUNDS} drain ticks "
                                     f"(livelock): {', '.join(unfinished)}"))


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
) -> CheckResult:
    """Model-check a stack; returns the (shrunk) counterexample instead of raising."""
    machine = make_machine(stack, engine_factory=engine_factory, engine_config=engine_config, sharing=sharing)
    try:
        run_state_machine_as_test(machine, settings=check_settings(
            examples, steps, derandomize=derandomize, shrink=shrink))
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
