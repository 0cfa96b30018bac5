"""The policy protocol: built-ins, loading user policies, errors that name module and hook,
stack order, and the engine paths the policies drive (async lookup, early prefetch)."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import attrs
import pytest

from kvlife.lifecycle.cli.main import main
from kvlife.lifecycle.config import EngineConfig, TierConfig, load_config
from kvlife.lifecycle.engine.core import Engine
from kvlife.lifecycle.engine.events import (
    Abort,
    Arrival,
    DiscardLookup,
    LookupAnswer,
    StartLoad,
    StartPrefetch,
    StepOutput,
    StepPlan,
    SubmitLookup,
    Tick,
    TransferReport,
)
from kvlife.policies.base import HOOKS, Decision, EngineView, PolicyError, PrefetchView, RequestView
from kvlife.policies.loading import load_policy, load_stack
from kvlife.policies.registry import BUILTIN, DESCRIPTIONS
from kvlife.policies.stack import PolicyStack

TIERED = EngineConfig(block_tokens=16, device_blocks=64, max_batched_tokens=256,
                      tiers=(TierConfig("host", capacity_blocks=32), TierConfig("disk", capacity_blocks=64)))


def write_policy(tmp_path: Path, body: str, name: str = "mine.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


# ---- built-ins ----------------------------------------------------------------------
def test_every_builtin_loads_has_a_description_and_implements_a_hook() -> None:
    assert set(DESCRIPTIONS) == set(BUILTIN)
    for name in BUILTIN:
        policy = load_policy(name)
        assert getattr(policy, "name", None) == name
        assert any(callable(getattr(policy, hook, None)) for hook in HOOKS)
        assert DESCRIPTIONS[name]


def test_kvlife_policies_lists_every_builtin_on_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["policies"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == list(BUILTIN)


def _view(**over: object) -> RequestView:
    base: dict[str, object] = dict(
        request_id="r", state="waiting", arrival_ms=0.0, prompt_tokens=100, generated_tokens=2,
        computed_tokens=90, confirmed_tokens=70, placeholder_tokens=1, block_tokens=16,
        block_hashes=(1, 2, 3, 4, 5, 6), stored_blocks=0, resumable=False, preemptions=0,
    )
    base.update(over)
    return RequestView(**base)  # type: ignore[arg-type]


ENGINE = EngineView(now_ms=0.0, running=1, waiting=1, loading=0, free_device_blocks=10, device_blocks=20)


def test_store_limits_baseline_and_naive() -> None:
    """The baseline stores up to the confirmed tokens (a confirmed token is never a
    placeholder); the unsafe boundary follows the computed count into the tokens of steps
    still in flight."""
    baseline = load_policy("baseline").store_limit  # type: ignore[attr-defined]
    naive = load_policy("naive-stores-unsafe").store_limit  # type: ignore[attr-defined]
    assert baseline(_view(), ENGINE).value == 70 and naive(_view(), ENGINE).value == 90
    assert baseline(_view(confirmed_tokens=101, computed_tokens=103), ENGINE).value == 101
    assert naive(_view(confirmed_tokens=101, computed_tokens=103), ENGINE).value == 103


@pytest.mark.parametrize("name", ["placeholder-safe-stores", "hold-while-sending"])
def test_a_retired_policy_name_is_one_line_saying_what_took_its_place(
        name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(PolicyError, match=f"policy '{name}' is no longer a policy: the baseline "):
        load_stack(["async-lookup", name])
    assert main(["run", "--limit", "3", "--stack", f"async-lookup,{name}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "drop it from the stack" in err, err


def test_prefetch_patience_values() -> None:
    view = PrefetchView(blocks=8, tokens=8000, source_tiers=("disk",) * 8, started_ms=0.0)
    assert load_policy("prefetch-best-effort").prefetch_patience(_view(), view, ENGINE).value == 0  # type: ignore[attr-defined]
    assert math.isinf(load_policy("prefetch-wait-complete").prefetch_patience(_view(), view, ENGINE).value)  # type: ignore[attr-defined]
    timeout = load_policy("prefetch-timeout")
    assert timeout.prefetch_patience(_view(), view, ENGINE).value == 3000.0  # type: ignore[attr-defined]  # capped
    small = PrefetchView(blocks=1, tokens=2000, source_tiers=("disk",), started_ms=0.0)
    assert timeout.prefetch_patience(_view(), small, ENGINE).value == 1500.0  # type: ignore[attr-defined]


def test_stack_is_asked_top_down_and_hooks_resolve_independently() -> None:
    stack = load_stack(["async-lookup", "shared-loads", "defer-while-loading"])
    assert stack.names == ("async-lookup", "shared-loads", "defer-while-loading", "baseline")
    from kvlife.policies.base import LoadView

    load = LoadView(device_hit_blocks=0, external_hit_blocks=3, tiers=("host",) * 3, in_flight=((1, "x"),))
    assert stack.ask("admission", _view(), load, ENGINE).policy == "shared-loads"
    assert stack.ask("lookup_mode", _view(), ENGINE).value == "async"
    assert stack.ask("store_limit", _view(), ENGINE).policy == "baseline"
    # nobody implements prefetch_patience here: the documented fallback answers
    view = PrefetchView(blocks=1, tokens=16, source_tiers=("disk",), started_ms=0.0)
    assert math.isinf(stack.ask("prefetch_patience", _view(), view, ENGINE).value)


# ---- user policies ------------------------------------------------------------------
GOOD = """
    from kvlife.policies.base import Decision

    class Eager:
        name = "eager"

        def lookup_mode(self, req, engine):
            return Decision("async", "mine")
"""


def test_file_policy_loads_and_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_policy(tmp_path, GOOD)
    policy = load_policy(f"{path}:Eager")
    assert load_stack([f"{path}:Eager"]).ask("lookup_mode", _view(), ENGINE).value == "async"
    assert policy.name == "eager"  # type: ignore[attr-defined]
    assert main(["run", "--limit", "20", "--stack", f"{path}:Eager,shared-loads", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)["summary"]
    # Eager answers lookup_mode with async for every request: every lookup the run made
    # went off the scheduler path (the baseline's would all be sync: 20 of them).
    assert summary["async_lookups"] >= 20
    assert summary["sync_lookups"] == 0
    assert summary["critical_path_lookup_ms"] == 0


def test_module_policy_loads_by_dotted_path() -> None:
    assert load_policy("kvlife.policies.shared_loads:SharedLoads").name == "shared-loads"  # type: ignore[attr-defined]


def test_config_file_stack(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[policies]\nstack = ["async-lookup", "shared-loads"]\n')
    assert load_config(path).policies == ("async-lookup", "shared-loads")


@pytest.mark.parametrize(
    ("body", "needles"),
    [
        ("import no_such_module_xyz\nclass P:\n    pass\n", ["importing", "mine.py", "no_such_module_xyz"]),
        ("class P:\n    def helper(self):\n        pass\n", ["implements none of the hooks"]),
        ("class P:\n    def admision(self, req, load, engine):\n        pass\n", ["'admission'", "'admision'"]),
        ("class P:\n    def admission(self, req):\n        pass\n", ["hook admission", "3 arguments"]),
        ("class P:\n    def __init__(self):\n        raise RuntimeError('boom')\n", ["constructing P failed", "boom"]),
    ],
)
def test_broken_user_policy_is_a_clear_error(tmp_path: Path, body: str, needles: list[str]) -> None:
    path = write_policy(tmp_path, body)
    with pytest.raises(PolicyError) as info:
        load_policy(f"{path}:P")
    for needle in needles:
        assert needle in str(info.value)


@pytest.mark.parametrize(
    ("body", "needles"),
    [
        ("def lookup_mode(self, req, engine):\n        raise KeyError('x')\n",
         ["raised KeyError", "hook lookup_mode", "mine.py"]),
        ("def lookup_mode(self, req, engine):\n        return 'async'\n",
         ["hook lookup_mode returned str", "mine.py"]),
        ("def lookup_mode(self, req, engine):\n        return Decision('maybe', 'x')\n",
         ["hook lookup_mode returned 'maybe'"]),
        ("def store_limit(self, req, engine):\n        return Decision(1.5, 'x')\n",
         ["hook store_limit returned 1.5"]),
    ],
)
def test_hook_misbehaving_at_run_time_names_policy_and_hook(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], body: str, needles: list[str]
) -> None:
    source = "from kvlife.policies.base import Decision\n\nclass P:\n    name = 'bad'\n\n    " + body
    path = write_policy(tmp_path, source)
    assert main(["run", "--limit", "10", "--stack", f"{path}:P"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvlife: error: policy bad")
    assert "\n" not in err  # one line, no traceback
    for needle in needles:
        assert needle in err


# ---- engine paths the lookup policies drive ----------------------------------------
def test_async_lookup_round_trip_and_idempotent_submission() -> None:
    engine = Engine(TIERED, load_stack(["async-lookup"]), reference=True)
    engine.handle(Arrival(0.0, "a", 40, (1, 2)))
    commands = engine.handle(Tick(0.0))
    # the lookup goes out; the pass schedules nothing (a is skipped in place)
    assert [type(c) for c in commands] == [SubmitLookup, StepPlan]
    assert next(c for c in commands if isinstance(c, StepPlan)).entries == ()
    assert engine.requests["a"].state == "lookup_pending"
    # the scheduler considering it again never submits a second lookup
    commands = engine.handle(Tick(0.5))
    assert [type(c) for c in commands] == [StepPlan]
    assert next(c for c in commands if isinstance(c, StepPlan)).entries == ()
    engine.core._submit_lookup(engine.requests["a"], "again")
    assert engine.core.take_commands() == []
    assert engine.stats.async_lookups == 1 and engine.stats.duplicate_lookups == 1
    engine.handle(LookupAnswer(1.0, "a", 0, ()))
    assert engine.requests["a"].state == "waiting"
    plan = next(c for c in engine.handle(Tick(1.0)) if isinstance(c, StepPlan))
    assert plan.sync_lookups == 0 and plan.entries[0].request_id == "a"


def test_stale_answer_after_abort_is_dropped_and_failed_lookup_is_a_miss() -> None:
    engine = Engine(TIERED, load_stack(["async-lookup"]), reference=True)
    engine.handle(Arrival(0.0, "a", 40, (1, 2)))
    engine.handle(Arrival(0.0, "b", 40, (1, 2)))
    engine.handle(Tick(0.0))
    assert any(isinstance(c, DiscardLookup) for c in engine.handle(Abort(0.5, "a")))
    engine.handle(LookupAnswer(1.0, "a", 0, ("host", "host")))
    assert engine.stats.stale_lookup_answers == 1
    assert engine.requests["a"].state == "finished"
    engine.handle(LookupAnswer(1.0, "b", 0, None))
    assert engine.stats.failed_lookups == 1
    assert engine.requests["b"].lookup == ()


def test_sync_lookup_is_re_paid_when_considered_again_after_tier_changes() -> None:
    # one device block: b's prompt cannot fit while a runs, so b is considered every tick
    config = EngineConfig(block_tokens=16, device_blocks=4, max_batched_tokens=256,
                          tiers=(TierConfig("host", capacity_blocks=32),))
    engine = Engine(config, load_stack(["sync-lookup"]), reference=True)
    engine.handle(Arrival(0.0, "a", 40, (1, 2)))
    engine.handle(Arrival(0.0, "b", 40, (3, 4)))
    plan = next(c for c in engine.handle(Tick(0.0)) if isinstance(c, StepPlan))
    assert plan.sync_lookups == 2 and [e.request_id for e in plan.entries] == ["a"]
    engine.handle(StepOutput(1.0, plan.step_id))  # a's prompt blocks confirmed: a store is decided
    # nothing changed in the tiers: b is not looked up again
    commands = engine.handle(Tick(1.0))
    plan = next(c for c in commands if isinstance(c, StepPlan))
    assert plan.sync_lookups == 0 and [e.request_id for e in plan.entries] == ["a"]
    # the store went out with this step's metadata; its report changes the host tier
    store = next(c for c in commands if type(c).__name__ == "StartStore")
    engine.handle(TransferReport(1.5, store.job_id, 0))
    plan = next(c for c in engine.handle(Tick(2.0)) if isinstance(c, StepPlan))
    assert plan.sync_lookups == 1


def test_early_prefetch_pulls_disk_hits_into_host_and_waits_for_them() -> None:
    engine = Engine(TIERED, load_stack(["early-prefetch"]), reference=True)
    disk = engine.tiers["disk"]
    plan = disk.prepare_store([1, 2, 3])
    disk.complete_store([h for h, _ in plan.accepted])
    engine.handle(Arrival(0.0, "a", 60, (1, 2, 3)))
    answer = engine.handle(LookupAnswer(1.0, "a", 0, engine.sync_lookup((1, 2, 3))))
    # the pull is started at the answer and goes to the workers with the next step's metadata
    assert not any(isinstance(c, StartPrefetch) for c in answer)
    # wait_complete: no patience deadline to wake up for, only the pull's reclaim deadline
    assert engine.next_wakeup() == 1.0 + engine.config.reclaim_deadline_ms
    commands = engine.handle(Tick(1.0))
    prefetch = [c for c in commands if isinstance(c, StartPrefetch)]
    assert len(prefetch) == 1
    assert [(m.block_hash, m.src_tier, m.dst_tier) for m in prefetch[0].moves] == [
        (1, "disk", "host"), (2, "disk", "host"), (3, "disk", "host")]
    # the scheduler defers it while the pull is in flight (fallback patience: wait)
    plan = next(c for c in commands if isinstance(c, StepPlan))
    assert plan.entries == () and not any(isinstance(c, StartLoad) for c in commands)
    assert engine.requests["a"].state == "waiting"
    engine.handle(TransferReport(5.0, prefetch[0].job_id, 0, failed=(3,)))
    assert engine.tiers["host"].lookup([1, 2, 3]) == 2
    assert engine.requests["a"].lookup == ("host", "host")
    loads = [c for c in engine.handle(Tick(5.0)) if isinstance(c, StartLoad)]
    assert [(m.block_hash, m.tier) for m in loads[0].moves] == [(1, "host"), (2, "host")]
    engine.check_invariants()


def test_best_effort_prefetch_computes_blocks_still_in_flight() -> None:
    engine = Engine(TIERED, PolicyStack([load_policy("prefetch-best-effort"), load_policy("early-prefetch")]))
    disk = engine.tiers["disk"]
    plan = disk.prepare_store([1, 2, 3])
    disk.complete_store([h for h, _ in plan.accepted])
    engine.handle(Arrival(0.0, "a", 60, (1, 2, 3)))
    engine.handle(LookupAnswer(1.0, "a", 0, engine.sync_lookup((1, 2, 3))))
    commands = engine.handle(Tick(1.0))
    plan_ = next(c for c in commands if isinstance(c, StepPlan))
    assert plan_.entries[0].computed_before == 0  # nothing loaded, all computed
    assert engine.stats.prefetch_gave_up == 1


def test_decisions_carry_reasons_into_the_trace() -> None:
    records: list[dict[str, object]] = []
    engine = Engine(TIERED, load_stack(["async-lookup"]), recorder=records.append)
    engine.handle(Arrival(0.0, "a", 40, (1, 2)))
    engine.handle(Tick(0.0))
    decisions = [r for r in records if r["kind"] == "decision"]
    assert {r["point"] for r in decisions} >= {"on_arrival", "lookup_mode"}
    assert all(isinstance(r["reason"], str) and r["reason"] for r in decisions)
    assert any(r["policy"] == "async-lookup" for r in decisions)


def test_decision_is_an_immutable_value_and_the_stack_checks_it() -> None:
    decision = Decision("go", "why")
    assert decision != Decision("defer", "why") and decision != Decision("go", "another reason")
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        decision.value = "defer"  # type: ignore[misc]

    class NoReason:
        name = "no-reason"

        def admission(self, req: RequestView, load: object, engine: EngineView) -> Decision[str]:
            return Decision("go", "")

    from kvlife.policies.base import LoadView

    load = LoadView(device_hit_blocks=0, external_hit_blocks=1, tiers=("host",), in_flight=())
    with pytest.raises(PolicyError, match="gave no reason"):
        PolicyStack([NoReason()]).ask("admission", _view(), load, ENGINE)


def test_sync_lookup_over_an_async_policy_takes_lookups_back_onto_the_critical_path() -> None:
    """What sync-lookup changes (alone it is the baseline's lookup): above a policy that looks
    up asynchronously, the stack looks up inline again. Without it the same stack parks the
    request in lookup_pending."""
    config = EngineConfig(block_tokens=16, device_blocks=8, max_batched_tokens=256,
                          tiers=(TierConfig("host", capacity_blocks=32),))
    for stack, sync_lookups, state in ((["sync-lookup", "async-lookup"], 1, "running"),
                                       (["async-lookup"], 0, "lookup_pending")):
        engine = Engine(config, load_stack(stack), reference=True)
        engine.handle(Arrival(0.0, "a", 40, (1, 2)))
        commands = engine.handle(Tick(0.0))
        plan = next(c for c in commands if isinstance(c, StepPlan))
        assert plan.sync_lookups == sync_lookups, stack
        assert engine.requests["a"].state == state, stack
