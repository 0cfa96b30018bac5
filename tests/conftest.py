"""Shared test fixtures: the real conversation trace is bundled with the package."""

from __future__ import annotations

from collections.abc import Iterator
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


def _vllm_importable() -> bool:
    import importlib.metadata

    try:  # the installed distribution: tests/vllm itself would pass as a namespace package "vllm"
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """The main suite runs without vLLM: it skips tests/vllm unless that folder is asked for
    by name (then tests/vllm/conftest.py explains the skip, or fails the run in CI)."""
    vllm_dir = Path(__file__).parent / "vllm"
    if collection_path != vllm_dir or _vllm_importable():
        return None
    asked = any(Path(arg.split("::")[0]).resolve().is_relative_to(vllm_dir) for arg in config.args)
    return None if asked else True


# Hypothesis profiles: "default" is Hypothesis's own (100 examples; on CI its "ci" profile, which
# is derandomized, so it is not re-loaded here); `pytest --hypothesis-profile=deep` runs ten
# times as many examples, for occasional runs (tests/test_fuzz_inputs.py takes a quarter of either).
settings.register_profile("deep", settings.get_profile("default"), max_examples=1000)


def written_so_far(trace: Path) -> int:
    """Bytes of a trace a running process is writing: it is written under a temporary name
    beside its path until the run ends (``kvlife.lifecycle.output_files``)."""
    found = [p for p in (trace, *trace.parent.glob(f".{trace.name}.*.tmp{trace.suffix}")) if p.exists()]
    return max((p.stat().st_size for p in found), default=0)
