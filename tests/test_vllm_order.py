"""The vLLM-order driver (``lifecycle/drivers/vllm_order.py``), without vLLM: kvlife's
engine stepped as vLLM's engine core steps vLLM, with the connector answering its own
lookups and simulated ranks running the jobs. The differential (``kvlife vllm-diff``) and
``KVLifeConnector`` share its parts, so they are tested here, in the default suite."""

from __future__ import annotations

from kvlife.lifecycle.config import EngineConfig, TierConfig
from kvlife.lifecycle.drivers.vllm_diff import DiffSetup, prefix_sharing_items, run_kvlife
from kvlife.lifecycle.drivers.vllm_order import DelayedLookups, Item, RankJob, SimulatedRank, VllmOrderDriver, run_items
from kvlife.lifecycle.engine.events import DiscardLookup, SubmitLookup
from kvlife.policies.loading import load_stack


# ---- DelayedLookups: the connector's own async lookups -----------------------------------
def test_a_lookup_is_answered_after_its_delay_with_the_tiers_of_then() -> None:
    held: dict[int, str] = {}
    lookups = DelayedLookups(2, lambda hashes: tuple(held[h] for h in hashes if h in held))
    assert lookups.due(0, 0.0) == []
    lookups.submit(SubmitLookup("a", 0, (1, 2)))
    lookups.submit(SubmitLookup("a", 0, (1, 2)))  # a second submission of one epoch: one answer
    assert lookups.due(1, 1.0) == [] and lookups.busy
    held.update({1: "host", 2: "disk"})  # stored while the lookup was out: the answer sees it
    (answer,) = lookups.due(2, 2.0)
    assert (answer.request_id, answer.epoch, answer.tiers, answer.t) == ("a", 0, ("host", "disk"), 2.0)
    assert not lookups.busy and lookups.due(3, 3.0) == []


def test_a_discarded_lookup_still_answers_and_epochs_answer_apart() -> None:
    lookups = DelayedLookups(1, lambda hashes: ())
    lookups.submit(SubmitLookup("a", 0, (1,)))
    lookups.discard(DiscardLookup("a", 0))  # a client cannot recall an answer: it comes, stale
    lookups.submit(SubmitLookup("a", 1, (1,)))
    assert [(x.request_id, x.epoch) for x in lookups.due(1, 1.0)] == [("a", 0), ("a", 1)]


# ---- SimulatedRank: a worker without bytes -----------------------------------------------
def _load(job: int, hashes: tuple[int, ...] = (7, 8), after: int | None = None) -> RankJob:
    return RankJob(job, "load", f"r{job}", hashes, tuple(range(len(hashes))), after)


def test_a_load_reports_after_its_delay_and_a_join_with_its_owner() -> None:
    rank = SimulatedRank(rank=1, load_delay=2, fail=lambda r, kind, rid, hashes: (8,) if rid == "r0" else ())
    assert rank.run_step([_load(0)]) == []
    # the join comes a step later and waits for the load it copies from
    assert rank.run_step([_load(1, after=0)]) == []
    # both report in the owner's step; the join fails the blocks its owner failed
    assert rank.run_step([]) == [(0, 1, (8,)), (1, 1, (8,))]
    assert not rank.busy
    # a join of a load already landed reports in its own step
    assert rank.run_step([_load(2, after=0)]) == [(2, 1, (8,))]


def test_flushed_abandoned_and_hung_jobs() -> None:
    rank = SimulatedRank(load_delay=None, store_delay=5)
    store = RankJob(3, "store", "s", (1, 2), (4, 5))
    assert rank.run_step([store, _load(4)]) == []
    assert rank.run_step([], flush=[3]) == [(3, 0, ())]  # a flushed store ends before the step computes
    assert rank.busy  # the load never reports on its own (a transfer that hangs) ...
    for _ in range(20):
        assert rank.run_step([]) == []
    assert rank.run_step([], abandon=[4]) == [(4, 0, (7, 8))]  # ... until given up: every block failed
    assert not rank.busy


# ---- VllmOrderDriver: the engine stepped in vLLM's order ---------------------------------
def _driver(async_scheduling: bool = False, stack: tuple[str, ...] = ()) -> VllmOrderDriver:
    config = EngineConfig(block_tokens=4, device_blocks=64, max_batched_tokens=64, max_running=8,
                          async_scheduling=async_scheduling, tiers=(TierConfig("host", capacity_blocks=64),))
    return VllmOrderDriver(config, load_stack(list(stack)), [SimulatedRank(0, load_delay=2)], lookup_delay_steps=1)


def test_async_scheduling_schedules_the_next_step_before_the_output_of_the_last() -> None:
    items = [Item(0, "a", tuple(range(10)), 4)]
    sync = [o.scheduled.get("a") for o in run_items(_driver(), items)]
    both = [o.scheduled.get("a") for o in run_items(_driver(async_scheduling=True), items)]
    # the same chunks: a prefill of 10 tokens, then one decode per step (under async
    # scheduling each scheduled before the last one's output came) ...
    assert sync[:4] == both[:4] == [(0, 10), (10, 1), (11, 1), (12, 1)]
    # ... and vLLM's ending: sync, one empty pass sees the request gone; async, a pass with
    # its last token in flight schedules nothing, and the output of each step comes a pass late
    assert sync[4:] == [None] and both[4:] == [None, None, None]


def _delay_driver(delay: int) -> VllmOrderDriver:
    config = EngineConfig(block_tokens=4, device_blocks=64, max_batched_tokens=64, max_running=8,
                          tiers=(TierConfig("host", capacity_blocks=64),))
    return VllmOrderDriver(config, load_stack(["async-lookup"]), [SimulatedRank(0)], lookup_delay_steps=delay)


def test_the_connector_answers_its_own_lookups_after_lookup_delay_steps_passes() -> None:
    first = tuple(range(32))
    items = [Item(0, "t1", first, 1), Item(12, "t2", (*first, *range(100, 116)), 1)]
    for delay in (1, 3):
        driver = _delay_driver(delay)
        obs = run_items(driver, items)
        when = {rid: next(o.step for o in obs if rid in o.scheduled) for rid in ("t1", "t2")}
        # the pass that first sees a request sends its lookup; the answer is there `delay`
        # passes later, and the request is scheduled in that pass (steps count from 1)
        assert when == {"t1": 1 + delay, "t2": 13 + delay}
        # the second turn's prompt begins with the first turn's: 8 full blocks hit on device
        assert [o.scheduled["t2"] for o in obs if "t2" in o.scheduled][0] == (32, 16)
        assert driver.engine.requests["t2"].device_hit_blocks == 8


def test_the_same_items_give_the_same_steps() -> None:
    items = prefix_sharing_items(3, requests=30, abort_rate=0.1)
    setup = DiffSetup(num_blocks=24, max_num_batched_tokens=64, max_num_seqs=6, async_scheduling=True, ranks=2)
    one, two = run_kvlife(items, setup), run_kvlife(items, setup)
    assert one == two
    assert any(o.preempted for o in one)  # the setup does put the device under pressure
