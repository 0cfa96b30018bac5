"""Per-rank report aggregation, alone and inside the engine (invariant 3)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvlife.lifecycle.config import EngineConfig, TierConfig
from kvlife.lifecycle.engine.core import Engine
from kvlife.lifecycle.engine.events import Arrival, StartLoad, StepOutput, StepPlan, Tick, TransferReport
from kvlife.lifecycle.engine.ranks import RankAggregator, ReportStatus
from kvlife.policies.stack import PolicyStack


def test_done_only_after_every_rank() -> None:
    agg = RankAggregator(3)
    agg.open(7)
    assert agg.report(7, 2, ()).status is ReportStatus.PENDING
    assert agg.report(7, 0, ()).status is ReportStatus.PENDING
    assert agg.missing_ranks(7) == (1,)
    outcome = agg.report(7, 1, ())
    assert outcome.status is ReportStatus.DONE and outcome.failed == ()
    assert not agg.in_flight(7)


def test_duplicates_unknown_and_bad_ranks_are_findings_not_progress() -> None:
    agg = RankAggregator(2)
    agg.open(1)
    assert agg.report(1, 0, ()).status is ReportStatus.PENDING
    assert agg.report(1, 0, ()).status is ReportStatus.DUPLICATE
    assert agg.report(1, 5, ()).status is ReportStatus.BAD_RANK
    assert agg.report(99, 0, ()).status is ReportStatus.UNKNOWN_JOB
    assert agg.report(1, 1, ()).status is ReportStatus.DONE
    assert agg.report(1, 1, ()).status is ReportStatus.UNKNOWN_JOB


@given(st.permutations(range(4)), st.lists(st.sets(st.integers(0, 9), max_size=3), min_size=4, max_size=4))
def test_failures_are_the_union_released_with_completion(order: list[int], failed: list[set[int]]) -> None:
    agg = RankAggregator(4)
    agg.open(0)
    outcomes = [agg.report(0, rank, tuple(sorted(failed[rank]))) for rank in order]
    assert [o.status for o in outcomes[:-1]] == [ReportStatus.PENDING] * 3
    assert outcomes[-1].status is ReportStatus.DONE
    assert outcomes[-1].failed == tuple(sorted(set().union(*failed)))


def _engine_with_stored_prefix(ranks: int) -> tuple[Engine, list[int]]:
    config = EngineConfig(block_tokens=16, device_blocks=8, max_batched_tokens=256, ranks=ranks,
                          tiers=(TierConfig("host", capacity_blocks=32),))
    engine = Engine(config, PolicyStack([]), reference=True)
    hashes = [101, 102, 103, 104]
    tier = engine.tiers["host"]
    plan = tier.prepare_store(hashes)
    tier.complete_store([h for h, _ in plan.accepted])
    return engine, hashes


def _admit_with_load(engine: Engine, hashes: list[int]) -> StartLoad:
    """``r`` hits the four stored blocks: its load goes out with step 0's metadata."""
    engine.handle(Arrival(0.0, "r", 70, tuple(hashes) + (105,)))
    commands = engine.handle(Tick(0.0))
    loads = [c for c in commands if isinstance(c, StartLoad)]
    assert len(loads) == 1
    assert [c.step_id for c in commands if isinstance(c, StepPlan)] == [0]
    assert engine.requests["r"].state == "loading"
    return loads[0]


def _step(engine: Engine, t: float, step_id: int) -> StepPlan:
    """Step ``step_id``'s output, then the next pass's plan (the ranks report what they
    finished, vLLM's finished_recving, only with a step output)."""
    engine.handle(StepOutput(t, step_id, ()))
    return next(c for c in engine.handle(Tick(t)) if isinstance(c, StepPlan))


def test_load_completes_only_when_both_ranks_report_in_any_order() -> None:
    engine, hashes = _engine_with_stored_prefix(ranks=2)
    load = _admit_with_load(engine, hashes)
    assert [m.block_hash for m in load.moves] == hashes
    engine.handle(TransferReport(1.0, load.job_id, 1))
    assert engine.requests["r"].state == "loading"
    engine.handle(TransferReport(1.5, load.job_id, 1))  # duplicate: warned, not counted
    assert engine.requests["r"].state == "loading"
    assert engine.stats.warnings == {"duplicate_report": 1}
    # rank 1 reports r in finished_recving with this output; rank 0 has not: not combined
    plan = _step(engine, 1.8, 0)
    assert engine.requests["r"].state == "loading" and plan.entries == ()
    engine.handle(TransferReport(2.0, load.job_id, 0))
    assert not engine.requests["r"].load_jobs  # every rank reported the job
    engine.handle(TransferReport(2.5, load.job_id, 0))  # after completion: unknown job
    assert engine.stats.warnings["unknown_job_report"] == 1
    assert engine.requests["r"].state == "loading"  # finished_recving comes with a step output
    plan = _step(engine, 3.0, plan.step_id)
    assert engine.requests["r"].state == "running"
    assert plan.entries[0].computed_before == 64 and plan.entries[0].num_tokens == 6
    engine.check_invariants()


def test_failed_blocks_on_one_rank_truncate_and_recompute() -> None:
    engine, hashes = _engine_with_stored_prefix(ranks=2)
    load = _admit_with_load(engine, hashes)
    engine.handle(TransferReport(1.0, load.job_id, 0, (103,)))
    engine.handle(TransferReport(1.0, load.job_id, 1))
    req = engine.requests["r"]
    assert req.state == "waiting" and req.epoch == 1
    assert not engine.tiers["host"].contains(103)  # the bad block is gone from the tier
    # vLLM's invalid_block_ids come with the step output: the request's computed tokens are
    # cut at the failed block; the next pass keeps the good blocks and recomputes the rest
    # into the blocks the load had filled.
    plan = _step(engine, 2.0, 0)
    entry, = plan.entries
    assert (entry.request_id, entry.computed_before, entry.num_tokens) == ("r", 32, 70 - 32)
    assert list(entry.block_table[:4]) == [m.device_block for m in load.moves]
    assert engine.pool.cached_prefix(hashes[:2]) == list(entry.block_table[:2])
    engine.handle(StepOutput(3.0, plan.step_id, (("r", "stopped"),)))
    engine.check_invariants()


def test_abort_during_load_keeps_blocks_until_every_rank_reports() -> None:
    engine, hashes = _engine_with_stored_prefix(ranks=2)
    load = _admit_with_load(engine, hashes)
    from kvlife.lifecycle.engine.events import Abort

    engine.handle(Abort(0.5, "r"))
    assert engine.requests["r"].state == "finished"
    held = [m.device_block for m in load.moves]
    assert all(engine.pool.refs[b] > 0 for b in held)  # the job still writes them
    engine.handle(TransferReport(1.0, load.job_id, 0))
    plan = _step(engine, 1.0, 0)  # rank 0 reports it finished, rank 1 does not yet
    assert all(engine.pool.refs[b] > 0 for b in held)
    engine.handle(TransferReport(2.0, load.job_id, 1))
    assert all(engine.pool.refs[b] > 0 for b in held)  # freed with finished_recving only
    engine.handle(StepOutput(2.0, plan.step_id, ()))
    assert all(engine.pool.refs[b] == 0 for b in held)
    assert engine.pool.free == engine.pool.capacity
    engine.check_invariants()


def test_missing_rank_times_out_and_blocks_stay_quarantined() -> None:
    engine, hashes = _engine_with_stored_prefix(ranks=2)
    engine = Engine(
        EngineConfig(block_tokens=16, device_blocks=8, max_batched_tokens=256, ranks=2,
                     transfer_deadline_ms=10.0, tiers=(TierConfig("host", capacity_blocks=32),)),
        PolicyStack([]),
        tiers=list(engine.tiers.values()),
    )
    load = _admit_with_load(engine, hashes)
    engine.handle(TransferReport(1.0, load.job_id, 0))
    plan = _step(engine, 20.0, 0)  # rank 1 never reported: the pass at 20 ms is past the deadline
    assert engine.stats.rank_timeouts == 1
    req = engine.requests["r"]
    # Degraded to recompute, not stranded: back in waiting, never to load from the tier again.
    assert req.state == "waiting"
    assert req.external_hit_limit == 0
    # The step output after the give-up reports the load failed on rank 1 (abandoned):
    # the scheduler lets go of r's blocks, but the core holds them (quarantine). r cannot
    # run yet: its 70 tokens need 5 blocks, and of the 8 only the 4 the quarantined load
    # does not hold are free.
    plan = _step(engine, 21.0, plan.step_id)
    assert plan.entries == ()
    held = [m.device_block for m in load.moves]
    assert all(engine.pool.refs[b] == 1 for b in held)
    assert engine.pool.free == 8 - len(held)
    engine.handle(TransferReport(30.0, load.job_id, 1))  # the late report releases them
    assert all(engine.pool.refs[b] == 0 for b in held)
    assert engine.pool.cached_prefix(hashes) == []  # a load given up on is never published
    plan = _step(engine, 31.0, plan.step_id)
    assert req.state == "running"
    assert [(e.request_id, e.computed_before, e.num_tokens) for e in plan.entries] == [("r", 0, 70)]
    engine.check_invariants()
