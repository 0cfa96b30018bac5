"""The differential comparison's vLLM half: a workload through vLLM 0.33's real scheduler.

``run_vllm`` steps vLLM's ``Scheduler`` (or ``AsyncScheduler``) with ``KVLifeConnector``
and simulated workers (one per rank, ``SimulatedWorker``, the same ranks the kvlife half
uses) as ``harness.VllmDriver`` steps it, and observes each step as ``StepObs``;
``vllm_diff.run_kvlife`` does the same with kvlife's engine. ``kvlife vllm-diff`` is the
command (``lifecycle/cli/commands/vllm_diff.py``); ``FAMILIES`` are the workload families its
``--family`` names and the test suite measures.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from kvlife.lifecycle.drivers.vllm.harness import SchedulerSpec, VllmDriver, build_scheduler
from kvlife.lifecycle.drivers.vllm.worker import OffloadingSimulatedWorker, SimulatedWorker
from kvlife.lifecycle.drivers.vllm_diff import (
    Agreement,
    DiffSetup,
    compare,
    prefix_sharing_items,
    run_kvlife,
    workload_items,
)
from kvlife.lifecycle.drivers.vllm_order import Item, StepObs
from kvlife.lifecycle.workloads.mooncake import WorkloadRequest


def vllm_states(driver: VllmDriver) -> dict[str, Any]:
    """Each request's status and computed tokens in vLLM's scheduler."""
    return {rid: (req.status.name, req.num_computed_tokens, req.num_output_tokens)
            for rid, req in sorted(driver.scheduler.requests.items())}


def drive(driver: VllmDriver, items: Sequence[Item], limit: int = 4000,
          states: list[dict[str, Any]] | None = None) -> list[StepObs]:
    """Arrivals before the pass of their step, aborts at theirs, one pass a step
    (``vllm_order.run_items`` drives kvlife's engine the same way)."""
    pending = sorted(items, key=lambda it: it.step)
    aborts = sorted((it for it in items if it.abort_step is not None), key=lambda it: (it.abort_step, it.step))
    step = 0
    while step < limit:
        while pending and pending[0].step <= step:
            item = pending.pop(0)
            driver.add(item.request_id, item.prompt, item.max_tokens)
        for item in aborts:
            if item.abort_step == step and item.step <= step and driver.status(item.request_id) is not None:
                driver.abort(item.request_id)
        driver.step()
        if states is not None:
            states.append(vllm_states(driver))
        step += 1
        if not pending and driver.idle():
            break
    driver.drain()
    return driver.observations


def run_vllm(model_dir: Path, items: Sequence[Item], setup: DiffSetup, connector: str = "kvlife",
             trace: Path | None = None, limit: int = 4000,
             states: list[dict[str, Any]] | None = None) -> list[StepObs]:
    """``items`` through vLLM's scheduler with ``KVLifeConnector`` (or ``"offloading"``:
    vLLM's OffloadingConnector), under ``RecordingConnector`` when ``trace`` is given."""
    if connector == "kvlife":
        extra: dict[str, Any] = {"stack": setup.stack, "host_blocks": setup.host_blocks,
                                 "lookup_delay_steps": setup.lookup_delay_steps, "ranks": setup.ranks,
                                 "clock": "steps"}
        inner = "kvlife.vllm:KVLifeConnector"
        workers: list[Any] = [SimulatedWorker(r, load_delay=d) for r, d in enumerate(setup.rank_delays())]
    else:
        extra = {"cpu_bytes_to_use": 1 << 22, "block_size": setup.block_size}
        inner = "OffloadingConnector"
        workers = [OffloadingSimulatedWorker(0, load_delay=setup.load_delay)]
    if trace is not None:
        extra["record"] = {"inner": inner, "trace": str(trace), "ranks": setup.ranks, "tier_blocks": setup.host_blocks}
        name, module = "RecordingConnector", "kvlife.vllm"
    elif connector == "kvlife":
        name, module = "KVLifeConnector", "kvlife.vllm"
    else:
        name, module = "OffloadingConnector", None
    spec = SchedulerSpec(block_size=setup.block_size, num_blocks=setup.num_blocks, max_num_seqs=setup.max_num_seqs,
                         max_num_batched_tokens=setup.max_num_batched_tokens, async_scheduling=setup.async_scheduling,
                         connector=name, module_path=module, extra=extra, world_size=1,
                         kv_load_failure_policy=setup.kv_load_failure_policy, max_model_len=setup.max_model_len)
    scheduler = build_scheduler(model_dir, spec)
    try:
        return drive(VllmDriver(scheduler, workers), items, limit, states)
    finally:
        closer = getattr(scheduler.connector, "shutdown", None)
        if closer is not None:
            closer()


def diff(model_dir: Path, name: str, items: Sequence[Item], setup: DiffSetup, limit: int = 4000) -> Agreement:
    """Both sides on ``items``; their agreement, with both sides' states at the first difference."""
    left_states: list[dict[str, Any]] = []
    right_states: list[dict[str, Any]] = []
    left = run_vllm(model_dir, items, setup, limit=limit, states=left_states)
    right = run_kvlife(items, setup, limit=limit, states=right_states)
    return compare(name, left, right, left_states, right_states)


def conversation_slice(offset: int, requests: int) -> list[WorkloadRequest]:
    """``requests`` requests of the bundled conversation trace from the ``offset``-th."""
    from kvlife.lifecycle.workloads.mooncake import load_mooncake

    return load_mooncake("mooncake-conversation", limit=offset + requests)[offset:]


Family = tuple[Callable[[int], list[Item]], DiffSetup]

# The families of the acceptance: slices of the bundled conversation trace under each
# scheduler mode, and random prefix-sharing workloads under preemption pressure. A family is
# measured over seeds (a seed picks the slice or draws the workload).
def _slice(seed: int, abort_rate: float = 0.0, max_prompt: int = 4096) -> list[Item]:
    """300 requests of the bundled conversation trace (the ``seed``-th slice of 400), 250 ms
    of the trace a scheduler step: requests queue and contend for the device."""
    return workload_items(conversation_slice(400 * seed, 300), ms_per_step=250.0, max_prompt=max_prompt,
                          abort_rate=abort_rate, seed=seed)


FAMILIES: dict[str, Family] = {
    "conversation-sync": (_slice, DiffSetup()),
    "conversation-async": (_slice, DiffSetup(async_scheduling=True)),
    "conversation-two-workers": (_slice, DiffSetup(ranks=2)),
    # A device of 95 blocks: prompts capped at 64 blocks (vLLM 0.33 parks the queue behind
    # a prompt that can never fit; kvlife fails it: docs/vllm.md).
    "conversation-preemption": (lambda seed: _slice(seed, max_prompt=1024), DiffSetup(num_blocks=96)),
    "conversation-aborts": (lambda seed: _slice(seed, abort_rate=0.2), DiffSetup()),
    "prefix-sharing-preemption": (lambda seed: prefix_sharing_items(seed, abort_rate=0.1),
                                  DiffSetup(num_blocks=24, max_num_batched_tokens=64, max_num_seqs=6)),
    "prefix-sharing-async": (lambda seed: prefix_sharing_items(seed, abort_rate=0.1),
                             DiffSetup(num_blocks=24, max_num_batched_tokens=64, max_num_seqs=6,
                                       async_scheduling=True)),
}


@attrs.frozen
class FamilyResult:
    family: str
    runs: tuple[Agreement, ...]

    @property
    def steps(self) -> int:
        return sum(r.steps for r in self.runs)

    @property
    def identical(self) -> int:
        return sum(r.identical for r in self.runs)


def run_family(model_dir: Path, family: str, seeds: Sequence[int]) -> FamilyResult:
    make, setup = FAMILIES[family]
    return FamilyResult(family, tuple(diff(model_dir, f"{family} seed {seed}", make(seed), setup) for seed in seeds))
