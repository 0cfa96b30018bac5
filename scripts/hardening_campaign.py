"""A campaign of generated bad inputs against every surface kvlife reads (issue 24).

Each case is one ``kvlife`` command in a process of its own, in a scratch directory, with
one bad input: a flag, a config file, a profile, a workload, a trace given to a reading
command, a policy module, a sweep spec, an SLO, an ``mrc`` input, a calibration CSV, an
output path. Every case is classified:

* ``clean``: what the project's rules say: a refusal is exit 2 with one line on stderr naming
  the file (and line) or the flag; a case that may be accepted (a trace ``validate`` judges)
  exits 0, 1 or 2 without a traceback;
* ``traceback``: a Python traceback on stderr, or an exit code outside 0, 1, 2;
* ``hang``: still running after ``--timeout`` seconds (killed);
* ``unclear``: refused, but not in one line, or without naming the file or flag;
* ``silent``: a bad input accepted (exit 0 where the case must be refused, or a policy module
  imported by ``--dry-run``);
* ``lost``: a file that existed before (a trace, an input) changed by a refused command.

The peak RSS of each command is measured (GNU ``time``, where it is) and the largest reported
per surface, with the slowest case.
The cases are generated from ``--seed`` (the same seed, the same cases) and run ``--jobs`` at
a time; ``--json FILE`` keeps every case and its outcome.

    python scripts/hardening_campaign.py --cases 1300 --jobs 2 --json campaign.json
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CATEGORIES = ("clean", "traceback", "hang", "unclear", "silent", "lost")


@dataclass
class Case:
    surface: str
    what: str
    argv: list[str]
    expect: str = "refuse"  # "refuse": exit 2 in one line; "survive": exit 0, 1 or 2
    names: tuple[str, ...] = ()  # one of these must appear in a refusal's line (a file, a flag)
    keep: tuple[str, ...] = ()  # files that must not change when the command does not exit 0
    marker: str | None = None  # a file whose existence means code ran that must not have
    trigger: str | None = None  # a file the bad input writes when it acts (absent: it never did; exit 0 is fine)
    files: dict[str, bytes] = field(default_factory=dict)  # written into the case's directory first
    fifos: tuple[str, ...] = ()
    result: dict[str, Any] = field(default_factory=dict)


# ---- the inputs -----------------------------------------------------------------------------------
def huge(rng: random.Random) -> str:
    digits = rng.choice([309, 310, 400, 1000, 4299, 4301, 6000])
    return ("-" if rng.random() < 0.3 else "") + rng.choice("123456789") + "9" * (digits - 1)


def nasty_number(rng: random.Random) -> str:
    return rng.choice([huge(rng), huge(rng), "nan", "inf", "-inf", "1e400", "-1e400", "0", "-1", "", "x",
                       "0x10", "٣", "¹", "1e-400", "  ", "+", "1.5.2", "true", "9" * 20])


GOOD_LINE = {"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]}


def workload_text(rng: random.Random, bad: str, at: int) -> bytes:
    lines = [json.dumps({**GOOD_LINE, "timestamp": i * 10, "hash_ids": [1, i + 2]}) for i in range(6)]
    lines.insert(min(at, len(lines)), bad)
    return ("\n".join(lines) + "\n").encode()


BAD_WORKLOAD_LINES: list[Callable[[random.Random], str]] = [
    lambda r: '{"timestamp": 0, "input_length": 600',
    lambda r: f'{{"timestamp": {huge(r)}, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]}}',
    lambda r: f'{{"timestamp": 0, "input_length": {huge(r)}, "output_length": 4, "hash_ids": [1, 2]}}',
    lambda r: f'{{"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, {huge(r)}]}}',
    lambda r: '{"timestamp": NaN, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]}',
    lambda r: '{"timestamp": 1e999, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]}',
    lambda r: '{"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1]}',
    lambda r: '{"timestamp": 0, "input_length": "600", "output_length": 4, "hash_ids": [1, 2]}',
    lambda r: '{"timestamp": -5, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]}',
    lambda r: '[1, 2, 3]',
    lambda r: "\u0000\u0001garbage",
    lambda r: '{"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": ' + "[" * 5000 + "]" * 5000 + "}",
    lambda r: '{"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2], "x": ' + "1" * 5000 + "}",
    lambda r: '{"timestamp": 0, "input_length": 0, "output_length": 4, "hash_ids": []}',
]


def gzip_bomb(lines: bool) -> bytes:
    raw = (b"\n" if lines else b"a") * (96 << 20)
    return gzip.compress(raw, compresslevel=9)


# ---- surfaces -------------------------------------------------------------------------------------
NUMBER_FLAGS = [["run", "--time-scale"], ["run", "--transfer-deadline"], ["run", "--hook-budget"], ["run", "--limit"],
                ["run", "--seed"], ["run", "--device-blocks"], ["run", "--ranks"], ["run", "--tp"],
                ["run", "--chaos"], ["compare", "--stack", "baseline", "--limit"],
                ["capacity", "--limit", "3", "--slo", "ttft_p90=2s", "--min-scale"],
                ["capacity", "--limit", "3", "--slo", "ttft_p90=2s", "--max-scale"],
                ["capacity", "--limit", "3", "--slo", "ttft_p90=2s", "--stability-ratio"],
                ["capacity", "--limit", "3", "--slo", "ttft_p90=2s", "--precision"], ["check", "--examples"],
                ["check", "--steps"], ["sweep", "run", "-o", "r.jsonl", "--limit"],
                ["sweep", "run", "-o", "r.jsonl", "--max-points"], ["sweep", "run", "-o", "r.jsonl", "--jobs"],
                ["mrc", "mooncake-conversation", "--limit"], ["calibrate", "x.csv", "--tp"]]


def flag_cases(rng: random.Random, n: int) -> list[Case]:
    out = []
    for _ in range(n):
        flag = rng.choice(NUMBER_FLAGS)
        word = nasty_number(rng)
        if word in ("0", "-1") and flag[-1] in ("--seed", "--chaos"):
            word = huge(rng)  # (0 and -1 are seeds)
        out.append(Case("flags", f"{' '.join(flag)} {word[:20]}", [*flag, word], names=(flag[-1], "argument")))
    for word in ("", " ", "-", "--"):
        out.append(Case("flags", f"--workload {word!r}", ["run", "--workload", word], names=("--workload", f"{word}:")))
    return out


CONFIG_KEYS = ["engine.block_tokens", "engine.device_blocks", "engine.max_batched_tokens", "engine.max_running",
               "engine.ranks", "engine.transfer_deadline_ms", "engine.lookup_latency_ms", "engine.max_async_lookups",
               "sim.seed", "sim.tp", "sim.gpu_memory_utilization", "sim.mfu", "sim.time_scale", "sim.lookup_workers",
               "sim.rank_jitter_ms", "sim.max_output_tokens", "sim.chaos", "live.stall_timeout_s", "live.redis_ttl_s",
               "policies.hook_budget_s"]


def config_cases(rng: random.Random, n: int) -> list[Case]:
    out = []
    for _ in range(n):
        key = rng.choice(CONFIG_KEYS)
        section, _, name = key.partition(".")
        value = rng.choice([huge(rng), huge(rng), "nan", "inf", "-inf", '"5"', "[1, 2]", "{a = 1}", "true",
                            "1979-05-27", "-1", "0", "1e400", "2.5"])
        if value == "0" and name == "redis_ttl_s":  # (0: keys never expire)
            value = "-1"
        if value in ("-1", "0", "2.5") and name in ("seed", "chaos"):
            value = huge(rng)
        if value == "2.5" and name in ("transfer_deadline_ms", "lookup_latency_ms", "gpu_memory_utilization", "mfu",
                                       "time_scale", "rank_jitter_ms", "stall_timeout_s", "hook_budget_s"):
            value = huge(rng)
        text = f"# fuzz\n[{section}]\n{name} = {value}\n"
        out.append(Case("configs", f"{key} = {value[:20]}", ["run", "--config", "c.toml", "--limit", "2"],
                        names=("c.toml",), files={"c.toml": text.encode()}))
    specials: list[tuple[str, bytes | None]] = [
        ("not UTF-8", b"[engine]\nranks = \xff\xfe\n"), ("binary", bytes(range(256)) * 4),
        ("unknown section", b"[nope]\nx = 1\n"), ("a table for a section", b"engine = 5\n"),
        ("deep nesting", b"x = " + b"[" * 3000 + b"]" * 3000 + b"\n"), ("4301-digit integer", b"[sim]\nseed = " +
                                                                        b"9" * 4301 + b"\n"),
        ("tiers out of order", b'[[tiers]]\nname = "disk"\ncapacity_blocks = 4\n[[tiers]]\nname = "host"\n'
                               b'capacity_blocks = 4\n'),
        ("a missing profile file", b'[sim]\nhardware = "missing.toml"\n'),
        ("a FIFO", None), ("a directory", None),
    ]
    for what, content in specials:
        case = Case("configs", what, ["run", "--config", "c.toml", "--limit", "2"], names=("c.toml",))
        if what == "a FIFO":
            case.fifos = ("c.toml",)
        elif what == "a directory":
            case.argv = ["run", "--config", ".", "--limit", "2"]
            case.names = ("argument", ".")
        elif content is not None:
            case.files = {"c.toml": content}
        out.append(case)
    empty = Case("configs", "an empty file (changes nothing)", ["run", "--config", "c.toml", "--limit", "2"],
                 expect="survive", files={"c.toml": b""})
    out.append(empty)
    return out


HARDWARE = (ROOT / "lifecycle/profiles/data/hardware/h100-sxm.toml").read_text()
MODEL = (ROOT / "lifecycle/profiles/data/models/llama-3-8b.toml").read_text()


def profile_cases(rng: random.Random, n: int) -> list[Case]:
    import re

    out = []
    hw_keys = re.findall(r"(?m)^(\w+) = [0-9]", HARDWARE)
    model_keys = re.findall(r"(?m)^(\w+) = [0-9]", MODEL)
    for _ in range(n):
        kind, text, keys = rng.choice([("hardware", HARDWARE, hw_keys), ("model", MODEL, model_keys)])
        key = rng.choice(keys)
        value = rng.choice([huge(rng), str(2**63 - 1), "nan", "-1", "0", "1e400", '"x"', str(2**70)])
        changed = re.sub(rf"(?m)^{key} = .*$", f"{key} = {value}", text, count=1)
        out.append(Case("profiles", f"{kind}.{key} = {value[:20]}", ["run", f"--{kind}", "p.toml", "--limit", "2"],
                        names=("p.toml",), files={"p.toml": changed.encode()}))
    for kind in ("hardware", "model", "efficiency"):
        out.append(Case("profiles", f"--{kind} a FIFO", ["run", f"--{kind}", "p.toml", "--limit", "2"],
                        names=("p.toml",), fifos=("p.toml",)))
        out.append(Case("profiles", f"--{kind} missing", ["run", f"--{kind}", "gone.toml", "--limit", "2"],
                        names=("gone.toml",)))
    return out


def workload_cases(rng: random.Random, n: int) -> list[Case]:
    out = []
    sentinel = b'{"kind":"header","schema":1}\n' + b"precious\n" * 100
    for _ in range(n):
        bad = rng.choice(BAD_WORKLOAD_LINES)(rng)
        at = rng.randrange(0, 7)
        command = rng.choice([["run", "--workload", "w.jsonl", "--trace", "keep.jsonl"], ["mrc", "w.jsonl"],
                              ["sweep", "run", "-o", "r.jsonl", "--workload", "w.jsonl", "--limit", "3"],
                              ["run", "--workload", "w.jsonl"]])
        gz = rng.random() < 0.2
        name = "w.jsonl.gz" if gz else "w.jsonl"
        data = workload_text(rng, bad, at)
        files = {name: gzip.compress(data) if gz else data, "keep.jsonl": sentinel}
        argv = [name if w == "w.jsonl" else w for w in command]
        expect = "refuse"
        if command[0] == "sweep" and at >= 3:
            expect = "survive"  # (a sweep reads a workload's first lines up front: a later bad line fails its run)
        out.append(Case("workloads", f"{command[0]}: {bad[:40]} at line {at + 1}", argv, expect=expect,
                        names=(name,), keep=("keep.jsonl",), files=files))
    for what, data, name in [("a gzip bomb of one line", gzip_bomb(False), "w.jsonl.gz"),
                             ("a gzip bomb of newlines", gzip_bomb(True), "w.jsonl.gz"),
                             ("a truncated gzip", gzip.compress(workload_text(rng, BAD_WORKLOAD_LINES[0](rng), 9))[:-9],
                              "w.jsonl.gz"), ("an empty file", b"", "w.jsonl"), ("blank lines", b"\n\n\n", "w.jsonl")]:
        for command in (["run", "--workload", name, "--trace", "keep.jsonl"], ["mrc", name]):
            out.append(Case("workloads", f"{command[0]}: {what}", command, names=(name,), keep=("keep.jsonl",),
                            files={name: data, "keep.jsonl": sentinel}))
    for command in (["run", "--workload", "w.jsonl"], ["mrc", "w.jsonl"]):
        out.append(Case("workloads", f"{command[0]}: a FIFO", command, names=("w.jsonl",), fifos=("w.jsonl",)))
    return out


TRACE_LINES: list[bytes] = []  # a small real trace, made once (_make_trace)


def trace_cases(rng: random.Random, n: int) -> list[Case]:
    import orjson

    out = []
    lines = TRACE_LINES
    commands = [["validate", "t.jsonl"], ["replay", "t.jsonl"], ["explain", "t.jsonl", "req-3"],
                ["export", "t.jsonl", "--perfetto", "o.json"], ["plot", "t.jsonl", "o.png"]]
    for _ in range(n):
        op = rng.choice(["drop", "duplicate", "swap", "edit", "garbage", "truncate", "header", "huge", "bomb"])
        changed = list(lines)
        i = rng.randrange(1, len(lines) - 1)
        expect = "survive"
        if op == "drop":
            del changed[i]
        elif op == "duplicate":
            changed.insert(i + 1, lines[i])
        elif op == "swap":
            changed[i], changed[i + 1] = changed[i + 1], changed[i]
        elif op == "edit":
            record = orjson.loads(lines[i])
            key = rng.choice([k for k in record if k != "kind"] or ["t"])
            record[key] = rng.choice([None, -1, "x", [], {}, 2**64, 1e300, True])
            changed[i] = json.dumps(record, separators=(",", ":")).encode()
        elif op == "garbage":
            changed[i] = rng.choice([b"{", b"\xff\xfe", b"[]", b'{"kind": 5}', b"null", b'{"kind":"nope"}'])
        elif op == "truncate":
            changed = changed[: i + 1]
            changed[-1] = changed[-1][: len(changed[-1]) // 2]
        elif op == "huge":
            changed[i] = lines[i].replace(b'"t":', b'"t":' + huge(rng).encode() + b",\"t0\":", 1)
        elif op == "header":
            header = orjson.loads(lines[0])
            field, value = rng.choice([("device_blocks", 24_000_000), ("device_blocks", huge(rng)),
                                       ("ranks", 10**6), ("block_tokens", 0), ("max_running", -1),
                                       ("device_blocks", None), ("tiers", "x")])
            header["config"]["engine"][field] = value if not isinstance(value, str) or field == "tiers" else None
            if isinstance(value, str) and field != "tiers":
                text = orjson.dumps(header).replace(b'"device_blocks":null', b'"device_blocks":' + value.encode())
                changed[0] = text
            else:
                changed[0] = orjson.dumps(header)
        command = rng.choice(commands)
        data = b"\n".join(changed) + (b"\n" if op != "truncate" else b"")
        name = "t.jsonl"
        if op == "bomb":
            data, name = gzip_bomb(rng.random() < 0.5), "t.jsonl.gz"
            expect = "refuse"
        argv = [name if w == "t.jsonl" else w for w in command]
        out.append(Case("traces", f"{command[0]}: {op} line {i + 1}", argv, expect=expect, names=(name,),
                        keep=("t.jsonl",) if command[0] == "export" else (), files={name: data}))
    for command in commands:
        argv = ["fifo.jsonl" if w == "t.jsonl" else w for w in command]
        out.append(Case("traces", f"{command[0]}: a FIFO", argv, names=("fifo.jsonl",), fifos=("fifo.jsonl",)))
        out.append(Case("traces", f"{command[0]}: an empty file", [("e.jsonl" if w == "t.jsonl" else w)
                                                                    for w in command], names=("e.jsonl",),
                        files={"e.jsonl": b""}))
    return out


HOOK_ARGS = {"on_arrival": "req, engine", "lookup_mode": "req, engine", "lookup_reuse": "req, engine",
             "prefetch_patience": "req, prefetch, engine", "admission": "req, load, engine",
             "store_limit": "req, engine", "hold_at_finish": "req, stores, engine",
             "on_load_failure": "req, failed, engine"}
TIERS = (b'[engine]\ndevice_blocks = 40\n[[tiers]]\nname = "host"\ncapacity_blocks = 20\nlatency_ms = 50.0\n'
         b'bandwidth_gbps = 0.5\nfailure_rate = 0.3\n[[tiers]]\nname = "disk"\ncapacity_blocks = 400\n'
         b'latency_ms = 5.0\nbandwidth_gbps = 0.5\nfailure_rate = 0.3\n')
# A valid value of each hook (so that only the reason is wrong).
VALID = {"on_arrival": "'none'", "lookup_mode": "'sync'", "lookup_reuse": "'consume'", "prefetch_patience": "0",
         "admission": "'go'", "store_limit": "0", "hold_at_finish": "False", "on_load_failure": "'recompute'"}
BODIES = {
    "spin": "while True:\n            pass",
    "sleep": "time.sleep(10**6)",
    "swallow": "while True:\n            try:\n                time.sleep(10**6)\n            except Exception:\n"
               "                pass",
    "KeyboardInterrupt": "raise KeyboardInterrupt",
    "SystemExit": "raise SystemExit(0)",
    "wrong type": "return 5",
    "nan": "return Decision(float('nan'), 'r')",
    "huge reason": "return Decision({valid}, 'x' * 5_000_000)",
    "raises": "return 1 / 0",
    "recursion": "return self.{hook}({args})",
    "exit": "os._exit(0)",
}


def policy_cases(rng: random.Random, n: int) -> list[Case]:
    out = []
    sentinel = b'{"kind":"header","schema":1}\n' + b"precious\n" * 100
    for _ in range(n):
        hook = rng.choice(sorted(HOOK_ARGS))
        how = rng.choice([b for b in BODIES if b != "exit"])
        body = BODIES[how].format(hook=hook, args=HOOK_ARGS[hook], valid=VALID[hook])
        after = rng.randrange(0, 4)
        module = (f"import os, time\nfrom kvlife.policies.base import Decision\nclass P:\n    asked = 0\n"
                  f"    def {hook}(self, {HOOK_ARGS[hook]}):\n        P.asked += 1\n"
                  f"        if P.asked <= {after}:\n            return None\n"
                  f"        open('triggered', 'w').close()\n        {body}\n")
        expect = "refuse"
        out.append(Case("policies", f"{hook} {how} after {after}",
                        ["run", "--stack", "p.py:P,early-prefetch,async-lookup", "--config", "c.toml", "--limit", "15",
                         "--hook-budget", "0.5", "--trace", "keep.jsonl"], expect=expect,
                        names=("policy P", "p.py"), keep=("keep.jsonl",), trigger="triggered",
                        files={"p.py": module.encode(), "c.toml": TIERS, "keep.jsonl": sentinel}))
    for what, text in [("a syntax error", b"class P(:\n"), ("not UTF-8", b"\xff\xfe\n"), ("no class", b"Q = 1\n"),
                       ("an import error", b"import no_such_module_kvlife\n")]:
        out.append(Case("policies", what, ["run", "--stack", "p.py:P", "--limit", "2"], names=("p.py",),
                        files={"p.py": text}))
    out.append(Case("policies", "a FIFO module", ["run", "--stack", "p.py:P", "--limit", "2"], names=("p.py",),
                    fifos=("p.py",)))
    return out


def sweep_cases(rng: random.Random, n: int) -> list[Case]:
    out = []
    keys = ["sim.time_scale", "sim.seed", "engine.max_running", "engine.lookup_latency_ms", "sim.lookup_workers",
            "tiers.host.capacity_blocks", "engine.max_async_lookups", "sim.rank_jitter_ms"]
    for _ in range(n):
        kind = rng.choice(["oversized", "huge", "unknown", "code", "jobs", "max_points", "bad value"])
        argv = ["sweep", "run", "g.toml", "-o", "r.jsonl", "--dry-run", "--limit", "3"]
        marker = None
        files: dict[str, bytes] = {}
        if kind == "oversized":
            axes = rng.sample(keys, rng.randint(4, 8))
            grid = "".join(f'"{k}" = [{", ".join(str(v) for v in range(1, 41))}]\n' for k in axes)
            text = f"[grid]\n{grid}"
        elif kind == "huge":
            text = f'[grid]\n"{rng.choice(keys)}" = [1, {huge(rng)}]\n'
        elif kind == "unknown":
            text = rng.choice(['[grid]\n"sim.nope" = [1]\n', 'nope = 1\n', '[set]\n"engine.x" = 1\n',
                               '[grid]\n"sim.time_scale" = []\n', '[grid]\n"sim.time_scale" = 5\n'])
        elif kind == "code":
            text = '[grid]\n"policies.stack" = ["p.py:P", "baseline"]\n'
            files["p.py"] = (b"open('imported', 'w').close()\nclass P:\n    def admission(self, req, load, engine):\n"
                             b"        return None\n")
            marker = "imported"
        elif kind == "jobs":
            text = '[grid]\n"sim.seed" = [1, 2]\n'
            argv = [*argv, "--jobs", str(rng.choice([64, 10**6, 0, -3]))]
        elif kind == "max_points":
            text = f'max_points = {rng.choice(["0", "-1", huge(rng), "2.5", chr(34) + "x" + chr(34)])}\n'
        else:
            text = f'[set]\n"{rng.choice(keys)}" = {rng.choice(["nan", "-1", huge(rng), "[1]"])}\n'
        files["g.toml"] = text.encode()
        names = ("g.toml",) if kind not in ("jobs",) else ("--jobs",)
        out.append(Case("sweep specs", f"{kind}: {text[:40]!r}", argv, expect="survive" if kind == "code" else "refuse",
                        names=names, marker=marker, files=files))
    out.append(Case("sweep specs", "a FIFO spec", ["sweep", "run", "g.toml", "-o", "r.jsonl", "--dry-run"],
                    names=("g.toml",), fifos=("g.toml",)))
    return out


def slo_cases(rng: random.Random, n: int) -> list[Case]:
    out = []
    for _ in range(n):
        slo = rng.choice([f"ttft_p90={huge(rng)}ms", f"ttft_p{huge(rng)}=2s", "ttft_p90=nan", "ttft_p90=-1s",
                          "ttft_p90=inf", "tpot_p100.5=2s", "ttft_p0=2s", "x_p90=2s", "ttft_p90=2", "", "ttft_p90=2s,",
                          f"ttft_p90={nasty_number(rng)}s", "ttft_p90=1e400ms"])
        out.append(Case("slos", f"--slo {slo[:30]}", ["capacity", "--stack", "baseline", "--slo", slo, "--limit", "3"],
                        names=("--slo",)))
    return out


def mrc_cases(rng: random.Random, n: int) -> list[Case]:
    out = []
    for _ in range(n):
        flag, value = rng.choice([("--capacities", nasty_number(rng)), ("--capacities", f"{huge(rng)}M"),
                                  ("--capacities", "1,,2"), ("--block-tokens", nasty_number(rng)),
                                  ("--limit", nasty_number(rng)),
                                  ("--plot", rng.choice(["p.nope", "p", ".", "w.jsonl"]))])
        files = {"w.jsonl": workload_text(rng, json.dumps(GOOD_LINE), 0)}
        out.append(Case("mrc", f"{flag} {value[:20]}", ["mrc", "w.jsonl", flag, value],
                        names=(flag, "w.jsonl", f"{value}:"),
                        keep=("w.jsonl",), files=files))
    return out


def calibrate_cases(rng: random.Random, n: int) -> list[Case]:
    out = []
    header = "prefill_tokens,decode_requests,context_tokens,step_ms\n"
    for _ in range(n):
        row = rng.choice([f"{huge(rng)},1,0,5", f"512,0,0,{huge(rng)}", "512,0,0,5e-324", "512,0,0,nan",
                          "512,0,0,-1", "0,0,0,5", "512,0,0", "512,0,0,5,6", "1.5,0,0,5", "٣,0,0,5",
                          f"512,0,{huge(rng)},5", "512,0,0,1e400"])
        data = (header + "512,4,512,9\n" + row + "\n").encode()
        if rng.random() < 0.15:
            data = data.replace(b"512,4", b"\xff\xfe,4")
        out.append(Case("calibrate", f"row {row[:30]}", ["calibrate", "s.csv", "-o", "out.toml"], names=("s.csv",),
                        keep=("out.toml",), files={"s.csv": data, "out.toml": b"# precious\n"}))
    for what, data in [("a gzip bomb", gzip_bomb(False)), ("no header", b""), ("binary", bytes(range(256)))]:
        out.append(Case("calibrate", what, ["calibrate", "s.csv.gz" if "gzip" in what else "s.csv"],
                        names=("s.csv",), files={("s.csv.gz" if "gzip" in what else "s.csv"): data}))
    big = header + "".join(f"{rng.choice([0, 128, 512])},{rng.randint(1, 64)},{rng.randint(0, 8192)},"
                           f"{rng.uniform(5, 80):.3f}\n" for _ in range(200_000))
    out.append(Case("calibrate", "200,000 rows", ["calibrate", "s.csv"], expect="survive",
                    files={"s.csv": big.encode()}))
    out.append(Case("calibrate", "-o the CSV itself", ["calibrate", "s.csv", "-o", "s.csv"], names=("s.csv",),
                    keep=("s.csv",), files={"s.csv": (header + "512,4,512,9\n512,0,0,5\n").encode()}))
    return out


def output_cases(rng: random.Random, n: int) -> list[Case]:
    out = []
    trace = b"\n".join(TRACE_LINES) + b"\n"
    forms = [
        (["export", "t.jsonl", "--perfetto", "t.jsonl"], ("t.jsonl",)),
        (["export", "t.jsonl", "--perfetto", "./t.jsonl"], ("t.jsonl",)),
        (["plot", "t.png", "t.png"], ("t.png",)),
        (["run", "--limit", "2", "--workload", "w.jsonl", "--trace", "w.jsonl"], ("w.jsonl",)),
        (["run", "--limit", "2", "--config", "c.toml", "--trace", "c.toml"], ("c.toml",)),
        (["mrc", "w.png", "--plot", "w.png"], ("w.png",)),
        (["run", "--limit", "2", "--trace", "nodir/t.jsonl"], ()),
        (["run", "--limit", "2", "--trace", "."], ()),
        (["export", "t.jsonl", "--perfetto", "."], ()),
    ]
    for _ in range(n):
        argv, keep = rng.choice(forms)
        files = {"t.jsonl": trace, "t.png": trace, "w.jsonl": workload_text(rng, json.dumps(GOOD_LINE), 0),
                 "w.png": workload_text(rng, json.dumps(GOOD_LINE), 0), "c.toml": b"[sim]\nseed = 1\n"}
        out.append(Case("outputs", " ".join(argv), list(argv), names=(argv[-1].lstrip("./"), "nodir", "."),
                        keep=keep, files=files))
    return out


SURFACES: dict[str, tuple[Callable[[random.Random, int], list[Case]], int]] = {
    "flags": (flag_cases, 150), "configs": (config_cases, 140), "profiles": (profile_cases, 80),
    "workloads": (workload_cases, 150), "traces": (trace_cases, 260), "policies": (policy_cases, 140),
    "sweep specs": (sweep_cases, 100), "slos": (slo_cases, 50), "mrc": (mrc_cases, 50),
    "calibrate": (calibrate_cases, 70), "outputs": (output_cases, 40),
}


# ---- running ------------------------------------------------------------------------------------------
def run_case(case: Case, scratch: Path, timeout: float) -> dict[str, Any]:
    cwd = Path(tempfile.mkdtemp(dir=scratch))
    for name, data in case.files.items():
        (cwd / name).write_bytes(data)
    for name in case.fifos:
        os.mkfifo(cwd / name)
    before = {name: (cwd / name).read_bytes() for name in case.keep if (cwd / name).exists()}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started = time.monotonic()
    # GNU time writes the command's peak RSS (KiB) to a file of its own: stderr stays the command's.
    timed = ["/usr/bin/time", "-o", str(cwd / ".rss"), "-f", "%M"] if Path("/usr/bin/time").exists() else []
    proc = subprocess.Popen([*timed, sys.executable, "-m", "kvlife", *case.argv], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            start_new_session=True)  # (its own process group: a hang is killed whole)
    hung = False
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        hung = True
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    wall = time.monotonic() - started
    try:
        rss_mib = int((cwd / ".rss").read_text().split()[-1]) / 1024
    except (OSError, ValueError, IndexError):
        rss_mib = 0.0
    text = err.decode(errors="replace")
    code = proc.returncode
    category = classify(case, code, text, hung, cwd, before)
    shutil.rmtree(cwd, ignore_errors=True)
    return {"code": code, "category": category, "stderr": text[-400:], "wall_s": round(wall, 2), "rss_mib": rss_mib}


def classify(case: Case, code: int, err: str, hung: bool, cwd: Path, before: dict[str, bytes]) -> str:
    if hung:
        return "hang"
    if "Traceback" in err or code not in (0, 1, 2):
        return "traceback"
    if case.marker is not None and (cwd / case.marker).exists():
        return "silent"
    if code != 0 and any((cwd / name).read_bytes() != data if (cwd / name).exists() else True
                         for name, data in before.items()):
        return "lost"
    if case.expect == "refuse" and code == 0 and (case.trigger is None or (cwd / case.trigger).exists()):
        return "silent"
    if code == 2:
        lines = err.rstrip("\n").split("\n")
        if len(lines) != 1 or not err.endswith("\n"):
            return "unclear"
        if case.names and not any(name in lines[0] for name in case.names):
            return "unclear"
    return "clean"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=1300, help="about how many cases (scaled over the surfaces)")
    parser.add_argument("--seed", type=int, default=24)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds before a case counts as a hang")
    parser.add_argument("--surface", action="append", help="only these surfaces (repeatable)")
    parser.add_argument("--json", help="write every case and its outcome here")
    args = parser.parse_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="kvlife-campaign-"))
    try:
        _make_trace(scratch)
        rng = random.Random(args.seed)
        scale = args.cases / sum(n for _, n in SURFACES.values())
        cases: list[Case] = []
        for name, (make, n) in SURFACES.items():
            if args.surface and name not in args.surface:
                continue
            cases += make(random.Random(rng.random()), max(1, round(n * scale)))
        print(f"{len(cases)} cases over {len({c.surface for c in cases})} surfaces, {args.jobs} at a time", flush=True)
        done = 0
        lock = threading.Lock()

        def one(case: Case) -> None:
            nonlocal done
            case.result = run_case(case, scratch, args.timeout)
            with lock:
                done += 1
                if case.result["category"] != "clean":
                    print(f"  {case.result['category']}: {case.surface}: {case.what}: {case.result['stderr'][-200:]!r}",
                          flush=True)
                if done % 100 == 0:
                    print(f"  {done}/{len(cases)}", flush=True)

        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            list(pool.map(one, cases))
        table = report(cases)
        print(table)
        print(f"wall time {time.monotonic() - started:.0f} s")
        if args.json:
            Path(args.json).write_text(json.dumps([{"surface": c.surface, "what": c.what, "argv": c.argv,
                                                    "expect": c.expect, **c.result} for c in cases], indent=1))
        return 0 if all(c.result["category"] == "clean" for c in cases) else 1
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def report(cases: list[Case]) -> str:
    counts: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    peak: dict[str, float] = collections.defaultdict(float)
    slowest: dict[str, float] = collections.defaultdict(float)
    for c in cases:
        counts[c.surface][c.result["category"]] += 1
        peak[c.surface] = max(peak[c.surface], c.result["rss_mib"])
        slowest[c.surface] = max(slowest[c.surface], c.result["wall_s"])
    rows: list[tuple[str, ...]] = [("surface", "inputs", *CATEGORIES, "peak RSS MiB", "slowest s")]
    for surface in sorted(counts):
        total = sum(counts[surface].values())
        rows.append((surface, str(total), *(str(counts[surface][k]) for k in CATEGORIES), f"{peak[surface]:.0f}",
                     f"{slowest[surface]:.1f}"))
    totals: collections.Counter[str] = collections.Counter()
    for c in counts.values():
        totals.update(c)
    rows.append(("all", str(sum(totals.values())), *(str(totals[k]) for k in CATEGORIES),
                 f"{max(peak.values(), default=0):.0f}", f"{max(slowest.values(), default=0):.1f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(v.ljust(w) if i == 0 else v.rjust(w)
                               for i, (v, w) in enumerate(zip(r, widths, strict=True))) for r in rows)


def _make_trace(scratch: Path) -> None:
    """A small real trace (two ranks, host and disk tiers, loads, stores, frees, evictions)."""
    path = scratch / "base.jsonl"
    subprocess.run([sys.executable, "-m", "kvlife", "run", "--limit", "30", "--device-blocks", "40", "--ranks", "2",
                    "--tier", "host=30", "--tier", "disk=200", "--stack", "async-lookup,shared-loads",
                    "--trace", str(path)], check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    TRACE_LINES.extend(path.read_bytes().splitlines())


if __name__ == "__main__":
    sys.exit(main())
