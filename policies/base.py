"""The policy protocol: decision points, read-only views, decisions with reasons, stacks.

A policy is a plain class with any subset of the hooks below. Hooks are pure: they read
the views they are given and return a ``Decision`` (a value plus a short human reason
that lands in the trace) or ``None`` to pass the decision down the stack. The engine
asks the stack top-down: the first policy that answers wins, and the baseline at the
bottom answers everything. The engine enforces safety whatever the answer is: a policy
chooses among legal options, it cannot free a block under a transfer.

Loading a policy module runs its code (it is imported like any Python module): load
only policy files you trust.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Generic, Literal, Protocol, TypeVar

import attrs

T = TypeVar("T")

LookupMode = Literal["sync", "async"]
ArrivalAction = Literal["none", "lookup"]
Admission = Literal["go", "defer", "join"]
LoadFailureAction = Literal["recompute", "fail"]

HOOKS: tuple[str, ...] = (
    "on_arrival",
    "lookup_mode",
    "admission",
    "store_limit",
    "hold_at_finish",
    "on_load_failure",
)
HOOK_VALUES: dict[str, tuple[Any, ...] | type] = {
    "on_arrival": ("none", "lookup"),
    "lookup_mode": ("sync", "async"),
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
            decision = fn(*args)
            if decision is None:
                continue
            _check_decision(name, hook, decision)
            return Answer(name, decision.value, decision.reason)
        raise PolicyError(f"no policy in the stack answered {hook}")


def _check_decision(policy: str, hook: str, decision: object) -> None:
    if not isinstance(decision, Decision):
        raise PolicyError(
            f"policy {policy}: hook {hook} returned {type(decision).__name__}, expected Decision or None"
        )
    if not isinstance(decision.reason, str) or not decision.reason:
        raise PolicyError(f"policy {policy}: hook {hook} gave no reason string")
    allowed = HOOK_VALUES[hook]
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
        raise PolicyError(
            f"policy {spec!r}: {class_name} implements none of the hooks {', '.join(HOOKS)}"
        )
    return policy


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
