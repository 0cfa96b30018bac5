"""The differential comparison's kvlife half and its workloads (no vLLM needed here).

``kvlife vllm-diff`` runs one workload through vLLM 0.33's scheduler with
``KVLifeConnector`` (``drivers.vllm.differential.run_vllm``, in the vLLM virtualenv) and
through kvlife's engine stepped in vLLM's order (``run_kvlife``: ``vllm_order``), and
compares them step by step (``compare``): the requests scheduled with their (tokens computed
before, tokens), the external hit tokens, the loads started, the requests waiting for remote
KV, the preemptions. Both sides use the same simulated ranks (``vllm_order.SimulatedRank``)
and the same connector core, so what differs is the scheduler: a step that differs is where
kvlife's model of vLLM's scheduler is not vLLM's.

A workload is any the simulator takes (``workload_items``): each Mooncake block of
``hash_ids`` becomes one block of ``block`` tokens whose ids are a function of the hash id (so
equal ids are equal tokens, and both sides hit alike), the rest of the input a tail of tokens
unique to the request; outputs are scaled down as the blocks are; arrivals are placed on
scheduler steps ``ms_per_step`` apart. ``prefix_sharing_items`` draws random prefix-sharing
workloads.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

import attrs

from kvlife.lifecycle.config import EngineConfig, TierConfig
from kvlife.lifecycle.drivers.vllm_order import Item, SimulatedRank, StepObs, VllmOrderDriver, run_items
from kvlife.lifecycle.workloads.mooncake import WorkloadRequest
from kvlife.policies.loading import load_stack

MOONCAKE_BLOCK = 512  # tokens per Mooncake hash id (the trace format's block)
VOCAB = 50_000  # token ids stay below OPT's 50,272


@attrs.frozen
class DiffSetup:
    """One configuration for both sides: vLLM's scheduler and connector, kvlife's engine."""

    block_size: int = 16
    num_blocks: int = 512  # vLLM's pool (block 0 is its null block): kvlife gets one fewer
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 256
    host_blocks: int = 4096
    stack: str = ""
    lookup_delay_steps: int = 1
    load_delay: int = 2  # steps before rank r reports a load (plus r)
    async_scheduling: bool = False
    ranks: int = 1
    max_model_len: int = 16_384
    kv_load_failure_policy: str = "fail"  # vLLM's default

    def engine_config(self) -> EngineConfig:
        return EngineConfig(block_tokens=self.block_size, device_blocks=self.num_blocks - 1,
                            max_batched_tokens=self.max_num_batched_tokens, max_running=self.max_num_seqs,
                            ranks=self.ranks, async_scheduling=self.async_scheduling,
                            kv_load_failure_policy=self.kv_load_failure_policy,
                            tiers=(TierConfig("host", capacity_blocks=self.host_blocks),))

    def rank_delays(self) -> list[int]:
        return [self.load_delay + r for r in range(self.ranks)]


def block_tokens(hash_id: int, block: int) -> tuple[int, ...]:
    """The tokens of a Mooncake block, as a function of its hash id."""
    base = (hash_id * 7919) % (VOCAB - block - 1000) + 1000
    return tuple(base + j for j in range(block))


def workload_items(workload: Sequence[WorkloadRequest], block: int = 16, ms_per_step: float = 100.0,
                   max_output: int = 64, max_prompt: int = 12_000, abort_rate: float = 0.0,
                   seed: int = 0) -> list[Item]:
    """A simulator workload as differential items (see the module docstring). With
    ``abort_rate``, that share of the requests is aborted 1 to 40 steps after it arrived."""
    if not workload:
        return []
    rng = random.Random(seed)
    scale = MOONCAKE_BLOCK / block
    t0 = workload[0].arrival_ms
    items = []
    for index, w in enumerate(workload):
        prompt: list[int] = []
        for h in w.hash_ids:
            prompt.extend(block_tokens(h, block))
        tail = max(1, round((w.input_length - len(w.hash_ids) * MOONCAKE_BLOCK) / scale))
        prompt.extend(rng.randrange(100, 1000) for _ in range(tail))
        prompt = prompt[:max_prompt]
        step = int(round((w.arrival_ms - t0) / ms_per_step))
        abort = step + rng.randrange(1, 41) if rng.random() < abort_rate else None
        items.append(Item(step, f"r{index:04d}", tuple(prompt),
                          max(1, min(max_output, math.ceil(w.output_length / scale))), abort))
    return items


def prefix_sharing_items(seed: int, requests: int = 60, block: int = 16, prefixes: int = 4,
                         abort_rate: float = 0.0) -> list[Item]:
    """A random workload of requests sharing a few prefixes (a system prompt, a document),
    each with a suffix of its own, arriving in bursts."""
    rng = random.Random(seed)
    heads = [tuple(rng.randrange(1000, VOCAB) for _ in range(block * rng.randrange(2, 9)))
             for _ in range(prefixes)]
    items = []
    step = 0
    for index in range(requests):
        step += rng.choice((0, 0, 1, 2, 5))
        prompt = rng.choice(heads) + tuple(rng.randrange(1000, VOCAB) for _ in range(rng.randrange(1, 3 * block)))
        abort = step + rng.randrange(1, 30) if rng.random() < abort_rate else None
        items.append(Item(step, f"p{index:03d}", prompt, rng.randrange(1, 3 * block), abort))
    return items


def run_kvlife(items: Sequence[Item], setup: DiffSetup, limit: int = 4000,
               states: list[dict[str, Any]] | None = None) -> list[StepObs]:
    """kvlife's engine in vLLM's order (``vllm_order.VllmOrderDriver``), with ``setup``'s
    ranks; ``states``, if given, gets each step's request states."""
    ranks = [SimulatedRank(r, load_delay=d) for r, d in enumerate(setup.rank_delays())]
    driver = VllmOrderDriver(setup.engine_config(), load_stack(_stack(setup.stack)), ranks,
                             lookup_delay_steps=setup.lookup_delay_steps)
    if states is not None:
        original = driver.step

        def step(stops: Any) -> StepObs:
            obs = original(stops)
            states.append(kvlife_states(driver))
            return obs

        driver.step = step  # type: ignore[method-assign]
    return run_items(driver, items, limit)


def kvlife_states(driver: VllmOrderDriver) -> dict[str, Any]:
    """Each request's scheduler status and computed tokens, as vLLM's would read."""
    return {rid: (req.status.name, req.num_computed_tokens, req.output_tokens)
            for rid, req in sorted(driver.engine.scheduler.requests.items())}


def _stack(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


@attrs.frozen
class Difference:
    step: int
    vllm: tuple[Any, ...] | None
    kvlife: tuple[Any, ...] | None
    vllm_state: dict[str, Any] | None = None
    kvlife_state: dict[str, Any] | None = None


@attrs.frozen
class Agreement:
    name: str
    steps: int
    identical: int
    first: Difference | None

    @property
    def ratio(self) -> float:
        return self.identical / self.steps if self.steps else 1.0


def compare(name: str, left: list[StepObs], right: list[StepObs], left_states: list[dict[str, Any]] | None = None,
            right_states: list[dict[str, Any]] | None = None) -> Agreement:
    """Steps identical out of the steps either side made; the first that differs, with
    both sides' request states after it."""
    steps = max(len(left), len(right))
    same = 0
    first = None
    for i in range(steps):
        a = left[i].key() if i < len(left) else None
        b = right[i].key() if i < len(right) else None
        if a == b:
            same += 1
        elif first is None:
            first = Difference(i + 1, a, b,
                               left_states[i] if left_states is not None and i < len(left_states) else None,
                               right_states[i] if right_states is not None and i < len(right_states) else None)
    return Agreement(name, steps, same, first)


def format_agreement(result: Agreement) -> list[str]:
    lines = [f"{result.name}: {result.identical}/{result.steps} steps identical ({100 * result.ratio:.1f} %)"]
    first = result.first
    if first is not None:
        lines.append(f"  first difference at step {first.step}:")
        lines.append(f"    vLLM   {first.vllm}")
        lines.append(f"    kvlife {first.kvlife}")
        if first.vllm_state is not None or first.kvlife_state is not None:
            lines.append(f"    vLLM requests   {first.vllm_state}")
            lines.append(f"    kvlife requests {first.kvlife_state}")
    return lines
