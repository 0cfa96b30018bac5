"""The native scheduler against the reference (``lifecycle/engine/scheduler.py``).

Both schedulers are driven by the same random run (arrivals, passes, step outputs with
stops, load results, invalid blocks and given-up loads, aborts), each with its own copy of
one scripted connector (``Scripted``): it answers every connector call from a seeded
random stream and logs the call with what it was shown. Two schedulers that decide the
same make the same calls in the same order, so their connectors answer alike; after every
operation the two logs, the step plans and the schedulers' state must be equal.
"""

from __future__ import annotations

import random
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlife.lifecycle.config import EngineConfig
from kvlife.lifecycle.engine.events import FreeBlocks
from kvlife.lifecycle.engine.request import Status
from kvlife.lifecycle.engine.scheduler import Scheduler
from kvlife.lifecycle.engine.vllm_shapes import KVConnectorOutput, SchedulerOutput, WorkerMeta

core_module = pytest.importorskip("kvlife.lifecycle.native._core")


@attrs.define
class Meta:
    sync_lookup_keys: tuple[int, ...]
    flush: tuple[int, ...]


class _Log(list[Any]):
    def append(self, item: Any) -> None:  # the scheduler's commands: logged as plain data
        super().append(("command", type(item).__name__, list(item.device_blocks)) if isinstance(item, FreeBlocks)
                       else item)


@attrs.define
class _State:
    log: list[Any]
    now: float = 0.0
    requests: dict[str, None] = attrs.Factory(dict)
    retired: set[str] = attrs.Factory(set)
    commands: _Log = attrs.Factory(_Log)


@attrs.define
class _Lifecycle:
    log: list[Any]

    def warn(self, what: str, **fields: Any) -> None:
        self.log.append(("warn", what, sorted(fields.items())))

    def record(self, record: dict[str, Any]) -> None:
        self.log.append(("record", record))


@attrs.define
class _Core:
    state: _State
    lifecycle: _Lifecycle


def _status(req: Any) -> str:
    return req.status.name if isinstance(req.status, Status) else str(req.status)


class Scripted:
    """vLLM's connector calls, answered from a seeded random stream, every call logged."""

    def __init__(self, seed: int, block_tokens: int) -> None:
        self.rng = random.Random(seed)
        self.bt = block_tokens
        self.log: list[Any] = []
        self.core = _Core(_State(self.log), _Lifecycle(self.log))
        self.core.state.commands = _Log()
        self.held: set[str] = set()
        self.seen: set[str] = set()

    def _req(self, req: Any) -> tuple[Any, ...]:
        return (req.request_id, req.num_tokens, req.num_computed_tokens, _status(req), list(req.blocks),
                req.finish_note)

    def on_new_request(self, req: Any, early: bool = True) -> None:
        self.core.state.requests[req.request_id] = None
        self.log.append(("new", self._req(req), early, list(req.block_hashes)))

    def begin_pass(self) -> None:
        self.log.append(("begin_pass",))

    def begin_output(self) -> None:
        self.log.append(("begin_output",))

    def take_events(self) -> None:
        self.log.append(("take_events",))
        for cmd in self.core.state.commands:
            self.log.append(cmd)
        self.core.state.commands.clear()

    def get_num_new_matched_tokens(self, req: Any, local_tokens: int) -> tuple[int | None, bool]:
        self.log.append(("match", self._req(req), local_tokens))
        roll = self.rng.random()
        if roll < 0.1:
            self.seen.add("deferred")
            return None, False
        limit = max(0, (req.num_tokens - 1) // self.bt - local_tokens // self.bt)
        blocks = self.rng.randint(0, limit)
        return blocks * self.bt, blocks > 0 and self.rng.random() < 0.6

    def update_state_after_alloc(self, req: Any, blocks: list[int], external: int) -> None:
        self.log.append(("alloc", self._req(req), list(blocks), external))

    def build_connector_meta(self, output: SchedulerOutput) -> Meta:
        cached = output.scheduled_cached_reqs
        self.log.append(("meta",
                         [(n.req_id, n.num_computed_tokens, [list(b) for b in n.block_ids])
                          for n in output.scheduled_new_reqs],
                         list(cached.req_ids), list(cached.num_computed_tokens),
                         [None if b is None else [list(x) for x in b] for b in cached.new_block_ids],
                         sorted(cached.resumed_req_ids), list(output.num_scheduled_tokens.items()),
                         sorted(output.preempted_req_ids), sorted(output.finished_req_ids)))
        keys = tuple(self.rng.randint(0, 5) for _ in range(self.rng.randint(0, 2)))
        return Meta(keys, tuple(self.rng.randint(0, 9) for _ in range(self.rng.randint(0, 1))))

    def request_finished(self, req: Any, blocks: list[int]) -> tuple[bool, None]:
        hold = bool(blocks) and self.rng.random() < 0.3
        if hold:
            self.held.add(req.request_id)
        self.log.append(("finished", self._req(req), list(blocks), hold))
        return hold, None

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        meta = output.kv_connector_worker_meta
        self.log.append(("output", sorted(output.finished_sending or ()), sorted(output.finished_recving or ()),
                         None if meta is None else [list(r) for r in meta.reports], sorted(output.invalid_block_ids)))


def _snapshot(s: Any) -> dict[str, Any]:
    native = isinstance(s, core_module.Scheduler)
    reqs = s.requests

    def ids(queue: Any) -> list[str]:
        return list(queue) if native else [r.request_id for r in queue]

    return {
        "requests": [(rid, _status(r), r.output_tokens, r.num_computed_tokens, r.num_output_placeholders,
                      r.num_in_flight_tokens, r.num_stale_output_tokens, r.num_preemptions, list(r.blocks),
                      r.num_cached_blocks, r.last_sched_seq, r.is_prefill_chunk, r.finished, r.free_on_recving,
                      r.free_on_sending, r.finish_note, list(r.hashes)) for rid, r in reqs.items()],
        "running": ids(s.running),
        "waiting": ids(s.waiting),
        "kv_holding": ids(s.kv_holding),
        "steps": list(s.steps),
        "results": s.results,
        "next_step_id": s.next_step_id,
        "free": s.free_blocks if native else s.pool.free,
        "refs": list(s.refs if native else s.pool.refs),
        "hashes": list(s.block_hashes_on_device if native else s.pool.hashes),
        "remote": s.waiting_for_remote_kvs(),
    }


def _plan(plan: Any) -> tuple[Any, ...]:
    return (plan.step_id, [tuple(e) for e in plan.entries], plan.sync_lookups, plan.sync_lookup_keys, plan.flush)


def _pair(config: EngineConfig, seed: int) -> tuple[Scheduler, Scripted, Any, Scripted]:
    ref_conn = Scripted(seed, config.block_tokens)
    nat_conn = Scripted(seed, config.block_tokens)
    reference = Scheduler(config, ref_conn)  # type: ignore[arg-type]
    native = core_module.Scheduler(block_tokens=config.block_tokens, device_blocks=config.device_blocks,
                                   max_batched_tokens=config.max_batched_tokens, max_running=config.max_running,
                                   async_scheduling=config.async_scheduling,
                                   kv_load_failure_policy=config.kv_load_failure_policy, connector=nat_conn)
    return reference, ref_conn, native, nat_conn


def _drive(seed: int, config: EngineConfig, ops: int) -> set[str]:
    """Run both schedulers through ``ops`` random operations; what the run reached."""
    rng = random.Random(seed)
    reference, ref_conn, native, nat_conn = _pair(config, seed)
    bt = config.block_tokens
    in_flight: list[int] = []
    seen: set[str] = set()
    arrived = 0
    shared = [rng.randrange(1 << 40) for _ in range(6)]  # prompt blocks several requests share
    for _ in range(ops):
        op = rng.random()
        if op < 0.2:
            rid = f"r{arrived}" if rng.random() < 0.95 else f"r{rng.randrange(arrived + 1)}"  # some duplicates
            arrived += 1
            prompt = rng.choice([1, bt - 1, bt, bt + 1, 3 * bt, rng.randint(1, 8 * bt), rng.randint(1, 40 * bt)])
            hashes = [shared[i] if i < len(shared) and rng.random() < 0.7 else rng.randrange(1 << 40)
                      for i in range(prompt // bt)]
            max_tokens = rng.choice([None, rng.randint(1, 20 * bt)])
            for s in (reference, native):
                s.add_request(rid, prompt, hashes, max_tokens, False)
        elif op < 0.6:
            if len(in_flight) >= (2 if config.async_scheduling else 1) and rng.random() < 0.9:
                continue  # (now and then a pass beyond what a driver keeps in flight: any call order)
            plan_r, _ = reference.schedule()
            plan_n, _ = native.schedule()
            assert _plan(plan_n) == _plan(plan_r)
            in_flight.append(plan_r.step_id)
        elif op < 0.92:
            if not in_flight:
                continue
            step_id = in_flight.pop(0)
            entries = reference.steps[step_id][0]
            stops = {req.request_id: rng.choice(["stopped", "length"]) for req, _, samples in entries
                     if samples and rng.random() < 0.08}
            remote = [r for r in reference.requests.values() if r.status == Status.WAITING_FOR_REMOTE_KVS]
            recving = {r.request_id for r in remote if rng.random() < 0.6}
            recving |= {r.request_id for r in reference.requests.values() if r.finished and rng.random() < 0.2}
            sending = {rid for rid in ref_conn.held if rng.random() < 0.5}
            invalid = {b for r in remote for b in r.blocks if rng.random() < 0.05}
            given_up = {r.request_id for r in remote if rng.random() < 0.05}
            output = None
            if recving or sending or invalid or rng.random() < 0.5:
                reports = ((rng.randrange(9), 0, (rng.randrange(99),)),) if rng.random() < 0.3 else ()
                output = KVConnectorOutput(sending or None, recving or None,
                                           WorkerMeta(reports) if reports else None, invalid)
            for s in (reference, native):
                assert s.update_from_output(step_id, stops, output, given_up)
            ref_conn.held -= sending
            nat_conn.held -= sending
        else:
            live = list(reference.requests)
            rid = rng.choice(live) if live and rng.random() < 0.9 else "nobody"
            assert native.finish_requests(rid) == reference.finish_requests(rid)
        assert nat_conn.log == ref_conn.log
        snapshot = _snapshot(reference)
        assert _snapshot(native) == snapshot
        for row in snapshot["requests"]:  # (id, status, ..., stale 6, preemptions 7, ...)
            seen.add(row[1])
            if row[7]:
                seen.add("preempted")
    assert native.update_from_output(10**9, {}, None) is reference.update_from_output(10**9, {}, None) is False
    for entry in ref_conn.log:
        if entry[0] == "match":
            seen.add("matched")
        if entry[0] == "finished" and entry[3]:
            seen.add("held")
        if entry[0] == "finished" and entry[1][5] and "prompt needs more" in entry[1][5]:
            seen.add("too long")
        if entry[0] == "warn" and entry[1] == "duplicate_arrival":
            seen.add("duplicate")
        if entry[0] == "output" and entry[2]:
            seen.add("landed")
    seen |= ref_conn.seen
    return seen


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), device_blocks=st.sampled_from([3, 6, 12, 40, 200]),
       async_scheduling=st.booleans(), fail=st.booleans(), budget=st.sampled_from([16, 64, 8192]),
       max_running=st.sampled_from([1, 3, 128]))
def test_the_native_scheduler_decides_as_the_reference(seed: int, device_blocks: int, async_scheduling: bool,
                                                        fail: bool, budget: int, max_running: int) -> None:
    config = EngineConfig(block_tokens=16, device_blocks=device_blocks, max_batched_tokens=budget,
                          max_running=max_running, async_scheduling=async_scheduling,
                          kv_load_failure_policy="fail" if fail else "recompute")
    _drive(seed, config, 160)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_long_busy_run_stays_identical_and_reaches_every_path(async_scheduling: bool) -> None:
    # Hundreds of requests through a small device: preemptions, loads, holds, aborts. The
    # differential is only as strong as what it reaches: the run must reach each of these.
    config = EngineConfig(block_tokens=16, device_blocks=24, max_batched_tokens=256, max_running=16,
                          async_scheduling=async_scheduling)
    seen = _drive(7, config, 3000)
    assert {"preempted", "WAITING_FOR_REMOTE_KVS", "deferred", "held", "too long", "duplicate", "landed"} <= seen, seen
