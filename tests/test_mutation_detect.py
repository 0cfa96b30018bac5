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

# A reference-count bug: a hit takes no reference on a block another request caches, so
# the device's accounting is off (invariant 8), or the block is freed under its reader.
MUTANT = ("lifecycle/engine/blocks.py", "                del self._free[block]\n            refs[block] += 1",
          "                del self._free[block]\n            refs[block] += 0")


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
                           "--per-stack-timeout", "300"],
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


# Mutants of the one-lifecycle engine's parts (issue 22: jobs.py, connector.py,
# scheduler.py, worker_book.py), each caught at the CLI's default budget by the rebuilt
# checker (docs/replay-and-check.md, "Mutation score"): (file, line, mutant line, the
# invariant that catches it, a phrase of the finding: a regular expression).
ENGINE_MUTANTS = [
    ("lifecycle/engine/jobs.py", 'if job.kind == "store" and job.request_id == req.request_id and not job.flushed',
     'if job.kind != "store" and job.request_id == req.request_id and not job.flushed', 2,
     "no step planned in this pass flushes it"),
    ("lifecycle/engine/worker_book.py", "sending = {rid for rid in self.holds if rid not in self.stores_of}",
     "sending = {rid for rid in self.holds if rid in self.stores_of}", 11,
     "stays in sending|completed from sending, but store job"),
    ("lifecycle/engine/jobs.py", "state.now - job.started_ms < deadline", "state.now - job.started_ms <= deadline", 3,
     "the tick did not give it up"),
    ("lifecycle/engine/connector.py", "            if req.epoch != epoch:", "            if req.epoch == epoch:", 13,
     "never offered"),
    ("lifecycle/engine/scheduler.py", "            if req.num_stale_output_tokens:",
     "            if not req.num_stale_output_tokens:", 11, "left the device idle"),
    ("lifecycle/engine/jobs.py", "        req.stored_blocks = upto", "        req.stored_blocks = upto + 1", 13,
     "never offered"),
    ("lifecycle/engine/connector.py", "if entry[0] is req and entry[1] == req.epoch:",
     "if entry[0] is req and entry[1] != req.epoch:", 13, "generated tokens"),
    # vLLM's request_finished for an aborted request taken as a completion, whatever its
    # state (the old ConnectorLifecycle set states as strings, so it was accepted there).
    ("lifecycle/engine/connector.py", 'self._finish(req, Trigger.ABORTED, "aborted"',
     'self._finish(req, Trigger.COMPLETED, "aborted"', 1, "completed.*is not allowed in state"),
    # Survivors of issue 26's re-measured sample, caught by the checks written for them.
    ("lifecycle/engine/connector.py", 'if choice == "join":', 'if choice <= "join":', 11,
     "only a join decision shares a load"),
    ("lifecycle/engine/connector.py", "            if samples:\n                req.placeholders += 1",
     "            if not samples:\n                req.placeholders += 1", 13, "placeholder_tokens="),
    ("lifecycle/engine/lifecycle.py", "free_device_blocks=device.free if device is not None else 0",
     "free_device_blocks=device.free if device is None else 0", 13, "free_device_blocks="),
    ("lifecycle/engine/connector.py", '                if action == "prefetch":',
     '                if action > "prefetch":', 13, "no prefetch started"),
    ("lifecycle/engine/connector.py", "            if tier is None or not tier.contains(block):",
     "            if not tier is None or not tier.contains(block):", 13, "a hit takes every block the tiers hold"),
    ("lifecycle/engine/jobs.py", "            state.stats.failed_loads += 1",
     "            state.stats.failed_loads += 0", 13, "stats.failed_loads is"),
    ("lifecycle/engine/jobs.py",
     'if job.kind == "store" and job.request_id == req.request_id and not job.flushed and not job.timed_out:',
     'if job.kind == "store" or job.request_id == req.request_id and not job.flushed and not job.timed_out:', 2,
     "a step flushes only the stores in flight of the requests its pass preempted"),
    ("lifecycle/engine/core.py", "if not self.scheduler.finish_requests(event.request_id):",
     "if not not self.scheduler.finish_requests(event.request_id):", 1, "yet an abort_ignored warning"),
    # A failed step's blocks stay in the prefix cache: a waiting request reads them (10).
    ("lifecycle/engine/blocks.py", "        for block in blocks:\n            self._evict(block)",
     "        for block in []:\n            self._evict(block)", 10, "holds no usable content \\(step \\d+ failed"),
    # The connector's own lookup client is handed pass index 0 at every pass (vLLM's path).
    ("lifecycle/engine/connector_api.py", "        self.passes += 1", "        self.passes += 0", 7,
     "the connector's own lookup of"),
    # Every command but a lookup's goes to the lookup client and out of the driver's list.
    ("lifecycle/engine/connector_api.py", "            elif type(command) is DiscardLookup:",
     "            elif type(command) is not DiscardLookup:", 7, "but never handed it to the driver"),
    # vLLM names generated blocks by its own hashes: only the recorded world with vLLM's
    # block names (recording_check.VllmNames) runs these. A recorder that derives the names
    # instead of reading them off the scheduler's request, or names a block before it fills,
    # names other blocks than the engine's jobs move; one whose trace leaves out the
    # position of such a stored block has it read as a block the request never computed.
    ("lifecycle/engine/connector_api.py", "record_inputs: bool = False, refresh_hashes: bool = True)",
     "record_inputs: bool = False, refresh_hashes: bool = False)", 13, "names blocks .* the engine's job"),
    ("lifecycle/engine/jobs.py", "range(max(positions.start, req.prompt_tokens // req.block_tokens)",
     "range(max(positions.start, req.prompt_tokens + req.block_tokens)", 5, "not a block r\\d+ has computed"),
    ("lifecycle/engine/connector.py", "full = req.confirmed // self.state.config.block_tokens",
     "full = req.confirmed / self.state.config.block_tokens", 13, "names blocks .* the engine's job"),
    ("lifecycle/engine/connector.py", "full = req.confirmed // self.state.config.block_tokens",
     "full = req.confirmed + self.state.config.block_tokens", 13, "names blocks .* the engine's job"),
]


@pytest.mark.parametrize(("path", "before", "after", "invariant", "phrase"), ENGINE_MUTANTS,
                         ids=[f"{p.rsplit('/', 1)[-1]}:{b.strip()[:30]}" for p, b, *_ in ENGINE_MUTANTS])
def test_engine_mutant_is_caught_at_the_default_budget(tmp_path: Path, path: str, before: str, after: str,
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
