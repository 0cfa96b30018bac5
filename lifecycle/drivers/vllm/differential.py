"""The differential comparison: one workload through vLLM's Scheduler and through kvlife's engine, step by step.

Three runs of the same workload, each producing one ``StepObs`` per scheduler step:

- (a) vLLM 0.33's ``Scheduler`` with ``KVLifeConnector`` and a simulated worker;
- (b) vLLM's ``Scheduler`` with its ``OffloadingConnector`` under ``RecordingConnector``;
- (c) kvlife's own ``Engine``, stepped in lockstep: one ``Tick`` per step, the step's
  output right after it, transfer reports and lookup answers at step boundaries after the
  same delays as the simulated worker (block size, budget, max running, device blocks
  and host tier matched to the vLLM config).

Compared per step: scheduled requests and their (computed before, tokens), external hit
tokens, loads started, requests waiting for remote KV, preemptions. Re-run with::

    .venv-vllm/bin/python -m kvlife.lifecycle.drivers.vllm.differential [--json]

The kvlife side is ``run_kvlife``: when the simulator's fidelity changes (completions at
step boundaries, answers consumed at admission), swap its driver there and re-run.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import random
import tempfile
from collections.abc import Callable
from functools import partial
from importlib import resources
from pathlib import Path
from typing import Any

import attrs

from kvlife.lifecycle.config import EngineConfig, TierConfig
from kvlife.lifecycle.drivers.vllm.harness import (
    SchedulerSpec,
    StepObs,
    VllmDriver,
    build_scheduler,
    offline_model_dir,
)
from kvlife.lifecycle.drivers.vllm.worker import OffloadingSimulatedWorker, SimulatedWorker
from kvlife.lifecycle.engine.core import Engine
from kvlife.lifecycle.engine.events import (
    Abort,
    Arrival,
    LookupAnswer,
    StartLoad,
    StartStore,
    StepOutput,
    StepPlan,
    SubmitLookup,
    Tick,
    TransferReport,
)


@attrs.frozen
class Item:
    step: int  # arrival step
    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    abort_step: int | None = None


def synthetic(seed: int = 0, requests: int = 12, block: int = 16) -> list[Item]:
    """Shared prefixes (3 of them), repeated after the device cache has turned over."""
    rng = random.Random(seed)
    prefixes = [tuple(range(1000 * p + 1, 1000 * p + 1 + 3 * block)) for p in range(3)]
    items = []
    for i in range(requests):
        tail = tuple(rng.randrange(20000, 40000) for _ in range(rng.randrange(2, 2 * block)))
        items.append(Item(2 * i, f"s{i:02d}", prefixes[i % 3] + tail, rng.randrange(2, 6)))
    return items


def conversation(requests: int = 12, block: int = 16, max_blocks: int = 6) -> list[Item]:
    """A slice of the bundled Mooncake conversation trace, scaled to small blocks: each
    512-token hash id becomes one ``block``-token block, prompts capped at ``max_blocks``."""
    data = resources.files("kvlife.lifecycle.workloads").joinpath("data/mooncake-conversation.jsonl.gz")
    items = []
    with gzip.open(str(data), "rt") as stream:
        for i, line in enumerate(stream):
            if i >= requests:
                break
            rec = json.loads(line)
            ids = rec["hash_ids"][:max_blocks]
            prompt = tuple(t for h in ids for t in range(h * block % 40000 + 1, h * block % 40000 + 1 + block))
            items.append(Item(i, f"c{i:02d}", prompt + (7,), min(4, max(2, rec["output_length"] // 100))))
    return items


def with_abort(items: list[Item], index: int, after: int) -> list[Item]:
    item = items[index]
    return [*items[:index], attrs.evolve(item, abort_step=item.step + after), *items[index + 1:]]


@attrs.frozen
class Setup:
    block_size: int = 16
    num_blocks: int = 14  # vLLM's pool (block 0 is its null block): preemption pressure
    max_num_seqs: int = 4
    max_num_batched_tokens: int = 64
    host_blocks: int = 256
    stack: str = ""
    lookup_delay_steps: int = 1
    load_delay: int = 2
    async_scheduling: bool = False
    ranks: int = 1


def _drive(driver: VllmDriver, items: list[Item], limit: int = 400) -> list[StepObs]:
    pending = sorted(items, key=lambda it: it.step)
    step = 0
    while step < limit:
        for it in [it for it in pending if it.step <= step]:
            driver.add(it.request_id, it.prompt, it.max_tokens)
            pending.remove(it)
        for it in items:
            if it.abort_step == step and driver.status(it.request_id) is not None:
                driver.abort(it.request_id)
        driver.step()
        step += 1
        if not pending and driver.idle():
            break
    driver.drain()
    return driver.observations


def run_vllm(model_dir: Path, items: list[Item], setup: Setup, connector: str,
             trace: Path | None = None) -> list[StepObs]:
    if connector == "kvlife":
        extra: dict[str, Any] = {"stack": setup.stack, "host_blocks": setup.host_blocks,
                                 "lookup_delay_steps": setup.lookup_delay_steps, "ranks": setup.ranks}
        inner = "kvlife.vllm:KVLifeConnector"
        workers: list[Any] = [SimulatedWorker(r, load_delay=setup.load_delay + r) for r in range(setup.ranks)]
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
                         connector=name, module_path=module, extra=extra)
    scheduler = build_scheduler(model_dir, spec)
    out = _drive(VllmDriver(scheduler, workers), items)
    recorder = getattr(scheduler.connector, "recorder", None)
    if recorder is not None:
        recorder.close()
    return out


def _hashes(prompt: tuple[int, ...], block: int) -> tuple[int, ...]:
    out, prev = [], b""
    for i in range(len(prompt) // block):
        digest = hashlib.blake2b(prev + repr(prompt[i * block:(i + 1) * block]).encode(), digest_size=8).digest()
        out.append(int.from_bytes(digest, "big") >> 1)
        prev = digest
    return tuple(out)


def run_kvlife(items: list[Item], setup: Setup) -> list[StepObs]:
    """kvlife's Engine in lockstep with the vLLM runs (see the module docstring)."""
    from kvlife.lifecycle.drivers.vllm.connector import parse_stack
    from kvlife.policies.loading import load_stack

    config = EngineConfig(block_tokens=setup.block_size, device_blocks=setup.num_blocks - 1,
                          max_batched_tokens=setup.max_num_batched_tokens, max_running=setup.max_num_seqs,
                          ranks=setup.ranks, async_scheduling=setup.async_scheduling,
                          tiers=(TierConfig("host", capacity_blocks=setup.host_blocks),))
    transitions: list[dict[str, Any]] = []
    engine = Engine(config, load_stack(parse_stack(setup.stack)),
                    recorder=lambda r: transitions.append(r) if r["kind"] == "transition" else None)
    outputs = {it.request_id: it.max_tokens for it in items}
    pending = sorted(items, key=lambda it: it.step)
    due: list[tuple[int, Callable[[float], Any]]] = []  # (step, event factory)
    observations: list[StepObs] = []
    generated: dict[str, int] = {}
    step = 0
    while step < 400:
        t = float(step)
        for it in [it for it in pending if it.step <= step]:
            engine.handle(Arrival(t, it.request_id, len(it.prompt), _hashes(it.prompt, setup.block_size)))
            pending.remove(it)
        for it in items:
            if it.abort_step == step and engine.requests[it.request_id].state != "finished":
                engine.handle(Abort(t, it.request_id))
        for when, make in sorted([d for d in due if d[0] <= step], key=lambda d: d[0]):
            due.remove((when, make))
            engine.handle(make(t))
        transitions.clear()
        commands = engine.handle(Tick(t))
        obs = StepObs(step + 1, {}, {}, 0, 0, ())
        follow: list[Any] = []
        for c in commands:
            if isinstance(c, StepPlan):
                finished = []
                for e in c.entries:
                    obs.scheduled[e.request_id] = (e.computed_before, e.num_tokens)
                    if e.samples:
                        generated[e.request_id] = generated.get(e.request_id, 0) + 1
                        if generated[e.request_id] >= outputs[e.request_id]:
                            finished.append((e.request_id, "length"))
                follow.append(StepOutput(t, c.step_id, tuple(finished)))
            elif isinstance(c, StartLoad):
                obs.loads_started += 1
                hit = len(c.moves) * setup.block_size
                obs.external_hits[c.request_id] = obs.external_hits.get(c.request_id, 0) + hit
                for r in range(setup.ranks):
                    due.append((step + setup.load_delay + r + 1,
                                partial(_report, c.job_id, r)))
            elif isinstance(c, StartStore):
                for r in range(setup.ranks):
                    due.append((step + 1, partial(_report, c.job_id, r)))
            elif isinstance(c, SubmitLookup):
                due.append((step + setup.lookup_delay_steps,
                            partial(_answer, engine, c)))
        obs.preempted = tuple(sorted(r["req"] for r in transitions if r["trigger"] == "preempted"))
        obs.waiting_remote = engine.state_counts["loading"]
        observations.append(obs)
        for event in follow:
            for c in engine.handle(event):
                if isinstance(c, StartStore):
                    for r in range(setup.ranks):
                        due.append((step + 1, partial(_report, c.job_id, r)))
        step += 1
        if not pending and not engine.busy() and not due:
            break
    return observations


def _report(job_id: int, rank: int, t: float) -> TransferReport:
    return TransferReport(t, job_id, rank)


def _answer(engine: Engine, command: SubmitLookup, t: float) -> LookupAnswer:
    return LookupAnswer(t, command.request_id, command.epoch, engine.sync_lookup(command.block_hashes))


@attrs.frozen
class Agreement:
    name: str
    steps: int
    identical: int
    first_differences: tuple[str, ...]


def compare(name: str, left: list[StepObs], right: list[StepObs], limit: int = 3) -> Agreement:
    steps = max(len(left), len(right))
    same = 0
    diffs: list[str] = []
    for i in range(steps):
        a = left[i].key() if i < len(left) else None
        b = right[i].key() if i < len(right) else None
        if a == b:
            same += 1
        elif len(diffs) < limit:
            diffs.append(f"step {i + 1}: {a} != {b}")
    return Agreement(name, steps, same, tuple(diffs))


SCENARIOS: dict[str, tuple[Callable[[], list[Item]], Setup]] = {
    "synthetic": (lambda: synthetic(0), Setup()),
    "seed000-async-lookup": (lambda: with_abort(synthetic(0), 4, 1), Setup(stack="async-lookup", lookup_delay_steps=2)),
    "seed002-two-workers": (lambda: synthetic(2), Setup(ranks=2)),
    "seed003-async-scheduling": (lambda: synthetic(3), Setup(async_scheduling=True)),
    "seed004-load-dedup": (lambda: synthetic(4), Setup(stack="shared-loads", load_delay=4)),
    "conversation": (lambda: conversation(), Setup()),
}


def run_all(model_dir: Path, names: list[str] | None = None) -> list[Agreement]:
    out = []
    for name in names or list(SCENARIOS):
        make, setup = SCENARIOS[name]
        items = make()
        a = run_vllm(model_dir, items, setup, "kvlife")
        c = run_kvlife(items, setup)
        out.append(compare(f"{name}: vLLM+KVLifeConnector vs kvlife engine", a, c))
        if setup.ranks == 1 and not setup.stack:
            b = run_vllm(model_dir, items, setup, "offloading")
            out.append(compare(f"{name}: vLLM+KVLifeConnector vs vLLM+OffloadingConnector", a, b))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvlife.lifecycle.drivers.vllm.differential",
                                     description="Step-by-step agreement of kvlife with vLLM's scheduler.",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("--scenario", action="append", choices=sorted(SCENARIOS), help="run only these")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        results = run_all(offline_model_dir(tmp), args.scenario)
    if args.json:
        print(json.dumps({"kind": "vllm-differential", "schema": 1,
                          "results": [attrs.asdict(r) for r in results]}))
    else:
        for r in results:
            print(f"{r.name}: {r.identical}/{r.steps} steps identical")
            for d in r.first_differences:
                print(f"  {d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
