"""Shared test fixtures: the real conversation trace lives beside the repo, never in it."""

from __future__ import annotations

from pathlib import Path

import pytest

CONVERSATION_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "conversation_trace.jsonl"


@pytest.fixture
def conversation_trace() -> Path:
    if not CONVERSATION_TRACE.exists():
        pytest.skip(f"conversation trace not found at {CONVERSATION_TRACE}")
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
