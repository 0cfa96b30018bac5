"""Mutation testing of the engine and the built-in policies, scored by ``kvlife check``.

    python scripts/mutation.py run [--sample N | --all] [--seed S] [--session PATH]
    python scripts/mutation.py report [--session PATH] [--survivors]
    python scripts/mutation.py rerun [--session PATH]      # survivors again (after a checker change)
    python scripts/mutation.py all-detectors [--session PATH]  # check's survivors against every detector
    python scripts/mutation.py export FILE                  # the sample, for run --sample-file FILE

The tool is Cosmic Ray (``pip install -e .[mutation]``), configured in pyproject.toml under
``[tool.cosmic-ray]``: it mutates ``lifecycle/engine/`` and ``policies/`` in place, one
mutant at a time, and runs ``scripts/mutation_detect.py`` (``kvlife check`` at its default
budget: the default stack, and a mutated policy's own stacks; ``--scope all`` for every
built-in stack). Cosmic Ray reads its own TOML with a top-level
``cosmic-ray`` table, so this script writes that file into the session's folder from
pyproject's ``[tool.cosmic-ray]`` (the one place the configuration lives).

Before the run the session is filtered: operators pyproject excludes (replacements no
real bug looks like), mutations inside type annotations (never evaluated under
``from __future__ import annotations``: equivalent by construction), and, unless
``--all``, every mutant outside a seeded random sample stratified per file (each file gets
its share of the sample, at least one). Survivors listed in ``scripts/mutation-equivalent.txt``
(path, operator and the source line; one line saying why) are reported as equivalent, or
as text-only when the reason starts with "text-only" (the mutant changes a reason string
or a diagnostic field, no decision, state or block: reported apart, and the score is
given both without and with them).

Cosmic Ray changes the checkout's files while it runs: run it in a clean checkout you are
not editing (``git clone`` this repository somewhere and run it there); an interrupted run
is undone with ``git checkout -- lifecycle policies``.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import random
import re
import sqlite3
import subprocess
import sys
import tomllib
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
EQUIVALENT_FILE = ROOT / "scripts" / "mutation-equivalent.txt"
DEFAULT_SESSION = ROOT / ".mutation" / "session.sqlite"


def pyproject_config() -> dict[str, Any]:
    with open(ROOT / "pyproject.toml", "rb") as handle:
        config: dict[str, Any] = tomllib.load(handle)["tool"]["cosmic-ray"]
    return config


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")


def write_cosmic_ray_config(config: dict[str, Any], path: Path) -> None:
    """pyproject's [tool.cosmic-ray] as Cosmic Ray's own file (tables become [cosmic-ray.x])."""
    lines: list[str] = []

    def table(name: str, values: dict[str, Any]) -> None:
        lines.append(f"[{name}]")
        nested = {k: v for k, v in values.items() if isinstance(v, dict)}
        for key, value in values.items():
            if key == "test-command":
                value = value.replace("python ", f"{sys.executable} ", 1) if value.startswith("python ") else value
            if not isinstance(value, dict):
                lines.append(f"{json.dumps(key)} = {_toml_value(value)}")
        for key, value in nested.items():
            table(f"{name}.{json.dumps(key)}", value)

    table("cosmic-ray", config)
    path.write_text("\n".join(lines) + "\n")


def annotation_spans(path: Path) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """(start, end) positions of every annotation in a module (line 1-based, col 0-based)."""
    tree = ast.parse(path.read_text())
    spans = []
    for node in ast.walk(tree):
        targets: list[ast.expr | None] = []
        if isinstance(node, ast.arg | ast.AnnAssign):
            targets.append(node.annotation)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            targets.append(node.returns)
        for target in targets:
            if target is not None and target.end_lineno is not None and target.end_col_offset is not None:
                spans.append(((target.lineno, target.col_offset), (target.end_lineno, target.end_col_offset)))
    return spans


def _inside(pos: tuple[int, int], spans: list[tuple[tuple[int, int], tuple[int, int]]]) -> bool:
    return any(start <= pos < end for start, end in spans)


def _db(session: Path) -> sqlite3.Connection:
    return sqlite3.connect(session)


def mutants(session: Path) -> list[dict[str, Any]]:
    """Every mutant of the session with its result (None while pending)."""
    with _db(session) as db:
        rows = db.execute(
            "SELECT m.job_id, m.module_path, m.operator_name, m.occurrence, m.start_pos_row, m.start_pos_col, "
            "r.worker_outcome, r.test_outcome, r.output, r.diff FROM mutation_specs m "
            "LEFT JOIN work_results r ON r.job_id = m.job_id ORDER BY m.module_path, m.start_pos_row, "
            "m.start_pos_col, m.operator_name").fetchall()
    keys = ("job_id", "path", "operator", "occurrence", "line", "col", "worker", "test", "output", "diff")
    found = [dict(zip(keys, row, strict=True)) for row in rows]
    for m in found:  # SQLAlchemy stores the enums' names (SKIPPED, KILLED, ...)
        m["worker"] = m["worker"] and m["worker"].lower()
        m["test"] = m["test"] and m["test"].lower()
    return found


def skip(session: Path, job_ids: list[str], why: str) -> None:
    with _db(session) as db:
        db.executemany("INSERT OR REPLACE INTO work_results (job_id, worker_outcome, output, test_outcome, diff) "
                       "VALUES (?, 'SKIPPED', ?, NULL, NULL)", [(j, why) for j in job_ids])


def mutant_key(m: dict[str, Any]) -> str:
    """A mutant's identity on given sources, stable across sessions (Cosmic Ray's job ids
    are random): file, operator and occurrence, with the position for the reader."""
    return f"{m['path']} {m['operator']} {m['occurrence']} {m['line']}:{m['col']}"


def remap_sample(old_commit: str, sample_file: Path, session: Path, out: Path) -> int:
    """Map a sample drawn on ``old_commit``'s sources onto today's (a session initialized on
    them lists today's mutants): the same file, operator and column, on a line whose text is
    unchanged, the nearest in occurrence. A mutant whose line was rewritten or removed is
    listed as lost, with its old text."""
    current: dict[tuple[str, str], list[tuple[int, int, int]]] = defaultdict(list)
    for m in mutants(session):
        current[(m["path"], m["operator"])].append((m["occurrence"], m["line"], m["col"]))
    files: dict[tuple[str | None, str], list[str] | None] = {}

    def text(commit: str | None, path: str, row: int) -> str | None:
        if (commit, path) not in files:
            if commit is None:
                source = ROOT / path
                files[(commit, path)] = source.read_text().splitlines() if source.exists() else None
            else:
                shown = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=ROOT, capture_output=True, text=True,
                                       check=False)
                files[(commit, path)] = shown.stdout.splitlines() if shown.returncode == 0 else None
        lines = files[(commit, path)]
        return lines[row - 1] if lines is not None and 0 < row <= len(lines) else None

    mapped, lost = [], []
    for key in (line.strip() for line in sample_file.read_text().splitlines()):
        if not key:
            continue
        path, operator, occurrence, position = key.split()
        row, col = (int(x) for x in position.split(":"))
        was = text(old_commit, path, row)
        found = sorted((abs(o - int(occurrence)), o, r) for o, r, c in current.get((path, operator), ())
                       if c == col and was is not None and text(None, path, r) == was)
        if found:
            _, o, r = found[0]
            mapped.append(f"{path} {operator} {o} {r}:{col}")
        else:
            lost.append(f"{key}  ({(was or '(gone)').strip()[:90]})")
    out.write_text("\n".join(sorted(mapped)) + "\n")
    print(f"{len(mapped)} mutants mapped to {out}; {len(lost)} lost (line rewritten or removed):")
    for line in lost:
        print(f"  {line}")
    return 0


def export_sample(session: Path, out: Path) -> int:
    """Write the session's sample (the mutants it ran), one ``mutant_key`` per line."""
    keys = sorted(mutant_key(m) for m in mutants(session) if m["worker"] != "skipped")
    out.write_text("\n".join(keys) + "\n")
    print(f"{len(keys)} mutants written to {out}")
    return 0


def filter_session(session: Path, config: dict[str, Any], sample: int | None, seed: int,
                   sample_file: Path | None = None) -> None:
    excluded = config.get("filters", {}).get("operators-filter", {}).get("exclude-operators", [])
    pattern = re.compile("|".join(f"(?:{e})" for e in excluded)) if excluded else None
    spans: dict[str, list[tuple[tuple[int, int], tuple[int, int]]]] = {}
    dropped: list[str] = []
    annotated: list[str] = []
    candidates: dict[str, list[str]] = defaultdict(list)
    keys: dict[str, str] = {}
    for m in mutants(session):
        keys[m["job_id"]] = mutant_key(m)
        if pattern is not None and pattern.match(m["operator"]):
            dropped.append(m["job_id"])
            continue
        if m["path"] not in spans:
            spans[m["path"]] = annotation_spans(ROOT / m["path"])
        if _inside((m["line"], m["col"]), spans[m["path"]]):
            annotated.append(m["job_id"])
            continue
        candidates[m["path"]].append(m["job_id"])
    skip(session, dropped, "excluded operator")
    skip(session, annotated, "inside a type annotation (equivalent)")
    total = sum(len(v) for v in candidates.values())
    print(f"{total} mutants after filtering ({len(dropped)} of excluded operators, {len(annotated)} in annotations)")
    if sample_file is not None:
        wanted = {line.strip() for line in sample_file.read_text().splitlines() if line.strip()}
        outside = [j for jobs in candidates.values() for j in jobs if keys[j] not in wanted]
        skip(session, outside, "not in the sample")
        print(f"sample: {total - len(outside)} mutants from {sample_file} ({len(wanted)} listed)")
        return
    if sample is None or sample >= total:
        return
    rng = random.Random(seed)
    unsampled: list[str] = []
    for path in sorted(candidates):
        jobs = sorted(candidates[path], key=keys.__getitem__)  # by identity, not by random job id
        share = max(1, round(sample * len(jobs) / total))
        keep = set(rng.sample(jobs, min(share, len(jobs))))
        unsampled += [j for j in jobs if j not in keep]
    skip(session, unsampled, "not in the sample")
    print(f"sample: {total - len(unsampled)} mutants (seed {seed}, stratified per file)")


def source_line(path: str, line: int) -> str:
    lines = (ROOT / path).read_text().splitlines()
    return lines[line - 1].strip() if 0 < line <= len(lines) else ""


def equivalents() -> dict[tuple[str, str, str], str]:
    """Survivors judged equivalent: ``path | operator | source line | why`` per line."""
    known: dict[tuple[str, str, str], str] = {}
    if not EQUIVALENT_FILE.exists():
        return known
    for raw in EQUIVALENT_FILE.read_text().splitlines():
        if not raw.strip() or raw.startswith("#"):
            continue
        path, operator, line, why = (part.strip() for part in raw.split(" | ", 3))
        known[(path, operator, line)] = why
    return known


def classify(m: dict[str, Any], known: dict[tuple[str, str, str], str]) -> str:
    if m["worker"] is None:
        return "pending"
    if m["worker"] == "skipped":
        return "skipped"
    if m["test"] == "killed":
        return "timeout" if (m["output"] or "").strip() == "timeout" or "time limit" in (m["output"] or "") \
            else "killed"
    if m["test"] == "survived":
        key = (m["path"], m["operator"].removeprefix("core/"), source_line(m["path"], m["line"]))
        if key not in known:
            return "survived"
        return "text-only" if known[key].startswith("text-only") else "equivalent"
    return "incompetent"


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def report(session: Path, show_survivors: bool) -> int:
    known = equivalents()
    per_file: dict[str, Counter[str]] = defaultdict(Counter)
    survivors = []
    for m in mutants(session):
        verdict = classify(m, known)
        per_file[m["path"]][verdict] += 1
        if verdict in ("survived", "text-only", "equivalent") and show_survivors:
            survivors.append((m, verdict))
    columns = ("killed", "timeout", "survived", "text-only", "equivalent", "incompetent", "pending")
    print(f"| file | {' | '.join(columns)} | score |")
    print("|---|" + "---:|" * (len(columns) + 1))
    total: Counter[str] = Counter()
    for path in sorted(per_file):
        counts = per_file[path]
        total.update(counts)
        if sum(counts[c] for c in columns):
            print(f"| {path} | " + " | ".join(str(counts[c]) for c in columns) + f" | {_score(counts)} |")
    print("| **all** | " + " | ".join(f"**{total[c]}**" for c in columns) + f" | **{_score(total)}** |")
    caught, judged = total["killed"] + total["timeout"], total["killed"] + total["timeout"] + total["survived"]
    low, high = wilson(caught, judged)
    print(f"\nkilled (incl. timeouts) / non-equivalent, text-only left out: {caught}/{judged} "
          f"({100 * caught / max(judged, 1):.1f} %; 95 % Wilson interval {100 * low:.1f}-{100 * high:.1f} %)")
    strict = judged + total["text-only"]
    low, high = wilson(caught, strict)
    print(f"killed / non-equivalent, text-only counted as survivors: {caught}/{strict} "
          f"({100 * caught / max(strict, 1):.1f} %; {100 * low:.1f}-{100 * high:.1f} %); "
          f"{total['skipped']} mutants skipped (filtered, out of scope or not sampled)")
    for m, verdict in survivors:
        print(f"\n{verdict}: {m['path']}:{m['line']} {m['operator']} (job {m['job_id'][:8]})")
        print((m["diff"] or "").strip())
    return 0


def _score(counts: Counter[str]) -> str:
    judged = counts["killed"] + counts["timeout"] + counts["survived"]
    return f"{100 * (counts['killed'] + counts['timeout']) / judged:.0f} %" if judged else "-"


def run(session: Path, sample: int | None, seed: int, fresh: bool, scope: str | None = None,
        sample_file: Path | None = None) -> int:
    config = pyproject_config()
    if scope is not None:
        config["test-command"] += f" --scope {scope}"
    session.parent.mkdir(parents=True, exist_ok=True)
    cr_config = session.with_suffix(".toml")
    write_cosmic_ray_config(config, cr_config)
    if fresh or not session.exists():
        session.unlink(missing_ok=True)
        subprocess.run([sys.executable, "-m", "cosmic_ray.cli", "init", str(cr_config), str(session)],
                       cwd=ROOT, check=True)
        filter_session(session, config, sample, seed, sample_file)
    dirty = subprocess.run(["git", "status", "--porcelain", "--", *config["module-path"]], cwd=ROOT,
                           capture_output=True, text=True, check=False).stdout.strip()
    if dirty:
        print(f"refusing to mutate a checkout with local changes under {config['module-path']}:\n{dirty}")
        return 2
    subprocess.run([sys.executable, "-m", "cosmic_ray.cli", "exec", str(cr_config), str(session)], cwd=ROOT,
                   check=True)
    return report(session, show_survivors=True)


def rerun_survivors(session: Path, scope: str | None) -> int:
    known = equivalents()
    again = [m["job_id"] for m in mutants(session) if classify(m, known) == "survived"]
    with _db(session) as db:
        db.executemany("DELETE FROM work_results WHERE job_id = ?", [(j,) for j in again])
    print(f"{len(again)} survivors to run again")
    return run(session, None, 0, fresh=False, scope=scope)


def all_detectors(session: Path) -> int:
    """The score of every detector together: ``kvlife check``'s survivors (not judged
    equivalent or text-only) run again, each in a copy of the sources with its diff
    applied, through ``scripts/mutation_detect.py --all-detectors`` (check, then a
    validated chaos run, then the engine's test files)."""
    import shutil
    import tempfile

    known = equivalents()
    found = mutants(session)
    survivors = [m for m in found if classify(m, known) == "survived"]
    caught = sum(1 for m in found if classify(m, known) in ("killed", "timeout"))
    judged = caught + len(survivors)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    still = []
    for m in survivors:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp) / "repo"
            for folder in ("lifecycle", "policies", "specs", "transfer", "tests", "scripts"):
                shutil.copytree(ROOT / folder, root / folder, ignore=ignore)
            shutil.copytree(ROOT / "kvlife", root / "kvlife", symlinks=True, ignore=ignore)
            shutil.copy(ROOT / "pyproject.toml", root)
            diff = (m["diff"] or "").replace("--- mutation diff ---\n", "").rstrip("\n") + "\n"
            patched = subprocess.run(["patch", "-p1", "--quiet", "--no-backup-if-mismatch"], cwd=root, input=diff,
                                     text=True,
                                     capture_output=True, check=False)
            if patched.returncode != 0:
                print(f"{m['path']}:{m['line']} {m['operator']}: the diff does not apply: {patched.stdout.strip()}")
                still.append(m)
                continue
            env = {**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"}
            done = subprocess.run([sys.executable, "scripts/mutation_detect.py", "--all-detectors"], cwd=root, env=env,
                                  capture_output=True, text=True, check=False, timeout=7200)
            last = [line for line in done.stdout.splitlines() if line.startswith("mutation_detect:")]
            verdict = last[-1] if last else done.stdout.strip()[-200:]
            print(f"{m['path']}:{m['line']} {m['operator']}: {verdict}", flush=True)
            if done.returncode == 0:
                still.append(m)
    killed = judged - len(still)
    low, high = wilson(killed, judged)
    print(f"\nall detectors together: {killed}/{judged} ({100 * killed / max(judged, 1):.1f} %; 95 % Wilson interval "
          f"{100 * low:.1f}-{100 * high:.1f} %); kvlife check alone: {caught}/{judged}; survivors of all: "
          + (", ".join(f"{m['path']}:{m['line']}" for m in still) or "none"))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run_p = sub.add_parser("run", help="create a session, filter and sample it, run every mutant, print the table")
    group = run_p.add_mutually_exclusive_group()
    group.add_argument("--sample", type=int, default=120, help="mutants to sample (stratified per file)")
    group.add_argument("--all", action="store_true", help="run every mutant (hours on a laptop)")
    run_p.add_argument("--seed", type=int, default=11, help="sampling seed")
    run_p.add_argument("--resume", action="store_true", help="continue an interrupted session")
    run_p.add_argument("--sample-file", type=Path, default=None,
                       help="run exactly the mutants listed (one per line, as `export` writes them)")
    rerun_p = sub.add_parser("rerun", help="run the survivors of a session again")
    for p in (run_p, rerun_p):
        p.add_argument("--scope", choices=("owner", "all"), default=None,
                       help="the detector's stacks (default: pyproject's test-command, the default stack and "
                            "a mutated policy's own stacks)")
    for p in (run_p, sub.add_parser("report", help="print the table of a session"), rerun_p):
        p.add_argument("--session", type=Path, default=DEFAULT_SESSION, help="session database")
    sub.choices["report"].add_argument("--survivors", action="store_true", help="print every survivor's diff")
    export_p = sub.add_parser("export", help="write the session's sample, to run it again with --sample-file")
    export_p.add_argument("out", type=Path)
    export_p.add_argument("--session", type=Path, default=DEFAULT_SESSION, help="session database")
    remap_p = sub.add_parser("remap", help="map a sample drawn on older sources onto today's (for --sample-file)")
    remap_p.add_argument("old_commit", help="the commit the sample was drawn on")
    remap_p.add_argument("sample_file", type=Path)
    remap_p.add_argument("out", type=Path)
    remap_p.add_argument("--session", type=Path, default=DEFAULT_SESSION,
                         help="a session initialized on today's sources (its mutants)")
    all_p = sub.add_parser("all-detectors", help="check's survivors against every detector (chaos validate, pytest)")
    all_p.add_argument("--session", type=Path, default=DEFAULT_SESSION, help="session database")
    args = parser.parse_args(argv)
    if args.command == "run":
        return run(args.session, None if args.all else args.sample, args.seed, fresh=not args.resume,
                   scope=args.scope, sample_file=args.sample_file)
    if args.command == "remap":
        return remap_sample(args.old_commit, args.sample_file, args.session, args.out)
    if args.command == "export":
        return export_sample(args.session, args.out)
    if args.command == "rerun":
        return rerun_survivors(args.session, args.scope)
    if args.command == "all-detectors":
        return all_detectors(args.session)
    return report(args.session, args.survivors)


if __name__ == "__main__":
    sys.exit(main())
