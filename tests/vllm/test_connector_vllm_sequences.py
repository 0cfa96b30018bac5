"""KVLifeConnector under call sequences of vLLM 0.33's scheduler that the peer suite found
(scripts/vllm_peer): the connector core raises into vLLM's scheduler on them. Both are engine
core bugs (lifecycle/engine/connector.py), strict xfails until it handles them; the
RecordingConnector traces of the same sequences end with a ``recording_stopped`` warning."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

try:
    importlib.metadata.version("vllm")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("vLLM is not installed: `bash scripts/install-vllm.sh`, then "
                "`.venv-vllm/bin/python -m pytest tests/vllm`", allow_module_level=True)

from vllm_scenarios import BS, PREFIX, run_until, warm_tier  # noqa: E402

from kvlife.lifecycle.drivers.vllm.harness import SchedulerSpec, VllmDriver, build_scheduler  # noqa: E402
from kvlife.specs.table import IllegalTransition  # noqa: E402

CORE_RAISES = "the connector core raises IllegalTransition into vLLM's scheduler (engine core bug, issue 22)"


def kvlife_driver(model_dir: Path) -> VllmDriver:
    spec = SchedulerSpec(block_size=BS, num_blocks=10, extra={"clock": "steps", "host_blocks": 64})
    return VllmDriver(build_scheduler(model_dir, spec))


@pytest.mark.xfail(strict=True, raises=IllegalTransition, reason=CORE_RAISES)
def test_reset_prefix_cache_preempting_running_requests(model_dir: Path) -> None:
    """``reset_prefix_cache(reset_running_requests=True)`` preempts running requests outside
    ``schedule()``; the next pass admits them again (``update_state_after_alloc``) before its
    ``build_connector_meta`` tells the core of the preemption."""
    driver = kvlife_driver(model_dir)
    warm_tier(driver)  # the tier holds PREFIX: the re-admission loads it
    driver.add("r1", PREFIX + [200], 20)
    run_until(driver, lambda: driver.status("r1") == "RUNNING")
    assert driver.scheduler.reset_prefix_cache(reset_running_requests=True)
    run_until(driver, lambda: driver.status("r1") is None)


@pytest.mark.xfail(strict=True, raises=IllegalTransition, reason=CORE_RAISES)
def test_streaming_session_resumed_for_its_next_chunk(model_dir: Path) -> None:
    """A resumable request (a streaming input session) that stopped its turn is scheduled
    again for the next chunk with no ``request_finished`` between: vLLM calls
    ``update_state_after_alloc`` again for a request the core has ``running``."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    driver = kvlife_driver(model_dir)
    driver.add("r0", [1, 2], 1)  # (the harness's request factory sets up vLLM's block hashing)
    run_until(driver, lambda: driver.status("r0") is None)
    hasher = get_request_block_hasher(BS, sha256)

    def chunk(tokens: list[int]) -> Request:
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        return Request(request_id="s", prompt_token_ids=tokens, sampling_params=params, pooling_params=None,
                       block_hasher=hasher, resumable=True)

    driver.scheduler.add_request(chunk(list(range(10, 50))))
    run_until(driver, lambda: driver.status("s") not in ("WAITING", "RUNNING"))
    driver.scheduler.add_request(chunk(list(range(200, 240))))
    for _ in range(4):
        driver.step()
