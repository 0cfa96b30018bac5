"""Steps whose model runner output carries no connector output.

vLLM's runner sends ``kv_connector_output=None`` for a step with nothing to report
(``ModelRunnerOutput.with_kv_conn_output_only``), and the scheduler then skips
``update_connector_output`` for that step; ``take_events`` still comes at the end of every
``update_from_output``. The recording (and KVLifeConnector's own step accounting) must come
out the same as when every step carries an (empty) connector output.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Any

import pytest

try:
    importlib.metadata.version("vllm")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("vLLM is not installed: `bash scripts/install-vllm.sh`, then "
                "`.venv-vllm/bin/python -m pytest tests/vllm`", allow_module_level=True)

from vllm_scenarios import BS, PREFIX, finish, kvlife_spec, run_until, warm_tier  # noqa: E402

from kvlife.lifecycle.drivers.vllm.harness import SchedulerSpec, VllmDriver, build_scheduler  # noqa: E402
from kvlife.lifecycle.drivers.vllm.worker import OffloadingSimulatedWorker, SimulatedWorker  # noqa: E402


def run(model_dir: Path, trace: Path, connector: str, async_scheduling: bool, none: bool) -> VllmDriver:
    workers: list[Any]
    if connector == "kvlife":
        spec = kvlife_spec(trace, lookup_delay_steps=2, async_scheduling=async_scheduling)
        workers = [SimulatedWorker(0, load_delay=3, store_delay=2)]
    else:
        extra = {"record": {"inner": "OffloadingConnector", "trace": str(trace), "tier_blocks": 64},
                 "cpu_bytes_to_use": 1 << 20, "block_size": BS, "offload_prompt_only": False}
        spec = SchedulerSpec(block_size=BS, num_blocks=10, connector="RecordingConnector", extra=extra,
                             async_scheduling=async_scheduling)
        workers = [OffloadingSimulatedWorker(0, load_delay=3)]
    driver = VllmDriver(build_scheduler(model_dir, spec), workers, empty_outputs_as_none=none)
    warm_tier(driver)
    driver.add("r1", PREFIX + [200, 201], 3)
    run_until(driver, lambda: driver.status("r1") is None)
    driver.add("r2", PREFIX + [300, 301, 302], 20)  # a long answer: stores of generated blocks
    driver.add("r3", PREFIX + [400], 2)
    finish(driver, trace)  # kvlife validate passes
    return driver


@pytest.mark.parametrize(("connector", "async_scheduling"),
                         [("kvlife", False), ("kvlife", True), ("offloading", False)],
                         ids=["kvlife", "kvlife-async", "offloading"])
def test_steps_without_connector_output_record_the_same_trace(
    model_dir: Path, tmp_path: Path, connector: str, async_scheduling: bool
) -> None:
    traces = []
    steps = []
    for none in (False, True):
        trace = tmp_path / f"{connector}-{none}.jsonl"
        driver = run(model_dir, trace, connector, async_scheduling, none)
        if none:
            assert driver.none_outputs >= 10  # a good share of the steps had no connector output
        steps.append([o.key() for o in driver.observations])
        traces.append(trace.read_bytes().splitlines())
    assert steps[0] == steps[1]  # vLLM decided the same
    assert len(traces[0]) == len(traces[1]) and traces[0][1:] == traces[1][1:]  # the header names the file
