"""The mutation detector: ``kvlife check`` at its default budget, stopping at the first finding.

Cosmic Ray (``python scripts/mutation.py``) applies one mutant to the sources in place and
runs this script: exit 0 means every stack passed (the mutant survived), any other exit
means ``kvlife check`` caught it (1: a counterexample; 2: the CLI refused to start, e.g.
a mutant that breaks a policy's loading; 3: a stack ran past its time limit, a hang).
It stops at the first stack that finds something.

Which stacks: ``--scope owner`` (what pyproject's test-command uses) runs ``kvlife check``
with the default stack, and for a mutant inside a policy's module the built-in stacks
that use that policy, so a policy's code is run at all; ``--scope all`` runs every
built-in stack (survivors of the first are run again this way: ``scripts/mutation.py
rerun --scope all``). Counterexamples are not shrunk (``--no-shrink``): shrinking only
shortens them and the verdict is the same.

Each stack is run through the CLI's own entry point (``kvlife check --stack NAME``) in this
one process, so the engine is imported once, mutated; ``naive-stores-unsafe`` is left out
(it is unsafe on purpose and fails on the unmodified engine).

Usage: ``python scripts/mutation_detect.py [--stacks a,b ...] [--examples N --steps N]
[--per-stack-timeout S] [--engine FILE.py:Class]``; with no budget flags the CLI's defaults
apply (that is what the mutation score measures). ``--engine`` checks another engine class
built on the mutated parts (a subclass in a file of your own, ``FILE.py:Class``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

ROOT = Path(__file__).resolve().parent.parent

# A stack that is unsafe by design; the detector would report every mutant "killed".
UNSAFE = {"naive-stores-unsafe"}
# Policy module -> the built-in stacks that run its code (tried first for a mutant there).
POLICY_STACKS = {
    "policies/async_lookup.py": ("async-lookup",),
    "policies/keep_lookup_answers.py": ("keep-lookup-answers",),
    "policies/early_prefetch.py": ("early-prefetch", "early-lookup"),
    "policies/shared_loads.py": ("shared-loads",),
    "policies/defer_while_loading.py": ("defer-while-loading",),
    "policies/prefetch_patience.py": ("prefetch-timeout", "prefetch-best-effort", "prefetch-wait-complete"),
    "policies/sync_lookup.py": ("sync-lookup",),
}


def builtin_stacks() -> list[str]:
    sys.path.insert(0, str(ROOT))
    from kvlife.policies.registry import BUILTIN

    return [name for name in BUILTIN if name not in UNSAFE]


def mutated_files() -> list[str]:
    """The sources the mutant changed (git's view of the checkout), to try their stacks first."""
    try:
        out = subprocess.run(["git", "diff", "--name-only", "--", "lifecycle", "policies"], cwd=ROOT,
                             capture_output=True, text=True, timeout=20, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def ordered(stacks: list[str], changed: list[str], scope: str) -> list[str]:
    """The default stack, then the stacks that use a changed policy, then (scope all) the rest."""
    owners = [s for path in changed for s in POLICY_STACKS.get(path, ()) if s in stacks]
    return list(dict.fromkeys(["baseline", *owners, *(stacks if scope == "all" else [])]))


def _timed_out(signum: int, frame: FrameType | None) -> None:
    print("mutation_detect: stack ran past its time limit (a hang counts as caught)", flush=True)
    os._exit(3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--stacks", default=None,
                        help="semicolon-separated stacks to check (default: every built-in but the unsafe one)")
    parser.add_argument("--scope", choices=("owner", "all"), default="owner",
                        help="owner: the default stack plus the stacks of a mutated policy; all: every built-in")
    parser.add_argument("--examples", type=int, default=None, help="checker examples (default: the CLI's)")
    parser.add_argument("--steps", type=int, default=None, help="checker steps (default: the CLI's)")
    parser.add_argument("--per-stack-timeout", type=float, default=180.0, help="seconds before a stack is a hang")
    parser.add_argument("--engine", default=None, metavar="FILE.py:Class",
                        help="check this engine class (a subclass of the mutated engine) instead of Engine")
    parser.add_argument("--all-detectors", action="store_true",
                        help="after kvlife check, also a chaos run validated (kvlife run --chaos, then kvlife "
                             "validate) and the engine's pytest files (PYTEST_FILES)")
    args = parser.parse_args(argv)

    sys.path.insert(0, str(ROOT))  # this checkout's kvlife (the one being mutated)
    from kvlife.lifecycle.cli.main import main as kvlife

    if args.engine:
        use_engine(args.engine)

    stacks = args.stacks.split(";") if args.stacks else ordered(builtin_stacks(), mutated_files(), args.scope)
    budget = ([] if args.examples is None else ["--examples", str(args.examples)]) + (
        [] if args.steps is None else ["--steps", str(args.steps)])
    signal.signal(signal.SIGALRM, _timed_out)
    for stack in stacks:
        started = time.perf_counter()
        out = io.StringIO()
        signal.alarm(max(1, int(args.per_stack_timeout)))
        try:
            with contextlib.redirect_stdout(out):
                code = kvlife(["check", "--stack", stack, "--no-shrink", *budget])
        except SystemExit as exc:  # argparse refusing the stack: the CLI failed to run it
            code = exc.code if isinstance(exc.code, int) else 2
        finally:
            signal.alarm(0)
        wall = time.perf_counter() - started
        if code != 0:
            print(f"mutation_detect: caught by --stack {stack} (exit {code}, {wall:.1f} s)")
            print("\n".join(out.getvalue().splitlines()[:6]))
            return code if code in (1, 2) else 1
        print(f"mutation_detect: --stack {stack} passed ({wall:.1f} s)", flush=True)
    if args.all_detectors:
        return other_detectors()
    return 0


def use_engine(spec: str) -> None:
    """``kvlife check`` builds ``kvlife.lifecycle.engine.core.Engine``: make it ``spec``'s class."""
    import importlib.util

    import kvlife.lifecycle.engine.core as core

    path, _, name = spec.rpartition(":")
    sys.path.insert(0, str(Path(path).resolve().parent))  # (its own imports: tests/bug_zoo.py's siblings)
    loaded = importlib.util.spec_from_file_location(Path(path).stem, path)
    assert loaded is not None and loaded.loader is not None, f"cannot load {path}"
    module = importlib.util.module_from_spec(loaded)
    sys.modules[Path(path).stem] = module
    loaded.loader.exec_module(module)
    core.Engine = getattr(module, name)  # type: ignore[misc]


# The test files that drive the engine and the policies (the whole suite takes 15-20 min a
# mutant here; these take about 75 s of CPU and include the golden traces, byte for byte).
PYTEST_FILES = ("test_golden_traces.py", "test_scheduler.py", "test_policies.py", "test_policy_effects.py",
                "test_vllm_semantics.py", "test_simulator.py", "test_ranks.py", "test_failures.py",
                "test_liveness.py", "test_memory.py")


def other_detectors() -> int:
    """``validate`` on a chaos run (the run's own online check included), then pytest."""
    import tempfile

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with tempfile.TemporaryDirectory() as tmp:
        trace = str(Path(tmp) / "chaos.jsonl")
        for argv, what in (
            (["run", "--workload", "synthetic:burst", "--stack", "async-lookup,shared-loads", "--chaos", "3",
              "--transfer-deadline", "50", "--trace", trace], "a chaos run"),
            (["validate", trace], "validate on the chaos run"),
        ):
            done = subprocess.run([sys.executable, "-m", "kvlife", *argv], cwd=ROOT, env=env, capture_output=True,
                                  text=True, timeout=600, check=False)
            if done.returncode != 0:
                print(f"mutation_detect: caught by {what} (exit {done.returncode})")
                print("\n".join((done.stdout + done.stderr).splitlines()[-6:]))
                return 1
            print(f"mutation_detect: {what} passed", flush=True)
    done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                           *(f"tests/{name}" for name in PYTEST_FILES)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=3600, check=False)
    if done.returncode != 0:
        print(f"mutation_detect: caught by pytest (exit {done.returncode})")
        print("\n".join(done.stdout.splitlines()[-8:]))
        return 1
    print("mutation_detect: pytest passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
