"""The mutation detector (scripts/mutation_detect.py) is what the mutation score counts:
it must pass the unmodified engine and catch a mutant. Both run on a copy of the sources
at a small budget (the score itself uses the CLI default); and the runner's configuration
is Cosmic Ray's own format, written from pyproject."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import mutation  # noqa: E402

# A reference-count bug: a block shared through the prefix cache gains no reference, so
# the second request's release frees it under the first (invariant 2 or 8, or a leak).
MUTANT = ("lifecycle/engine/blocks.py", "        self.refs[block] += 1\n        return block\n",
          "        return block\n")


def _copy(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in ("lifecycle", "policies", "specs", "transfer"):
        shutil.copytree(ROOT / folder, root / folder, ignore=ignore)
    shutil.copytree(ROOT / "kvlife", root / "kvlife", symlinks=True, ignore=ignore)
    (root / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "mutation_detect.py", root / "scripts")
    return root


def _detect(root: Path, *budget: str, stacks: str = "baseline;shared-loads") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, "scripts/mutation_detect.py", "--stacks", stacks, *budget,
                           "--per-stack-timeout", "120"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)


def _mutate(root: Path, path: str, before: str, after: str) -> None:
    source = (root / path).read_text()
    assert source.count(before) == 1, f"the mutant's target moved in {path}: update it"
    (root / path).write_text(source.replace(before, after))


def test_detector_passes_the_engine_and_catches_a_refcount_mutant(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    small = ("--examples", "30", "--steps", "30")
    clean = _detect(root, *small)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert "--stack baseline passed" in clean.stdout and "--stack shared-loads passed" in clean.stdout
    _mutate(root, *MUTANT)
    caught = _detect(root, *small)
    assert caught.returncode == 1, caught.stdout + caught.stderr
    assert "caught by --stack baseline" in caught.stdout and "invariant" in caught.stdout
    assert "Traceback" not in caught.stdout + caught.stderr


# Survivors of the first mutation run, each now caught at the CLI's default budget by the
# check added for it (docs/replay-and-check.md, "Mutation score"): (file, line, mutant line,
# the invariant that catches it, a phrase of the finding: a regular expression).
FORMER_SURVIVORS = [
    ("lifecycle/engine/lifecycle.py", "warnings[what] = warnings.get(what, 0) + 1",
     "warnings[what] = warnings.get(what, 1) + 1", 13, "stats.warnings"),
    ("lifecycle/engine/scheduler.py", "state.stats.steps += 1", "state.stats.steps += 0", 13, "stats.steps"),
    ("lifecycle/engine/transfers.py", 'if action == "fail":', 'if action < "fail":', 1, "on_load_failure said fail"),
    ("lifecycle/engine/transfers.py", "state.now - job.started_ms < deadline", "state.now // job.started_ms < deadline",
     7, "deadline"),
    ("lifecycle/engine/blocks.py", "        if block_hash in self.cached:", "        if not block_hash in self.cached:",
     13, "not published"),
    ("lifecycle/engine/transfers.py", "host.complete_store(landed, ok=True)", "host.complete_store(landed, ok=False)",
     13, "no longer holds block"),
    ("lifecycle/engine/state.py", 'if r.state != "finished"]', 'if r.state < "finished"]', 7,
     "reports nothing unfinished"),
    # Survivors of the second run (the merged engine), caught by the checks added for them.
    ("lifecycle/engine/request.py", "    stored_blocks: int = 0", "    stored_blocks: int = 1", 13,
     "never offered to the host tier"),
    ("lifecycle/engine/scheduler.py", "if req.async_lookups < max_lookups:", "if req.async_lookups <= max_lookups:",
     12, "engine.max_async_lookups"),
    ("lifecycle/engine/scheduler.py", 'if req.lookup_async and reuse == "consume":',
     'if not req.lookup_async and reuse == "consume":', 12,
     "(told consume|keeps its answer past its lookup bound)"),
    ("lifecycle/engine/scheduler.py", "req.computed + 2 - req.placeholders >=",
     "req.computed + 1 - req.placeholders >=", 11, "past its last input"),
    ("lifecycle/engine/scheduler.py", "elif end % bt < n:", "elif end % bt <= n:", 0, "the plan computes"),
    ("lifecycle/engine/state.py", "self.stats.ticks > req.sending_tick", "self.stats.ticks >= req.sending_tick", 11,
     "completed from sending too early"),
    ("lifecycle/engine/state.py", "if entry[0] is req and entry[1] == req.epoch:",
     "if not entry[0] is req and entry[1] == req.epoch:", 2, "which no output has ended yet"),
    # Survivors of the third round, caught by the checks added for them.
    ("lifecycle/engine/scheduler.py", ">= req.prompt_tokens + req.max_tokens)\n",
     ">= req.prompt_tokens / req.max_tokens)\n", 11, "work conservation"),
    ("lifecycle/engine/state.py", "    deferred: bool = False  # its request",
     "    deferred: bool = True  # its request", 13, "stats.prefetch_waits"),
    ("lifecycle/engine/state.py", "if now < job.deadline_ms < soonest:", "if now < job.deadline_ms >= soonest:", 7,
     "prefetch patience"),
    ("lifecycle/engine/transfers.py", 'status = "duplicate" if 0 <= event.rank',
     'status = "duplicate" if 0 < event.rank', 3, "bad_rank_report"),
    ("lifecycle/engine/state.py", "self.last_output_step = -1", "self.last_output_step = 1", 11,
     "completed from sending too early"),
    ("lifecycle/engine/state.py", "    expired_lookups: int = 0", "    expired_lookups: int = 1", 13,
     "stats.expired_lookups"),
    # Survivors of a fresh sample on the engine with the decode fast path, caught by the
    # checks added for them (docs/replay-and-check.md, "Mutation score").
    ("lifecycle/engine/scheduler.py", "k = min(stop[0] - req.generated - 1,", "k = min(stop[0] + req.generated - 1,",
     14, "decode fast path is not the step-by-step path"),
    ("lifecycle/engine/core.py", 'if req is None or req.state != "lookup_pending" or req.epoch != event.epoch:',
     'if req is None or req.state != "lookup_pending" or req.epoch >= event.epoch:', 4, "dropped as stale"),
    ("lifecycle/engine/core.py", '        if req is None or req.state == "finished":\n            gone',
     '        if not req is None or req.state == "finished":\n            gone', 1, "abort_ignored"),
    ("lifecycle/engine/blocks.py", "        for h in hashes:\n            if h not in cached:",
     "        for h in []:\n            if h not in cached:", 13, "longest cached prefix"),
    ("lifecycle/engine/transfers.py", "        if state.now < job.deadline_ms:",
     "        if state.now >= job.deadline_ms:", 11, "prefetch job"),
    ("lifecycle/engine/transfers.py", '            done["abandoned"] = True',
     '            done["abandoned"] = False', 13, "abandoned=False"),
    ("lifecycle/engine/transfers.py", 'if tier != "host" and state.pool.block_of(candidates[i]) is None',
     'if tier != "host" and state.pool.block_of(candidates[i]) is not None', 12, "device prefix cache holds"),
    ("lifecycle/engine/lifecycle.py", "                if freed:\n                    self.free_blocks",
     "                if not freed:\n                    self.free_blocks", 0, "a free of no device blocks"),
    ("lifecycle/engine/scheduler.py", "                req.lookup_uses += 1",
     "                req.lookup_uses += 2", 13, "uses of its answer"),
    ("lifecycle/engine/state.py", 'return req is not None and req.state == "lookup_pending" and req.async_lookups',
     'return req is not None and req.state <= "lookup_pending" and req.async_lookups', 7, "a wakeup for nothing"),
    ("lifecycle/engine/transfers.py", "failed_here = [h for h in blocks if h in bad or job.timed_out]",
     "failed_here = [h for h in blocks if h in bad and job.timed_out]", 7, "still holds blocks"),
    ("lifecycle/engine/transfers.py", "state.stats.failed_blocks += len(bad & set(hashes))",
     "state.stats.failed_blocks += len(bad - set(hashes))", 13, "stats.failed_blocks"),
    ("lifecycle/engine/core.py", "        if event.step_id > state.last_output_step:",
     "        if not event.step_id > state.last_output_step:", 11, "stays in sending"),
]


@pytest.mark.parametrize(("path", "before", "after", "invariant", "phrase"), FORMER_SURVIVORS,
                         ids=[f"{p.rsplit('/', 1)[-1]}:{b.strip()[:30]}" for p, b, *_ in FORMER_SURVIVORS])
def test_former_survivor_is_caught_at_the_default_budget(tmp_path: Path, path: str, before: str, after: str,
                                                         invariant: int, phrase: str) -> None:
    root = _copy(tmp_path)
    _mutate(root, path, before, after)
    caught = _detect(root, stacks="baseline")
    assert caught.returncode == 1, caught.stdout + caught.stderr
    assert f"invariant {invariant} (" in caught.stdout and re.search(phrase, caught.stdout), caught.stdout


def test_cosmic_ray_config_is_written_from_pyproject(tmp_path: Path) -> None:
    config = mutation.pyproject_config()
    assert config["module-path"] == ["lifecycle/engine", "policies"]
    out = tmp_path / "session.toml"
    mutation.write_cosmic_ray_config(config, out)
    written = tomllib.loads(out.read_text())["cosmic-ray"]
    assert written["test-command"] == f"{sys.executable} scripts/mutation_detect.py"
    assert written["distributor"]["name"] == "local"
    assert written["filters"]["operators-filter"]["exclude-operators"] == \
        config["filters"]["operators-filter"]["exclude-operators"]


def test_mutations_inside_annotations_are_found(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f(a: int | None, b=1 + 2) -> list[int]:\n    x: int | str = a or b\n    return [x]\n")
    spans = mutation.annotation_spans(module)
    assert mutation._inside((1, 12), spans)  # the `|` of `int | None`
    assert not mutation._inside((1, 29), spans)  # the `+` of a default value
    assert mutation._inside((2, 11), spans)
    assert not mutation._inside((2, 19), spans)  # `or` in the value


@pytest.mark.parametrize(("k", "n"), [(90, 100), (0, 10), (10, 10)])
def test_wilson_interval_contains_the_estimate(k: int, n: int) -> None:
    low, high = mutation.wilson(k, n)
    assert 0.0 <= low <= k / n <= high <= 1.0
