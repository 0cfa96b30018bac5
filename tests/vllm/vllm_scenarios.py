"""Shared pieces of the vLLM tests: specs, trace readers and the warm-tier scenario.

Imported by the test modules after they checked that vLLM is installed (it imports vLLM).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from kvlife.lifecycle.drivers.vllm.harness import SchedulerSpec, VllmDriver
from kvlife.lifecycle.traces.validate import validate

BS = 16
PREFIX = list(range(1, 65))  # four full blocks shared by the requests of the tests


def kvlife_spec(trace: Path, stack: str = "async-lookup", **kw: Any) -> SchedulerSpec:
    """KVLifeConnector under the RecordingConnector, writing ``trace``; the other keywords
    go to ``SchedulerSpec`` (``lookup_delay_steps``, ``ranks`` (recorded), ``worker_ranks``
    (the connector's), ``store_timeout_ms`` go to the connector's extra config). The
    connector's clock is its scheduler passes (one ms each): deterministic."""
    extra: dict[str, Any] = {
        "record": {"inner": "kvlife.vllm:KVLifeConnector", "trace": str(trace), "ranks": kw.pop("ranks", 1)},
        "stack": stack, "host_blocks": 64, "lookup_delay_steps": kw.pop("lookup_delay_steps", 1),
        "ranks": kw.pop("worker_ranks", 1), "clock": "steps"}
    timeout = kw.pop("store_timeout_ms", None)
    if timeout is not None:
        extra["store_timeout_ms"] = timeout
    return SchedulerSpec(block_size=BS, num_blocks=kw.pop("num_blocks", 10), connector="RecordingConnector",
                         extra=extra, **kw)


def records(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


def transitions(path: Path, rid: str) -> list[str]:
    return [r["trigger"] for r in records(path) if r["kind"] == "transition" and r["req"] == rid]


def run_until(driver: VllmDriver, done: Any, limit: int = 60) -> None:
    for _ in range(limit):
        if done():
            return
        driver.step()
    raise AssertionError("did not happen within the step limit")


def warm_tier(driver: VllmDriver, first: str = "r0", filler: str = "filler") -> None:
    """``first`` computes the prefix (its blocks are stored in the host tier), then a filler
    request evicts them from vLLM's device cache: the next request hits only the tier."""
    driver.add(first, PREFIX + [100, 101, 102], 2)
    run_until(driver, lambda: driver.status(first) is None)
    evict(driver, filler)


# OffloadingConnector as vLLM's own tests configure it (no recorder).
OFFLOADING = SchedulerSpec(block_size=BS, num_blocks=10, connector="OffloadingConnector", module_path=None,
                           extra={"cpu_bytes_to_use": 1 << 20, "block_size": BS})


def run_a_tier_hit(driver: VllmDriver) -> None:
    """r0 computes and stores the prefix, a filler evicts it from the device, r1 loads it."""
    warm_tier(driver)
    driver.add("r1", PREFIX + [200], 2)
    run_until(driver, lambda: driver.status("r1") is None)
    run_until(driver, driver.idle)
    driver.drain()


def evict(driver: VllmDriver, filler: str = "filler") -> None:
    """A request that takes every device block (130 tokens, 9 blocks of 10 - the null block)."""
    driver.add(filler, list(range(1000, 1130)), 2)
    run_until(driver, lambda: driver.status(filler) is None)


def close(driver: VllmDriver) -> None:
    driver.scheduler.connector.close()


def finish(driver: VllmDriver, trace: Path) -> None:
    """Run until idle, close the recording and require ``kvlife validate`` to pass."""
    run_until(driver, driver.idle)
    driver.drain()
    close(driver)
    report = validate(trace)
    assert report.ok, report.format()


def inner(driver: VllmDriver) -> Any:
    """The KVLifeConnector inside the RecordingConnector (scheduler side)."""
    return driver.scheduler.connector.inner
