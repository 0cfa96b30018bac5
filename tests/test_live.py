"""Live runs: real KV bytes across ranks and tiers, verified byte for byte (invariant 9)."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from kvlife.lifecycle.config import ConfigError, EngineConfig, LiveConfig, RunConfig, SimConfig, TierConfig
from kvlife.lifecycle.drivers.live import run_live
from kvlife.lifecycle.traces.trace import read_trace
from kvlife.lifecycle.workloads.synthetic import synthetic_workload
from tests.redis_server import RedisServer


def live_config(tmp_path: Path, *tiers: TierConfig, ranks: int = 2, **live: object) -> RunConfig:
    return RunConfig(
        engine=EngineConfig(device_blocks=48, max_running=12, ranks=ranks, transfer_deadline_ms=5000.0,
                            tiers=tiers),
        sim=SimConfig(max_output_tokens=12),
        live=LiveConfig(disk_path=str(tmp_path / "disk"), **live),  # type: ignore[arg-type]
    )


def workload(n: int = 120) -> list:  # type: ignore[type-arg]
    return synthetic_workload(seed=11, num_requests=n, arrival_rate_per_s=4.0)


def test_host_and_disk_loads_are_byte_exact(tmp_path: Path) -> None:
    # Host 80 of disk 300: both tiers serve a tenth or more of the blocks at any time scale from 5 to
    # 2000 (a loaded CI machine is a slow one). With host 40, host hits were ~1 % and a slow run had none.
    config = live_config(tmp_path, TierConfig("host", capacity_blocks=80), TierConfig("disk", capacity_blocks=300))
    outcome = run_live(config, workload(), time_scale=40.0, trace_path=tmp_path / "live.jsonl")
    summary = outcome.summary
    assert summary["finished"] and sum(summary["finished"].values()) == 120
    assert outcome.result.stranded == []
    assert summary["prefix_hit_rate"]["host"] > 0 and summary["prefix_hit_rate"]["disk"] > 0
    assert outcome.stats.blocks_verified == 2 * summary["blocks_loaded"] > 0
    assert outcome.stats.mismatches == 0
    assert outcome.rank_errors == []
    header = next(read_trace(tmp_path / "live.jsonl"))[1]
    assert header["driver"] == "live" and header["config"]["engine"]["ranks"] == 2


def test_bad_model_shape_is_a_config_error_before_anything_starts(tmp_path: Path) -> None:
    config = live_config(tmp_path, TierConfig("host", capacity_blocks=8), ranks=3)
    with pytest.raises(ConfigError, match="ranks"):
        run_live(config, workload(5))
    with pytest.raises(ConfigError):
        run_live(attrs.evolve(config, live=LiveConfig(num_layers=0)), workload(5))


def test_unwritable_disk_path_is_a_clear_error_at_start(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    config = live_config(tmp_path, TierConfig("disk", capacity_blocks=8))
    config = attrs.evolve(config, live=attrs.evolve(config.live, disk_path=str(blocker / "sub")))
    with pytest.raises(ConfigError, match="disk_path"):
        run_live(config, workload(5))


def test_redis_tier_round_trip_and_redis_killed_mid_run(tmp_path: Path) -> None:
    server = RedisServer().start()
    try:
        config = live_config(tmp_path, TierConfig("host", capacity_blocks=16),
                             TierConfig("remote", capacity_blocks=2000), redis_url=server.url)
        healthy = run_live(config, workload(80), time_scale=40.0)
        assert healthy.stats.mismatches == 0
        assert healthy.summary["prefix_hit_rate"]["remote"] > 0
        assert healthy.stats.blocks_verified > 0

        killed = {"done": False}

        def kill_midway(done: int, total: int) -> None:
            if not killed["done"] and done >= total // 4:
                server.stop()
                killed["done"] = True

        from kvlife.lifecycle.drivers.live import LiveRuntime
        from kvlife.policies.loading import load_stack

        runtime = LiveRuntime(config, workload(160), load_stack(()), time_scale=40.0, progress=kill_midway)
        result = runtime.run()
        assert killed["done"]
        assert result.stranded == []
        assert all(r.state == "finished" for r in result.engine.requests.values())
        assert runtime.stats().mismatches == 0  # nothing corrupt was served
        warnings = [e for e in runtime.tier_events if "redis" in str(e.get("event", "")).lower()]
        assert warnings, "a dead Redis must be reported as tier events"
    finally:
        server.stop()


def test_rank_that_never_reports_is_failed_after_the_deadline(tmp_path: Path) -> None:
    from kvlife.lifecycle.drivers.live import LiveRuntime
    from kvlife.policies.loading import load_stack

    config = live_config(tmp_path, TierConfig("host", capacity_blocks=60))
    # Long enough that a job of a loaded machine (2 cores, other tests) is not declared late.
    config = attrs.evolve(config, engine=attrs.evolve(config.engine, transfer_deadline_ms=400.0))
    silenced: list[int] = []

    def rank1_silent_on_two_jobs(rank: int, job_id: object) -> bool:
        if rank == 1 and len(silenced) < 2 and isinstance(job_id, int):
            silenced.append(job_id)
            return True
        return False

    runtime = LiveRuntime(config, workload(80), load_stack(()), time_scale=40.0, silent=rank1_silent_on_two_jobs)
    result = runtime.run()
    assert len(silenced) == 2
    assert result.engine.stats.rank_timeouts == 2
    assert result.stranded == []
    assert all(r.state == "finished" for r in result.engine.requests.values())
    assert runtime.stats().mismatches == 0
    from kvlife.lifecycle.metrics import summarize

    assert summarize(result, 0.0, runtime.block_bytes)["quarantined_jobs"] == 2
    # the silenced jobs never completed: their blocks stay held (quarantined), never reused
    for job_id in silenced:
        assert job_id in result.engine.jobs and result.engine.jobs[job_id].timed_out
        for move in result.engine.jobs[job_id].moves:
            assert result.engine.pool.refs[move.device_block] > 0


def test_disk_full_mid_run_fails_stores_and_loads_of_them_miss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno
    import os

    real_pwritev = os.pwritev
    calls = {"n": 0}

    def fills_up(fd: int, buffers: object, offset: int) -> int:
        calls["n"] += 1
        if calls["n"] > 60:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwritev(fd, buffers, offset)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "pwritev", fills_up)
    config = live_config(tmp_path, TierConfig("disk", capacity_blocks=300), ranks=1)
    outcome = run_live(config, workload(120), time_scale=40.0, trace_path=tmp_path / "full.jsonl")
    assert calls["n"] > 60
    assert outcome.result.stranded == []
    assert sum(outcome.summary["finished"].values()) == 120
    assert outcome.stats.mismatches == 0
    assert any(e.get("event") == "disk_write_failed" for e in outcome.stats.tier_events)
    records = [r for _, r in read_trace(tmp_path / "full.jsonl")]
    failed_stores = [r for r in records if r["kind"] == "job_done" and r["op"] == "store" and r["failed"] > 0]
    assert failed_stores, "the engine records the failed stores"
    # Whatever failed to store is not in the index, so it can never be served: a hash that
    # only ever went to disk in stores that failed is neither indexed nor loaded from disk.
    blocks_of = {r["job"]: r["blocks"] for r in records if r["kind"] == "job" and r["op"] == "store"}
    failed_ids = {r["job"] for r in failed_stores if r["failed"] == blocks_of[r["job"]]}  # wholly failed
    stored: dict[int, set[int]] = {}  # hash -> store jobs that wrote it to disk
    for r in records:
        if r["kind"] == "job" and r["op"] == "store":
            for block_hash, _, tier in r["moves"]:
                if tier == "disk":
                    stored.setdefault(block_hash, set()).add(r["job"])
    only_failed = {h for h, jobs in stored.items() if jobs <= failed_ids}
    assert only_failed, "some blocks were written only by stores that failed"
    disk = outcome.result.engine.tiers["disk"]
    disk.check_accounting()
    assert not any(disk.contains(h) for h in only_failed)
    loaded_from_disk = {block_hash for r in records if r["kind"] == "job" and r["op"] == "load"
                        for block_hash, _, tier in r["moves"] if tier == "disk"}
    assert not loaded_from_disk & only_failed


def test_rank_polls_copies_that_finish_later_without_new_messages() -> None:
    """On CUDA a job completes when its event does, after ``flush`` returned: the rank
    thread must keep polling while copies are in flight, not wait for the next message."""
    import queue as queue_module

    from kvlife.lifecycle.drivers.live import RankWorker
    from kvlife.transfer.copy_engine import Completion
    from kvlife.transfer.layout import SMALL_SHAPE, BlockGeometry

    class LateCopies:
        def __init__(self) -> None:
            self.jobs: list[int] = []
            self.polls = 0

        @property
        def pending_jobs(self) -> int:
            return len(self.jobs)

        def submit_store(self, job_id: int, moves: object) -> None:
            self.jobs.append(job_id)

        def flush(self) -> None:
            pass

        def poll(self) -> list[Completion]:
            self.polls += 1
            if self.polls < 5 or not self.jobs:
                return []
            done = [Completion(j, 0, "store", ()) for j in self.jobs]
            self.jobs = []
            return done

    outbox: queue_module.Queue[tuple[object, ...]] = queue_module.Queue()
    worker = RankWorker(0, BlockGeometry(SMALL_SHAPE), 4, {}, outbox, verify=False)
    worker.copies = LateCopies()  # type: ignore[assignment]
    worker.start()
    try:
        worker.inbox.put(("store", 7, ()))
        worker.inbox.put(("flush",))
        assert outbox.get(timeout=5) == ("report", 7, 0, ())
    finally:
        worker.inbox.put(("stop",))
        worker.join(timeout=5)


@pytest.mark.parametrize("stores", ["baseline", "naive-stores-unsafe"])
def test_async_scheduling_live_keeps_loads_byte_exact(tmp_path: Path, stores: str) -> None:
    config = live_config(tmp_path, TierConfig("host", capacity_blocks=40), TierConfig("disk", capacity_blocks=300))
    config = attrs.evolve(config, engine=attrs.evolve(config.engine, async_scheduling=True), policies=(stores,))
    outcome = run_live(config, workload(100), time_scale=40.0)
    assert outcome.result.stranded == []
    assert sum(outcome.summary["finished"].values()) == 100
    assert outcome.stats.blocks_verified > 0
    # Ranks compute a step before they copy what the same engine call stored, as a side
    # stream ordered after the compute stream would: even naive stores read computed
    # bytes here; the model checker and `kvlife validate` are what flag them.
    assert outcome.stats.mismatches == 0


def test_live_trace_replays_exactly_and_validates(tmp_path: Path) -> None:
    """Wall-clock runs are not repeatable, but their traces are: every input is recorded
    (lookup answers with their tiers, step outputs with their finishes)."""
    from kvlife.lifecycle.traces.replay import replay
    from kvlife.lifecycle.traces.validate import validate

    config = live_config(tmp_path, TierConfig("host", capacity_blocks=40), TierConfig("disk", capacity_blocks=300))
    config = attrs.evolve(config, policies=("async-lookup", "shared-loads"))
    trace = tmp_path / "live.jsonl"
    run_live(config, workload(100), time_scale=40.0, trace_path=trace)
    result = replay(trace)
    assert result.identical, result.divergence
    report = validate(trace)
    assert report.ok, report.findings[:3]


# ---- what a run leaves behind -----------------------------------------------------------------
@pytest.mark.parametrize("ttl", [3600, 0])
def test_redis_keys_expire_and_are_deleted_when_the_run_ends(tmp_path: Path, ttl: int) -> None:
    import redis

    from kvlife.lifecycle.drivers.live import LiveRuntime
    from kvlife.policies.loading import load_stack

    with RedisServer() as server:
        admin = redis.Redis.from_url(server.url)
        config = live_config(tmp_path, TierConfig("host", capacity_blocks=16),
                             TierConfig("remote", capacity_blocks=2000), redis_url=server.url, redis_ttl_s=ttl)
        ttls: list[int] = []

        def look(done: int, total: int) -> None:
            keys = admin.keys(f"{runtime.redis_prefix}:*")
            if keys and done >= total // 2 and not ttls:
                ttls.extend(admin.ttl(k) for k in keys)

        runtime = LiveRuntime(config, workload(60), load_stack(()), time_scale=40.0, progress=look)
        assert runtime.redis_prefix.startswith("kvlife:")
        result = runtime.run()
        assert result.stranded == [] and runtime.stats().mismatches == 0
        assert ttls, "the run stored blocks in Redis"
        if ttl:
            assert all(0 < t <= ttl for t in ttls), ttls[:5]
        else:  # 0: no expiry, only because the config said so
            assert set(ttls) == {-1}
        assert admin.keys(f"{runtime.redis_prefix}:*") == []
        assert admin.dbsize() == 0
        admin.close()


def test_temporary_disk_files_are_removed_a_named_path_is_kept(tmp_path: Path) -> None:
    from kvlife.lifecycle.drivers.live import LiveRuntime
    from kvlife.policies.loading import load_stack

    tiers = (TierConfig("host", capacity_blocks=20), TierConfig("disk", capacity_blocks=300))
    temp = attrs.evolve(live_config(tmp_path, *tiers), live=LiveConfig())
    runtime = LiveRuntime(temp, workload(40), load_stack(()), time_scale=40.0)
    disk_dir = runtime.disk_dir
    assert disk_dir is not None and (disk_dir / "rank0.kvblocks").exists()
    runtime.run()
    assert not disk_dir.exists()

    named = live_config(tmp_path, *tiers)
    runtime = LiveRuntime(named, workload(40), load_stack(()), time_scale=40.0)
    runtime.run()
    assert runtime.disk_dir == tmp_path / "disk"
    assert sorted(p.name for p in (tmp_path / "disk").iterdir()) == ["rank0.kvblocks", "rank1.kvblocks"]


def test_named_disk_path_is_recovered_and_corrupt_slots_are_warnings(tmp_path: Path) -> None:
    from kvlife.lifecycle.drivers.live import LiveRuntime
    from kvlife.policies.loading import load_stack
    from kvlife.transfer.disk_tier import HEADER_BYTES

    config = live_config(tmp_path, TierConfig("host", capacity_blocks=20), TierConfig("disk", capacity_blocks=300))
    run_live(config, workload(60), time_scale=40.0)
    # Reopened: the blocks the first run wrote are indexed again, rank by rank.
    runtime = LiveRuntime(config, workload(5), load_stack(()))
    recovered = runtime.ranks[0].tiers["disk"].recovered  # type: ignore[union-attr]
    stride = runtime.ranks[0].tiers["disk"].slot_stride  # type: ignore[union-attr]
    assert len(recovered) > 10
    assert runtime.tier_events == []
    runtime.shutdown()
    block, slot = sorted(recovered.items(), key=lambda item: item[1])[0]
    with open(tmp_path / "disk" / "rank0.kvblocks", "r+b") as f:  # one flipped payload byte
        f.seek(slot * stride + HEADER_BYTES + 7)
        byte = f.read(1)[0]
        f.seek(slot * stride + HEADER_BYTES + 7)
        f.write(bytes([byte ^ 0xFF]))
    trace = tmp_path / "again.jsonl"
    outcome = run_live(config, workload(20), time_scale=40.0, trace_path=trace)
    assert outcome.summary["warnings"] == {"disk_slot_dropped": 1}
    assert outcome.summary["live"]["tier_events"] == 1
    (warning,) = [r for _, r in read_trace(trace) if r["kind"] == "warning"]
    assert warning == {"kind": "warning", "t": 0.0, "what": "disk_slot_dropped", "origin": "driver", "rank": 0,
                       "tier": "disk", "slot": slot, "block": block, "reason": "payload checksum mismatch",
                       "path": str(tmp_path / "disk" / "rank0.kvblocks")}


def test_lookup_probe_events_are_recorded_when_redis_dies(tmp_path: Path) -> None:
    """The async lookup thread's Redis probe fails once the server is gone: its events come
    back with the answer and are warnings like the ranks' own."""
    from kvlife.lifecycle.drivers.live import LiveRuntime
    from kvlife.lifecycle.drivers.runner import recording
    from kvlife.lifecycle.traces.replay import replay
    from kvlife.lifecycle.traces.validate import validate
    from kvlife.policies.loading import load_stack

    server = RedisServer().start()
    try:
        # A breaker that never opens: with it open, a probe is refused without an event
        # (tests/test_redis_breaker.py), and here every probe must meet the dead server.
        config = live_config(tmp_path, TierConfig("host", capacity_blocks=8),
                             TierConfig("remote", capacity_blocks=2000), redis_url=server.url,
                             redis_breaker_failures=10**6)
        config = attrs.evolve(config, policies=("async-lookup",))
        stack = load_stack(config.policies)
        trace = tmp_path / "probe.jsonl"
        with recording(trace, config, stack, driver="live") as writer:
            runtime = LiveRuntime(config, workload(120), stack, writer.record, time_scale=40.0)
            probe = runtime._remote_probe
            assert probe is not None
            checked = probe.exists_many

            def die_before_the_second_probe(hashes: list[int]) -> list[bool]:
                if hashes and server.running:  # the first remote hit is confirmed; then the server dies
                    answer = checked(hashes)
                    server.stop()
                    return answer
                return checked(hashes)

            probe.exists_many = die_before_the_second_probe  # type: ignore[method-assign]
            result = runtime.run()
        assert not server.running, "no lookup found a remote block: the test proves nothing"
        assert result.stranded == [] and runtime.stats().mismatches == 0
        from_probe = [e for e in runtime.tier_events if e["rank"] is None]
        assert from_probe and all(e["event"] == "redis_unavailable" and e["op"] == "exists" for e in from_probe)
        traced = [r for _, r in read_trace(trace) if r["kind"] == "warning" and r.get("origin") == "driver"]
        assert len(traced) == len(runtime.tier_events) == sum(runtime.driver_warnings.values())
        assert any(r["rank"] is None and r["op"] == "exists" for r in traced)
        assert replay(trace).identical and validate(trace).ok
    finally:
        server.stop()
