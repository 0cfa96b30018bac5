"""Hostile policies, and what the policy stack must do with each.

"The engine enforces safety whatever the answer is" (``kvlife.policies.base``), and that
includes answers that never come. The model checker's own policies always answer, so
``kvlife check`` also runs the guards a stack runs under, once per invocation, against
policies written to misbehave:

* a hook that never returns (it sleeps; it spins in pure Python), asked first in a fresh
  stack, in the main thread and from another thread: the watchdog
  (``kvlife.policies.watchdog``) ends it with a ``HookTimeout`` naming the policy, the hook
  and the request;
* a hook that spins and catches that error (``except Exception``): what it catches first
  is the ``HookTimeout``, and the ask still ends with one (the watchdog's second error,
  ``OverrunKilled``, is one ``except Exception`` does not catch);
* a hook that raises from a helper function: the ``PolicyError`` names the innermost frame
  that raised, ``at FILE:LINE in FUNCTION``;
* a reason of the documented limit, 4,096 characters, is taken, and a tiny simulated run
  records it in a trace line the trace reader reads back; one character more is refused
  in one line.

Each hostile policy sits on top of the stack being checked, in a fresh ``PolicyStack`` with
a short budget. A hostile hook gives up after ``BOUND_S`` (a broken watchdog makes the
check fail, never hang); the watchdog takes one to two budgets. The watchdog is left as
found: no error pending for the main thread, the signal handler unchanged.
"""

from __future__ import annotations

import signal
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from kvlife.policies.base import Answer, Decision, PolicyError
from kvlife.policies.stack import HookTimeout, PolicyStack
from kvlife.policies.watchdog import _WATCHDOG, SIGNAL, OverrunKilled
from kvlife.specs.policy_contracts import hook_args, legal_value, views

# The hostile stacks' hook budget: short, so the check adds well under a second.
BUDGET_S = 0.05
# A hang must end within this many budgets: the watchdog looks CHECKS times a budget (at
# most every 50 ms) and stops a call after one to two budgets; the rest is room for a
# loaded machine. A hostile hook gives up at this bound.
BOUND_BUDGETS = 40
BOUND_S = BUDGET_S * BOUND_BUDGETS
# One blocking sleep of the sleeping hook (five budgets): the watchdog's signal breaks it
# in the main thread; an asynchronous exception (another thread, or a signal that is not
# the watchdog's) waits for it to end, well within the bound. (So the hook that catches
# what it is sent spins: an asynchronous exception is sent again, uncatchable, before a
# blocked call could catch the first.)
SLEEP_S = BOUND_S / 8
# The longest reason a decision may give, as docs/policies.md ("Writing your own") documents it: it
# is part of a trace line (kvlife.lifecycle.traces.trace.record_line_max bounds those).
DOCUMENTED_REASON_MAX = 4096
# What a reason of any length is made of: characters JSON escapes (a quote, a backslash,
# control characters), and some past ASCII, one of them past the Basic Multilingual Plane.
REASON_CHARACTERS = 'why "not" \\ \x00\t\n\x7f é € \U0001f600 '
REQUEST_ID = "guard-req"


def guard_problems(stack: PolicyStack) -> list[str]:
    """What the stack's guards failed to do against each hostile policy, one line each
    (empty when every guard held). ``stack``: the stack being checked (built already, so
    the watchdog's signal handler is in place, as in a run)."""
    own = stack.policies[:-1]  # the stack's own policies (each new stack puts the baseline back)
    handler = signal.getsignal(SIGNAL)
    problems = [problem for problem in (
        _hang(own, "on_arrival", spin=False),
        _hang(own, "admission", spin=True),
        _hang(own, "store_limit", spin=True, catch=True),
        _hang(own, "lookup_mode", spin=True, thread=True),
        _hang(own, "admission", spin=True, after=1),
        _innermost_frame(own),
        _reason_over_limit(own),
        _reason_at_limit(own),
    ) if problem is not None]
    if signal.getsignal(SIGNAL) != handler:
        problems.append(f"the watchdog's signal handler ({SIGNAL.name}) changed while hooks were stopped: "
                        f"{handler!r} became {signal.getsignal(SIGNAL)!r}")
    return problems


@attrs.define
class Hang:
    """A policy whose hook ``hook`` does not return for ``BOUND_S``: it sleeps, or spins in
    pure Python; with ``catch`` it catches what it is sent (``except Exception``), keeps it
    in ``caught`` and goes on. Past the bound it gives up and answers. With ``after``, its
    first ``after`` asks answer at once (the watchdog must time every call, not the first)."""

    hook: str
    spin: bool
    catch: bool = False
    after: int = 0
    name: str = "guard-hang"
    caught: list[Exception] = attrs.Factory(list)

    def __getattr__(self, name: str) -> Any:
        if name == self.hook:
            return self.hang
        raise AttributeError(name)

    def hang(self, *args: Any) -> Decision[Any]:
        if self.after:
            self.after -= 1
            return Decision(legal_value(self.hook), "answered at once")
        deadline = time.monotonic() + BOUND_S
        while time.monotonic() < deadline:
            try:
                _wait(deadline, self.spin)
            except Exception as exc:
                if not self.catch:
                    raise
                self.caught.append(exc)
        return Decision(legal_value(self.hook), "gave up: nothing stopped this hook")


def _wait(deadline: float, spin: bool) -> None:
    while (left := deadline - time.monotonic()) > 0:
        if not spin:
            time.sleep(min(left, SLEEP_S))


def _hang(own: Sequence[object], hook: str, *, spin: bool, catch: bool = False, thread: bool = False,
          after: int = 0) -> str | None:
    """A hook that never returns, asked first in a fresh stack (or after ``after`` quick
    answers): stopped, and named."""
    hostile = Hang(hook, spin, catch, after)
    stack = PolicyStack([hostile, *own], budget_s=BUDGET_S)
    what = _hang_described(hook, spin, catch, thread, after)
    stopped = next((quick for quick in (_ask(stack, hook) for _ in range(after)) if not isinstance(quick, Answer)),
                   None)
    if stopped is not None:
        return f"{what}: a quick answer was stopped: {type(stopped).__name__}: {stopped}"
    outcome = _ask_in_thread(stack, hook) if thread else _ask(stack, hook)
    # (A hook that caught nothing and gave up was sent nothing: the timeout's problem.)
    sent = bool(hostile.caught) or not isinstance(outcome, Answer)
    problem = _caught_problem(hostile.caught) if catch and sent else None
    problem = problem or _timeout_problem(outcome, hostile.name, hook)
    if problem is None and stack._watch in _WATCHDOG.pending:
        problem = "the watchdog left an error pending for the main thread after the hook was stopped"
    return None if problem is None else f"{what}: {problem}"


def _hang_described(hook: str, spin: bool, catch: bool, thread: bool, after: int) -> str:
    here = "in the main thread" if threading.current_thread() is threading.main_thread() else "in the asking thread"
    when = f"after {after} quick answer{'s' if after > 1 else ''}" if after else "first"
    return (f"a hook ({hook}) that {'spins' if spin else 'sleeps'}{' and catches what it is sent' if catch else ''}, "
            f"asked {when} in a fresh stack {'from another thread' if thread else here}")


def _request_args(hook: str) -> tuple[Any, ...]:
    v = next(views(count=1))
    v = attrs.evolve(v, req=attrs.evolve(v.req, request_id=REQUEST_ID))
    return hook_args(v)[hook]


def _ask(stack: PolicyStack, hook: str) -> Answer | BaseException:
    try:
        return stack.ask(hook, *_request_args(hook))
    except (Exception, OverrunKilled) as exc:  # what the ask ended with is the finding
        return exc


def _ask_in_thread(stack: PolicyStack, hook: str) -> Answer | BaseException:
    box: list[Answer | BaseException] = []

    def ask() -> None:
        try:
            box.append(stack.ask(hook, *_request_args(hook)))
        except BaseException as exc:  # handed to the asking thread
            box.append(exc)

    asker = threading.Thread(target=ask, name="guard-ask", daemon=True)
    asker.start()
    asker.join(2 * BOUND_S)  # (the hook itself gives up at BOUND_S)
    return box[0] if box else TimeoutError(f"the asking thread still runs after {2 * BOUND_S:g} s")


def _timeout_problem(outcome: Answer | BaseException, name: str, hook: str) -> str | None:
    if isinstance(outcome, Answer):
        return (f"the watchdog did not stop it within {BOUND_S:g} s ({BOUND_S / BUDGET_S:g} budgets of {BUDGET_S:g} s; "
                f"it stops a hook after one or two)")
    if not isinstance(outcome, HookTimeout):
        return f"it ended with {type(outcome).__name__}: {outcome}, expected HookTimeout (a PolicyError)"
    message = str(outcome)
    missing = [part for part in (f"policy {name}", f"hook {hook}", f"request {REQUEST_ID}") if part not in message]
    if missing or "\n" in message:
        return f"its HookTimeout is not one line naming {', '.join(missing) or 'it'}: {message!r}"
    return None


def _caught_problem(caught: list[Exception]) -> str | None:
    if not caught:
        return ("it caught nothing: the first error the watchdog sends must be the catchable HookTimeout, "
                "not one `except Exception` cannot catch")
    if not isinstance(caught[0], HookTimeout):
        return f"the first error it caught is {type(caught[0]).__name__}: {caught[0]}, expected HookTimeout"
    if len(caught) > 1:
        return (f"it caught {len(caught)} errors: once it caught the first, the watchdog must send one "
                f"`except Exception` does not catch (OverrunKilled)")
    return None


@attrs.define
class Raises:
    """A policy whose hook raises from a helper function."""

    name: str = "guard-raises"

    def hold_at_finish(self, req: Any, stores_in_flight: int, engine: Any) -> Decision[bool]:
        return _helper()


class HelperError(Exception):
    """What ``_helper`` raises: the line it raised at."""


def _helper() -> Decision[bool]:
    raise HelperError(sys._getframe().f_lineno)


def _innermost_frame(own: Sequence[object]) -> str | None:
    """A hook that raises from a helper: a one-line PolicyError at the helper's line."""
    hostile = Raises()
    outcome = _ask(PolicyStack([hostile, *own], budget_s=BUDGET_S), "hold_at_finish")
    what = "a hook (hold_at_finish) that raises from a helper function"
    cause = getattr(outcome, "__cause__", None)
    if not isinstance(outcome, PolicyError) or not isinstance(cause, HelperError):
        return f"{what}: the ask ended with {outcome!r}, expected a PolicyError from the HelperError"
    where = f"at {_helper.__code__.co_filename}:{cause.args[0]} in {_helper.__name__}"
    message = str(outcome)
    if f"({where};" not in message or "\n" in message or f"policy {hostile.name}" not in message:
        return (f"{what}: the PolicyError is not one line naming the policy and the innermost frame ({where}): "
                f"{message!r}")
    return None


@attrs.define
class Reason:
    """A policy that answers ``on_arrival`` (with its legal value) giving ``reason``."""

    reason: str
    name: str = "guard-reason"

    def on_arrival(self, req: Any, engine: Any) -> Decision[str]:
        return Decision(legal_value("on_arrival"), self.reason)


def reason_of(length: int) -> str:
    return (REASON_CHARACTERS * (length // len(REASON_CHARACTERS) + 1))[:length]


def _reason_over_limit(own: Sequence[object]) -> str | None:
    """One character past the documented limit: refused in one line."""
    length = DOCUMENTED_REASON_MAX + 1
    outcome = _ask(PolicyStack([Reason(reason_of(length)), *own], budget_s=BUDGET_S), "on_arrival")
    if isinstance(outcome, PolicyError) and "\n" not in str(outcome):
        return None
    return (f"a reason of {length:,} characters (the documented limit is {DOCUMENTED_REASON_MAX:,}) ended with "
            f"{outcome!r}, expected a one-line PolicyError")


def _reason_at_limit(own: Sequence[object]) -> str | None:
    """A reason of the documented limit: taken, recorded by a tiny run, read back."""
    from kvlife.lifecycle.config import RunConfig
    from kvlife.lifecycle.drivers.runner import run_workload
    from kvlife.lifecycle.traces.trace import TraceError, read_trace
    from kvlife.lifecycle.workloads.synthetic import synthetic_workload

    hostile = Reason(reason_of(DOCUMENTED_REASON_MAX))
    what = f"a reason of {DOCUMENTED_REASON_MAX:,} characters (the documented limit)"
    with tempfile.TemporaryDirectory(prefix="kvlife-guard-") as folder:
        trace = Path(folder) / "reason.trace.jsonl"
        try:
            run_workload(RunConfig(), synthetic_workload(seed=0, num_requests=1), PolicyStack([hostile, *own]), trace)
        except PolicyError as exc:
            if not str(exc).startswith(f"policy {hostile.name} "):
                return None  # one of the stack's own policies failed: the model checker reports it
            return f"{what} was refused: {exc}"
        except Exception as exc:  # (the engine failed the run: a finding too, never a traceback)
            return f"{what}: the one-request run that records it failed: {type(exc).__name__}: {exc}"
        try:
            reasons = [record.get("reason") for _, record in read_trace(trace)
                       if record.get("kind") == "decision" and record.get("policy") == hostile.name]
        except TraceError as exc:
            return f"{what}: the trace reader refused the trace that records it: {exc}"
    if hostile.reason not in reasons:
        return f"{what}: no decision record read back from the trace carries it"
    return None
