"""A policy stack: ask policies top-down, the first ``Decision`` wins, the baseline answers the rest."""

from __future__ import annotations

import math
import sys
import traceback
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

from kvlife.policies.base import FALLBACKS, HOOK_VALUES, HOOKS, Answer, Decision, PolicyError
from kvlife.policies.baseline import Baseline
from kvlife.policies.watchdog import Overrun, OverrunKilled, Watch

# How long one hook may run before the run is stopped (``policies.hook_budget_s``): a hook
# answers from a view in microseconds, so seconds mean it will not return.
DEFAULT_HOOK_BUDGET_S = 5.0


# The longest reason a decision may give: it is written into a trace line, which a reader
# takes only up to a bound (kvlife.lifecycle.traces.trace.record_line_max).
REASON_MAX = 4096


class HookTimeout(PolicyError, Overrun):
    """A hook ran past its time budget (raised inside it by ``policies.watchdog``)."""

    message = "a policy hook ran past its time budget"


class NativeAsking:
    """Which hook of which request the native core asks (the last one asked; ``hook`` None:
    none yet): the asking thread, the policy, the hook and the request view. The native
    asker writes the four slots in place before each hook, with no attribute lookup and no
    tuple per ask; the watchdog reads them when that hook runs past its budget."""

    __slots__ = ("ident", "policy", "hook", "request")

    def __init__(self) -> None:
        self.ident: int = 0
        self.policy: str = ""
        self.hook: str | None = None
        self.request: object = None


class PolicyStack:
    """Ask policies top-down; the first ``Decision`` wins. Each hook runs under a time
    budget of ``budget_s`` seconds (``policies.watchdog``): past it, a ``HookTimeout``
    (a ``PolicyError``) naming the policy, the hook and the request ends the run."""

    def __init__(self, policies: Sequence[object], budget_s: float = DEFAULT_HOOK_BUDGET_S) -> None:
        self.policies: tuple[object, ...] = tuple(policies) + (Baseline(),)
        self.budget_s = budget_s
        self._watch = Watch(budget_s, HookTimeout, self._locate_ask)
        # The native core asks the chains itself (lifecycle/native/src/bind_policy_asker.hpp):
        # before each hook it writes which one into ``native_asking``, which the watchdog
        # reads when that hook runs past the budget (no ask frame to read it from).
        self.native_asking = NativeAsking()
        self._chains: dict[str, tuple[tuple[str, Callable[..., Any]], ...]] = {}
        for hook in HOOKS:
            chain = []
            for policy in self.policies:
                fn = getattr(policy, hook, None)
                if fn is not None:
                    if not callable(fn):
                        raise PolicyError(f"policy {policy_name(policy)}: hook {hook} is not callable")
                    chain.append((policy_name(policy), fn))
            self._chains[hook] = tuple(chain)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(policy_name(p) for p in self.policies)

    def ask(self, hook: str, *args: Any) -> Answer:
        watch = self._watch
        watch.seq += 1  # (odd: a hook of this stack runs; the watchdog times it)
        try:
            for name, fn in self._chains[hook]:
                try:
                    decision = fn(*args)
                    if decision is None:
                        continue
                    _check_decision(name, hook, decision, fn)
                except BaseException as exc:
                    raise hook_failure(name, hook, fn, exc)  # noqa: B904 (the cause is hook_failure's)
                return Answer(name, decision.value, decision.reason)
        finally:
            watch.seq += 1
        fallback = FALLBACKS.get(hook)
        if fallback is not None:
            return fallback
        raise PolicyError(f"no policy in the stack answered {hook}")

    def _locate_ask(self) -> tuple[int, str] | None:
        """For the watchdog, when a hook ran past the budget: the thread asking this stack,
        and the message naming the policy, the hook and the request (read from the asking
        frame, or from ``native_asking`` when the native core asks; None when no thread is
        asking any more)."""
        for ident, frame in sys._current_frames().items():
            found: FrameType | None = frame
            while found is not None and not (found.f_code is _ASK_CODE and found.f_locals.get("self") is self):
                found = found.f_back
            if found is None:
                continue
            local = found.f_locals
            args = local.get("args") or ()
            return ident, self._overrun_message(local.get("name", "?"), local.get("hook", "?"),
                                                args[0] if args else None)
        asking = self.native_asking
        if asking.hook is not None:
            return asking.ident, self._overrun_message(asking.policy, asking.hook, asking.request)
        return None

    def _overrun_message(self, name: str, hook: str, req: object) -> str:
        fn = dict(self._chains.get(hook, ())).get(name)
        where = f" ({_origin(fn)})" if fn is not None else ""
        request = getattr(req, "request_id", None)
        about = f" for request {request}" if isinstance(request, str) else ""
        return (f"policy {name}{where}: hook {hook} ran past its time budget of {self.budget_s:g} s{about} "
                f"(policies.hook_budget_s); the run was stopped")


_ASK_CODE = PolicyStack.ask.__code__


def hook_failure(name: str, hook: str, fn: Callable[..., Any], exc: BaseException) -> BaseException:
    """What ``PolicyStack.ask`` raises when hook ``fn`` of policy ``name``, or the check of its
    answer, raised ``exc``: ``exc`` itself when it passes through (a ``PolicyError``, another
    watchdog's ``Overrun``, Ctrl-C or SIGTERM, a ``BaseException`` that is none of the below),
    else the error that replaces it, its ``__cause__`` set (the native core raises the same)."""
    if isinstance(exc, PolicyError | Overrun):  # (Overrun: another watchdog's, the live loop's, passes through)
        return exc
    error: BaseException
    if isinstance(exc, OverrunKilled):  # the hook caught its HookTimeout and went on
        error = exc.overrun(str(exc))
        error.__cause__ = None
        return error
    if isinstance(exc, Exception | SystemExit):  # a user's hook (or its value's __eq__) can raise anything
        error = PolicyError(f"policy {name} ({_origin(fn)}): hook {hook} raised {type(exc).__name__}: {exc}"
                            f"{_where(exc)}")
    elif isinstance(exc, KeyboardInterrupt):
        if getattr(exc, "from_signal", False):
            return exc  # Ctrl-C or SIGTERM (kvlife.lifecycle.drivers.interrupts marks them)
        error = PolicyError(f"policy {name} ({_origin(fn)}): hook {hook} raised KeyboardInterrupt "
                            f"(not an interrupt: no signal came)")
    else:
        return exc
    error.__cause__ = exc
    return error


def _where(exc: BaseException) -> str:
    """`` (at FILE:LINE in FUNCTION; --traceback shows the whole traceback)``: the innermost
    frame of the policy's code that raised."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    last = frames[-1]
    return f" (at {last.filename}:{last.lineno} in {last.name}; --traceback shows the whole traceback)"


def _origin(fn: Callable[..., Any]) -> str:
    """Where a hook's code lives, for errors: module (and file for file-loaded policies)."""
    module_name = getattr(fn, "__module__", None) or "?"
    module = sys.modules.get(module_name)
    path = getattr(module, "__file__", None)
    if module_name.startswith("kvlife_user_policy_") and path:
        return f"module {path}"
    return f"module {module_name}"


def _check_decision(name: str, hook: str, decision: object, fn: Callable[..., Any] | None = None) -> None:
    """Raise ``PolicyError`` naming the policy (and where ``fn``, its hook, lives) unless
    ``decision`` is a well-formed answer at ``hook``; the name is put together only then."""
    problem = _decision_problem(hook, decision)
    if problem is not None:
        policy = name if fn is None else f"{name} ({_origin(fn)})"
        raise PolicyError(f"policy {policy}: hook {hook} {problem}")


def _decision_problem(hook: str, decision: object) -> str | None:
    """What is wrong with ``decision`` as an answer at ``hook``; None if nothing."""
    if not isinstance(decision, Decision):
        return f"returned {type(decision).__name__}, expected Decision or None"
    if not isinstance(decision.reason, str) or not decision.reason:
        return "gave no reason string"
    if len(decision.reason) > REASON_MAX:
        return (f"gave a reason of {len(decision.reason):,} characters (at most {REASON_MAX:,}: it is part of a "
                f"trace line)")
    allowed = HOOK_VALUES[hook]
    value = decision.value
    if allowed is float:
        if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value) or value < 0:
            return f"returned {value!r}, expected a number of ms >= 0"
        return None
    if isinstance(allowed, tuple):
        return None if value in allowed else f"returned {value!r}, expected one of {allowed}"
    if isinstance(value, bool) is not (allowed is bool) or not isinstance(value, allowed):
        return f"returned {value!r}, expected {allowed.__name__}"
    return None


def policy_name(policy: object) -> str:
    name = getattr(policy, "name", None)
    return name if isinstance(name, str) else type(policy).__name__
