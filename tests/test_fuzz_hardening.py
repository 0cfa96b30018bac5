"""Fuzzing the hardened surfaces of issue 24: every input kvlife reads, and what it writes.

The same invariant as ``tests/test_fuzz_inputs.py`` (whose ``kvlife`` helper runs each
command in-process, bounded in time): no traceback, no hang, exit 0, 1 or 2, an exit 2 is one
line. Here, per surface, the inputs the second campaign of the issue found to break it:

* **309 digits and more**: an integer past a float's range (and a negative one) in every
  number-typed config key and flag, a sweep grid, capacity's flags, an SLO, a calibration
  CSV, a workload line and a trace header;
* **gzip bombs**: a small ``.gz`` that decompresses to one long line, or to many, given to
  every command that reads a workload, a trace, a results file or a CSV: refused within
  the bounds of ``kvlife.lifecycle.input_files``, its memory bounded (tracemalloc);
* **header bombs**: a trace header whose sizes ask for gigabytes: what rebuilds the engine
  refuses it, the rest reads it without allocating by it;
* **FIFOs** (and devices, directories) in place of every input file: refused, not waited on;
* **never-returning hooks**: each hook of a policy spinning, sleeping or swallowing the
  watchdog's error: the run ends past ``--hook-budget`` with one line naming the policy and
  the hook, and its trace so far validates;
* **outputs**: a run refused part-way never replaces the trace already at its path, and no
  output may be one of the command's inputs.

Examples run in-process on a few requests; ``pytest --hypothesis-profile=deep`` runs more.
"""

from __future__ import annotations

import gzip
import os
import tracemalloc
from pathlib import Path

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlife.lifecycle.config import field_rule
from kvlife.lifecycle.traces.validate import validate
from kvlife.policies.base import HOOKS
from tests.test_fuzz_inputs import ARGS, FAILING_TIERS, FIELDS, TIER_FIELDS, UNDER, Outcome, kvlife

SUITE = settings(max_examples=max(8, settings().max_examples // 8), deadline=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
# An integer past a 64-bit float's range (1.8e308): 309 digits and more, either sign.
HUGE = st.integers(309, 4000).map(lambda n: "9" * n) | st.integers(309, 600).map(lambda n: "-" + "9" * n)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hardening")


@pytest.fixture(scope="module")
def trace(scratch: Path) -> Path:
    path = scratch / "run.jsonl"
    assert kvlife("run", "--limit", "20", "--tier", "host=30", "--device-blocks", "40", "--trace", str(path)).code == 0
    return path


@pytest.fixture(scope="module")
def workload(scratch: Path) -> Path:
    path = scratch / "w.jsonl"
    path.write_bytes(b"".join(orjson.dumps({"timestamp": i * 10, "input_length": 600, "output_length": 4,
                                            "hash_ids": [1, i + 2]}) + b"\n" for i in range(8)))
    return path


def refused(outcome: Outcome, *words: str) -> None:
    assert outcome.code == 2, outcome
    assert all(w in outcome.line for w in words), outcome.line


# ---- integers of 309 digits and more, in every number field --------------------------------
NUMBER_KEYS = [k for k in [*FIELDS, *(f"tiers.{f}" for f in TIER_FIELDS)] if field_rule(k).kind in ("int", "number")]
NUMBER_FLAGS = [["run", "--time-scale"], ["run", "--transfer-deadline"], ["run", "--hook-budget"],
                ["run", "--limit"], ["run", "--seed"], ["run", "--device-blocks"], ["run", "--ranks"],
                ["capacity", "--slo", "ttft_p90=2s", "--min-scale"],
                ["capacity", "--slo", "ttft_p90=2s", "--max-scale"],
                ["capacity", "--slo", "ttft_p90=2s", "--stability-ratio"],
                ["capacity", "--slo", "ttft_p90=2s", "--stability-slack-ms"],
                ["capacity", "--slo", "ttft_p90=2s", "--precision"], ["bench", "soak", "--time-scale"],
                ["check", "--examples"], ["sweep", "run", "-o", "unused.jsonl", "--max-points"]]


@SUITE
@given(st.sampled_from(NUMBER_KEYS), HUGE)
def test_a_huge_integer_in_any_config_key(scratch: Path, key: str, digits: str) -> None:
    section, _, name = key.partition(".")
    path = scratch / "huge.toml"
    if section == "tiers":
        path.write_text(f'[[tiers]]\nname = "host"\ncapacity_blocks = 10\n{name} = {digits}\n')
    else:
        path.write_text(f"[{section}]\n{name} = {digits}\n")
    refused(kvlife("run", "--config", str(path), "--limit", "2"), str(path))


@SUITE
@given(st.sampled_from(NUMBER_FLAGS), HUGE)
def test_a_huge_integer_in_any_number_flag(flag: list[str], digits: str) -> None:
    refused(kvlife(*flag, digits), "argument")


@SUITE
@given(st.sampled_from(["sim.time_scale", "engine.lookup_latency_ms", "sim.seed", "tiers.host.capacity_blocks",
                        "engine.max_running"]), HUGE, st.booleans())
def test_a_huge_integer_in_a_sweep_grid(scratch: Path, key: str, digits: str, in_spec: bool) -> None:
    if in_spec:
        spec = scratch / "grid.toml"
        spec.write_text(f'[grid]\n"{key}" = [1, {digits}]\n')
        refused(kvlife("sweep", "run", str(spec), "-o", str(scratch / "r.jsonl"), "--dry-run"), f"{spec}:2")
    else:
        refused(kvlife("sweep", "run", "-o", str(scratch / "r.jsonl"), "--dry-run", "--vary", f"{key}=1,{digits}"),
                "argument --vary")


@SUITE
@given(HUGE, st.sampled_from(["slo", "csv", "workload", "header"]))
def test_a_huge_integer_in_other_inputs(scratch: Path, trace: Path, digits: str, where: str) -> None:
    if where == "slo":
        refused(kvlife("capacity", "--slo", f"ttft_p90={digits}ms", "--limit", "3"), "argument --slo")
    elif where == "csv":
        path = scratch / "steps.csv"
        path.write_text(f"prefill_tokens,decode_requests,context_tokens,step_ms\n{digits},1,0,5\n512,0,0,{digits}\n")
        refused(kvlife("calibrate", str(path)), f"{path}:2: field")
    elif where == "workload":
        path = scratch / "huge-w.jsonl"
        path.write_text(f'{{"timestamp": {digits}, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]}}\n')
        refused(kvlife("run", "--workload", str(path)), f"{path}:1")
    else:
        lines = trace.read_bytes().splitlines()
        header = lines[0].replace(b'"seed":0', f'"seed":{digits}'.encode(), 1)
        path = scratch / "huge-h.jsonl"
        path.write_bytes(b"\n".join([header, *lines[1:]]) + b"\n")
        for command in (["validate"], ["replay"], ["explain"], ["export"]):
            extra = ["req-0"] if command == ["explain"] else ["--perfetto", str(scratch / "o.json")] \
                if command == ["export"] else []
            outcome = kvlife(*command, str(path), *extra)
            assert outcome.code in (0, 1, 2), outcome  # (the header's seed is not every command's business)


# ---- gzip bombs ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bombs(scratch: Path) -> dict[str, Path]:
    """A 32 MiB line in 32 KB, and 128 MiB of short lines in 120 KB."""
    found = {}
    one = scratch / "one-line.jsonl.gz"
    with gzip.open(one, "wb", compresslevel=9) as f:
        for _ in range(32):
            f.write(b"a" * (1 << 20))
    found["one line"] = one
    many = scratch / "many-lines.jsonl.gz"
    with gzip.open(many, "wb", compresslevel=9) as f:
        for _ in range(128):
            f.write(b"\n" * (1 << 20))
    found["many lines"] = many
    return found


BOMBED = [["run", "--workload", "{}"], ["validate", "{}"], ["replay", "{}"], ["explain", "{}", "req-0"],
          ["export", "{}", "--perfetto", "{out}"], ["mrc", "{}"], ["calibrate", "{}"],
          ["sweep", "run", "-o", "{out}", "--workload", "{}", "--dry-run"]]


@pytest.mark.parametrize("command", BOMBED, ids=[c[0] + (" " + c[1] if c[0] == "sweep" else "") for c in BOMBED])
@pytest.mark.parametrize("bomb", ["one line", "many lines"])
def test_a_gzip_bomb_is_refused_within_bounded_memory(bombs: dict[str, Path], scratch: Path, command: list[str],
                                                      bomb: str) -> None:
    argv = [w.format(str(bombs[bomb]), out=str(scratch / "out.x")) for w in command]
    tracemalloc.start()
    try:
        outcome = kvlife(*argv)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    refused(outcome, "gzip" if bomb == "many lines" else "longer than")
    assert peak < 96 << 20, f"{' '.join(argv)}: peak {peak >> 20} MiB"  # (it was 1.2-2.7 GB)


# ---- header bombs ---------------------------------------------------------------------------------
HEADER_BOMBS = {
    "device blocks": ("engine", "device_blocks", 24_000_000),
    "tier slots": ("tier", "capacity_blocks", 90_000_000),
    "requests": ("workload", "requests", 10**15),
    "line": ("pad", "x", 17 << 20),
}


@SUITE
@given(st.sampled_from(sorted(HEADER_BOMBS)), st.sampled_from(["validate", "replay", "explain", "export", "plot"]))
def test_a_header_bomb_allocates_nothing_by_it(scratch: Path, trace: Path, bomb: str, command: str) -> None:
    if command == "plot":
        pytest.importorskip("matplotlib")
    lines = trace.read_bytes().splitlines()
    header = orjson.loads(lines[0])
    where, key, value = HEADER_BOMBS[bomb]
    if where == "engine":
        header["config"]["engine"][key] = value
    elif where == "tier":
        header["config"]["engine"]["tiers"][0][key] = value
    elif where == "workload":
        header["workload"][key] = value
    else:
        header["pad"] = "x" * value
    path = scratch / "bomb.jsonl"
    path.write_bytes(b"\n".join([orjson.dumps(header), *lines[1:]]) + b"\n")
    extra = {"explain": ["req-0"], "export": ["--perfetto", str(scratch / "o.json")], "plot": [str(scratch / "o.png")]}
    tracemalloc.start()
    try:
        outcome = kvlife(command, str(path), *extra.get(command, []))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert outcome.code in (0, 1, 2), outcome
    if command in ("replay", "plot") and bomb in ("device blocks", "tier slots"):
        refused(outcome, "rebuild the engine")  # (3.9 GB and 54 s before)
    if bomb == "line":
        refused(outcome, "longer than")
    assert peak < 160 << 20, f"{command} of a header bomb ({bomb}): peak {peak >> 20} MiB"


# ---- FIFOs, devices and directories in place of an input file -----------------------------------
SPECIAL_INPUTS = [["run", "--workload", "{}"], ["run", "--config", "{}"], ["run", "--hardware", "{}.toml"],
                  ["run", "--model", "{}.toml"], ["run", "--efficiency", "{}.toml"], ["validate", "{}"],
                  ["replay", "{}"], ["explain", "{}", "req-0"], ["export", "{}", "--perfetto", "{out}"],
                  ["mrc", "{}"], ["calibrate", "{}"], ["sweep", "run", "{}", "-o", "{out}", "--dry-run"],
                  ["sweep", "plot", "{}", "-o", "{out}.png", "--pareto", "x=a,y=b"],
                  ["sweep", "run", "-o", "{}", "--limit", "2", "--dry-run"],
                  ["run", "--stack", "{}.py:P", "--limit", "2"], ["capacity", "--slo", "ttft_p90=2s",
                                                                  "--workload", "{}", "--limit", "2"]]


@pytest.fixture(scope="module")
def specials(scratch: Path) -> dict[str, Path]:
    base = scratch / "special"
    base.mkdir()
    found = {}
    for name in ("fifo", "dir"):
        for suffix in ("", ".toml", ".py"):
            path = base / f"{name}{suffix}"
            if name == "fifo":
                os.mkfifo(path)
            else:
                path.mkdir()
        found[name] = base / name
    found["device"] = Path("/dev/zero")
    return found


@SUITE
@given(st.sampled_from(SPECIAL_INPUTS), st.sampled_from(["fifo", "dir", "device"]))
def test_a_fifo_device_or_directory_is_refused_not_waited_on(specials: dict[str, Path], scratch: Path,
                                                             command: list[str], kind: str) -> None:
    if command[:2] == ["sweep", "plot"]:
        pytest.importorskip("matplotlib")
    path = specials[kind]
    if kind == "device" and any(w.endswith((".toml", ".py")) for w in command):
        return  # /dev/zero has no .toml or .py twin
    argv = [w.format(str(path), out=str(scratch / "special-out")) for w in command]
    outcome = kvlife(*argv, bound=15.0)  # a FIFO opened for reading waits for a writer: a hang, before
    assert outcome.code == 2, outcome


# ---- never-returning hooks ------------------------------------------------------------------------
NEVER = {
    "spin": "        while True:\n            pass\n",
    "sleep": "        time.sleep(10**6)\n",
    "swallow": "        while True:\n            try:\n                while True:\n                    pass\n"
               "            except Exception:\n                pass\n",
}


@pytest.mark.parametrize("how", sorted(NEVER))
@pytest.mark.parametrize("hook", HOOKS)
def test_a_hook_that_never_returns_ends_the_run_in_one_line(scratch: Path, hook: str, how: str) -> None:
    """The run of tests/test_fuzz_inputs.py that asks every hook, with one hook that never
    returns when it is first asked."""
    config = scratch / "failing.toml"
    config.write_text(FAILING_TIERS)
    module = scratch / f"never_{hook}_{how}.py"
    module.write_text(f"import time\nclass P:\n    def {hook}(self, {ARGS[hook]}):\n{NEVER[how]}")
    trace = scratch / f"never_{hook}_{how}.jsonl"
    outcome = kvlife("run", "--stack", f"{module}:P{UNDER}", "--config", str(config), "--limit", "15",
                     "--hook-budget", "0.15", "--trace", str(trace), bound=20.0)
    refused(outcome, f"policy P (module {module}): hook {hook} ran past its time budget of 0.15 s")
    assert validate(trace).ok  # the trace so far, ended by the error


# ---- outputs ----------------------------------------------------------------------------------------
@SUITE
@given(st.integers(1, 12), st.sampled_from(["workload", "policy"]))
def test_a_run_refused_part_way_keeps_the_existing_trace(scratch: Path, workload: Path, at: int, why: str) -> None:
    trace = scratch / "keep.jsonl"
    if not trace.exists():
        assert kvlife("run", "--limit", "5", "--trace", str(trace)).code == 0
    kept = trace.read_bytes()
    if why == "workload":
        bad = scratch / "bad-at.jsonl"
        lines = workload.read_bytes().splitlines()
        bad.write_bytes(b"\n".join([*lines[: at % len(lines)], b"{not json", *lines]) + b"\n")
        outcome = kvlife("run", "--workload", str(bad), "--trace", str(trace))
    else:
        module = scratch / "bad-at.py"
        module.write_text(f"class P:\n    asked = 0\n    def on_arrival(self, req, engine):\n"
                          f"        P.asked += 1\n        return 5 if P.asked > {at} else None\n")
        config = scratch / "failing.toml"
        config.write_text(FAILING_TIERS)
        outcome = kvlife("run", "--stack", f"{module}:P{UNDER}", "--config", str(config), "--limit", "15",
                         "--trace", str(trace))
    assert outcome.code in (0, 2), outcome
    if outcome.code == 2:
        assert trace.read_bytes() == kept
    assert not [p for p in scratch.iterdir() if p.name.startswith(".keep.jsonl.")]  # no temporary file left


# (An image output must have an image's name: there the input is named like one.)
OUTPUTS = [["export", "{t}", "--perfetto", "{t}"], ["plot", "{tp}", "{tp}"], ["calibrate", "{c}", "-o", "{c}"],
           ["run", "--limit", "2", "--config", "{g}", "--trace", "{g}"], ["mrc", "{wp}", "--plot", "{wp}"],
           ["sweep", "plot", "{rp}", "-o", "{rp}", "--pareto", "x=a,y=b"],
           ["run", "--limit", "2", "--workload", "{w}", "--trace", "{w}"]]


@pytest.mark.parametrize("command", OUTPUTS, ids=[" ".join(c[:2]) for c in OUTPUTS])
def test_an_output_may_not_be_an_input(scratch: Path, trace: Path, workload: Path, command: list[str]) -> None:
    if "--plot" in command or command[0] in ("plot", "sweep"):
        pytest.importorskip("matplotlib")
    base = scratch / "outputs"
    base.mkdir(exist_ok=True)
    files = {"t": base / "t.jsonl", "tp": base / "t.png", "w": base / "w.jsonl", "wp": base / "w.png",
             "c": base / "steps.csv", "g": base / "config.toml", "rp": base / "results.png"}
    for key in ("t", "tp"):
        files[key].write_bytes(trace.read_bytes())
    for key in ("w", "wp"):
        files[key].write_bytes(workload.read_bytes())
    files["c"].write_text("prefill_tokens,decode_requests,context_tokens,step_ms\n512,0,0,5\n512,4,512,9\n")
    files["g"].write_text("[sim]\nseed = 1\n")
    files["rp"].write_bytes(orjson.dumps({"key": "k", "a": 1, "b": 2}) + b"\n")
    before = {p: p.read_bytes() for p in base.iterdir()}
    outcome = kvlife(*[w.format(**{k: str(v) for k, v in files.items()}) for w in command])
    refused(outcome, "input of this command")
    assert {p: p.read_bytes() for p in base.iterdir()} == before
