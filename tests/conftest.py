"""Shared test fixtures: the real conversation trace is bundled with the package."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from hypothesis import settings

from kvlife.lifecycle.workloads.bundled import resolve_workload

if TYPE_CHECKING:
    from tests.redis_server import RedisServer

# Hypothesis profiles: "default" keeps the suite's budget (tests that fuzz set their own small
# max_examples from it, see tests/test_trace_fuzz.py); `pytest --hypothesis-profile=deep` runs
# many more examples, for occasional long runs.
settings.register_profile("default", settings.get_profile("default"))
settings.register_profile("deep", max_examples=2000, deadline=None)

# Mooncake's conversation trace (12,031 requests), gzip-compressed in the package's data/.
CONVERSATION_TRACE = resolve_workload("mooncake-conversation")


@pytest.fixture
def server() -> Iterator[RedisServer]:
    """A redis-server of the test's own on a free loopback port (skips without one); the
    import waits for a test that asks (redis is an extra)."""
    from tests.redis_server import RedisServer

    with RedisServer() as server:
        yield server


@pytest.fixture
def conversation_trace() -> Path:
    # Bundled, so always present: a missing file is a packaging bug, not a reason to skip.
    assert CONVERSATION_TRACE.is_file(), f"bundled conversation trace missing: {CONVERSATION_TRACE}"
    return CONVERSATION_TRACE


VLLM_DIR = Path(__file__).parent / "vllm"
VLLM_HINT = ("vLLM is not installed here: build its virtualenv with `bash scripts/install-vllm.sh` and run "
             "`.venv-vllm/bin/python -m pytest tests/vllm`")


def _vllm_installed() -> bool:
    import importlib.metadata

    try:  # the installed distribution: tests/vllm itself would pass as a namespace package "vllm"
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


class VllmAbsent(pytest.Directory):
    """tests/vllm where vLLM is not installed: one skipped collector, with the reason."""

    def collect(self) -> Iterable[pytest.Item | pytest.Collector]:
        pytest.skip(VLLM_HINT)


def pytest_report_header(config: pytest.Config) -> str:
    return "" if _vllm_installed() else f"vllm: not installed (tests/vllm skipped): {VLLM_HINT}"


def _named_in_vllm_dir(config: pytest.Config) -> list[Path]:
    """The command line's paths that are tests/vllm or inside it."""
    named = [Path(arg.split("::")[0]).resolve() for arg in config.args]
    return [p for p in named if p.is_relative_to(VLLM_DIR)]


def pytest_configure(config: pytest.Config) -> None:
    """Under CI=true, asking for tests/vllm by name without vLLM fails the run (exit 4):
    scripts/ci-vllm.sh relies on that."""
    if os.environ.get("CI") == "true" and _named_in_vllm_dir(config) and not _vllm_installed():
        raise pytest.UsageError(f"CI=true: {VLLM_HINT}")


def pytest_collect_directory(path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    """The main suite runs without vLLM: tests/vllm then shows as one skip with the reason
    instead of being collected. A test file or node inside it named on the command line is
    collected as usual (each module skips itself)."""
    if path != VLLM_DIR or _vllm_installed():
        return None
    if any(p != VLLM_DIR for p in _named_in_vllm_dir(parent.config)):
        return None
    return VllmAbsent.from_parent(parent, path=path)


# Hypothesis profiles: "default" is Hypothesis's own (100 examples; on CI its "ci" profile, which
# is derandomized, so it is not re-loaded here); `pytest --hypothesis-profile=deep` runs ten
# times as many examples, for occasional runs (tests/test_fuzz_inputs.py takes a quarter of either).
settings.register_profile("deep", settings.get_profile("default"), max_examples=1000)


def written_so_far(trace: Path) -> int:
    """Bytes of a trace a running process is writing: it is written under a temporary name
    beside its path until the run ends (``kvlife.lifecycle.output_files``)."""
    found = [p for p in (trace, *trace.parent.glob(f".{trace.name}.*.tmp{trace.suffix}")) if p.exists()]
    return max((p.stat().st_size for p in found), default=0)
