"""Golden traces: a few fixed simulated runs must reproduce their recorded traces byte for byte.

Each case below is a workload, a run config and a policy stack. Its golden trace (and the
workload it was made from) lives in ``tests/data/golden/``. The test replays the case
in-process through ``run_workload`` and compares the new trace with the golden one line
by line; a mismatch names the first line that differs. Any change to what the engine
decides or records, or to the simulator's cost model, shows up here.

The workload is stored beside its trace, so the goldens do not move when the synthetic
generator changes. Every line after the header is compared byte for byte. The header
holds the whole config dump, which grows with every new config field, so it is compared
on its meaning instead: same schema, policies, seed and workload, and every config value
the golden recorded unchanged.

When a change to the simulator is intended, regenerate the goldens deliberately, look at
the diff of what changed, and commit them with the change that explains it::

    PYTHONPATH=$PWD python tests/test_golden_traces.py --regenerate
"""

from __future__ import annotations

import argparse
import gzip
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import orjson
import pytest

from kvlife.lifecycle.config import EngineConfig, RunConfig, SimConfig, TierConfig
from kvlife.lifecycle.drivers.runner import run_workload
from kvlife.lifecycle.workloads.mooncake import WorkloadRequest
from kvlife.lifecycle.workloads.synthetic import synthetic_workload
from kvlife.policies.loading import load_stack

GOLDEN_DIR = Path(__file__).resolve().parent / "data" / "golden"


@attrs.frozen
class Case:
    name: str
    what: str
    config: RunConfig
    workload: Callable[[], list[WorkloadRequest]]  # only called to (re)generate the golden

    @property
    def trace_path(self) -> Path:
        return GOLDEN_DIR / f"{self.name}.trace.jsonl.gz"

    @property
    def workload_path(self) -> Path:
        return GOLDEN_DIR / f"{self.name}.workload.jsonl.gz"


CASES: tuple[Case, ...] = (
    Case(
        "baseline",
        "default config and stack: sync lookups, host stores, device prefix hits",
        RunConfig(),
        lambda: synthetic_workload(seed=0, num_requests=60),
    ),
    Case(
        "async-ranks-deadline",
        "async scheduling, 2 ranks, a transfer deadline that jittery ranks miss (jobs given up), a host tier "
        "that fails blocks (loads fail, requests recompute), unsafe stores",
        RunConfig(
            engine=EngineConfig(
                device_blocks=40,
                async_scheduling=True,
                ranks=2,
                transfer_deadline_ms=2.0,
                tiers=(TierConfig("host", 300, failure_rate=0.1), TierConfig("disk", 3000)),
            ),
            sim=SimConfig(rank_jitter_ms=3.0),
            policies=("naive-stores-unsafe", "shared-loads", "async-lookup"),
        ),
        lambda: synthetic_workload(seed=1, num_requests=60, arrival_rate_per_s=8.0),
    ),
    Case(
        "early-prefetch-disk",
        "early prefetch from a disk tier behind a small host tier, failing transfers, best-effort patience",
        RunConfig(
            engine=EngineConfig(
                device_blocks=200,
                ranks=2,
                tiers=(
                    TierConfig("host", 150, failure_rate=0.05),
                    TierConfig("disk", 3000, bandwidth_gbps=2.0, latency_ms=2.0, failure_rate=0.05),
                ),
            ),
            policies=("early-prefetch", "prefetch-best-effort", "defer-while-loading"),
        ),
        lambda: synthetic_workload(seed=2, num_requests=100),
    ),
    Case(
        "preempt-hold-share",
        "device memory short enough to preempt, shared loads, slow stores held while sending, a length limit; "
        "lookup answers kept (a request the device cannot take yet would look up again at every pass)",
        RunConfig(
            engine=EngineConfig(
                device_blocks=70,
                max_batched_tokens=4096,
                tiers=(TierConfig("host", 400, bandwidth_gbps=0.1, latency_ms=5.0),),
            ),
            sim=SimConfig(seed=3, max_output_tokens=100),
            policies=("keep-lookup-answers", "async-lookup", "shared-loads", "early-lookup"),
        ),
        lambda: synthetic_workload(seed=3, num_requests=120, arrival_rate_per_s=12.0),
    ),
)


def _workload_to_lines(workload: Sequence[WorkloadRequest]) -> bytes:
    return b"".join(orjson.dumps(attrs.asdict(w)) + b"\n" for w in workload)


def _workload_from_file(path: Path) -> list[WorkloadRequest]:
    with gzip.open(path, "rb") as f:
        rows = [orjson.loads(line) for line in f if line.strip()]
    return [WorkloadRequest(**{**row, "hash_ids": tuple(row["hash_ids"])}) for row in rows]


def _run(case: Case, workload: list[WorkloadRequest], trace_path: Path) -> list[bytes]:
    run_workload(case.config, workload, load_stack(case.config.policies), trace_path=trace_path,
                 workload_name=case.name)
    return trace_path.read_bytes().splitlines()


def _read_golden(case: Case) -> list[bytes]:
    with gzip.open(case.trace_path, "rb") as f:
        return f.read().splitlines()


def _config_drift(golden: Any, new: Any, where: str = "config") -> str | None:
    """Where a config value the golden recorded differs now (new keys are fine)."""
    if isinstance(golden, dict) and isinstance(new, dict):
        for key, value in golden.items():
            if key not in new:
                return f"{where}.{key}: gone"
            drift = _config_drift(value, new[key], f"{where}.{key}")
            if drift:
                return drift
        return None
    if isinstance(golden, list) and isinstance(new, list) and len(golden) == len(new):
        for i, (a, b) in enumerate(zip(golden, new, strict=True)):
            drift = _config_drift(a, b, f"{where}[{i}]")
            if drift:
                return drift
        return None
    return None if golden == new else f"{where}: golden {golden!r}, now {new!r}"


def _first_difference(golden: list[bytes], new: list[bytes]) -> str | None:
    old_header, new_header = orjson.loads(golden[0]), orjson.loads(new[0])
    for key in sorted(set(old_header) | set(new_header)):
        if key == "config":
            drift = _config_drift(old_header.get(key), new_header.get(key))
            if drift:
                return f"line 1 (header): {drift}"
        elif old_header.get(key) != new_header.get(key):
            return f"line 1 (header): {key}: golden {old_header.get(key)!r}, now {new_header.get(key)!r}"
    for number, (a, b) in enumerate(zip(golden, new, strict=False), start=1):
        if number > 1 and a != b:
            return f"line {number}:\n  golden: {a.decode()}\n  now:    {b.decode()}"
    if len(golden) != len(new):
        return f"golden has {len(golden)} lines, the new trace {len(new)}"
    return None


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_trace_matches_golden(case: Case, tmp_path: Path) -> None:
    assert case.trace_path.exists(), f"missing golden {case.trace_path}; see the module docstring"
    golden = _read_golden(case)
    new = _run(case, _workload_from_file(case.workload_path), tmp_path / "run.trace.jsonl")
    difference = _first_difference(golden, new)
    assert difference is None, f"{case.name} ({case.what}) no longer matches its golden trace at {difference}"


def test_goldens_cover_the_lifecycle() -> None:
    """The goldens exercise every trigger the synthetic runs can reach, and the paths that
    keep coming back as bugs: rank timeouts, failed loads, prefetches, joins, preemption."""
    triggers: set[str] = set()
    kinds: set[str] = set()
    text = b""
    for case in CASES:
        lines = _read_golden(case)
        text += b"\n".join(lines)
        for line in lines:
            record = orjson.loads(line)
            kinds.add(record["kind"])
            if record["kind"] == "transition":
                triggers.add(record["trigger"])
    assert {"admitted", "completed", "lookup_submitted", "lookup_answered", "load_started", "load_done",
            "load_failed", "preempted", "send_started"} <= triggers
    assert {"job", "job_done", "evict", "warning", "decision", "step", "free"} <= kinds
    for needle in (b'"op":"prefetch"', b'"what":"rank_timeout"', b"joined", b"patience ran out"):
        assert needle in text, needle


def test_difference_names_the_first_differing_line() -> None:
    header = b'{"kind":"header","schema":1,"config":{"engine":{"ranks":1}},"policies":[],"seed":0}'
    grown = b'{"kind":"header","schema":1,"config":{"engine":{"ranks":1,"new":2}},"policies":[],"seed":0}'
    assert _first_difference([header, b"a", b"b"], [grown, b"a", b"b"]) is None
    assert "line 3" in (_first_difference([header, b"a", b"b"], [header, b"a", b"c"]) or "")
    assert "engine.ranks" in (_first_difference([header], [header.replace(b":1}", b":2}")]) or "")
    assert "2 lines" in (_first_difference([header, b"a"], [header]) or "")


def regenerate(names: Sequence[str]) -> None:
    GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
    for case in CASES:
        if names and case.name not in names:
            continue
        workload = case.workload()
        # mtime=0: the same trace gives the same .gz bytes, so an unchanged golden has no diff.
        with gzip.GzipFile(case.workload_path, "wb", compresslevel=9, mtime=0) as f:
            f.write(_workload_to_lines(workload))
        scratch = case.trace_path.with_suffix("")
        try:
            lines = _run(case, _workload_from_file(case.workload_path), scratch)
        finally:
            scratch.unlink(missing_ok=True)
        with gzip.GzipFile(case.trace_path, "wb", compresslevel=9, mtime=0) as f:
            f.write(b"".join(line + b"\n" for line in lines))
        size = case.trace_path.stat().st_size + case.workload_path.stat().st_size
        print(f"{case.name}: {len(workload)} requests, {len(lines)} trace lines, {size / 1024:.0f} KiB")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Regenerate the golden traces (only for intended changes).")
    parser.add_argument("--regenerate", action="store_true", required=True,
                        help="rerun every case and overwrite its golden workload and trace")
    parser.add_argument("cases", nargs="*", help=f"only these cases (default: all of {[c.name for c in CASES]})")
    args = parser.parse_args(argv)
    regenerate(args.cases)
    return 0


if __name__ == "__main__":
    sys.exit(main())
