"""``kvlife mrc``: the one-pass LRU curve against brute force, the independent replay and the
engine; OPT against a brute-force Belady and above LRU; the command line and its errors."""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import attrs
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlife.lifecycle.cli.main import main
from kvlife.lifecycle.config import RunConfig
from kvlife.lifecycle.fidelity import mrc
from kvlife.lifecycle.fidelity.lru_replay import lru_replay, read_prompts
from kvlife.lifecycle.fidelity.runs import load, simulate, with_tiers
from kvlife.lifecycle.workloads.bundled import resolve_workload

WORKLOAD = "mooncake-conversation"


# ---- brute force, per capacity ---------------------------------------------------------------
def brute_lru(prompts: Sequence[Sequence[int]], capacity: int, counts: Sequence[int] | None = None) -> int:
    """Prefix hits of an LRU cache of ``capacity`` blocks: every block looked up, then made most
    recent (inserted on a miss, the least recent evicted past ``capacity``); only the first
    ``counts[i]`` blocks of prompt ``i`` count."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for i, prompt in enumerate(prompts):
        prefix = True
        for k, block in enumerate(prompt):
            present = block in cache
            prefix = prefix and present and (counts is None or k < counts[i])
            hits += prefix
            cache[block] = None
            cache.move_to_end(block)
            if len(cache) > capacity:
                cache.popitem(last=False)
    return hits


def brute_opt(prompts: Sequence[Sequence[int]], capacity: int, counts: Sequence[int] | None = None) -> int:
    """Prefix hits of Belady's rule, scanning the future at every eviction: the victim is the
    cached block accessed again last (ties only between blocks never accessed again, where the
    choice cannot change a hit)."""
    flat = [b for p in prompts for b in p]

    def next_use(block: int, after: int) -> int:
        return next((u for u in range(after + 1, len(flat)) if flat[u] == block), len(flat))

    cache: set[int] = set()
    hits = 0
    t = -1
    for i, prompt in enumerate(prompts):
        prefix = True
        for k, block in enumerate(prompt):
            t += 1
            present = block in cache
            prefix = prefix and present and (counts is None or k < counts[i])
            hits += prefix
            if not present:
                if len(cache) >= capacity:
                    farthest = max(sorted(cache), key=lambda b: next_use(b, t))  # noqa: B023 - used at once
                    cache.remove(farthest)
                cache.add(block)
    return hits


def chained(paths: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    """Prompts as Mooncake chains them: hash i names the whole prefix up to block i."""
    ids: dict[tuple[int, ...], int] = {}
    return [tuple(ids.setdefault(tuple(p[: i + 1]), len(ids)) for i in range(len(p))) for p in paths]


prompts_strategy = st.lists(st.lists(st.integers(0, 7), min_size=1, max_size=6), min_size=1, max_size=25)


@settings(max_examples=300, deadline=None)
@given(prompts_strategy, st.lists(st.integers(0, 6), min_size=25, max_size=25))
def test_lru_curve_equals_brute_force_at_every_capacity(prompts: list[list[int]], cut: list[int]) -> None:
    # Arbitrary hash lists (repeats inside a prompt included), the same lists chained, and
    # with only a leading part of each prompt counted (the rest inserted only: output blocks).
    partly = [min(c, len(p)) for p, c in zip(prompts, cut, strict=False)]
    for trace, counts in ((prompts, None), (chained(prompts), None), (prompts, partly)):
        histogram, cold = mrc.lru_histogram(trace, counts)
        hits = mrc.cumulative(histogram)
        distinct = len({b for p in trace for b in p})
        assert len(hits) == distinct + 1
        assert hits[-1] + cold == (sum(len(p) for p in trace) if counts is None else sum(counts))
        for capacity in range(1, distinct + 2):
            assert hits[min(capacity, distinct)] == brute_lru(trace, capacity, counts), (trace, capacity)


@settings(max_examples=150, deadline=None)
@given(prompts_strategy, st.lists(st.integers(0, 6), min_size=25, max_size=25))
def test_opt_equals_brute_force_belady_and_bounds_lru(prompts: list[list[int]], cut: list[int]) -> None:
    partly = [min(c, len(p)) for p, c in zip(prompts, cut, strict=False)]
    for trace, counts in ((prompts, None), (chained(prompts), None), (prompts, partly)):
        nexts = mrc.next_uses(trace)
        distinct = len({b for p in trace for b in p})
        previous = -1
        for capacity in range(1, distinct + 1):
            opt = mrc.opt_hits(trace, nexts, capacity, counts)
            assert opt == brute_opt(trace, capacity, counts), (trace, capacity)
            assert opt >= previous  # a stack algorithm: more capacity never hits less
            previous = opt
    # Chained hashes: the prefix rule never removes an OPT hit, so OPT bounds LRU everywhere.
    trace = chained(prompts)
    nexts = mrc.next_uses(trace)
    for capacity in range(1, len({b for p in trace for b in p}) + 1):
        assert mrc.opt_hits(trace, nexts, capacity) >= brute_lru(trace, capacity)


def test_by_hand() -> None:
    a, b, c = (1, 2, 3), (1, 2, 9), (7, 2, 3)
    curve = mrc.miss_ratio_curve(mrc.Prompts("x", (a, b, c), 16, "all"), [1, 2, 3, 4])
    assert curve.counted == 9 and curve.distinct == 5
    # 2 is cached when c comes, but its prefix (7) is not: only b's 1 and 2 ever hit.
    assert curve.max_hits == 2
    # Capacity 2: after a, {2, 3}; b finds 1 evicted, so b misses all; c's 7 misses.
    assert curve.lru_hits(2) == 0 and curve.lru_hits(3) == 2
    # OPT at 2 must take 3 in (every block is stored) and gives up 2, needed after 1: b's 1 hits.
    assert curve.opt_hits(1) == 0 and curve.opt_hits(2) == 1 and curve.opt_hits(3) == 2
    with pytest.raises(ValueError, match="capacity"):
        mrc.opt_hits([a], mrc.next_uses([a]), 0)


# ---- the independent replay, and the figures of issue 13 -------------------------------------
def test_lru_curve_equals_the_independent_replay_on_the_conversation_trace() -> None:
    # The whole trace: the figures, recomputed. "all" blocks (Mooncake's accounting) is
    # the counting that gives them; "cacheable" must agree with the replay as exactly.
    replay_prompts = read_prompts(resolve_workload(WORKLOAD))
    for mode in ("all", "cacheable"):
        curve = mrc.miss_ratio_curve(mrc.read_trace(WORKLOAD, mode=mode))
        assert curve.requests == len(replay_prompts) == 12_031  # the trace's lines
        replay_hits = {}
        for tokens in (3_000_000, 10_000_000, 50_000_000, None):
            blocks = None if tokens is None else tokens // 512
            replay = lru_replay(replay_prompts, blocks, mode, 512)  # type: ignore[arg-type]
            assert (curve.lru_hits(blocks), curve.counted) == (replay.hits, replay.blocks), (mode, tokens)
            replay_hits[tokens] = replay.hits
        # With an infinite cache a block misses at its first use only: the trace's hash ids are
        # prefix hashes, so a block seen before comes with its whole prefix seen. The maximum is
        # counted - distinct blocks, found without replaying anything.
        assert curve.max_hits == replay_hits[None] == curve.counted - curve.distinct
        if mode == "all":
            # Issue 13's figures, which it computed with its own replay: 36.6 % of all blocks hit
            # at most, (288,500 blocks - 182,790 distinct) / 288,500; and 37 %, 78 % and 99 % of
            # that maximum at 3M, 10M and 50M tokens (5,859, 19,531 and 97,656 blocks of 512 tokens).
            assert (curve.counted, curve.distinct) == (288_500, 182_790)
            assert round(100 * (curve.counted - curve.distinct) / curve.counted, 1) == 36.6
            of_max = [round(100 * replay_hits[t] / replay_hits[None]) for t in (3_000_000, 10_000_000, 50_000_000)]
            assert of_max == [37, 78, 99]


def test_lru_curve_equals_the_replay_at_many_capacities_of_a_slice() -> None:
    replay_prompts = read_prompts(resolve_workload(WORKLOAD), 400)
    curve = mrc.miss_ratio_curve(mrc.read_trace(WORKLOAD, 400, "cacheable"))
    for blocks in (1, 7, 50, 333, 1000, 2500, 5000, curve.distinct - 1, curve.distinct, 10**9):
        assert curve.lru_hits(blocks) == lru_replay(replay_prompts, blocks, "cacheable", 512).hits, blocks


def test_opt_is_above_lru_and_both_are_monotone_on_the_trace() -> None:
    curve = mrc.miss_ratio_curve(mrc.read_trace(WORKLOAD, 500), mrc.plot_capacities(11_879))
    assert curve.distinct == 11_879
    assert list(curve.lru) == sorted(curve.lru)
    opt = [curve.opt[c] for c in sorted(curve.opt)]
    assert opt == sorted(opt) and len(opt) == mrc.PLOT_POINTS - 1  # the last is every block: the maximum
    for c, hits in curve.opt.items():
        assert hits >= curve.lru_hits(c), c
    assert curve.opt_hits(None) == curve.lru_hits(None) == curve.max_hits


# ---- the engine ------------------------------------------------------------------------------
# Five host-tier capacities (blocks) across the curve of the first 1,000 requests (21,222
# distinct blocks stored): its foot, its climb (5,000 sits on its steepest step), its top.
ENGINE_CAPACITIES = (1000, 3000, 5000, 8000, 20000)


def test_mrc_equals_engine_runs_with_a_host_tier_only() -> None:
    """The engine with one host tier of each capacity and a small device (300 blocks), baseline
    stack: its summary's device + host prefix hit rate, over the same (cacheable) blocks, within
    1 point of the curve that also inserts the output blocks the engine stores (``output_blocks``;
    measured: one block of 26,305 apart at every capacity, the first two requests arriving
    together: timing). Without them the curve sits up to 1.1 points above the engine on its
    steepest step: the engine's host tier also holds the blocks outputs fill (docs/mrc.md)."""
    with_outputs = mrc.miss_ratio_curve(mrc.read_trace(WORKLOAD, 1000, "cacheable", output_blocks=True))
    prompts_only = mrc.miss_ratio_curve(mrc.read_trace(WORKLOAD, 1000, "cacheable"))
    assert with_outputs.counted == prompts_only.counted == 26_305
    base = RunConfig()
    base = attrs.evolve(base, engine=attrs.evolve(base.engine, device_blocks=300))
    workload = load(WORKLOAD, 1000, 1.0, base)
    engine = []
    for capacity in ENGINE_CAPACITIES:
        run = simulate(with_tiers(base, {"host": capacity}), workload, WORKLOAD)
        assert run.summary["stranded"] == 0
        assert set(run.summary["prefix_hit_rate"]) == {"device", "host"}
        total = float(sum(run.summary["prefix_hit_rate"].values()))
        engine.append(total)
        assert abs(total - with_outputs.lru_hits(capacity) / with_outputs.counted) <= 0.01, (capacity, total)
        # The output blocks only take capacity: the prompt-only curve is above the engine.
        assert total <= prompts_only.lru_hits(capacity) / prompts_only.counted + 0.005, (capacity, total)
    assert engine == sorted(engine) and engine[-1] > engine[0] + 0.1


# ---- the command line ------------------------------------------------------------------------
def test_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["mrc", WORKLOAD, "--limit", "300", "--capacities", "100k,1M"]) == 0
    out = capsys.readouterr().out
    assert "300 requests" in out and "infinite cache:" in out
    # A capacity in tokens is that many whole 512-token blocks; infinite holds every distinct
    # block of the 300 requests (counted here from the trace's hash ids).
    distinct = len({h for p in read_prompts(resolve_workload(WORKLOAD), 300) for h in p.hash_ids})
    assert f"| 100k | {100_000 // 512} |" in out and f"| 1M | {1_000_000 // 512:,} |" in out
    assert f"| infinite | all ({distinct:,}) |" in out and distinct == 7_814
    assert "OPT: Belady, one run per capacity" in out


def test_json_and_plot(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    png = tmp_path / "mrc.png"
    assert main(["mrc", WORKLOAD, "--limit", "200", "--unit", "blocks", "--capacities", "10,100",
                 "--blocks", "cacheable", "--plot", str(png), "--json"]) == 0
    text = capsys.readouterr().out
    assert "NaN" not in text and "Infinity" not in text
    result = json.loads(text)
    assert list(result)[:2] == ["kind", "schema"] and result["kind"] == "mrc" and result["schema"] == 1
    assert result["blocks"] == "cacheable" and result["requests"] == 200
    rows = result["rows"]
    assert [r["capacity_blocks"] for r in rows] == [10, 100, None]
    assert rows[0]["capacity_tokens"] == 5120 and rows[-1]["capacity_tokens"] is None
    assert rows[-1]["lru_of_max"] == 1.0 and rows[-1]["lru_hit_ratio"] == result["max_hit_ratio"]
    assert all(r["opt_hits"] >= r["lru_hits"] for r in rows)
    assert len(result["curve"]) >= 2 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_empty_trace_is_refused_and_no_blocks_has_no_nan(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert main(["mrc", str(empty), "--json"]) == 2  # as kvlife run refuses it (issue 24)
    assert capsys.readouterr().err == f"kvlife: error: {empty}: no requests\n"
    # A request whose prompt fills no block: nothing to count, and still no NaN.
    short = tmp_path / "short.jsonl"
    short.write_bytes(orjson.dumps({"timestamp": 0, "input_length": 100, "output_length": 4, "hash_ids": [1]}) + b"\n")
    assert main(["mrc", str(short), "--blocks", "cacheable", "--json", "--plot", str(tmp_path / "e.png")]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["counted_blocks"] == 0 and result["max_hit_ratio"] is None
    assert [r["capacity_blocks"] for r in result["rows"]] == [None]


def write_trace(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


GOOD = orjson.dumps({"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]})


@pytest.mark.parametrize(("line", "message"), [
    (b'{"timestamp": 1, "input_length": 600, "output_length": 4}', "2: field 'hash_ids': missing"),
    (b'{"timestamp": 1, "input_length": -5, "output_length": 4, "hash_ids": [1]}', "2: field 'input_length': "),
    (b'{"timestamp": 1, "input_length": 600, "output_length": 4, "hash_ids": [1]}',
     "2: field 'hash_ids': expected 2 block hashes for input_length 600, got 1"),
    (b"{not json", "2: invalid JSON"),
])
def test_bad_line_is_one_error_line(line: bytes, message: str, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    path = write_trace(tmp_path / "bad.jsonl", [GOOD, line])
    assert main(["mrc", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"kvlife: error: {path}:{message}")
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err


@pytest.mark.parametrize(("argv", "error"), [
    (["mrc", "/nonexistent/trace.jsonl"], "kvlife: error: /nonexistent/trace.jsonl: cannot read: "
                                          "No such file or directory\n"),
    (["mrc", "no-such-workload"], "kvlife: error: no-such-workload: cannot read: No such file or directory "
                                  "(and not a bundled workload: mooncake-conversation)\n"),
    (["mrc", WORKLOAD, "--capacities", "3M,x"],
     "kvlife mrc: error: argument --capacities: 'x' is not a size (a number with an optional k, M or G: 3M, "
     "500k)\n"),
    (["mrc", WORKLOAD, "--capacities", "0"], "kvlife mrc: error: argument --capacities: '0': expected a whole "
                                             "number >= 1\n"),
    (["mrc", WORKLOAD, "--plot", "out.xyz"], None),
])
def test_bad_input_exits_2(argv: list[str], error: str | None, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err and captured.err.count("\n") == 1
    if error is not None:
        assert captured.err == error
    else:
        assert captured.err.startswith("kvlife: error: out.xyz: unsupported image extension '.xyz'")


def test_parse_size() -> None:
    assert [mrc.parse_size(s) for s in ("3M", "500k", "1.5G", "5859", " 2m ")] == [
        3_000_000, 500_000, 1_500_000_000, 5859, 2_000_000]
    for bad in ("", "M", "nan", "inf", "1.5", "-3", "1e30"):
        with pytest.raises(ValueError):
            mrc.parse_size(bad)
    assert mrc.default_capacities_tokens(182_790, 512)[:3] == [10_000, 30_000, 100_000]
    assert mrc.default_capacities_tokens(182_790, 512)[-1] == 30_000_000
    assert mrc.default_capacities_tokens(0, 512) == []


def test_output_blocks_are_inserted_never_counted(tmp_path: Path) -> None:
    records = [{"timestamp": 0, "input_length": 1024, "output_length": 1000, "hash_ids": [1, 2]},
               {"timestamp": 1, "input_length": 600, "output_length": 10, "hash_ids": [1, 3]}]
    path = write_trace(tmp_path / "t.jsonl", [orjson.dumps(r) for r in records])
    plain = mrc.read_trace(path, mode="cacheable")
    assert plain.blocks == ((1,), (1,)) and plain.counts is None and plain.counted == 2
    engine = mrc.read_trace(path, mode="cacheable", output_blocks=True)
    # The first prompt ends on a block boundary: its full last block (2) is stored; its output
    # fills (1024 + 1000) // 512 - 2 = 1 more block. The second's output fills none.
    assert engine.blocks == ((1, 2, -1), (1,)) and engine.counts == (1, 1) and engine.counted == 2
    assert mrc.read_trace(path, output_blocks=True).blocks == ((1, 2, -1), (1, 3))
    curve = mrc.miss_ratio_curve(engine, [1, 2])
    # Capacity 2: 1, 2, then the output block evicts 1: the second prompt misses.
    assert curve.lru_hits(2) == 0 and curve.lru_hits(3) == 1 and curve.max_hits == 1
    # OPT keeps 1 (needed next) and lets the output block go: a hit even at 2.
    assert curve.opt_hits(1) == 0 and curve.opt_hits(2) == 1
