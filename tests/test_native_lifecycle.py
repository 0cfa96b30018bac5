"""The native Lifecycle and CoreState (``core_lifecycle.hpp``, ``core_state.hpp``) against the
reference (``lifecycle/engine/lifecycle.py``): random sequences of moves (legal and illegal),
asks of a Python policy stack (built-ins and a user policy whose answers change with what it
sees: ints and floats, bools, reasons, passes, bad answers, a raise), warnings with typed fields,
arrivals, clock and device changes give the same trace bytes, state counts, answers (per
policy, hook and str(value)), last decisions (types included), warnings and deferrals, the same
views seen by the policies, and the same errors, after every operation."""

from __future__ import annotations

import math
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlife.lifecycle.config import EngineConfig
from kvlife.lifecycle.engine.blocks import DeviceBlockPool
from kvlife.lifecycle.engine.lifecycle import Lifecycle
from kvlife.lifecycle.engine.request import Request
from kvlife.lifecycle.engine.state import CoreState
from kvlife.lifecycle.traces.trace import render_record
from kvlife.policies.base import Decision, EngineView, LoadView, PolicyError, PrefetchView, RequestView
from kvlife.policies.registry import BUILTIN
from kvlife.policies.stack import HookTimeout, PolicyStack
from kvlife.policies.watchdog import OverrunKilled
from kvlife.specs.names import RequestState, Trigger
from kvlife.specs.table import IllegalTransition

core = pytest.importorskip("kvlife.lifecycle.native._core")
from kvlife.lifecycle.native import bridge  # noqa: E402  (after the skip: it needs the core)

BLOCK_TOKENS = 16
DEVICE_BLOCKS = 64


class Wobbly:
    """A user policy: answers from what it sees, so answers change between asks; keeps every
    view it is given (the native views must carry the same fields)."""

    name = "wobbly"

    def __init__(self) -> None:
        self.seen: list[tuple[Any, ...]] = []
        self.patience_asks = 0

    def _see(self, *views: Any) -> int:
        self.seen.append(tuple(attrs.astuple(v) if attrs.has(type(v)) else v for v in views))
        req = views[0]
        assert isinstance(req, RequestView)
        return req.computed_tokens + req.generated_tokens + len(req.block_hashes) + req.preemptions

    def lookup_mode(self, req: RequestView, engine: EngineView) -> Decision[str] | None:
        n = self._see(req, engine)
        if n % 3 == 0:
            return None  # pass: the stack asks the next policy
        return Decision("async" if n % 2 else "sync", f"n={n % 2}")

    def prefetch_patience(self, req: RequestView, prefetch: PrefetchView, engine: EngineView) -> Decision[float]:
        n = self._see(req, prefetch, engine) + prefetch.blocks
        self.patience_asks += 1
        # An int and the same float in turn: the same answer (no new decision), counted apart by str().
        value: float = [5, 5.0, 5, 5.0, math.inf, 2.5][self.patience_asks % 6]
        return Decision(value, "patience" if n % 7 else "patience!")

    def admission(self, req: RequestView, load: LoadView, engine: EngineView) -> Decision[str] | None:
        n = self._see(req, load, engine) + load.external_hit_blocks + engine.running
        if n % 4 == 0:
            return None
        return Decision(["go", "defer", "join"][n % 3], "adm")

    def store_limit(self, req: RequestView, engine: EngineView) -> Decision[int]:
        n = self._see(req, engine)
        if n % 11 == 10:
            return Decision(1.5, "not an int")  # type: ignore[arg-type]  # a bad answer: PolicyError
        return Decision(req.computed_tokens - n % 2, "limit")

    def hold_at_finish(self, req: RequestView, stores: int, engine: EngineView) -> Decision[bool]:
        n = self._see(req, stores, engine) + stores
        if n % 13 == 12:
            raise RuntimeError(f"wobbly broke on {req.request_id}")
        return Decision(n % 2 == 0, "hold")


TRIGGERS = [str(t) for t in Trigger]
HOOKS = ["on_arrival", "lookup_mode", "lookup_reuse", "prefetch_patience", "admission", "store_limit",
         "hold_at_finish", "on_load_failure"]
texts = st.text(max_size=12)
small = st.integers(0, 40)
load_views = st.builds(LoadView, small, small, st.lists(st.sampled_from(["host", "disk"]), max_size=3).map(tuple),
                       st.lists(st.tuples(st.integers(0, 2**63 - 1), texts), max_size=2).map(tuple))
prefetch_views = st.builds(PrefetchView, small, small, st.lists(st.sampled_from(["disk", "remote"]), max_size=3)
                           .map(tuple), st.floats(0, 1e6))


@st.composite
def asks(draw: st.DrawFn) -> tuple[Any, ...]:
    hook = draw(st.sampled_from(HOOKS))
    args: tuple[Any, ...] = ()
    if hook == "admission":
        args = (draw(load_views),)
    elif hook == "prefetch_patience":
        args = (draw(prefetch_views),)
    elif hook in ("hold_at_finish", "on_load_failure"):
        args = (draw(small),)
    return ("ask", draw(st.integers(0, 5)), hook, args)


warn_fields = st.dictionaries(st.sampled_from(["req", "job", "rank", "note", "ranks", "x", "state"]),
                              st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats() | texts
                              | st.lists(st.integers(-(2**63), 2**63 - 1), max_size=3), max_size=4)

operations = st.one_of(
    st.tuples(st.just("arrive"), small, st.lists(st.integers(0, 2**63 - 1), max_size=4), st.booleans()),
    st.tuples(st.just("move"), st.integers(0, 5), st.sampled_from(TRIGGERS), texts),
    st.tuples(st.just("move"), st.integers(0, 5), st.sampled_from(TRIGGERS), texts),
    asks(),
    asks(),
    asks(),
    st.tuples(st.just("warn"), st.sampled_from(["late_report", "rank_timeout", "é"]), warn_fields),
    st.tuples(st.just("set"), st.integers(0, 5), st.sampled_from(["generated", "computed", "confirmed",
                                                                   "placeholders", "stored_blocks", "preemptions"]),
              small),
    st.tuples(st.just("now"), st.floats(0, 1e9)),
    st.tuples(st.just("alloc"), st.integers(0, 8)),
)
stacks = st.lists(st.sampled_from(sorted(BUILTIN)), max_size=3, unique=True).flatmap(
    lambda names: st.permutations([*names, "wobbly"]))


class Twin:
    """The reference and the native kernel, built alike."""

    def __init__(self, names: list[str]) -> None:
        config = EngineConfig(block_tokens=BLOCK_TOKENS)
        self.lines: list[bytes] = []
        self.ref_wobbly, self.nat_wobbly = Wobbly(), Wobbly()
        self.ref_pool, self.nat_pool = DeviceBlockPool(DEVICE_BLOCKS), core.DeviceBlockPool(DEVICE_BLOCKS)
        self.state = CoreState(config, recorder=lambda r: self.lines.append(render_record(r) + b"\n"))
        self.ref = Lifecycle(self.state, PolicyStack(self.policies(names, self.ref_wobbly)), self.ref_pool)
        self.nat = core.CoreKernel(bridge.core_config(config), bridge.transition_table(),
                                   PolicyStack(self.policies(names, self.nat_wobbly)), self.nat_pool)
        self.ids: list[str] = []

    @staticmethod
    def policies(names: list[str], wobbly: Wobbly) -> list[object]:
        return [wobbly if n == "wobbly" else BUILTIN[n]() for n in names]

    def request(self, i: int) -> str | None:
        return self.ids[i % len(self.ids)] if self.ids else None

    def apply(self, op: tuple[Any, ...]) -> None:
        kind = op[0]
        if kind == "arrive":
            new = f"r{len(self.ids)}"
            self.ids.append(new)
            _, prompt, hashes, resumable = op
            req = Request(new, self.state.next_seq, self.state.now, prompt + 1, tuple(hashes), resumable, BLOCK_TOKENS)
            self.state.next_seq += 1
            self.state.requests[new] = req
            self.state.state_counts[RequestState.WAITING] += 1
            self.nat.add_request(new, self.state.now, prompt + 1, hashes, resumable)
        elif kind == "now":
            self.state.now = op[1]
            self.nat.now = op[1]
        elif kind == "alloc":
            assert self.ref_pool.allocate(op[1]) == self.nat_pool.allocate(op[1])
        elif kind == "warn":
            self.ref.warn(op[1], **op[2])
            self.nat.warn(op[1], **op[2])
        elif (rid := self.request(op[1])) is None:
            return
        elif kind == "set":
            setattr(self.state.requests[rid], op[2], op[3])
            self.nat.set_request(rid, **{op[2]: op[3]})
        elif kind == "move":
            self.both(lambda: self.ref.move(self.state.requests[rid], Trigger(op[2]), op[3]),
                      lambda: self.nat.move(rid, op[2], op[3]))
            assert self.nat.state_of(rid) == self.state.requests[rid].state
        else:
            _, _, hook, args = op
            self.both(lambda: self.ref.ask(self.state.requests[rid], hook, *args),
                      lambda: self.nat.ask(rid, hook, *args))
            ref_last = {str(h): d for h, d in self.state.requests[rid].last_decisions.items()}
            assert repr(list(self.nat.last_decisions(rid).items())) == repr(list(ref_last.items()))

    @staticmethod
    def both(ref: Any, nat: Any) -> None:
        try:
            expected = ref()
        except Exception as exc:  # the native must raise the same type with the same message
            with pytest.raises(type(exc)) as raised:
                nat()
            assert str(raised.value) == str(exc)
            return
        got = nat()
        assert repr(got) == repr(expected)  # the value and its type (5 is not 5.0)

    def check(self) -> None:
        assert self.nat.take_trace() == b"".join(self.lines)
        self.lines.clear()
        assert self.nat.state_counts() == {str(k): v for k, v in self.state.state_counts.items()}
        assert self.nat.moves == self.state.moves
        assert list(self.nat.answers().items()) == list(self.ref.answers.items())
        assert list(self.nat.warnings().items()) == list(self.state.stats.warnings.items())
        assert list(self.nat.deferrals().items()) == list(self.state.stats.deferrals.items())
        assert self.nat.engine_view() == self.ref.engine_view()
        assert self.nat_wobbly.seen == self.ref_wobbly.seen


@settings(max_examples=150, deadline=None)
@given(stacks, st.lists(operations, min_size=5, max_size=60))
def test_lifecycle_matches_reference(names: list[str], ops: list[tuple[Any, ...]]) -> None:
    twin = Twin(names)
    for op in [("arrive", 3, [1, 2], False), *ops]:
        twin.apply(op)
        twin.check()


def test_illegal_move_raises_the_reference_error() -> None:
    twin = Twin([])
    twin.apply(("arrive", 3, [], False))
    with pytest.raises(IllegalTransition) as raised:
        twin.nat.move("r0", "load_done", "why")
    assert twin.nat.state_counts()["waiting"] == 1 and twin.nat.moves == 0 and twin.nat.take_trace() == b""
    # The engine moves by Trigger members; a request never moved still holds the RequestState member.
    assert str(raised.value) == ("request r0: trigger <Trigger.LOAD_DONE: 'load_done'> is not allowed in state "
                                 "<RequestState.WAITING: 'waiting'>")
    twin.nat.move("r0", "lookup_submitted", "why")
    with pytest.raises(IllegalTransition) as raised:
        twin.nat.move("r0", "lookup_submitted", "again")
    assert str(raised.value) == ("request r0: trigger <Trigger.LOOKUP_SUBMITTED: 'lookup_submitted'> is not allowed "
                                 "in state 'lookup_pending'")


class _Decision(Decision[Any]):
    """A Decision subclass: well formed, but not the exact class (the native asker's slow path)."""


class _Str(str):
    pass


class _Grumpy:
    def __eq__(self, other: object) -> bool:
        raise ValueError("no comparing me")

    __hash__ = object.__hash__


class _Escape(BaseException):
    """A BaseException that is none of the ones PolicyStack.ask turns into a PolicyError."""


def _raise(exc: BaseException) -> Any:
    raise exc


# (hook, what the hook does, what the ask gives: "answer", or the error's type and its cause's
# type): the plain answers the native asker takes itself, and every odd one it hands to the
# reference's checks (_check_decision) and error path (hook_failure).
ODD_ANSWERS: list[tuple[str, Any, Any]] = [
    ("admission", lambda: Decision("go", "plain"), "answer"),
    ("admission", lambda: Decision(_Str("defer"), "a str subclass among the choices"), "answer"),
    ("admission", lambda: _Decision("join", "a Decision subclass"), "answer"),
    ("admission", lambda: Decision("maybe", "not a choice"), ("PolicyError", "NoneType")),
    ("admission", lambda: Decision(_Grumpy(), "its __eq__ raises"), ("PolicyError", "ValueError")),
    ("admission", lambda: Decision("go", ""), ("PolicyError", "NoneType")),
    ("admission", lambda: Decision("go", 7), ("PolicyError", "NoneType")),
    ("admission", lambda: Decision("go", _Str("a str subclass reason")), "answer"),
    ("admission", lambda: Decision("go", "x" * 4096), "answer"),
    ("admission", lambda: Decision("go", "x" * 4097), ("PolicyError", "NoneType")),
    ("admission", lambda: "go", ("PolicyError", "NoneType")),
    ("admission", lambda: None, "answer"),  # the baseline answers
    ("store_limit", lambda: Decision(3, "an int"), "answer"),
    ("store_limit", lambda: Decision(-3, "a negative int"), "answer"),
    ("store_limit", lambda: Decision(True, "a bool is no int here"), ("PolicyError", "NoneType")),
    ("store_limit", lambda: Decision(3.0, "a float"), ("PolicyError", "NoneType")),
    ("store_limit", lambda: Decision(2**63 - 1, "the largest int64"), "answer"),
    ("hold_at_finish", lambda: Decision(False, "a bool"), "answer"),
    ("hold_at_finish", lambda: Decision(1, "an int is no bool here"), ("PolicyError", "NoneType")),
    ("prefetch_patience", lambda: Decision(0, "an int"), "answer"),
    ("prefetch_patience", lambda: Decision(-(2**64), "an int past int64, < 0"), ("PolicyError", "NoneType")),
    ("prefetch_patience", lambda: Decision(-0.0, "minus zero"), "answer"),
    ("prefetch_patience", lambda: Decision(math.inf, "wait"), "answer"),
    ("prefetch_patience", lambda: Decision(math.nan, "nan"), ("PolicyError", "NoneType")),
    ("prefetch_patience", lambda: Decision(-1, "negative"), ("PolicyError", "NoneType")),
    ("prefetch_patience", lambda: Decision(True, "a bool"), ("PolicyError", "NoneType")),
    ("prefetch_patience", lambda: None, "answer"),  # nobody answers: FALLBACKS
    ("lookup_mode", lambda: _raise(ValueError("broken")), ("PolicyError", "ValueError")),
    ("lookup_mode", lambda: _raise(PolicyError("the policy's own")), ("PolicyError", "NoneType")),
    ("lookup_mode", lambda: _raise(KeyboardInterrupt()), ("PolicyError", "KeyboardInterrupt")),  # no signal came
    ("lookup_mode", lambda: _raise(_signal_interrupt()), ("KeyboardInterrupt", "NoneType")),
    ("lookup_mode", lambda: _raise(SystemExit(3)), ("PolicyError", "SystemExit")),
    ("lookup_mode", lambda: _raise(_Escape("through")), ("_Escape", "NoneType")),
    ("lookup_mode", lambda: _raise(_Killed("it caught its HookTimeout")), ("HookTimeout", "NoneType")),
]


def _signal_interrupt() -> KeyboardInterrupt:
    """Ctrl-C as kvlife's handler raises it (kvlife.lifecycle.drivers.interrupts)."""
    interrupt = KeyboardInterrupt()
    interrupt.from_signal = True  # type: ignore[attr-defined]
    return interrupt


class _Killed(OverrunKilled):
    """What the watchdog raises the second time in a hook that caught its HookTimeout."""

    overrun = HookTimeout


# The hook's own argument (between the request view and the engine view) for one ask of a hook.
HOOK_ARGS: dict[str, tuple[Any, ...]] = {"admission": (LoadView(0, 0, (), ()),),
                                         "prefetch_patience": (PrefetchView(1, 16, ("disk",), 0.0),),
                                         "hold_at_finish": (1,)}


def _twin_asking(policy: type) -> Twin:
    """A Twin whose two stacks are one ``policy`` each (over the baseline), with request r0."""
    twin = Twin([])
    twin.ref = Lifecycle(twin.state, PolicyStack([policy()]), twin.ref_pool)
    twin.nat = core.CoreKernel(bridge.core_config(EngineConfig(block_tokens=BLOCK_TOKENS)), bridge.transition_table(),
                               PolicyStack([policy()]), twin.nat_pool)
    twin.apply(("arrive", 3, [1, 2], False))
    return twin


@pytest.mark.parametrize(("hook", "answer", "expected"), ODD_ANSWERS)
def test_odd_answers_are_taken_or_refused_as_the_reference_does(hook: str, answer: Any, expected: Any) -> None:
    """The native asker takes a plainly well-formed Decision itself and hands every other one to
    the reference's checks and error path: each answer gives the expected outcome, and the same
    value, decision and trace, or the same error (type, message, cause, whether the context
    shows), on both engines."""

    class Odd:
        name = "odd"

    setattr(Odd, hook, lambda self, *views: answer())
    twin = _twin_asking(Odd)
    args = HOOK_ARGS.get(hook, ())
    outcomes: list[tuple[Any, ...]] = []
    for ask in (lambda: twin.ref.ask(twin.state.requests["r0"], hook, *args),
                lambda: twin.nat.ask("r0", hook, *args)):
        try:
            outcomes.append(("answer", repr(ask())))
        except BaseException as exc:  # noqa: BLE001  (a hook's BaseException passes through both)
            outcomes.append((type(exc).__name__, type(exc.__cause__).__name__, str(exc), exc.__suppress_context__))
    assert outcomes[0] == outcomes[1]
    assert (outcomes[0][0] if expected == "answer" else outcomes[0][:2]) == expected
    if expected == "answer":
        twin.check()
    elif expected[0] == "HookTimeout":  # raised as `from None`: the error the hook caught does not show
        assert outcomes[0][3] is True
    elif expected[1] != "NoneType":  # a replaced error: it names the policy, the hook and what was raised
        assert outcomes[0][2].startswith(f"policy odd (module {__name__}): hook {hook} raised {expected[1]}")


# Answers the native asker takes without Python (True) and ones it must hand to the reference's
# _check_decision (False): the same outcome either way, so only the count of checks tells.
ROUTES: list[tuple[str, Any, bool]] = [
    ("admission", Decision("go", "plain"), True),
    ("admission", Decision("go", "x" * 4096), True),  # a reason of REASON_MAX characters
    ("store_limit", Decision(-3, "a negative int"), True),
    ("store_limit", Decision(2**63 - 1, "the largest int64"), True),
    ("hold_at_finish", Decision(False, "a bool"), True),
    ("prefetch_patience", Decision(0, "an int"), True),
    ("prefetch_patience", Decision(-0.0, "minus zero"), True),
    ("prefetch_patience", Decision(math.inf, "wait"), True),
    ("admission", Decision(_Str("defer"), "a str subclass among the choices"), False),
    ("admission", _Decision("join", "a Decision subclass"), False),
    ("admission", Decision("go", _Str("a str subclass reason")), False),
]


@pytest.mark.parametrize(("hook", "decision", "plain"), ROUTES)
def test_plain_answers_are_taken_without_python(hook: str, decision: Any, plain: bool,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from kvlife.policies import stack as stack_module

    checks: list[tuple[Any, ...]] = []
    check = stack_module._check_decision

    def counted(*args: Any) -> None:
        checks.append(args)
        check(*args)

    monkeypatch.setattr(stack_module, "_check_decision", counted)  # before the asker takes it

    class Plain:
        name = "plain"

    setattr(Plain, hook, lambda self, *views: decision)
    twin = _twin_asking(Plain)
    args = HOOK_ARGS.get(hook, ())
    expected = twin.ref.ask(twin.state.requests["r0"], hook, *args)
    assert len(checks) == 1  # the reference checks every answer
    checks.clear()
    assert repr(twin.nat.ask("r0", hook, *args)) == repr(expected)
    assert len(checks) == (0 if plain else 1)
    twin.check()
