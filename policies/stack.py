"""A policy stack: ask policies top-down, the first ``Decision`` wins, the baseline answers the rest."""

from __future__ import annotations

import math
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from kvlife.policies.base import FALLBACKS, HOOK_VALUES, HOOKS, Answer, Decision, PolicyError
from kvlife.policies.baseline import Baseline


class PolicyStack:
    """Ask policies top-down; the first ``Decision`` wins."""

    def __init__(self, policies: Sequence[object]) -> None:
        self.policies: tuple[object, ...] = tuple(policies) + (Baseline(),)
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
        for name, fn in self._chains[hook]:
            try:
                decision = fn(*args)
                if decision is None:
                    continue
                _check_decision(name, hook, decision, fn)
            except PolicyError:
                raise
            except (Exception, SystemExit) as exc:  # a user's hook (or its value's __eq__) can raise anything
                raise PolicyError(
                    f"policy {name} ({_origin(fn)}): hook {hook} raised {type(exc).__name__}: {exc}"
                    f"{_where(exc)}"
                ) from exc
            return Answer(name, decision.value, decision.reason)
        fallback = FALLBACKS.get(hook)
        if fallback is not None:
            return fallback
        raise PolicyError(f"no policy in the stack answered {hook}")


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
