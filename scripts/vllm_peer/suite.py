"""vLLM's own tests as kvlife's peer suite: each set runs twice, as shipped and with kvlife in
the connector's place, and the two runs must end the same, test by test.

- ``core``: the tests of ``tests/v1/core`` during which vLLM's connector factory builds a KV
  connector (``core-tests.txt``), with ``KVLifeConnector`` built in its place;
- ``unit``: the tests of ``tests/v1/kv_connector/unit`` during which the factory builds a
  connector (``unit-tests.txt``), with each connector wrapped in ``RecordingConnector``.

A test's outcome is passed, failed, skipped, error, xfailed or xpassed (``plugin.py``).
``exclusions.toml`` lists the tests whose outcomes are not compared, each with its reason. It
prints the counts per set and run, the differences, and exits 1 on a difference that is not
listed, on a baseline failure that is not listed as environmental, or when a peer run built
no kvlife connector at all.

    python scripts/vllm_peer/suite.py [--sets core,unit] [--cache DIR] [--out DIR] [--json]
    python scripts/vllm_peer/suite.py discover SET     # rewrite SET's test list (runs the whole folder)

Run it in the vLLM virtualenv (``scripts/vllm-peer-suite.sh`` does).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import tomllib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))  # scripts/, as the pytest runs have it (-p vllm_peer.plugin)

from vllm_peer.sdist import DEFAULT_CACHE, fetch_tests  # noqa: E402


@dataclass(frozen=True)
class PeerSet:
    name: str
    folder: str  # inside the sdist's tree
    mode: str  # the plugin's peer mode
    title: str

    @property
    def selection(self) -> Path:
        return HERE / f"{self.name}-tests.txt"


SETS = {
    "core": PeerSet("core", "tests/v1/core", "kvlife", "(a) tests/v1/core, KVLifeConnector in place of the connector"),
    "unit": PeerSet("unit", "tests/v1/kv_connector/unit", "record",
                    "(b) tests/v1/kv_connector/unit, every connector inside RecordingConnector"),
}
OUTCOMES = ("passed", "failed", "skipped", "error", "xfailed", "xpassed")
# Per-test limit: a test that hangs fails instead of stopping the suite.
TEST_TIMEOUT_S = 120


def run_pytest(tests_root: Path, args: list[str], mode: str, out: Path) -> dict[str, Any]:
    """One pytest process over ``args`` in the sdist's tree; its outcomes (``plugin.py``)."""
    outcomes = out / f"{mode}.json"
    traces = out / f"{mode}-traces"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "pytest", *args, "-q", f"--rootdir={tests_root}", "-p", "no:cacheprovider",
               "-p", "no:warnings",
               "-o", f"timeout={TEST_TIMEOUT_S}", "--continue-on-collection-errors", "-p", "vllm_peer.plugin",
               f"--peer-mode={mode}", f"--peer-outcomes={outcomes}", f"--peer-traces={traces}"]
    with (out / f"{mode}.log").open("w") as log:
        subprocess.run(command, cwd=tests_root, env=env, stdout=log, stderr=subprocess.STDOUT, check=False)
    if not outcomes.exists():
        raise SystemExit(f"vllm-peer: pytest wrote no outcomes in {mode} mode; see {out / f'{mode}.log'}")
    data: dict[str, Any] = json.loads(outcomes.read_text())
    return data


def read_selection(test_set: PeerSet) -> list[str]:
    lines = test_set.selection.read_text().splitlines()
    return [line for line in lines if line and not line.startswith("#")]


def read_exclusions(path: Path = HERE / "exclusions.toml") -> dict[str, dict[str, str]]:
    with path.open("rb") as f:
        data = tomllib.load(f)
    return {section: dict(entries) for section, entries in data.items()}


def matching(test_id: str, entries: dict[str, str]) -> str | None:
    """The entry (an exact id, or a prefix ending in ``*``) that covers ``test_id``."""
    if test_id in entries:
        return test_id
    return next((key for key in entries if key.endswith("*") and test_id.startswith(key[:-1])), None)


def is_kvlife(name: str) -> bool:
    return name.startswith(("KVLifeConnector", "RecordingConnector"))


@dataclass
class Traces:
    """What ``kvlife validate`` says of the traces a peer run wrote (not a pass/fail: a test
    may stop with requests still running, which validate reports as stranded)."""

    total: int = 0
    valid: int = 0
    findings: Counter[str] = field(default_factory=Counter)  # invariant -> traces whose first finding it is
    stopped: dict[str, str] = field(default_factory=dict)  # test id -> the recording_stopped warning

    def to_dict(self) -> dict[str, Any]:
        return {"total": self.total, "valid": self.valid, "first_findings": dict(sorted(self.findings.items())),
                "recording_stopped": dict(sorted(self.stopped.items()))}


def validate_traces(folder: Path, tests: dict[str, dict[str, Any]]) -> Traces:
    from kvlife.lifecycle.traces.trace import TraceError
    from kvlife.lifecycle.traces.validate import validate

    owner = {name: test_id for test_id, entry in tests.items() for name in entry.get("traces", [])}
    traces = Traces()
    for path in sorted(folder.glob("*.trace.jsonl")):
        traces.total += 1
        try:
            report = validate(path)
        except (TraceError, OSError):
            traces.findings["no header (the connector was never used)"] += 1
            continue
        if report.ok:
            traces.valid += 1
        else:
            first = report.findings[0]
            traces.findings[f"invariant {first.invariant}"] += 1
        for line in path.read_text().splitlines():
            if '"recording_stopped"' in line:
                warning = json.loads(line)
                traces.stopped[owner.get(path.name, path.name)] = f"at {warning['call']}: {warning['error']}"
    return traces


@dataclass
class Comparison:
    test_set: PeerSet
    baseline: dict[str, dict[str, Any]]
    peer: dict[str, dict[str, Any]]
    excluded: dict[str, tuple[str, str, str]]  # id -> (baseline, peer, reason)
    unexpected: dict[str, tuple[str, str]]  # id -> (baseline, peer)
    unlisted_failures: dict[str, str]  # id -> baseline outcome
    unused: list[str]  # entries of exclusions.toml for this set's folder that explained nothing
    traces: Traces = field(default_factory=Traces)

    @property
    def kvlife_tests(self) -> int:
        """Peer tests during which the factory built kvlife's connector."""
        return sum(1 for entry in self.peer.values() if any(map(is_kvlife, entry.get("connectors", []))))

    @property
    def ok(self) -> bool:
        return not self.unexpected and not self.unlisted_failures and self.kvlife_tests > 0

    def counts(self, tests: dict[str, dict[str, Any]]) -> dict[str, int]:
        counted = Counter(entry["outcome"] for entry in tests.values())
        return {outcome: counted.get(outcome, 0) for outcome in OUTCOMES}

    def to_dict(self) -> dict[str, Any]:
        return {
            "set": self.test_set.name, "tests": len(set(self.baseline) | set(self.peer)),
            "baseline": self.counts(self.baseline), "peer": self.counts(self.peer),
            "differences": len(self.excluded) + len(self.unexpected),
            "excluded": {k: {"baseline": b, "peer": p, "reason": r} for k, (b, p, r) in sorted(self.excluded.items())},
            "unexpected": {k: {"baseline": b, "peer": p} for k, (b, p) in sorted(self.unexpected.items())},
            "unlisted_baseline_failures": dict(sorted(self.unlisted_failures.items())),
            "unused_exclusions": self.unused,
            "kvlife_tests": self.kvlife_tests, "traces": self.traces.to_dict(), "ok": self.ok,
        }


def compare(test_set: PeerSet, baseline: dict[str, dict[str, Any]], peer: dict[str, dict[str, Any]],
            exclusions: dict[str, dict[str, str]]) -> Comparison:
    environmental = {k: v for k, v in exclusions.get("environmental", {}).items() if k.startswith(test_set.folder)}
    own = exclusions.get(test_set.name, {})
    excluded: dict[str, tuple[str, str, str]] = {}
    unexpected: dict[str, tuple[str, str]] = {}
    unlisted: dict[str, str] = {}
    used: set[str] = set()
    for test_id in sorted(set(baseline) | set(peer)):
        before = baseline.get(test_id, {}).get("outcome", "absent")
        after = peer.get(test_id, {}).get("outcome", "absent")
        env_key = matching(test_id, environmental)
        if before in ("failed", "error"):
            if env_key is None:
                unlisted[test_id] = before
            else:
                used.add(env_key)
        if before == after:
            continue
        key = env_key or matching(test_id, own)
        if key is None:
            unexpected[test_id] = (before, after)
        else:
            used.add(key)
            excluded[test_id] = (before, after, {**own, **environmental}[key])
    unused = sorted((set(environmental) | set(own)) - used)
    return Comparison(test_set, baseline, peer, excluded, unexpected, unlisted, unused)


def report(comparison: Comparison, seconds: float, verbose: bool = False) -> None:
    d = comparison.to_dict()

    def line(counts: dict[str, int]) -> str:
        return ", ".join(f"{counts[o]} {o}" for o in OUTCOMES if counts[o] or o in ("passed", "failed", "skipped",
                                                                                    "error"))

    print(f"vllm-peer: {comparison.test_set.title}: {d['tests']} tests ({seconds:.0f} s)")
    print(f"  baseline  {line(d['baseline'])}")
    print(f"  peer      {line(d['peer'])}")
    print(f"  differences {d['differences']}: {len(comparison.excluded)} listed in exclusions.toml, "
          f"{len(comparison.unexpected)} unexpected; {comparison.kvlife_tests} peer tests built kvlife's connector")
    if comparison.unused:
        print(f"  {len(comparison.unused)} entries of exclusions.toml explained nothing this run"
              + ("" if verbose else " (--verbose lists them)"))
    traces = comparison.traces
    findings = ", ".join(f"{n} {what}" for what, n in sorted(traces.findings.items()))
    print(f"  traces    {traces.total} written, {traces.valid} pass kvlife validate"
          + (f"; first findings: {findings}" if findings else "")
          + f"; {len(traces.stopped)} recordings stopped")
    for test_id, (before, after, reason) in sorted(comparison.excluded.items()) if verbose else ():
        print(f"    listed      {test_id}: {before} -> {after} ({reason})")
    for key in comparison.unused if verbose else ():
        print(f"    unused      {key}")
    for test_id, warning in sorted(traces.stopped.items()):
        print(f"    stopped     {test_id}: recording stopped {warning}")
    for test_id, (before, after) in sorted(comparison.unexpected.items()):
        print(f"    UNEXPECTED  {test_id}: {before} -> {after}")
    for test_id, before in sorted(comparison.unlisted_failures.items()):
        print(f"    UNLISTED    {test_id}: {before} in the baseline, not listed as environmental")
    if not comparison.kvlife_tests:
        print("    NO PEER     the peer run built no kvlife connector")


def run_set(test_set: PeerSet, tests_root: Path, out: Path, exclusions: dict[str, dict[str, str]]
            ) -> tuple[Comparison, float]:
    start = time.monotonic()
    folder = out / test_set.name
    folder.mkdir(parents=True, exist_ok=True)
    args = read_selection(test_set)
    baseline = run_pytest(tests_root, args, "baseline", folder)["tests"]
    peer = run_pytest(tests_root, args, test_set.mode, folder)["tests"]
    comparison = compare(test_set, baseline, peer, exclusions)
    comparison.traces = validate_traces(folder / f"{test_set.mode}-traces", peer)
    return comparison, time.monotonic() - start


# A test that fails before any connector is built (a model's config it cannot fetch, a library
# missing here) still belongs to a set when its code configures a KV connector.
CONNECTOR_WORDS = re.compile(r"kv_connector|KVTransferConfig|MockKVConfig|mock_kv|[A-Za-z]Connector\b")


def source_of(tests_root: Path, test_id: str) -> str:
    """The source of a test's function (its module's, for a module that failed to collect)."""
    path, _, name = test_id.partition("::")
    module = (tests_root / path).read_text()
    if not name:
        return module
    parts = name.split("[")[0].split("::")
    body: list[ast.stmt] = ast.parse(module).body
    node: ast.AST | None = None
    for part in parts:
        node = next((n for n in body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
                     and n.name == part), None)
        if node is None:
            return ""
        body = node.body  # type: ignore[attr-defined]
    return ast.get_source_segment(module, node) or "" if node is not None else ""


def discover(test_set: PeerSet, tests_root: Path, out: Path) -> None:
    """Run the whole folder once as shipped and keep the tests during which the factory built a
    connector (the others cannot tell a peer run from the baseline), and the failing tests whose
    code configures one (exclusions.toml must say why they fail here)."""
    data = run_pytest(tests_root, [test_set.folder], "baseline", out)["tests"]
    built = {test_id for test_id, entry in data.items() if entry.get("connectors")}
    failing = {test_id for test_id, entry in data.items() if entry["outcome"] in ("failed", "error")
               and test_id not in built and CONNECTOR_WORDS.search(source_of(tests_root, test_id))}
    header = (f"# {test_set.folder}: the tests during which vLLM's KVConnectorFactory built a connector\n"
              f"# ({len(built)}), and the tests that fail here before it and configure one ({len(failing)}),\n"
              f"# of {len(data)}; written by `suite.py discover {test_set.name}` on vllm 0.33.0's sdist.\n")
    test_set.selection.write_text(header + "".join(f"{test_id}\n" for test_id in sorted(built | failing)))
    print(f"vllm-peer: {test_set.name}: {len(built)} of {len(data)} tests build a connector, {len(failing)} fail "
          f"before it -> {test_set.selection}")
    for test_id in sorted(failing):
        print(f"  {data[test_id]['outcome']:7} {test_id}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", nargs="?", choices=("run", "discover"), default="run")
    parser.add_argument("discover_set", nargs="?", choices=sorted(SETS), help="discover: the set to rewrite")
    parser.add_argument("--sets", default="core,unit", help="comma-separated: core, unit (default both)")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where the sdist is kept")
    parser.add_argument("--out", type=Path, default=None, help="keep logs, outcomes and traces here")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--verbose", action="store_true", help="also list each difference exclusions.toml explains")
    args = parser.parse_args(argv)
    tests_root = fetch_tests(args.cache)
    out = args.out or Path(tempfile.mkdtemp(prefix="kvlife-vllm-peer-"))
    out.mkdir(parents=True, exist_ok=True)
    if args.command == "discover":
        if args.discover_set is None:
            parser.error("discover: name the set (core or unit)")
        discover(SETS[args.discover_set], tests_root, out)
        return 0
    names = [name.strip() for name in args.sets.split(",") if name.strip()]
    unknown = [name for name in names if name not in SETS]
    if unknown:
        parser.error(f"--sets: unknown set {unknown[0]!r} (known: {', '.join(sorted(SETS))})")
    exclusions = read_exclusions()
    results = []
    for name in names:
        comparison, seconds = run_set(SETS[name], tests_root, out, exclusions)
        results.append(comparison)
        if not args.json:
            report(comparison, seconds, args.verbose)
    ok = all(c.ok for c in results)
    if args.json:
        print(json.dumps({"sets": [c.to_dict() for c in results], "ok": ok, "out": str(out)}, indent=1))
    else:
        print(f"vllm-peer: {'same outcomes' if ok else 'DIFFERENT OUTCOMES'}; logs and outcomes in {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
