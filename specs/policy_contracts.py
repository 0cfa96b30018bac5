"""What each built-in policy promises (docs/policies.md), checked over many views.

The engine's invariants hold whichever legal answer a policy gives, so the model checker
alone cannot tell a built-in policy that stopped doing what its name says (a baseline that
no longer holds a finished request while its stores run, a prefetch timeout that shrinks
as the pull grows). ``kvlife check`` therefore first asks every built-in policy of the
stack its hooks over a fixed, seeded set of request, load, prefetch and engine views and
compares each answer with the property the documentation states. Every policy of the
stack, built-in or not, must also take each hook's documented arguments.

Properties, not a second implementation: each states what the policy's documentation
says in words (a mode, a bound, a monotone growth), never re-derives its reason text.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator
from typing import Any

import attrs

from kvlife.policies.base import (
    HOOK_VALUES,
    Decision,
    EngineView,
    LoadView,
    PolicyError,
    PrefetchView,
    RequestView,
)

SAMPLES = 200  # views per policy (deterministic: seeded)
BLOCK_TOKENS = 16


@attrs.frozen
class Views:
    req: RequestView
    load: LoadView
    prefetch: PrefetchView
    engine: EngineView
    stores_in_flight: int
    failed_blocks: int


def views(seed: int = 0, count: int = SAMPLES) -> Iterator[Views]:
    rng = random.Random(seed)
    for i in range(count):
        prompt = rng.randint(1, 4000)
        generated = rng.randint(0, 300)
        computed = rng.randint(0, prompt + generated)
        confirmed = rng.randint(0, computed)
        full = prompt // BLOCK_TOKENS
        hashes = tuple(range(1000 * i, 1000 * i + rng.randint(0, full)))
        req = RequestView(f"r{i}", "waiting", float(i), prompt, generated, computed, confirmed,
                          computed - confirmed, BLOCK_TOKENS, hashes, rng.randint(0, len(hashes)),
                          rng.random() < 0.2, rng.randint(0, 3))
        hits = rng.randint(0, len(hashes))
        device = rng.randint(0, hits)
        tiers = tuple(rng.choice(("host", "disk", "remote")) for _ in range(hits - device))
        in_flight = tuple((h, f"o{h}") for h in hashes[device:hits] if rng.random() < 0.3)
        load = LoadView(device, hits - device, tiers, in_flight)
        pulled = rng.randint(0, 300)
        # Any token count (a policy's answer is a function of it, whatever the block size).
        tokens = max(0, pulled * BLOCK_TOKENS - rng.randint(0, BLOCK_TOKENS - 1))
        prefetch = PrefetchView(pulled, tokens, tuple("disk" for _ in range(pulled)), float(i))
        engine = EngineView(float(i), rng.randint(0, 64), rng.randint(0, 64), rng.randint(0, 8),
                            rng.randint(0, 400), 400)
        yield Views(req, load, prefetch, engine, rng.randint(0, 4), rng.randint(1, 8))


def hook_args(v: Views) -> dict[str, tuple[Any, ...]]:
    """Each hook's arguments (``kvlife.policies.base.Policy``) taken from ``v``."""
    return {"on_arrival": (v.req, v.engine), "lookup_mode": (v.req, v.engine), "lookup_reuse": (v.req, v.engine),
            "prefetch_patience": (v.req, v.prefetch, v.engine), "admission": (v.req, v.load, v.engine),
            "store_limit": (v.req, v.engine), "hold_at_finish": (v.req, v.stores_in_flight, v.engine),
            "on_load_failure": (v.req, v.failed_blocks, v.engine)}


def _value(policy: Any, hook: str, *args: Any) -> Any:
    decision = getattr(policy, hook)(*args)
    return None if decision is None else decision.value


def _arrival(action: str) -> Callable[[Any, Views], str | None]:
    def check(policy: Any, v: Views) -> str | None:
        got = _value(policy, "on_arrival", v.req, v.engine)
        want = "none" if v.req.resumable or not v.req.block_hashes else action
        return None if got == want else f"on_arrival answered {got!r} for {_describe(v.req)}, documented {want!r}"
    return check


def _describe(req: RequestView) -> str:
    return (f"a request with {len(req.block_hashes)} full prompt blocks"
            f"{' (resumable)' if req.resumable else ''}")


def _constant(hook: str, want: Any) -> Callable[[Any, Views], str | None]:
    def check(policy: Any, v: Views) -> str | None:
        got = _value(policy, hook, *hook_args(v)[hook])
        return None if got == want else f"{hook} answered {got!r}, documented {want!r}"
    return check


def _baseline(policy: Any, v: Views) -> str | None:
    for check in (_constant("on_arrival", "none"), _constant("lookup_mode", "sync"),
                  _constant("lookup_reuse", "consume"), _constant("on_load_failure", "recompute")):
        if (problem := check(policy, v)) is not None:
            return problem
    if (got := _value(policy, "admission", v.req, v.load, v.engine)) != "go":
        return f"admission answered {got!r}, documented 'go' (no sharing, no deferral)"
    if (got := _value(policy, "store_limit", v.req, v.engine)) != v.req.confirmed_tokens:
        return f"store_limit answered {got!r} for {v.req.confirmed_tokens} confirmed tokens: it stores those"
    if v.stores_in_flight and _value(policy, "hold_at_finish", v.req, v.stores_in_flight, v.engine) is not True:
        return f"hold_at_finish does not hold a request with {v.stores_in_flight} stores in flight (vLLM holds)"
    return None


def _admission(choice: str) -> Callable[[Any, Views], str | None]:
    def check(policy: Any, v: Views) -> str | None:
        got = _value(policy, "admission", v.req, v.load, v.engine)
        want = choice if v.load.in_flight else None
        return None if got == want else (f"admission answered {got!r} with {len(v.load.in_flight)} hit blocks in "
                                         f"flight, documented {want!r}")
    return check


def _store_limit(rule: Callable[[RequestView], int], what: str) -> Callable[[Any, Views], str | None]:
    def check(policy: Any, v: Views) -> str | None:
        got = _value(policy, "store_limit", v.req, v.engine)
        return None if got == rule(v.req) else f"store_limit answered {got!r}, documented {what} ({rule(v.req)})"
    return check


def _patience(rule: Callable[[PrefetchView], float], what: str) -> Callable[[Any, Views], str | None]:
    def check(policy: Any, v: Views) -> str | None:
        got = _value(policy, "prefetch_patience", v.req, v.prefetch, v.engine)
        want = rule(v.prefetch)
        ok = isinstance(got, (int, float)) and (got == want or math.isclose(got, want, rel_tol=1e-9))
        return None if ok else f"prefetch_patience answered {got!r} for {v.prefetch.tokens} tokens, documented {what}"
    return check


# What ``kvlife policies`` documents for the built-in prefetch-timeout: SGLang HiCache's
# prefetch_timeout_base (1 s) and prefetch_timeout_per_ki_token (0.25 s), capped at 3 s.
TIMEOUT_DEFAULTS = (1000.0, 250.0, 3000.0)


def _timeout(policy: Any, v: Views) -> str | None:
    """prefetch-timeout: base + per_1k_tokens x (tokens / 1000), capped (SGLang HiCache)."""
    base, per_1k, cap = policy.base_ms, policy.per_1k_tokens_ms, policy.cap_ms
    if (base, per_1k, cap) != TIMEOUT_DEFAULTS:
        return (f"the built-in waits {base:g} ms + {per_1k:g} ms per 1k tokens, capped at {cap:g} ms; it documents "
                f"1 s + 0.25 s per 1k tokens, capped at 3 s")
    return _patience(lambda p: min(base + per_1k * p.tokens / 1000.0, cap),
                     f"min({base:g} + {per_1k:g} x tokens / 1000, {cap:g})")(policy, v)


CONTRACTS: dict[str, Callable[[Any, Views], str | None]] = {
    "baseline": _baseline,
    "sync-lookup": _constant("lookup_mode", "sync"),
    "async-lookup": _constant("lookup_mode", "async"),
    "keep-lookup-answers": _constant("lookup_reuse", "keep"),
    "early-lookup": _arrival("lookup"),
    "early-prefetch": _arrival("prefetch"),
    "shared-loads": _admission("join"),
    "defer-while-loading": _admission("defer"),
    "naive-stores-unsafe": _store_limit(lambda r: r.computed_tokens, "every computed token"),
    "prefetch-best-effort": _patience(lambda p: 0.0, "0 (never wait)"),
    "prefetch-wait-complete": _patience(lambda p: math.inf, "inf (wait for the whole pull)"),
    "prefetch-timeout": _timeout,
}


# Answers the stack must refuse, per kind of hook (the engine acts on none of them).
_MALFORMED: dict[str, tuple[Any, ...]] = {
    "float": (math.nan, -1.0, "10", True, None),
    "int": (1.5, "4", True, None),
    "bool": (1, "yes", None),
    "choice": ("maybe", 1, None),
}


def _malformed(hook: str) -> tuple[Any, ...]:
    allowed = HOOK_VALUES[hook]
    if allowed is float:
        return _MALFORMED["float"]
    if allowed is int:
        return _MALFORMED["int"]
    if allowed is bool:
        return _MALFORMED["bool"]
    return _MALFORMED["choice"]


def stack_guard_problems() -> list[str]:
    """The policy stack refuses (``PolicyError``) every malformed answer: a value of the
    wrong type or out of range, no ``Decision``, an empty reason; the engine never acts on
    one, whatever a user's policy returns."""
    from kvlife.policies.stack import PolicyStack

    problems = []
    for hook, args in hook_args(next(views(count=1))).items():
        answers: list[Any] = [Decision(value, "a malformed answer") for value in _malformed(hook)]
        answers += ["not a Decision", Decision(legal_value(hook), "")]
        for answer in answers:
            policy = type("Malformed", (), {"name": "malformed", hook: lambda self, *a, _x=answer: _x})()
            try:
                PolicyStack([policy]).ask(hook, *args)
            except PolicyError:
                continue
            except Exception as exc:  # noqa: BLE001 - any other failure is the finding
                problems.append(f"the policy stack raised {type(exc).__name__} on {hook} answer {answer!r}, "
                                f"not PolicyError")
                continue
            problems.append(f"the policy stack accepted the malformed {hook} answer {answer!r}")
    return problems


def legal_value(hook: str) -> Any:
    """A legal value for ``hook``'s answer (what is malformed or hostile is elsewhere)."""
    allowed = HOOK_VALUES[hook]
    return allowed[0] if isinstance(allowed, tuple) else {float: 1.0, int: 1, bool: True}[allowed]


def contract_problems(stack: Any) -> list[str]:
    """Every built-in policy of ``stack`` against its documented properties; every policy
    against the hooks' arguments; the stack's refusal of malformed answers. Empty when all
    hold."""
    from kvlife.policies.loading import check_hooks
    from kvlife.policies.registry import BUILTIN

    problems: list[str] = stack_guard_problems()
    for policy in getattr(stack, "policies", ()):
        name = str(getattr(policy, "name", type(policy).__name__))
        try:
            check_hooks(name, policy)
        except PolicyError as exc:
            problems.append(str(exc))
            continue
        contract = CONTRACTS.get(name)
        if contract is None or type(policy) is not BUILTIN.get(name):
            continue  # a user's policy (or one sharing a built-in's name): no documented contract
        for v in views():
            problem = contract(policy, v)
            if problem is not None:
                problems.append(f"policy {name}: {problem}")
                break
    return problems
