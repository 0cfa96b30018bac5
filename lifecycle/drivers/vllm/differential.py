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
from kvlife.lifecycle.engine.blocks import extend_hashes
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
    continues: str | None = None  # the request whose prompt and answer this prompt starts with


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


def multi_turn(seed: int = 5, conversations: int = 5, block: int = 16) -> list[Item]:
    """Conversations of two turns: turn 2's prompt is turn 1's prompt, turn 1's answer
    (the scripted model samples token 7) and a new message, so it can hit the blocks
    turn 1's answer filled, on the device or, once they were evicted, in the tier."""
    rng = random.Random(seed)
    items = []
    for c in range(conversations):
        prompt = tuple(rng.randrange(1000, 20000) for _ in range(rng.randrange(block + 2, 3 * block)))
        items.append(Item(2 * c, f"m{c}a", prompt, rng.randrange(block // 2, block + 4)))
    for c in range(conversations):
        first = items[c]
        prompt = first.prompt + (7,) * first.max_tokens + tuple(
            rng.randrange(20000, 40000) for _ in range(rng.randrange(2, block)))
        items.append(Item(24 + 3 * c, f"m{c}b", prompt, rng.randrange(2, 5), continues=first.request_id))
    return items


def dedup_burst(seed: int = 4, block: int = 16, burst: int = 3) -> list[Item]:
    """A prefix stored by a first request, evicted from the device by unrelated requests,
    then wanted by a burst of requests one step apart while its load is in flight."""
    rng = random.Random(seed)
    prefix = tuple(range(5001, 5001 + 3 * block))

    def tail(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(20000, 40000) for _ in range(n))

    items = [Item(0, "w0", prefix + tail(10), 2)]
    items += [Item(3 + 2 * i, f"f{i}", tail(4 * block - 4), 2) for i in range(5)]
    items += [Item(16 + i, f"d{i}", prefix + tail(rng.randrange(4, block)), rng.randrange(2, 5)) for i in range(burst)]
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


def _item_hashes(item: Item, items: dict[str, Item], block: int) -> tuple[int, ...]:
    """An item's block hashes as kvlife names them: content hashes, except that a turn
    continuing another starts with that turn's prompt blocks and then the blocks its
    answer filled, under the engine's derived names (``blocks.derived_block_hash``)."""
    if item.continues is None:
        return _hashes(item.prompt, block)
    first = items[item.continues]
    context = extend_hashes(_item_hashes(first, items, block)[: len(first.prompt) // block], first.request_id,
                            (len(first.prompt) + first.max_tokens) // block)
    out, prev = list(context), context[-1].to_bytes(8, "big")
    for i in range(len(context), len(item.prompt) // block):
        digest = hashlib.blake2b(prev + repr(item.prompt[i * block:(i + 1) * block]).encode(), digest_size=8).digest()
        out.append(int.from_bytes(digest, "big") >> 1)
        prev = digest
    return tuple(out)


def _hashes(prompt: tuple[int, ...], block: int) -> tuple[int, ...]:
    out, prev = [], b""
    for i in range(len(prompt) // block):
        digest = hashlib.blake2b(prev + repr(prompt[i * block:(i + 1) * block]).encode(), digest_size=8).digest()
        out.append(int.from_bytes(digest, "big") >> 1)
        prev = digest
    return tuple(out)


def run_kvlife(items: list[Item], setup: Setup) -> list[StepObs]:
    """kvlife's Engine in lockstep with the vLLM runs (see the module docstring).

    It is stepped as ``VllmDriver`` steps vLLM: tick ``k`` is schedule ``k``; the
    simulated worker reports a job at worker step (the tick that carried the job) plus its
    delay; the output of step ``k`` reaches the engine together with the reports of worker
    step ``k``, right after tick ``k`` (or after tick ``k + 1`` under async scheduling, one
    step in flight). A store the engine starts on a step output is carried by the next
    tick, as the connector carries it in the next build. Lookup answers come
    ``lookup_delay_steps`` ticks after the tick that submitted them."""
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
    by_id = {it.request_id: it for it in items}
    pending = sorted(items, key=lambda it: it.step)
    answers: list[tuple[int, SubmitLookup]] = []  # (tick before which it is answered, lookup)
    reports: dict[int, list[tuple[int, int]]] = {}  # worker step -> [(job, rank)]
    bundles: list[tuple[int, int | None]] = []  # (worker step, step id of its plan) not yet applied
    in_flight = 1 if setup.async_scheduling else 0
    observations: list[StepObs] = []

    def carry(commands: list[Any], worker_step: int) -> None:
        for c in commands:
            if isinstance(c, StartLoad):
                for r in range(setup.ranks):
                    reports.setdefault(worker_step + setup.load_delay + r, []).append((c.job_id, r))
            elif isinstance(c, StartStore):
                for r in range(setup.ranks):
                    reports.setdefault(worker_step, []).append((c.job_id, r))
            elif isinstance(c, SubmitLookup):
                answers.append((tick + setup.lookup_delay_steps, c))

    def apply(worker_step: int, step_id: int | None, t: float) -> None:
        """One step's model output, then the workers' reports of that step."""
        if step_id is not None:
            finished = []
            for req, epoch, _, samples in engine.state.steps.get(step_id, ()):
                if samples and req.state == "running" and req.epoch == epoch \
                        and req.generated + 1 >= outputs[req.request_id]:
                    finished.append((req.request_id, "length"))
            carry(engine.handle(StepOutput(t, step_id, tuple(finished))), tick + 1)
        for job_id, rank in reports.pop(worker_step, []):
            carry(engine.handle(TransferReport(t, job_id, rank)), tick + 1)

    tick = 0
    while tick < 400:
        t = float(tick)
        for it in [it for it in pending if it.step <= tick]:
            engine.handle(Arrival(t, it.request_id, len(it.prompt), _item_hashes(it, by_id, setup.block_size),
                                  max_tokens=it.max_tokens))
            pending.remove(it)
        for it in items:
            if it.abort_step == tick and engine.requests[it.request_id].state != "finished":
                carry(engine.handle(Abort(t, it.request_id)), tick)
        for when, lookup in sorted([a for a in answers if a[0] <= tick], key=lambda a: a[0]):
            answers.remove((when, lookup))
            carry(engine.handle(LookupAnswer(t, lookup.request_id, lookup.epoch,
                                             engine.sync_lookup(lookup.block_hashes))), tick)
        transitions.clear()
        commands = engine.handle(Tick(t))
        obs = StepObs(tick + 1, {}, {}, 0, 0, ())
        plan_id = None
        for c in commands:
            if isinstance(c, StepPlan):
                plan_id = c.step_id
                for e in c.entries:
                    obs.scheduled[e.request_id] = (e.computed_before, e.num_tokens)
            elif isinstance(c, StartLoad):
                obs.loads_started += 1
                hit = len(c.moves) * setup.block_size
                obs.external_hits[c.request_id] = obs.external_hits.get(c.request_id, 0) + hit
        carry(commands, tick)
        obs.preempted = tuple(sorted(r["req"] for r in transitions if r["trigger"] == "preempted"))
        # vLLM's WAITING_FOR_REMOTE_KVS ends when a schedule pass first reaches the landed
        # request, even if it does not fit yet; kvlife's loading ends when it runs.
        obs.waiting_remote = sum(1 for r in engine.state.holding if not r.landed_seen)
        observations.append(obs)
        bundles.append((tick, plan_id))
        while len(bundles) > in_flight:
            apply(*bundles.pop(0), t)
        tick += 1
        if not pending and not engine.busy() and not answers and not any(reports.values()) \
                and all(step_id is None for _, step_id in bundles):
            break
    for worker_step, step_id in bundles:
        apply(worker_step, step_id, float(tick))
    return observations


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
    "seed004-load-dedup": (lambda: dedup_burst(), Setup(stack="shared-loads", load_delay=4)),
    "seed004-defer-while-loading": (lambda: dedup_burst(), Setup(stack="defer-while-loading", load_delay=4)),
    "conversation": (lambda: conversation(), Setup()),
    "multi-turn": (lambda: multi_turn(), Setup()),
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
