"""Loading policies: a built-in name, an installed entry point, ``pkg.mod:Class`` or ``file.py:Class``.

Built-in names resolve from ``kvlife.policies.registry`` and run no code outside kvlife.
An installed package can register policies by name in the ``kvlife.policies`` entry-point
group (``[project.entry-points."kvlife.policies"] my-policy = "mypkg.policy:MyPolicy"``).
Loading any other spec imports and runs the module's code: load only policies you trust.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvlife.policies.base import HOOK_ARITY, HOOKS, PolicyError
from kvlife.policies.registry import BUILTIN, RETIRED
from kvlife.policies.stack import DEFAULT_HOOK_BUDGET_S, PolicyStack, policy_name

ENTRY_POINT_GROUP = "kvlife.policies"
# What running a user's policy code may raise that is reported as a PolicyError (one line,
# exit 2): any Exception, and SystemExit (a stray sys.exit() in a module). KeyboardInterrupt
# stays an interrupt.
USER_CODE_ERRORS: tuple[type[BaseException], ...] = (Exception, SystemExit)

__all__ = ["ENTRY_POINT_GROUP", "PolicyStack", "check_hooks", "check_spec", "entry_point_policies", "is_builtin",
           "load_builtin_stack", "load_policy", "load_stack", "policy_name"]


def entry_point_policies() -> dict[str, str]:
    """Policies that installed packages register by name: name -> ``pkg.mod:Class``."""
    import importlib.metadata  # only when a name is not a built-in: off the run path

    return {ep.name: ep.value for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def _refuse_retired(spec: str) -> None:
    if spec in RETIRED:
        raise PolicyError(f"policy {spec!r} is no longer a policy: {RETIRED[spec]}; drop it from the stack")


def load_policy(spec: str) -> object:
    """Load a policy by built-in or entry-point name, ``pkg.mod:Class`` or ``path/to/file.py:Class``.

    This imports and runs the module's code.
    """
    if spec in BUILTIN:
        return BUILTIN[spec]()
    _refuse_retired(spec)
    if ":" not in spec:
        installed = entry_point_policies()
        if spec in installed:
            return load_policy(installed[spec])
        names = sorted(BUILTIN) + sorted(installed)
        close = difflib.get_close_matches(spec, names, n=1, cutoff=0.8)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        if Path(f"{spec}.py").is_file():
            hint += f"; {spec}.py is a file: name a class in it, {spec}.py:Class"
        raise PolicyError(f"unknown policy {spec!r} (built-ins: {', '.join(names)}; "
                          f"or pkg.mod:Class, file.py:Class){hint}")
    module_part, _, class_name = spec.rpartition(":")
    module = _import_policy_module(spec, module_part)
    try:
        cls = getattr(module, class_name, None)
    except USER_CODE_ERRORS as exc:  # a module __getattr__ is user code too
        raise PolicyError(f"policy {spec!r}: reading {class_name!r} from {module_part!r} failed: "
                          f"{type(exc).__name__}: {exc}") from exc
    if cls is None:
        raise PolicyError(f"policy {spec!r}: module {module_part!r} has no attribute {class_name!r}")
    if not callable(cls):
        raise PolicyError(f"policy {spec!r}: {class_name} is not a class (got {type(cls).__name__})")
    try:
        policy = cls()
    except USER_CODE_ERRORS as exc:  # a user's constructor can raise anything
        raise PolicyError(f"policy {spec!r}: constructing {class_name} failed: {type(exc).__name__}: {exc}") from exc
    try:
        if not any(callable(getattr(policy, hook, None)) for hook in HOOKS):
            near = _misspelled_hooks(policy)
            hint = f" (did you mean {near}?)" if near else ""
            raise PolicyError(
                f"policy {spec!r}: {class_name} implements none of the hooks {', '.join(HOOKS)}{hint}"
            )
        check_hooks(spec, policy)
    except PolicyError:
        raise
    except USER_CODE_ERRORS as exc:  # a property or __getattr__ of the policy raised
        raise PolicyError(f"policy {spec!r}: inspecting {class_name}'s hooks failed: {type(exc).__name__}: {exc}") \
            from exc
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
                f"arguments it is called with (see kvlife.policies.base.Policy)"
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
    except USER_CODE_ERRORS as exc:  # import errors of user code: report, never traceback
        hint = ""
        if isinstance(exc, ModuleNotFoundError) and exc.name == module_part.partition(".")[0]:
            # ``my_policies:Class`` for a file my_policies.py: a module path, not a file path.
            as_file = module_part.replace(".", "/") + ".py"
            found = " (that file exists)" if Path(as_file).is_file() else ""
            hint = (f"; to load a file, name it with its .py: {as_file}:{spec.rpartition(':')[2]}{found}, "
                    "or put its folder on PYTHONPATH")
        raise PolicyError(f"policy {spec!r}: importing {module_part!r} failed: {type(exc).__name__}: {exc}"
                          f"{hint}") from exc


def check_spec(spec: str) -> None:
    """What ``load_policy(spec)`` checks before it imports anything: a built-in or installed
    name (entry-point metadata only), else ``module:Class`` with a class name and, for a
    ``file.py``, a file that exists. A PolicyError otherwise. Imports and runs nothing
    (``kvlife sweep run --dry-run``)."""
    if spec in BUILTIN:
        return
    _refuse_retired(spec)
    if ":" not in spec:
        installed = entry_point_policies()
        if spec not in installed:
            known = ", ".join(sorted(BUILTIN) + sorted(installed))
            raise PolicyError(f"unknown policy {spec!r} (built-ins: {known}; or pkg.mod:Class, file.py:Class)")
        return
    module_part, _, class_name = spec.rpartition(":")
    if not module_part or not class_name.isidentifier():
        raise PolicyError(f"policy {spec!r}: expected pkg.mod:Class or file.py:Class")
    if module_part.endswith(".py") and not Path(module_part).is_file():
        raise PolicyError(f"policy {spec!r}: file {module_part!r} not found")


def load_stack(specs: Sequence[str], budget_s: float = DEFAULT_HOOK_BUDGET_S) -> PolicyStack:
    """The stack of ``specs`` (top first); each hook runs under ``budget_s`` seconds."""
    return PolicyStack([load_policy(s) for s in specs], budget_s)


def is_builtin(spec: object) -> bool:
    """A built-in policy name: loading it runs only kvlife's own code."""
    return isinstance(spec, str) and spec in BUILTIN


def load_builtin_stack(specs: Sequence[str], budget_s: float = DEFAULT_HOOK_BUDGET_S) -> PolicyStack:
    """A stack of built-in names, resolved from the registry only: no entry point is
    looked up and no module imported, whatever ``specs`` holds (a trace header's stack is
    data; see ``kvlife.lifecycle.traces.header``). Anything else is a PolicyError."""
    for spec in specs:
        if not is_builtin(spec):
            raise PolicyError(f"policy {spec!r} is not a built-in (built-ins: {', '.join(sorted(BUILTIN))})")
    return PolicyStack([BUILTIN[s]() for s in specs], budget_s)
