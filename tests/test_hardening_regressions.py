"""Regression tests for the failures of issue 24 ("Hardening, second round"), one per
numbered failure (each failed on the main branch the issue was filed against).

The fuzz suite for the same surfaces is ``tests/test_fuzz_hardening.py``; the campaign of
generated bad inputs is ``scripts/hardening_campaign.py``.
"""

from __future__ import annotations

from pathlib import Path

from kvlife.lifecycle.config import EngineConfig, RunConfig, SimConfig, TierConfig
from kvlife.lifecycle.drivers.runner import run_workload
from kvlife.lifecycle.traces.validate import validate
from kvlife.lifecycle.workloads.synthetic import synthetic_workload


# ---- 1: validate and --check agree on the async lookup cap (invariant 12) ------------------
def test_validate_accepts_answers_kept_past_the_lookup_cap(tmp_path: Path) -> None:
    """Past ``engine.max_async_lookups`` the engine keeps a request's last answer (a
    ``lookup_limit`` warning); validate counted no lookups from a trace and called every
    later use of that answer a violation of 12, while ``--check`` called the run clean."""
    config = RunConfig(engine=EngineConfig(device_blocks=40, max_async_lookups=2,
                                           tiers=(TierConfig("host", capacity_blocks=200),)),
                       policies=("async-lookup",), sim=SimConfig(check=True))
    path = tmp_path / "cap.jsonl"
    outcome = run_workload(config, synthetic_workload(seed=3, num_requests=40, arrival_rate_per_s=20.0),
                           trace_path=path)
    assert outcome.summary["warnings"].get("lookup_limit", 0) > 0  # the cap was reached
    assert outcome.summary["check"]["violations"] == 0
    report = validate(path)
    assert report.ok, report.format()
