"""Mutation testing of the native core, scored by its differential tests.

    python scripts/native_mutation.py [--sample N] [--seed S] [--list] [--tests PATTERN]

Every binary operator written with a space on each side in ``lifecycle/native/src/*.cpp``
and ``*.hpp`` (the bindings and ``module.cpp`` excepted: they hold no logic; but the policy
asker, ``bind_policy_asker.hpp``, which mirrors ``PolicyStack.ask``) is a mutation
point: comparisons flip to their neighbour or negation (``<`` to ``<=``, ``==`` to ``!=``),
arithmetic to its inverse (``+`` to ``-``, ``*`` to ``/``), logic to its dual (``&&`` to
``||``); and every ``std::max`` becomes ``std::min`` and back. Template brackets and
stream operators are never spaced that way, so they are never touched. Comments and string literals are skipped.

Each mutant is built in a scratch clone of this repository: the object files are compiled
once, and a mutant recompiles only its own file (at -O1) before the link, so a mutant costs
seconds. The differential tests (``tests/test_native_*.py``, run there with ``python -m
pytest`` so the clone's build is the one imported) must fail: then the mutant is killed.
A mutant that does not compile is not counted. The report lists every survivor with its
place, for a reader to judge (an equivalent mutant, or a missing test).

Run it from the repository root in the development venv (pybind11 installed).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parents[1]
SRC = Path("lifecycle/native/src")
SWAPS = {
    "<": ["<=", ">="], "<=": ["<", ">"], ">": [">=", "<="], ">=": [">", "<"],
    "==": ["!="], "!=": ["=="], "&&": ["||"], "||": ["&&"],
    "+": ["-"], "-": ["+"], "*": ["/"], "/": ["*"],
    "+=": ["-="], "-=": ["+="],
    "std::max": ["std::min"], "std::min": ["std::max"],
}
# Longest first, so "<=" is not read as "<".
_OPERATOR = re.compile(r"(?<= )(<=|>=|==|!=|&&|\|\||\+=|-=|<|>|\+|-|\*|/)(?= )|std::max(?=\()|std::min(?=\()")
_SKIP = re.compile(r"//.*$|\"(?:\\.|[^\"\\])*\"|'(?:\\.|[^'\\])*'")


@attrs.frozen
class Mutant:
    path: Path  # relative to the repository root
    line: int  # 1-based
    column: int  # 0-based, of the operator
    old: str
    new: str

    def where(self) -> str:
        return f"{self.path}:{self.line}:{self.column + 1} {self.old} -> {self.new}"


# The binding files convert and hold no logic, but one: the policy asker mirrors
# PolicyStack.ask (which answers it takes itself, what it raises), so it is mutated too.
BINDINGS_WITH_LOGIC = {"bind_policy_asker.hpp"}


def sources() -> list[Path]:
    return sorted(p.relative_to(ROOT) for p in (ROOT / SRC).glob("*.[ch]pp")
                  if (not p.name.startswith("bind_") or p.name in BINDINGS_WITH_LOGIC) and p.name != "module.cpp")


def mutants() -> list[Mutant]:
    out = []
    for path in sources():
        in_block_comment = False
        for number, text in enumerate((ROOT / path).read_text().splitlines(), start=1):
            stripped = text.strip()
            if in_block_comment:
                in_block_comment = "*/" not in stripped
                continue
            if stripped.startswith("/*"):
                in_block_comment = "*/" not in stripped
                continue
            if stripped.startswith("#"):
                continue  # preprocessor: #include <...>
            code = _SKIP.sub(lambda m: " " * len(m.group()), text)
            for match in _OPERATOR.finditer(code):
                for new in SWAPS[match.group()]:
                    out.append(Mutant(path, number, match.start(), match.group(), new))
    return out


def _compile_flags() -> list[str]:
    import pybind11

    return ["-std=c++17", "-fPIC", "-fvisibility=hidden", "-ffp-contract=off", "-fno-fast-math", "-O1",
            f"-I{pybind11.get_include()}", f"-I{sysconfig.get_paths()['include']}", f"-I{SRC}"]


class Builder:
    """A scratch clone whose core is rebuilt one changed file at a time."""

    def __init__(self, scratch: Path, timeout_s: float = 300.0) -> None:
        self.clone = scratch / "clone"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(self.clone)], check=True)
        for path in (ROOT / SRC).glob("*.[ch]pp"):  # the working tree as it is, committed or not
            shutil.copy(path, self.clone / SRC / path.name)
        for test in (ROOT / "tests").glob("test_native_*.py"):
            shutil.copy(test, self.clone / "tests" / test.name)
        self.timeout_s = timeout_s
        self.last_failure = ""
        self.objects = scratch / "objects"
        self.objects.mkdir()
        self.flags = _compile_flags()
        self.units = sorted(p.relative_to(self.clone) for p in (self.clone / SRC).glob("*.cpp"))
        for unit in self.units:
            self._compile(unit)
        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        self.target = self.clone / "lifecycle" / "native" / f"_core{suffix}"

    def _object(self, unit: Path) -> Path:
        return self.objects / f"{unit.stem}.o"

    def _compile(self, unit: Path) -> bool:
        proc = subprocess.run(["g++", *self.flags, "-c", str(unit), "-o", str(self._object(unit))],
                              cwd=self.clone, capture_output=True, text=True)
        return proc.returncode == 0

    def _includers(self, changed: set[str]) -> list[Path]:
        """The units that include any of ``changed`` (file names), directly or through headers."""
        names = set(changed)
        grew = True
        while grew:
            grew = False
            for header in (self.clone / SRC).glob("*.hpp"):
                if header.name not in names and any(f'#include "{n}"' in header.read_text() for n in names):
                    names.add(header.name)
                    grew = True
        return [u for u in self.units
                if u.name in names or any(f'#include "{n}"' in (self.clone / u).read_text() for n in names)]

    def build(self, changed: list[Path]) -> bool:
        """Recompile ``changed`` and every unit that includes it; link. False if it does not compile."""
        units = self._includers({p.name for p in changed})
        if not all(self._compile(unit) for unit in units):
            return False
        link = subprocess.run(["g++", "-shared", *[str(self._object(u)) for u in self.units], "-o", str(self.target)],
                              cwd=self.clone, capture_output=True, text=True)
        return link.returncode == 0

    def tests_pass(self, pattern: str) -> bool:
        tests = sorted(str(p.relative_to(self.clone)) for p in (self.clone / "tests").glob(pattern))
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
        try:
            proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:randomly", "-o", "addopts=",
                                   *tests], cwd=self.clone, capture_output=True, text=True, env=env,
                                  timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            self.last_failure = f"the tests ran past {self.timeout_s} s"
            return False  # a mutant that hangs the tests is caught
        self.last_failure = "\n".join(proc.stdout.splitlines()[-15:])
        return proc.returncode == 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sample", type=int, default=None, help="score a random sample of N mutants (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="the sample's seed (default: 0)")
    parser.add_argument("--list", action="store_true", help="list the mutants and stop")
    parser.add_argument("--tests", default="test_native_*.py", help="the tests that must kill (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds the tests may run on one mutant; past it, it counts as killed (default: 300)")
    parser.add_argument("--only", default="*", help="mutate only the sources whose file name matches (default: all)")
    args = parser.parse_args()
    # A job started in the background (``&``) starts with SIGINT ignored, and the tests' processes
    # would inherit that: the tests that send SIGINT would see nothing. Handled here, it is the
    # default again in each child.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    every = [m for m in mutants() if m.path.match(args.only)]
    chosen = every if args.sample is None else sorted(
        random.Random(args.seed).sample(every, min(args.sample, len(every))), key=lambda m: (str(m.path), m.line))
    if args.list:
        for mutant in chosen:
            print(mutant.where())
        print(f"{len(chosen)} of {len(every)} mutants")
        return 0
    with tempfile.TemporaryDirectory(prefix="kvlife-native-mutation-") as scratch:
        builder = Builder(Path(scratch), args.timeout)
        started = time.monotonic()
        if not builder.build([]) or not builder.tests_pass(args.tests):
            print(f"the unmutated core does not build or pass its tests:\n{builder.last_failure}", file=sys.stderr)
            return 1
        # A mutant's tests may take three times the unmutated run's (a loaded machine is not a hang).
        builder.timeout_s = max(builder.timeout_s, 3 * (time.monotonic() - started))
        killed, survived, broken = [], [], []
        for i, mutant in enumerate(chosen, start=1):
            path = builder.clone / mutant.path
            original = path.read_text()
            lines = original.splitlines(keepends=True)
            text = lines[mutant.line - 1]
            lines[mutant.line - 1] = text[:mutant.column] + mutant.new + text[mutant.column + len(mutant.old):]
            path.write_text("".join(lines))
            try:
                if not builder.build([mutant.path]):
                    broken.append(mutant)
                    verdict = "does not compile"
                elif builder.tests_pass(args.tests):
                    survived.append(mutant)
                    verdict = "SURVIVED"
                else:
                    killed.append(mutant)
                    verdict = "killed"
            finally:
                path.write_text(original)
            print(f"[{i}/{len(chosen)}] {verdict}: {mutant.where()}", flush=True)
    scored = len(killed) + len(survived)
    score = 100.0 * len(killed) / scored if scored else 0.0
    print(f"native core: {len(killed)} killed, {len(survived)} survived, {len(broken)} did not compile; "
          f"score {score:.1f} % of {scored} ({len(every)} mutants in all)")
    for mutant in survived:
        print(f"  survivor: {mutant.where()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
