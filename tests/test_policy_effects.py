"""The built-in policies' effects, measured on seeded simulated runs (numbers, not hopes).

Each scenario picks the knobs that make one effect visible: slow lookups for async lookup,
a queue and a slow disk tier for early prefetch, bursts of requests whose shared prefix was
evicted from the device for shared loads, async scheduling for stores. The physics are the
defaults (Llama-3-8B on one H100 SXM: the step-cost model, contended links, one lookup
worker, completions at step boundaries); the figures in the comments were measured on them
(main at b6b7b15). The thresholds are not those figures: each is derived from what the
policy must do (the derivation is in a comment beside it), so they hold for any engine and
physics that do what the policy asks, and fail for one that does not.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvlife.lifecycle.config import EngineConfig, RunConfig, SimConfig, TierConfig
from kvlife.lifecycle.drivers.runner import RunOutcome, run_workload
from kvlife.lifecycle.drivers.simulator import Simulator
from kvlife.lifecycle.engine.events import StartLoad, StartStore
from kvlife.lifecycle.metrics import summarize
from kvlife.lifecycle.profiles.catalog import load_hardware
from kvlife.lifecycle.workloads.mooncake import WorkloadRequest
from kvlife.lifecycle.workloads.synthetic import synthetic_workload
from kvlife.policies.loading import load_stack

BT = 256
SIM = SimConfig(seed=1)


def run(engine: EngineConfig, stack: tuple[str, ...], workload: list[WorkloadRequest]) -> RunOutcome:
    outcome = run_workload(RunConfig(engine=engine, sim=SIM, policies=stack), workload)
    assert outcome.summary["stranded"] == 0
    assert outcome.result.engine.state_counts["finished"] == len(workload)
    outcome.result.engine.check_invariants()
    return outcome


def ttft(outcome: RunOutcome, q: float) -> float:
    value = outcome.summary["ttft_ms"][f"p{q:g}"]
    assert value is not None
    return float(value)


# ---- async lookup -------------------------------------------------------------------
SLOW_LOOKUPS = EngineConfig(
    block_tokens=BT, device_blocks=400, max_batched_tokens=4096, max_running=64, lookup_latency_ms=8.0,
    tiers=(TierConfig("host", capacity_blocks=2000),),
)


def test_async_lookup_takes_lookups_off_the_critical_path() -> None:
    workload = synthetic_workload(seed=1, num_requests=300, arrival_rate_per_s=12.0, block_tokens=BT)
    sync = run(SLOW_LOOKUPS, ("sync-lookup",), workload)
    async_ = run(SLOW_LOOKUPS, ("async-lookup",), workload)
    assert sync.summary["critical_path_lookup_ms"] > 0
    assert sync.summary["sync_lookups"] > 0
    assert async_.summary["critical_path_lookup_ms"] == 0
    assert async_.summary["sync_lookups"] == 0
    assert async_.summary["async_lookups"] >= len(workload)
    # measured: p50 1,833 ms (sync: 4.9 s of lookups inline with steps, 606 of them) vs
    # 316 ms (async). Derivation: every ms of an inline lookup stalls the step loop, so
    # every request waiting for its first token then waits that much longer; async takes
    # the lookups off that path (each request still awaits its own answer, in
    # lookup_pending, but no step waits for it). TTFT must drop by at least half the inline
    # lookup time removed per request.
    removed_per_request = sync.summary["critical_path_lookup_ms"] / len(workload)
    assert ttft(sync, 50) - ttft(async_, 50) >= 0.5 * removed_per_request


# ---- early prefetch -----------------------------------------------------------------
# A small host tier in front of a slow disk (1.5 GB/s: a SATA or network block device; the
# profile's 7 GB/s NVMe makes the pull too cheap to matter, see docs/benchmarks.md).
SLOW_DISK = EngineConfig(
    block_tokens=BT, device_blocks=300, max_batched_tokens=4096, max_running=64, lookup_latency_ms=2.0,
    tiers=(
        TierConfig("host", capacity_blocks=300),
        TierConfig("disk", capacity_blocks=8000, bandwidth_gbps=1.5, latency_ms=2.0),
    ),
)


def loaded_from(stack: tuple[str, ...], workload: list[WorkloadRequest]) -> tuple[RunOutcome, dict[str, int]]:
    """The run, and the blocks its admissions loaded from each tier."""
    records: list[dict[str, Any]] = []
    config = RunConfig(engine=SLOW_DISK, sim=SIM, policies=stack)
    sim = Simulator(config, workload, load_stack(list(stack)), recorder=records.append)
    result = sim.run()
    assert result.stranded == []
    tiers: dict[str, int] = {}
    for r in records:
        if r["kind"] == "job" and r["op"] == "load":
            for tier, n in r["tiers"].items():
                tiers[tier] = tiers.get(tier, 0) + n
    return RunOutcome(result, summarize(result, 0.0, sim.physics.block_bytes), len(records)), tiers


def test_early_prefetch_pulls_disk_blocks_into_host_while_requests_queue() -> None:
    """Early prefetch looks a request up when it arrives and pulls its disk blocks into the
    host tier while it queues: the load at admission then comes from host, and the lookup is
    off the critical path. At 4 req/s the queue holds (TTFT p50 161 ms, p99 7.5 s)."""
    workload = synthetic_workload(seed=1, num_requests=300, arrival_rate_per_s=4.0, block_tokens=BT)
    base, base_tiers = loaded_from((), workload)
    early, early_tiers = loaded_from(("early-prefetch",), workload)
    stats = early.result.engine.stats
    assert stats.prefetches > 0 and stats.blocks_prefetched > 0
    assert early.summary["critical_path_lookup_ms"] < 0.1 * base.summary["critical_path_lookup_ms"]
    # measured: 1,233 blocks pulled into host; admissions load 24 blocks from disk instead
    # of 1,283, and 1,202 from host instead of 20. Derivation: a block pulled into host
    # before its request is admitted is loaded from host, not disk (the patience is the
    # fallback's: wait for the pull); allow half of the pulled blocks to be lost to host
    # evictions and to admissions that come before the pull was started.
    pulled = stats.blocks_prefetched
    assert early_tiers.get("disk", 0) <= base_tiers["disk"] - pulled // 2
    assert early_tiers.get("host", 0) >= base_tiers.get("host", 0) + pulled // 2
    # measured: p50 160.5 -> 82.9 ms, p90 4,837 -> 3,888 ms; p99 7,506 -> 11,263 ms (worse:
    # the pulls share the disk with the stores, and the answers taken at arrival age in the queue)
    assert ttft(early, 50) < 0.9 * ttft(base, 50)


def test_early_prefetch_skips_resumable_requests() -> None:
    from kvlife.lifecycle.engine.core import Engine
    from kvlife.lifecycle.engine.events import Arrival, SubmitLookup

    engine = Engine(SLOW_DISK, load_stack(["early-prefetch"]))
    plain = engine.handle(Arrival(0.0, "a", 4 * BT, (1, 2, 3, 4)))
    streaming = engine.handle(Arrival(0.0, "b", 4 * BT, (1, 2, 3, 4), resumable=True))
    assert [type(c) for c in plain] == [SubmitLookup]
    assert streaming == []
    assert engine.requests["a"].state == "lookup_pending"
    assert engine.requests["b"].state == "waiting"


def _prefetch_runs(stack: tuple[str, ...]) -> RunOutcome:
    # The profile's NVMe drive: a request admitted soon after it arrives finds its prefetch
    # (tens of blocks at 7 GB/s, ~0.1 s) still running.
    engine = EngineConfig(
        block_tokens=BT, device_blocks=300, max_batched_tokens=4096, max_running=64, lookup_latency_ms=2.0,
        tiers=(TierConfig("host", capacity_blocks=300), TierConfig("disk", capacity_blocks=8000)),
    )
    workload = synthetic_workload(seed=3, num_requests=200, arrival_rate_per_s=2.0, block_tokens=BT)
    return run(engine, stack, workload)


def test_prefetch_patience_best_effort_computes_what_has_not_landed() -> None:
    best = _prefetch_runs(("prefetch-best-effort", "early-prefetch"))
    wait = _prefetch_runs(("prefetch-wait-complete", "early-prefetch"))
    assert best.result.engine.stats.prefetch_gave_up > 0
    assert best.summary["deferrals"].get("prefetch-best-effort", 0) == 0
    assert wait.result.engine.stats.prefetch_gave_up == 0
    assert wait.summary["deferrals"]["prefetch-wait-complete"] > 0


def test_prefetch_timeout_gives_up_at_its_deadline() -> None:
    from kvlife.policies.prefetch_patience import PrefetchTimeout

    class Short(PrefetchTimeout):
        name = "short-timeout"

        def __init__(self) -> None:
            super().__init__(base_ms=5.0, per_1k_tokens_ms=1.0, cap_ms=20.0)

    from kvlife.policies.stack import PolicyStack

    engine = _prefetch_runs(()).result.engine.config  # same engine config
    workload = synthetic_workload(seed=3, num_requests=200, arrival_rate_per_s=2.0, block_tokens=BT)
    records: list[dict[str, Any]] = []
    from kvlife.policies.early_prefetch import EarlyPrefetch

    sim = Simulator(RunConfig(engine=engine, sim=SIM), workload, PolicyStack([Short(), EarlyPrefetch()]),
                    recorder=records.append)
    result = sim.run()
    assert result.stranded == []
    gave_up = [r for r in records if r["kind"] == "decision" and r["value"] == "compute"]
    assert gave_up and all(r["policy"] == "short-timeout" for r in gave_up)
    # Nobody gave up before the deadline, and nobody waited past the cap unless admission
    # could not reach it: a give-up is decided when the scheduler considers the request,
    # and a request ahead of it in the queue that does not fit stops admission (FIFO).
    # Then the tick that gives up also admits a request that arrived before it.
    planned = {r["step"]: r["t"] for r in records if r["kind"] == "step"}
    longest = max(r["t"] - planned[r["step_id"]] for r in records
                  if r["kind"] == "input" and r["type"] == "step_output")
    started = {r["req"]: r["t"] for r in records if r["kind"] == "job" and r["op"] == "prefetch"}
    patience = {r["req"]: r["value"] for r in records if r["kind"] == "decision"
                and r["point"] == "prefetch_patience" and r["value"] != "compute"}
    order = {w.request_id: i for i, w in enumerate(workload)}
    admitted = [(r["t"], r["req"]) for r in records if r["kind"] == "transition"
                and r["trigger"] in ("admitted", "load_started")]
    late = 0
    for r in gave_up:
        waited = r["t"] - started[r["req"]]
        assert waited >= patience[r["req"]] - 1e-6
        if waited > 20.0 + longest + 1e-6:  # past the cap by more than one step
            late += 1
            assert any(t == r["t"] and order[rid] < order[r["req"]] for t, rid in admitted), r
    assert late <= len(gave_up) // 10


# ---- shared loads --------------------------------------------------------------------
def shared_prefix_bursts(n_prefixes: int = 3, prefix_blocks: int = 24, burst: int = 12, own: int = 12,
                         fillers: int = 38) -> list[WorkloadRequest]:
    """Warm a shared prefix plus each member's own history into the host tier, flush the
    device with unrelated requests, then send the members again in a burst: every member
    hits the shared prefix (one load suffices) and its own history (its own load). Warm-up
    requests come every 400 ms and fillers every 300 ms, which one H100 keeps up with."""
    out: list[WorkloadRequest] = []
    h = 10_000_000
    t = 0.0
    for p in range(n_prefixes):
        prefix = tuple(range(p * 1000, p * 1000 + prefix_blocks))
        owns = []
        for b in range(burst):
            mine = tuple(range(h, h + own))
            h += own + 1
            owns.append(mine)
            prompt = (prefix_blocks + own) * BT + 10
            out.append(WorkloadRequest(f"warm-{p}-{b}", t, prompt, 2, prefix + mine + (h - 1,)))
            t += 400.0
        for f in range(fillers):
            out.append(WorkloadRequest(f"fill-{p}-{f}", t, 30 * BT, 2, tuple(range(h, h + 30))))
            h += 30
            t += 300.0
        t += 1000.0
        for b in range(burst):
            hashes = prefix + owns[b] + (h, h + 1)
            h += 2
            out.append(WorkloadRequest(f"b-{p}-{b}", t + b, (prefix_blocks + own + 1) * BT + 100, 20, hashes))
        t += 5000.0
    return out


# The profile's host link (PCIe Gen5, 52.8 GB/s per direction), shared by concurrent loads.
BURSTS = EngineConfig(
    block_tokens=BT, device_blocks=1000, max_batched_tokens=8192, max_running=64, lookup_latency_ms=1.0,
    tiers=(TierConfig("host", capacity_blocks=6000),),
)


def test_shared_loads_removes_redundant_loads_without_the_convoy() -> None:
    """Without dedup, every burst member loads the shared prefix again, and those loads share
    the host link with everyone's: the last member's first token comes late. Shared loads
    join the one in-flight load. Deferring until it lands (defer-while-loading) costs nothing
    more here: the members' own blocks queue on the same saturated link either way, so the
    convoy the old uncontended model showed (+13 % p99) is gone."""
    n_prefixes, prefix_blocks = 3, 24
    workload = shared_prefix_bursts(n_prefixes=n_prefixes, prefix_blocks=prefix_blocks)
    plain = run(BURSTS, (), workload)
    shared = run(BURSTS, ("shared-loads",), workload)
    defer = run(BURSTS, ("defer-while-loading",), workload)
    assert plain.summary["redundant_block_loads"] > 0
    assert shared.summary["redundant_block_loads"] == 0
    assert defer.summary["redundant_block_loads"] == 0
    assert shared.result.engine.stats.joined_blocks > 0
    assert shared.summary["bytes_loaded"] < plain.summary["bytes_loaded"]
    assert defer.summary["deferrals"]["defer-while-loading"] > 0
    # measured p99: 405 ms (no dedup: 792 redundant block loads, 43.5 GB loaded), 308 ms
    # (shared-loads, 16.9 GB), 308 ms (defer-while-loading).
    # Derivation: the loads shared-loads removes all cross the one host link (the
    # profile's 52.8 GB/s), which each burst saturates; a burst's last member waits for
    # every byte queued ahead of it, so its TTFT drops by the link time removed from its
    # burst. Allow 40 % of it: steps, and the members' own loads, overlap part of that time.
    link_bytes_per_ms = load_hardware(SIM.hardware).host_link_gb_s * 1e6
    removed_ms = (plain.summary["bytes_loaded"] - shared.summary["bytes_loaded"]) / link_bytes_per_ms / n_prefixes
    assert ttft(plain, 99) - ttft(shared, 99) >= 0.4 * removed_ms
    # defer-while-loading starts no load that joining would not: a deferred member waits
    # for the shared prefix to land, then hits it on the device, where a joiner waits for
    # the same load. The two may differ by at most one load of the prefix.
    prefix_ms = prefix_blocks * shared.summary["setup"]["block_bytes"] / link_bytes_per_ms
    assert abs(ttft(defer, 99) - ttft(shared, 99)) <= prefix_ms


def test_shared_loads_never_has_two_loads_of_one_block_in_flight() -> None:
    """Invariant 6, checked at every event of a whole run: at most one tier load of a block
    is in flight. A joiner's own job (``StartLoad.after``) reads no tier: it copies, device
    to device, the blocks its owner's in-flight tier load fills."""
    workload = shared_prefix_bursts(n_prefixes=1, burst=8)
    sim = Simulator(RunConfig(engine=BURSTS, sim=SIM), workload, load_stack(["shared-loads"]))
    engine = sim.engine
    handle = engine.handle
    fills: dict[int, dict[int, int]] = {}  # tier load job -> {block hash: device block it fills}
    joins = [0]

    def checked(event: Any) -> Any:
        commands = handle(event)
        for command in commands:
            if not isinstance(command, StartLoad):
                continue
            if command.after is None:
                assert all(m.tier != "device" for m in command.moves)
                fills[command.job_id] = {m.block_hash: m.device_block for m in command.moves}
                continue
            joins[0] += 1
            assert command.after in engine.jobs, f"job {command.job_id} joins a load no longer in flight"
            owner = fills[command.after]
            for move in command.moves:
                assert move.tier == "device" and move.slot == owner[move.block_hash]
        seen: dict[int, int] = {}
        for job in engine.jobs.values():
            if job.kind == "load" and job.after is None:
                for move in job.moves:
                    assert move.block_hash not in seen, f"block {move.block_hash} loaded by two jobs"
                    seen[move.block_hash] = job.job_id
        return commands

    engine.handle = checked  # type: ignore[method-assign]
    assert sim.run().stranded == []
    assert joins[0] > 0  # the burst did join (else the check above saw nothing to check)


@pytest.mark.parametrize("stack", [["shared-loads"], []])
def test_a_joiner_copies_the_owners_blocks_instead_of_loading_them_again(stack: list[str]) -> None:
    """Two requests admitted in one pass hit the same four host blocks. With shared-loads the
    second joins the first's load: its job copies the owner's device blocks, no tier block is
    read twice, and the summary's blocks loaded count only the tier reads. Without it, both
    read the tier."""
    from kvlife.lifecycle.engine.core import Engine
    from kvlife.lifecycle.engine.events import Arrival, Tick

    config = EngineConfig(block_tokens=16, device_blocks=32, max_batched_tokens=256,
                          tiers=(TierConfig("host", capacity_blocks=32),))
    engine = Engine(config, load_stack(stack), reference=True)
    prefix = [1, 2, 3, 4]
    host = engine.tiers["host"]
    host.complete_store([h for h, _ in host.prepare_store(prefix).accepted])
    engine.handle(Arrival(0.0, "a", 70, (*prefix, 5)))
    engine.handle(Arrival(0.0, "b", 70, (*prefix, 6)))
    loads = {c.request_id: c for c in engine.handle(Tick(0.0)) if isinstance(c, StartLoad)}
    owner, joiner = loads["a"], loads["b"]
    assert [m.block_hash for m in owner.moves] == prefix and owner.after is None
    assert {m.tier for m in owner.moves} == {"host"}
    stats = engine.stats
    if stack:
        assert joiner.after == owner.job_id
        assert [(m.block_hash, m.tier, m.slot) for m in joiner.moves] == \
            [(m.block_hash, "device", m.device_block) for m in owner.moves]
        assert (stats.blocks_loaded, stats.joined_blocks, stats.redundant_block_loads) == (4, 4, 0)
    else:
        assert joiner.after is None and {m.tier for m in joiner.moves} == {"host"}
        assert (stats.blocks_loaded, stats.joined_blocks, stats.redundant_block_loads) == (8, 0, 4)
    assert {m.device_block for m in joiner.moves}.isdisjoint(m.device_block for m in owner.moves)


# ---- placeholder-safe stores ----------------------------------------------------------
ASYNC = EngineConfig(
    block_tokens=64, device_blocks=600, max_batched_tokens=512, max_running=32, async_scheduling=True,
    tiers=(TierConfig("host", capacity_blocks=4000),),
)


def stores_past_confirmed(stack: list[str]) -> tuple[int, int]:
    """(blocks stored, blocks stored while some of their tokens were unconfirmed), judged
    when each store is decided (its ``job`` record: the request as it is at that moment). The
    ``StartStore`` goes out with the next step's metadata, by when the request may have been
    preempted (its confirmed count reset, the store flushed): that is no unsafe store."""
    workload = synthetic_workload(seed=4, num_requests=120, arrival_rate_per_s=20.0, block_tokens=64)
    counts = [0, 0]
    requests: dict[str, Any] = {}

    def recorder(record: dict[str, Any]) -> None:
        if record["kind"] != "job" or record["op"] != "store":
            return
        req = requests[record["req"]]
        real = req.prompt_tokens + req.generated
        for block_hash, _, _ in record["moves"]:
            end = (req.hashes.index(block_hash) + 1) * ASYNC.block_tokens
            counts[0] += 1
            if end > req.confirmed or end > real:
                counts[1] += 1

    sim = Simulator(RunConfig(engine=ASYNC, sim=SIM), workload, load_stack(stack), recorder=recorder)
    requests = sim.engine.requests
    result = sim.run()
    assert result.stranded == []
    return counts[0], counts[1]


def test_the_baseline_never_stores_an_unconfirmed_position() -> None:
    """The baseline's store boundary (once the policy placeholder-safe-stores) against the
    naive one below: the same workload, where naive stores do cover placeholders."""
    stored, unsafe = stores_past_confirmed([])
    assert stored > 100
    assert unsafe == 0


def test_naive_boundary_stores_placeholder_positions() -> None:
    stored, unsafe = stores_past_confirmed(["naive-stores-unsafe"])
    assert stored > 100
    assert unsafe > 0


def _finish_with_a_store() -> tuple[Any, StartStore]:
    """Two ranks; ``a`` stops on its first step. Its last full blocks' store is decided at
    that step output and goes out with the next step's metadata (vLLM's build_connector_meta)."""
    from kvlife.lifecycle.engine.core import Engine
    from kvlife.lifecycle.engine.events import Arrival, StepOutput, StepPlan, Tick

    config = EngineConfig(block_tokens=16, device_blocks=32, max_batched_tokens=256, ranks=2,
                          tiers=(TierConfig("host", capacity_blocks=16),))
    engine = Engine(config, load_stack([]), reference=True)
    engine.handle(Arrival(0.0, "a", 33, (10, 20, 30)))
    plan = next(c for c in engine.handle(Tick(0.0)) if isinstance(c, StepPlan))
    assert not [c for c in engine.handle(StepOutput(1.0, plan.step_id, (("a", "stopped"),)))
                if isinstance(c, StartStore)]
    store = next(c for c in engine.handle(Tick(1.0)) if isinstance(c, StartStore))
    assert [m.block_hash for m in store.moves] == [10, 20]
    return engine, store


def test_the_baseline_holds_a_finished_request_until_every_rank_reported() -> None:
    """The request waits in ``sending``, its blocks held, until every rank has reported its
    store and vLLM's ``finished_sending`` (each rank's, combined as KVOutputAggregator does)
    came with a step output. (Once the policy hold-while-sending, now the baseline's; the
    test below is the same sequence with a policy that does not hold.)"""
    from kvlife.lifecycle.engine.events import StepOutput, Tick, TransferReport

    engine, store = _finish_with_a_store()
    assert engine.requests["a"].state == "sending"
    engine.handle(TransferReport(2.0, store.job_id, 0))
    engine.handle(StepOutput(2.0, 1, ()))  # rank 0 reports finished_sending; rank 1 does not yet
    assert engine.requests["a"].state == "sending"
    assert engine.pool.free < engine.pool.capacity
    engine.handle(Tick(2.0))
    engine.handle(TransferReport(3.0, store.job_id, 1))
    # Every rank reported; finished_sending comes with the next step output.
    assert engine.requests["a"].state == "sending"
    assert engine.pool.free < engine.pool.capacity
    engine.handle(StepOutput(4.0, 2, ()))
    assert engine.requests["a"].state == "finished"
    assert engine.pool.free == engine.pool.capacity
    engine.check_invariants()


class _FinishAtOnce:
    """A policy that does not hold: the request is finished at once."""

    name = "finish-at-once"

    def hold_at_finish(self, req: Any, stores_in_flight: int, engine: Any) -> Any:
        from kvlife.policies.base import Decision

        return Decision(False, "finish now")


def test_without_a_hold_the_request_finishes_while_its_store_still_reads_its_blocks() -> None:
    """What the baseline's hold decides: without it (a policy answering False), the request is
    reported finished while its KV is still leaving; the blocks stay held all the same
    (block safety is the engine's), until every rank reported the store."""
    from kvlife.lifecycle.engine.core import Engine
    from kvlife.lifecycle.engine.events import Arrival, StepOutput, StepPlan, Tick, TransferReport
    from kvlife.policies.stack import PolicyStack

    config = EngineConfig(block_tokens=16, device_blocks=32, max_batched_tokens=256, ranks=2,
                          tiers=(TierConfig("host", capacity_blocks=16),))
    engine = Engine(config, PolicyStack([_FinishAtOnce()]), reference=True)
    engine.handle(Arrival(0.0, "a", 33, (10, 20, 30)))
    plan = next(c for c in engine.handle(Tick(0.0)) if isinstance(c, StepPlan))
    engine.handle(StepOutput(1.0, plan.step_id, (("a", "stopped"),)))
    assert engine.requests["a"].state == "finished"
    store = next(c for c in engine.handle(Tick(1.0)) if isinstance(c, StartStore))
    for rank in (0, 1):
        engine.handle(TransferReport(2.0, store.job_id, rank))
    assert engine.pool.free < engine.pool.capacity
    engine.handle(StepOutput(3.0, 1, ()))
    assert engine.pool.free == engine.pool.capacity
