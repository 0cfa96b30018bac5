"""One user policy through the simulator and through the vLLM-order driver: asked at the same
points, with the same views, answering the same.

The vLLM-order driver (``drivers.vllm_order``) steps kvlife's engine as vLLM's engine core steps
vLLM's scheduler (the path ``KVLifeConnector`` runs inside vLLM: the same ``ConnectorAPI`` and
connector core); the simulator steps it with its physical model. On a workload whose requests
do not overlap (each arrives after the one before has finished and its blocks were given back),
the two drivers differ only in time (stores report within a step in both: whether a store is
still in flight when a request finishes decides whether ``hold_at_finish`` is asked):
every request meets the same hooks in the same order,
sees the same request and engine views (the driver's clock aside, which each view must carry
in ms), and gets the same answers. The workload exercises a tier hit (a prefix stored by the
first request, then evicted from the small device), an async lookup, a load and a hold at
finish.
"""

from __future__ import annotations

from typing import Any

import attrs

from kvlife.lifecycle.config import EngineConfig, RunConfig, SimConfig, TierConfig
from kvlife.lifecycle.drivers.simulator import Simulator
from kvlife.lifecycle.drivers.vllm_order import Item, SimulatedRank, VllmOrderDriver, run_items
from kvlife.lifecycle.workloads.mooncake import WorkloadRequest
from kvlife.policies.base import Decision, EngineView, LoadView, RequestView
from kvlife.policies.stack import PolicyStack

BT = 16
ENGINE = EngineConfig(block_tokens=BT, device_blocks=12, max_batched_tokens=64, max_running=4, ranks=1,
                      tiers=(TierConfig("host", capacity_blocks=64),))


class LoggingPolicy:
    """A user policy: async lookups for prompts of 4 blocks or more, defer admission while the
    device is nearly full, store everything confirmed; every ask logged."""

    name = "logging"

    def __init__(self) -> None:
        self.asks: list[tuple[str, RequestView, EngineView, Any, Any]] = []

    def _log(self, hook: str, req: RequestView, engine: EngineView, extra: Any, decision: Decision[Any]) -> Any:
        self.asks.append((hook, req, engine, extra, decision.value))
        return decision

    def on_arrival(self, req: RequestView, engine: EngineView) -> Decision[str]:
        return self._log("on_arrival", req, engine, None, Decision("none", "no early lookup"))

    def lookup_mode(self, req: RequestView, engine: EngineView) -> Decision[str]:
        mode = "async" if len(req.block_hashes) >= 4 else "sync"
        return self._log("lookup_mode", req, engine, None, Decision(mode, f"{len(req.block_hashes)} blocks"))

    def admission(self, req: RequestView, load: LoadView, engine: EngineView) -> Decision[str]:
        value = "defer" if engine.free_device_blocks < 2 else "go"
        return self._log("admission", req, engine, load, Decision(value, f"{engine.free_device_blocks} free"))

    def store_limit(self, req: RequestView, engine: EngineView) -> Decision[int]:
        return self._log("store_limit", req, engine, None, Decision(req.confirmed_tokens, "confirmed"))

    def hold_at_finish(self, req: RequestView, stores: int, engine: EngineView) -> Decision[bool]:
        return self._log("hold_at_finish", req, engine, stores, Decision(True, "hold while storing"))


def workload() -> list[WorkloadRequest]:
    shared = tuple(range(100, 105))  # five blocks: the first request stores them
    return [
        WorkloadRequest("a", 0.0, 5 * BT + 3, 4, shared),
        WorkloadRequest("filler", 60_000.0, 8 * BT, 3, tuple(range(300, 308))),  # evicts a's blocks
        WorkloadRequest("b", 120_000.0, 5 * BT + 7, 5, shared),  # hits them in the host tier: a load
        WorkloadRequest("c", 180_000.0, 2 * BT + 1, 2, (900, 901)),  # a sync lookup, a miss
    ]


def simulated(policy: LoggingPolicy) -> None:
    config = RunConfig(engine=ENGINE, sim=SimConfig(rank_jitter_ms=0.0))
    Simulator(config, workload(), PolicyStack([policy])).run()


def vllm_order(policy: LoggingPolicy) -> None:
    items = [Item(int(w.arrival_ms // 1000), w.request_id, tuple(range(w.input_length)), w.output_length,
                  block_hashes=w.hash_ids) for w in workload()]
    driver = VllmOrderDriver(ENGINE, PolicyStack([policy]), [SimulatedRank(0, load_delay=3, store_delay=0)])
    run_items(driver, items)


def without_time(ask: tuple[str, RequestView, EngineView, Any, Any]) -> tuple[Any, ...]:
    hook, req, engine, extra, value = ask
    return hook, attrs.evolve(req, arrival_ms=0.0), attrs.evolve(engine, now_ms=0.0), extra, value


def test_one_policy_is_asked_alike_by_the_simulator_and_in_vllm_order() -> None:
    sim, order = LoggingPolicy(), LoggingPolicy()
    simulated(sim)
    vllm_order(order)
    hooks = {ask[0] for ask in sim.asks}
    # Every decision point this workload reaches was reached, the load's admission included.
    assert hooks == {"on_arrival", "lookup_mode", "admission", "store_limit", "hold_at_finish"}
    loads = [a for a in sim.asks if a[0] == "admission"]
    assert loads and all(a[3].external_hit_blocks >= 1 and a[3].device_hit_blocks + a[3].external_hit_blocks == 5
                         for a in loads)
    assert [without_time(a) for a in sim.asks] == [without_time(a) for a in order.asks]


def test_the_views_carry_each_drivers_clock_and_real_device_blocks() -> None:
    for run, ms_per_step in ((simulated, None), (vllm_order, 1000.0)):
        policy = LoggingPolicy()
        run(policy)
        arrivals = {w.request_id: w.arrival_ms for w in workload()}
        for hook, req, engine, _, _ in policy.asks:
            # The request's arrival in ms of the driver's clock (the vLLM-order driver's is one
            # ms per scheduler step; the workload's step for it is arrival_ms / 1000).
            expected = arrivals[req.request_id] if ms_per_step is None else arrivals[req.request_id] / ms_per_step
            assert req.arrival_ms == expected, (hook, req.request_id)
            assert engine.now_ms >= req.arrival_ms
            assert engine.device_blocks == ENGINE.device_blocks
            assert 0 <= engine.free_device_blocks <= ENGINE.device_blocks
