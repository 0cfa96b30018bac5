"""kvlife validate: legal traces pass; each kind of breakage is found, located and counted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import orjson
import pytest

from kvlife.lifecycle.cli.main import main
from kvlife.lifecycle.config import EngineConfig, RunConfig, SimConfig, TierConfig
from kvlife.lifecycle.drivers.runner import run_workload
from kvlife.lifecycle.traces.trace import TraceError
from kvlife.lifecycle.traces.validate import validate
from kvlife.lifecycle.workloads.mooncake import WorkloadRequest
from kvlife.lifecycle.workloads.synthetic import synthetic_workload

# Two ranks and a small device: reports per rank, loads, stores and preemptions.
SMALL = EngineConfig(ranks=2, device_blocks=60, max_batched_tokens=2048,
                     tiers=(TierConfig("host", capacity_blocks=400),))


def _small_workload() -> list[WorkloadRequest]:
    return synthetic_workload(seed=5, num_requests=80, block_tokens=512, arrival_rate_per_s=20.0,
                              num_system_prompts=2, user_tokens=(200, 1500))


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("validate") / "run.jsonl"
    run_workload(RunConfig(engine=SMALL), _small_workload(), trace_path=path)
    return path


def _lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines()


def _write(path: Path, lines: list[bytes], newline: bool = True) -> Path:
    path.write_bytes(b"\n".join(lines) + (b"\n" if newline else b""))
    return path


def _records(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(raw) for raw in _lines(path)]


def _dump(path: Path, records: list[dict[str, Any]]) -> Path:
    return _write(path, [orjson.dumps(r) for r in records])


def test_simulated_trace_is_valid(trace: Path) -> None:
    report = validate(trace)
    assert report.ok, report.format()
    assert report.checked == (0, 1, 2, 3, 4, 5, 7, 8, 10, 11, 12)
    data = trace.read_bytes()
    for needle in (b'"reports":[[', b'"op":"load"', b'"op":"store"', b'"kind":"free"', b'"trigger":"preempted"'):
        assert needle in data


def test_illegal_transition_named_and_rest_counted(trace: Path, tmp_path: Path) -> None:
    lines = _lines(trace)
    hits = [i for i, raw in enumerate(lines) if b'"trigger":"completed"' in raw]
    for i in hits[:3]:
        record = orjson.loads(lines[i])
        record["trigger"] = "load_done"  # running -> finished by load_done: not in the spec
        lines[i] = orjson.dumps(record)
    report = validate(_write(tmp_path / "bad.jsonl", lines))
    ones = [f for f in report.findings if f.invariant == 1]
    assert len(ones) >= 3
    assert report.findings[0].line == hits[0] + 1
    assert "first offending line: line" in report.format()


def test_job_done_before_every_rank_reported(trace: Path, tmp_path: Path) -> None:
    records = _records(trace)
    # Drop the first rank report a step output carries: its job is then counted done
    # after the other rank only.
    output = next(r for r in records if r["kind"] == "input" and r.get("reports"))
    job, rank, _ = output["reports"].pop(0)
    report = validate(_dump(tmp_path / "bad.jsonl", records))
    threes = [f for f in report.findings if f.invariant == 3]
    assert threes and f"job {job} counted done with ranks [{rank}] still to report" in threes[0].message, \
        report.format()


def test_stale_lookup_answer_applied(tmp_path: Path) -> None:
    header = {"kind": "header", "schema": 1, "config": RunConfig().to_dict(), "policies": ["baseline"], "seed": 0}
    records = [
        header,
        {"kind": "input", "type": "arrival", "t": 0.0, "request_id": "a", "prompt_tokens": 10,
         "block_hashes": [], "resumable": False},
        {"kind": "input", "type": "tick", "t": 1.0},
        {"kind": "transition", "t": 1.0, "req": "a", "from": "waiting", "to": "lookup_pending",
         "trigger": "lookup_submitted", "reason": "r"},
        {"kind": "input", "type": "lookup_answer", "t": 2.0, "request_id": "a", "epoch": 7, "tiers": []},
        {"kind": "transition", "t": 2.0, "req": "a", "from": "lookup_pending", "to": "waiting",
         "trigger": "lookup_answered", "reason": "r"},
        {"kind": "input", "type": "abort", "t": 3.0, "request_id": "a"},
        {"kind": "transition", "t": 3.0, "req": "a", "from": "waiting", "to": "finished",
         "trigger": "aborted", "reason": "r"},
    ]
    path = _write(tmp_path / "t.jsonl", [orjson.dumps(r) for r in records])
    report = validate(path)
    assert [(f.invariant, f.line) for f in report.findings] == [(4, 6)]


def test_stranded_request_and_unreported_job_at_end(tmp_path: Path) -> None:
    config = RunConfig(engine=EngineConfig(ranks=2))
    header = {"kind": "header", "schema": 1, "config": config.to_dict(), "policies": ["baseline"], "seed": 0}
    records = [
        header,
        {"kind": "input", "type": "arrival", "t": 0.0, "request_id": "a", "prompt_tokens": 10,
         "block_hashes": [], "resumable": False},
        {"kind": "input", "type": "tick", "t": 1.0},
        {"kind": "transition", "t": 1.0, "req": "a", "from": "waiting", "to": "lookup_pending",
         "trigger": "lookup_submitted", "reason": "r"},
        {"kind": "job", "t": 1.0, "job": 0, "op": "store", "req": "a", "blocks": 1, "tiers": {"host": 1}},
        {"kind": "input", "type": "transfer_report", "t": 2.0, "job_id": 0, "rank": 1, "failed": []},
    ]
    report = validate(_write(tmp_path / "s.jsonl", [orjson.dumps(r) for r in records]))
    messages = [f.message for f in report.findings if f.invariant == 7]
    assert any("ranks [0] never reported" in m for m in messages)
    assert any("a stranded in lookup_pending" in m for m in messages)


def test_format_findings_are_counted_not_fatal(trace: Path, tmp_path: Path) -> None:
    lines = _lines(trace)
    lines[3:3] = [b"{oops", b'{"kind":"mystery","t":0}', b'{"kind":"input","type":"warp","t":0}']
    report = validate(_write(tmp_path / "f.jsonl", lines))
    zeros = [f for f in report.findings if f.invariant == 0]
    assert [f.line for f in zeros] == [4, 5, 6]


def test_truncated_last_line_is_reported_and_rest_used(trace: Path, tmp_path: Path) -> None:
    data = trace.read_bytes()
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes(data[: len(data) - 25])
    report = validate(cut)
    assert report.truncated_line == len(_lines(trace))
    assert report.ok, report.format()  # no end-of-run checks on a run that did not end
    assert "truncated last line" in report.format()


def test_missing_header_is_a_finding(trace: Path, tmp_path: Path) -> None:
    report = validate(_write(tmp_path / "h.jsonl", _lines(trace)[1:]))
    assert report.findings[0].invariant == 0 and report.findings[0].line == 1
    assert "missing header" in report.findings[0].message


def test_newer_schema_is_an_error(trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = _lines(trace)
    lines[0] = lines[0].replace(b'"schema":1', b'"schema":42')
    path = _write(tmp_path / "n.jsonl", lines)
    with pytest.raises(TraceError, match="newer"):
        validate(path)
    assert main(["validate", str(path)]) == 2
    assert "kvlife: error:" in capsys.readouterr().err


def test_cli_exit_codes(trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(trace)]) == 0
    assert "0 findings" in capsys.readouterr().out
    lines = _lines(trace)
    lines.insert(2, b"garbage")
    assert main(["validate", str(_write(tmp_path / "g.jsonl", lines))]) == 1
    assert "line 3" in capsys.readouterr().out


# ---- invariants 2, 5 and 6 from the block-level records ----------------------------------
BT = 256
SHARED = EngineConfig(block_tokens=BT, device_blocks=1000, max_batched_tokens=8192, max_running=64,
                      lookup_latency_ms=1.0,
                      tiers=(TierConfig("host", capacity_blocks=6000, latency_ms=1.0),))
PREFETCH = EngineConfig(block_tokens=BT, device_blocks=100, max_batched_tokens=4096, max_running=64,
                        lookup_latency_ms=2.0, ranks=2,
                        tiers=(TierConfig("host", capacity_blocks=60),
                               TierConfig("disk", capacity_blocks=8000, bandwidth_gbps=0.25, latency_ms=2.0,
                                          failure_rate=0.02)))
# Two ranks, a transfer deadline that slow disk stores miss, and blocks failing in both tiers.
FLAKY = EngineConfig(ranks=2, device_blocks=60, max_batched_tokens=2048, transfer_deadline_ms=10.0,
                     tiers=(TierConfig("host", capacity_blocks=30, failure_rate=0.05),
                            TierConfig("disk", capacity_blocks=2000, latency_ms=2.0, bandwidth_gbps=4.0,
                                       failure_rate=0.05)))
ASYNC = EngineConfig(block_tokens=64, device_blocks=600, max_batched_tokens=512, max_running=32,
                     async_scheduling=True, tiers=(TierConfig("host", capacity_blocks=4000),))


def burst_workload(burst: int = 6, prefix_blocks: int = 24, own: int = 12, fillers: int = 38) -> list[WorkloadRequest]:
    """Warm a shared prefix into the host tier, flush the device with unrelated requests,
    then send a burst that hits the prefix: loads of the same blocks at the same time."""
    out: list[WorkloadRequest] = []
    prefix = tuple(range(prefix_blocks))
    h, t = 1_000_000, 0.0
    owns = []
    for b in range(burst):
        mine = tuple(range(h, h + own))
        h += own + 1
        owns.append(mine)
        out.append(WorkloadRequest(f"warm-{b}", t, (prefix_blocks + own) * BT + 10, 2, prefix + mine + (h - 1,)))
        t += 150.0
    for f in range(fillers):
        out.append(WorkloadRequest(f"fill-{f}", t, 30 * BT, 2, tuple(range(h, h + 30))))
        h += 30
        t += 60.0
    t += 1000.0
    for b in range(burst):
        out.append(WorkloadRequest(f"b-{b}", t + b, (prefix_blocks + own + 1) * BT + 100, 20,
                                   prefix + owns[b] + (h, h + 1)))
        h += 2
    return out


def _run(path: Path, engine: EngineConfig, stack: tuple[str, ...], workload: list[WorkloadRequest],
         sim: SimConfig | None = None) -> Path:
    config = RunConfig(engine=engine, sim=sim or SimConfig(seed=1), policies=stack)
    outcome = run_workload(config, workload, trace_path=path)
    assert outcome.summary["stranded"] == 0
    return path


def _prefetch_workload() -> list[WorkloadRequest]:
    return synthetic_workload(seed=3, num_requests=60, arrival_rate_per_s=2.0, block_tokens=BT)


def _async_workload() -> list[WorkloadRequest]:
    return synthetic_workload(seed=4, num_requests=30, arrival_rate_per_s=20.0, block_tokens=64)


STACKS: dict[str, tuple[EngineConfig, tuple[str, ...], Any, tuple[bytes, ...]]] = {
    # name: engine, stack, workload, what the trace must contain for the run to prove something
    "shared-loads": (SHARED, ("shared-loads",), burst_workload, (b"joined", b'"op":"load"')),
    "async-lookup": (SMALL, ("async-lookup",), _small_workload, (b'"to":"lookup_pending"', b'"op":"load"')),
    "keep-lookup-answers": (SMALL, ("async-lookup", "keep-lookup-answers"), _small_workload,
                            (b'"kind":"lookup_reuse"',)),
    "early-prefetch": (PREFETCH, ("early-prefetch",), _prefetch_workload, (b'"op":"prefetch"', b'"op":"load"')),
    "prefetch-best-effort": (PREFETCH, ("prefetch-best-effort", "early-prefetch"), _prefetch_workload,
                             (b'"op":"prefetch"',)),
    "ranks-deadline-failures": (FLAKY, ("shared-loads",), _small_workload,
                                (b'"what":"rank_timeout"', b'"late":true', b'"trigger":"load_failed"')),
    "async-scheduling-baseline": (ASYNC, (), _async_workload, (b'"op":"store"',)),
}


@pytest.mark.parametrize("name", list(STACKS))
def test_real_traces_of_builtin_stacks_are_valid(name: str, tmp_path: Path) -> None:
    engine, stack, workload, needles = STACKS[name]
    sim = SimConfig(rank_jitter_ms=4.0) if engine is FLAKY else None
    path = _run(tmp_path / "run.jsonl", engine, stack, workload(), sim)
    report = validate(path)
    assert report.ok, report.format()
    assert report.sharing == ("shared-loads" in stack)
    assert {2, 5} <= set(report.checked) and not report.notes
    data = path.read_bytes()
    for needle in (b'"kind":"free"', b'"op":"store"', *needles):
        assert needle in data, needle


def _job_done_index(records: list[dict[str, Any]], job: int) -> int:
    return next(i for i, r in enumerate(records) if r["kind"] == "job_done" and r["job"] == job)


def test_free_while_a_job_moves_the_block_is_caught(trace: Path, tmp_path: Path) -> None:
    records = _records(trace)
    for j, record in enumerate(records):
        if record["kind"] == "job" and record["op"] in ("load", "store"):
            blocks = {m[1] for m in record["moves"]}
            k = next((k for k in range(j + 1, len(records)) if records[k]["kind"] == "free"
                      and blocks & set(records[k]["blocks"])), None)
            if k is not None:
                break
    else:
        pytest.fail("no freed block of a job in the trace")
    # Move the free record to right after the job that moves the block: no rank reported yet.
    records.insert(j + 1, records.pop(k))
    report = validate(_dump(tmp_path / "bad.jsonl", records))
    assert report.findings, report.format()
    # (Its blocks that later jobs moved are then never freed after them: 8, at the end.)
    assert {(f.invariant, f.line) for f in report.findings if f.line is not None} == {(2, j + 2)}
    assert {f.invariant for f in report.findings if f.line is None} <= {8}
    assert f"{record['op']} job {record['job']} still moves it" in report.findings[0].message


def test_a_run_with_no_tier_is_valid(tmp_path: Path) -> None:
    # Plain vLLM, no tier: the scheduler still calls the connector core, so the requests'
    # states move through the lifecycle as with a tier.
    path = _run(tmp_path / "run.jsonl", attrs.evolve(SMALL, tiers=()), (), _small_workload()[:20])
    assert validate(path).ok, validate(path).format()


def test_free_after_a_rank_timeout_but_before_the_late_report_is_caught(tmp_path: Path) -> None:
    # A load given up at its deadline: a silent rank may still write its blocks, so they
    # stay held (quarantined) until its late report; freeing them before it is 2, after it
    # is not.
    header = {"kind": "header", "schema": 1, "config": RunConfig(engine=EngineConfig(
        ranks=2, transfer_deadline_ms=10.0)).to_dict(), "policies": ["baseline"], "seed": 0}
    records: list[dict[str, Any]] = [
        header,
        {"kind": "input", "type": "arrival", "t": 0.0, "request_id": "a", "prompt_tokens": 1030,
         "block_hashes": [1, 2], "resumable": False},
        {"kind": "input", "type": "tick", "t": 1.0},
        {"kind": "job", "t": 1.0, "job": 0, "op": "load", "req": "a", "blocks": 2, "tiers": {"host": 2},
         "moves": [[1, 5, "host"], [2, 6, "host"]]},
        {"kind": "transition", "t": 1.0, "req": "a", "from": "waiting", "to": "loading", "trigger": "load_started",
         "reason": "r"},
        {"kind": "step", "t": 1.0, "step": 0, "requests": 0, "prefill_tokens": 0, "sync_lookups": 0, "prompt": []},
        {"kind": "input", "type": "step_output", "t": 2.0, "step_id": 0, "finished": [], "reports": [[0, 0, []]]},
        {"kind": "input", "type": "tick", "t": 12.0},
        {"kind": "warning", "t": 12.0, "what": "rank_timeout", "job": 0, "ranks": [1]},
        {"kind": "transition", "t": 12.0, "req": "a", "from": "loading", "to": "waiting", "trigger": "load_failed",
         "reason": "r"},
        {"kind": "step", "t": 12.0, "step": 1, "requests": 0, "prefill_tokens": 0, "sync_lookups": 0, "prompt": []},
        {"kind": "free", "t": 12.0, "blocks": [6, 5]},
    ]
    report = validate(_dump(tmp_path / "early.jsonl", records))
    twos = [f for f in report.findings if f.invariant == 2]
    assert [f.line for f in twos] == [len(records)] * 2, report.format()
    assert "freed while load job 0 still moves it (ranks [1] have not reported)" in twos[0].message
    # The late report first: the blocks may go.
    late = {"kind": "input", "type": "transfer_report", "t": 13.0, "job_id": 0, "rank": 1, "failed": []}
    done = {"kind": "job_done", "t": 13.0, "job": 0, "op": "load", "failed": 0, "late": True}
    report = validate(_dump(tmp_path / "late.jsonl", [*records[:-1], late, done, records[-1]]))
    assert not [f for f in report.findings if f.invariant == 2], report.format()


def test_load_into_a_block_another_job_still_moves_is_caught(bursts: tuple[Path, Path], tmp_path: Path) -> None:
    # The burst's loads of one shared prefix overlap (no dedup in the plain stack).
    records = _records(bursts[0])

    def load_beside_another_job() -> tuple[int, dict[str, Any], dict[str, Any]]:
        in_flight: dict[int, dict[str, Any]] = {}
        for i, record in enumerate(records):
            if record["kind"] == "job_done":
                in_flight.pop(record["job"], None)
            elif record["kind"] == "job":
                if record["op"] == "load" and in_flight:
                    return i, record, next(iter(in_flight.values()))
                in_flight[record["job"]] = record
        raise AssertionError("no load started while another job was in flight")

    i, record, other = load_beside_another_job()
    record["moves"][0][1] = other["moves"][0][1]
    report = validate(_dump(tmp_path / "bad.jsonl", records))
    assert report.findings and report.findings[0].invariant == 2 and report.findings[0].line == i + 1, \
        report.format()
    assert f"{other['op']} job {other['job']} still moves it" in report.findings[0].message


def test_store_of_an_unconfirmed_block_is_caught(trace: Path, tmp_path: Path) -> None:
    records = _records(trace)
    bt = SMALL.block_tokens
    arrivals = {r["request_id"]: r for r in records if r["kind"] == "input" and r["type"] == "arrival"}

    def step_computing_a_whole_block() -> tuple[int, dict[str, Any], str, int, int]:
        for s, step in enumerate(records):
            for rid, before, n in step.get("prompt", ()) if step["kind"] == "step" else ():
                full = arrivals[rid]["prompt_tokens"] // bt
                block = -(-before // bt)  # the first block that starts inside this chunk
                if block < full and (block + 1) * bt <= before + n:
                    return s, step, rid, before, block
        raise AssertionError("no step computes a whole prompt block")

    s, step, rid, before, block = step_computing_a_whole_block()
    # A store of that block issued with the step plan: its tokens are still being computed.
    fake = {"kind": "job", "t": step["t"], "job": 10**6, "op": "store", "req": rid, "blocks": 1,
            "tiers": {"host": 1}, "moves": [[arrivals[rid]["block_hashes"][block], 10**6, "host"]]}
    records.insert(s + 1, fake)
    report = validate(_dump(tmp_path / "bad.jsonl", records))
    located = [(f.invariant, f.line) for f in report.findings if f.line is not None]
    assert located[0] == (5, s + 2), report.format()
    assert f"covers tokens up to {(block + 1) * bt}, only {before} are computed" in report.findings[0].message
    # The made-up job never hears from a rank: the request finishes with it in flight (11)
    # and it never ends (7). Those are the only other findings.
    assert [i for i, _ in located[1:]] == [11] and "store job" in report.findings[1].message \
        and "1000000" in report.findings[1].message
    assert all("job 1000000" in f.message for f in report.findings if f.invariant == 7)


def _stores_of_generated_blocks(path: Path) -> int:
    """Store moves of blocks past the prompt (blocks that generated tokens filled)."""
    records = _records(path)
    prompt_blocks = {r["request_id"]: set(r["block_hashes"]) for r in records
                     if r["kind"] == "input" and r["type"] == "arrival"}
    return sum(1 for r in records if r["kind"] == "job" and r["op"] == "store"
               for move in r["moves"] if move[0] not in prompt_blocks[r["req"]])


def test_naive_stores_under_async_scheduling_store_placeholders_and_are_flagged(tmp_path: Path) -> None:
    path = _run(tmp_path / "naive.jsonl", ASYNC, ("naive-stores-unsafe",), _async_workload())
    assert _stores_of_generated_blocks(path) > 10
    report = validate(path)
    counts = report.counts()
    assert set(counts) == {5} and counts[5] > 10, report.format()
    assert all("only" in f.message and "are computed" in f.message for f in report.findings)


def test_safe_stores_under_async_scheduling_store_generated_blocks_and_validate_clean(tmp_path: Path) -> None:
    path = _run(tmp_path / "safe.jsonl", ASYNC, (), _async_workload())
    assert _stores_of_generated_blocks(path) > 10
    report = validate(path)
    assert report.ok, report.format()


@pytest.fixture(scope="module")
def bursts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("bursts")
    return (_run(root / "plain.jsonl", SHARED, (), burst_workload()),
            _run(root / "shared.jsonl", SHARED, ("shared-loads",), burst_workload()))


def test_second_inflight_load_of_a_hash_is_caught_with_sharing(bursts: tuple[Path, Path], tmp_path: Path) -> None:
    records = _records(bursts[1])
    # (A join reads no tier: it copies an in-flight load's device blocks.)
    loads = [(i, r) for i, r in enumerate(records) if r["kind"] == "job" and r["op"] == "load" and "after" not in r]
    first, (c, second) = next((first, (c, r)) for i, first in loads
                              for c, r in loads if i < c < _job_done_index(records, first["job"]))
    second["moves"].append([first["moves"][0][0], 10**6, first["moves"][0][2]])
    report = validate(_dump(tmp_path / "bad.jsonl", records))
    assert report.findings and report.findings[0].line == c + 1, report.format()
    # (The made-up device block is never freed: 8, at the end of the run.)
    assert {f.invariant for f in report.findings if f.line is not None} == {6}
    assert "already loading" in report.findings[0].message
    assert {f.invariant for f in validate(tmp_path / "bad.jsonl", sharing=False).findings} == {8}


def test_sharing_flag_checks_a_stack_that_loads_twice(bursts: tuple[Path, Path],
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    plain = bursts[0]
    assert validate(plain).ok  # baseline does not share loads: 6 does not apply
    assert set(validate(plain, sharing=True).counts()) == {6}
    assert main(["validate", str(plain), "--sharing", "on", "--limit", "1"]) == 1
    assert "invariant 6" in capsys.readouterr().out
    assert main(["validate", str(bursts[1])]) == 0
    assert "invariants 0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12 hold" in capsys.readouterr().out


def test_trace_without_block_records_is_not_misjudged(trace: Path, tmp_path: Path) -> None:
    # An older or foreign trace: jobs without moves, steps without prompt chunks, no frees.
    records = [r for r in _records(trace) if r["kind"] != "free"]
    for r in records:
        r.pop("moves", None)
        r.pop("prompt", None)
    report = validate(_dump(tmp_path / "old.jsonl", records))
    assert report.ok, report.format()
    assert report.checked == (0, 1, 3, 4, 7, 11, 12)
    assert any("invariants 2, 5 and 6 were not checked" in n for n in report.notes)
    assert any("invariant 5 was not checked" in n for n in report.notes)


@pytest.mark.parametrize("kind", ["job_done", "reclaim", "abandon"])
def test_a_record_naming_a_job_by_an_object_is_a_finding_not_a_crash(kind: str, trace: Path, tmp_path: Path) -> None:
    # (A campaign case: an edited trace whose job_done named its job by a JSON object made
    # validate raise TypeError, unhashable dict.)
    records = _records(trace)
    at = next(i for i, r in enumerate(records) if r["kind"] == "job_done")
    records.insert(at, {"kind": kind, "t": records[at]["t"], "job": {"id": 1}, "req": ["r"]})
    report = validate(_dump(tmp_path / "bad.jsonl", records))
    assert report.findings and report.findings[0].line == at + 1, report.format()  # (records[0] is line 1)
