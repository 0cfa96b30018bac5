"""The policy protocol: decision points, read-only views, decisions with reasons, stacks.

A policy is a plain class with any subset of the hooks below. Hooks are pure: they read
the views they are given and return a ``Decision`` (a value plus a short human reason
that lands in the trace) or ``None`` to pass the decision down the stack. The engine
asks the stack top-down: the first policy that answers wins, and the baseline at the
bottom answers everything. The engine enforces safety whatever the answer is: a policy
chooses among legal options, it cannot free a block under a transfer.

Stack order: the stack is the ``--policy`` flags (or ``[policies] stack``) in the order
given, then ``Baseline``. Each hook is resolved on its own, so policies that answer
different hooks (``async-lookup`` answers ``lookup_mode``, ``shared-loads`` answers
``admission``) compose in any order; when two answer the same hook, put the more specific
one first (``prefetch-timeout`` before ``early-prefetch``, a user override before the
built-ins). A hook nobody answers falls back to ``FALLBACKS`` (only
``prefetch_patience``, which the baseline predates: wait for the prefetch to complete).

Decision points, in the order a request meets them: ``on_arrival`` (none, lookup, or
lookup plus a lower-tier prefetch into the host tier), ``lookup_mode`` (sync or async),
``prefetch_patience`` (ms a request may wait for its prefetch, counted from the start of
the prefetch: 0 is best effort, ``math.inf`` waits for completion), ``admission`` (go,
defer, join an in-flight load), ``store_limit`` (tokens whose blocks may be stored),
``hold_at_finish`` and ``on_load_failure``.

Loading a policy module runs its code (it is imported like any Python module): load
only policy files you trust.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Generic, Literal, Protocol, TypeVar

import attrs

T = TypeVar("T")

LookupMode = Literal["sync", "async"]
ArrivalAction = Literal["none", "lookup", "prefetch"]
Admission = Literal["go", "defer", "join"]
LoadFailureAction = Literal["recompute", "fail"]

HOOKS: tuple[str, ...] = (
    "on_arrival",
    "lookup_mode",
    "prefetch_patience",
    "admission",
    "store_limit",
    "hold_at_finish",
    "on_load_failure",
)
HOOK_VALUES: dict[str, tuple[Any, ...] | type] = {
    "on_arrival": ("none", "lookup", "prefetch"),
    "lookup_mode": ("sync", "async"),
    "prefetch_patience": float,  # ms, >= 0; ints accepted, math.inf means wait for completion
    "admission": ("go", "defer", "join"),
    "store_limit": int,
    "hold_at_finish": bool,
    "on_load_failure": ("recompute", "fail"),
}


@attrs.frozen(slots=True)
class Decision(Generic[T]):
    value: T
    reason: str


@attrs.frozen(slots=True)
class RequestView:
    """What a policy may know about one request."""

    request_id: str
    state: str
    arrival_ms: float
    prompt_tokens: int
    generated_tokens: int
    computed_tokens: int  # includes tokens of steps still in flight (placeholders)
    confirmed_tokens: int  # tokens whose step output has arrived
    placeholder_tokens: int
    block_tokens: int
    block_hashes: tuple[int, ...]  # hashes of the full prompt blocks
    stored_blocks: int  # leading prompt blocks already sent to store
    resumable: bool
    preemptions: int


@attrs.frozen(slots=True)
class LoadView:
    """The admission question: what this request could take from where."""

    device_hit_blocks: int  # leading blocks already valid on the device
    external_hit_blocks: int  # further leading blocks available in a tier
    tiers: tuple[str, ...]  # tier of each external hit block
    in_flight: tuple[tuple[int, str], ...]  # (block hash, loading request) among the hits


@attrs.frozen(slots=True)
class PrefetchView:
    """A lower-tier to host-tier pull started for this request (early prefetch)."""

    blocks: int  # blocks being pulled into the host tier
    tokens: int  # tokens those blocks hold
    source_tiers: tuple[str, ...]  # tier each block is pulled from
    started_ms: float


@attrs.frozen(slots=True)
class EngineView:
    now_ms: float
    running: int
    waiting: int
    loading: int
    free_device_blocks: int
    device_blocks: int


class Policy(Protocol):
    """Documentation of the hooks; a policy implements any subset of them."""

    name: str

    def on_arrival(self, req: RequestView, engine: EngineView) -> Decision[ArrivalAction] | None: ...

    def lookup_mode(self, req: RequestView, engine: EngineView) -> Decision[LookupMode] | None: ...

    def prefetch_patience(
        self, req: RequestView, prefetch: PrefetchView, engine: EngineView
    ) -> Decision[float] | None: ...

    def admission(
        self, req: RequestView, load: LoadView, engine: EngineView
    ) -> Decision[Admission] | None: ...

    def store_limit(self, req: RequestView, engine: EngineView) -> Decision[int] | None: ...

    def hold_at_finish(
        self, req: RequestView, stores_in_flight: int, engine: EngineView
    ) -> Decision[bool] | None: ...

    def on_load_failure(
        self, req: RequestView, failed_blocks: int, engine: EngineView
    ) -> Decision[LoadFailureAction] | None: ...


class PolicyError(Exception):
    """A policy could not be loaded, or one of its hooks answered nonsense."""


@attrs.frozen
class Answer:
    policy: str
    value: Any
    reason: str


# Answers for hooks that no policy in the stack implements (the baseline predates them).
FALLBACKS: dict[str, Answer] = {
    "prefetch_patience": Answer("fallback", math.inf, "wait_complete: no policy set a prefetch patience"),
}
# Positional arguments each hook is called with (the request view first, the engine view last).
HOOK_ARITY: dict[str, int] = {
    "on_arrival": 2,
    "lookup_mode": 2,
    "prefetch_patience": 3,
    "admission": 3,
    "store_limit": 2,
    "hold_at_finish": 3,
    "on_load_failure": 3,
}


class PolicyStack:
    """Ask policies top-down; the first ``Decision`` wins."""

    def __init__(self, policies: Sequence[object]) -> None:
        from policies.baseline import Baseline

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
            except Exception as exc:  # a user's hook can raise anything: name it, no traceback
                raise PolicyError(
                    f"policy {name} ({_origin(fn)}): hook {hook} raised {type(exc).__name__}: {exc}"
                ) from exc
            if decision is None:
                continue
            _check_decision(f"{name} ({_origin(fn)})", hook, decision)
            return Answer(name, decision.value, decision.reason)
        fallback = FALLBACKS.get(hook)
        if fallback is not None:
            return fallback
        raise PolicyError(f"no policy in the stack answered {hook}")


def _origin(fn: Callable[..., Any]) -> str:
    """Where a hook's code lives, for errors: module (and file for file-loaded policies)."""
    module_name = getattr(fn, "__module__", None) or "?"
    module = sys.modules.get(module_name)
    path = getattr(module, "__file__", None)
    if module_name.startswith("kvlife_user_policy_") and path:
        return f"module {path}"
    return f"module {module_name}"


def _check_decision(policy: str, hook: str, decision: object) -> None:
    if not isinstance(decision, Decision):
        raise PolicyError(
            f"policy {policy}: hook {hook} returned {type(decision).__name__}, expected Decision or None"
        )
    if not isinstance(decision.reason, str) or not decision.reason:
        raise PolicyError(f"policy {policy}: hook {hook} gave no reason string")
    allowed = HOOK_VALUES[hook]
    if allowed is float:
        value = decision.value
        if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value) or value < 0:
            raise PolicyError(
                f"policy {policy}: hook {hook} returned {value!r}, expected a number of ms >= 0"
            )
        return
    if isinstance(allowed, tuple):
        if decision.value not in allowed:
            raise PolicyError(
                f"policy {policy}: hook {hook} returned {decision.value!r}, expected one of {allowed}"
            )
    elif isinstance(decision.value, bool) is not (allowed is bool) or not isinstance(
        decision.value, allowed
    ):
        raise PolicyError(
            f"policy {policy}: hook {hook} returned {decision.value!r}, expected {allowed.__name__}"
        )


def policy_name(policy: object) -> str:
    name = getattr(policy, "name", None)
    return name if isinstance(name, str) else type(policy).__name__


# ---- loading -----------------------------------------------------------------------
def load_policy(spec: str) -> object:
    """Load a policy by built-in name, ``pkg.mod:Class`` or ``path/to/file.py:Class``.

    This imports and runs the module's code.
    """
    from policies.registry import BUILTIN

    if spec in BUILTIN:
        return BUILTIN[spec]()
    if ":" not in spec:
        known = ", ".join(sorted(BUILTIN))
        raise PolicyError(f"unknown policy {spec!r} (built-ins: {known}; or pkg.mod:Class, file.py:Class)")
    module_part, _, class_name = spec.rpartition(":")
    module = _import_policy_module(spec, module_part)
    cls = getattr(module, class_name, None)
    if cls is None:
        raise PolicyError(f"policy {spec!r}: module {module_part!r} has no attribute {class_name!r}")
    try:
        policy = cls()
    except Exception as exc:  # a user's constructor can raise anything
        raise PolicyError(f"policy {spec!r}: constructing {class_name} failed: {exc}") from exc
    if not any(callable(getattr(policy, hook, None)) for hook in HOOKS):
        near = _misspelled_hooks(policy)
        hint = f" (did you mean {near}?)" if near else ""
        raise PolicyError(
            f"policy {spec!r}: {class_name} implements none of the hooks {', '.join(HOOKS)}{hint}"
        )
    check_hooks(spec, policy)
    return policy


def _misspelled_hooks(policy: object) -> str:
    pairs = []
    for attr in sorted(dir(policy)):
        if attr.startswith("_") or attr in HOOKS or not callable(getattr(policy, attr, None)):
            continue
        match = difflib.get_close_matches(attr, HOOKS, n=1, cutoff=0.8)
        if match:
            pairs.append(f"{match[0]!r} for {attr!r}")
    return ", ".join(pairs)


def check_hooks(spec: str, policy: object) -> None:
    """Reject, at load time, hooks that could never be called: not callable, a name one
    typo away from a hook, or a signature that cannot take the hook's arguments."""
    near = _misspelled_hooks(policy)
    if near:
        raise PolicyError(f"policy {spec!r}: not a hook, did you mean {near}?")
    for hook in HOOKS:
        fn = getattr(policy, hook, None)
        if fn is None:
            continue
        if not callable(fn):
            raise PolicyError(f"policy {spec!r}: hook {hook} is not callable")
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):
            continue  # builtins and C callables: checked when called
        try:
            signature.bind(*([None] * HOOK_ARITY[hook]))
        except TypeError:
            raise PolicyError(
                f"policy {spec!r}: hook {hook}{signature} cannot take the {HOOK_ARITY[hook]} "
                f"arguments it is called with (see policies.base.Policy)"
            ) from None


def _import_policy_module(spec: str, module_part: str) -> Any:
    try:
        if module_part.endswith(".py"):
            path = Path(module_part)
            if not path.is_file():
                raise PolicyError(f"policy {spec!r}: file {module_part!r} not found")
            name = f"kvlife_user_policy_{path.stem}"
            loader_spec = importlib.util.spec_from_file_location(name, path)
            if loader_spec is None or loader_spec.loader is None:
                raise PolicyError(f"policy {spec!r}: cannot load {module_part!r}")
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[name] = module
            loader_spec.loader.exec_module(module)
            return module
        return importlib.import_module(module_part)
    except PolicyError:
        raise
    except Exception as exc:  # import errors of user code: report, never traceback
        raise PolicyError(f"policy {spec!r}: importing {module_part!r} failed: {type(exc).__name__}: {exc}") from exc


def load_stack(specs: Sequence[str]) -> PolicyStack:
    return PolicyStack([load_policy(s) for s in specs])
