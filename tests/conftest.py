"""Shared test fixtures: the real conversation trace is bundled with the package."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvlife.lifecycle.workloads.bundled import resolve_workload

# Mooncake's conversation trace (12,031 requests), gzip-compressed in the package's data/.
CONVERSATION_TRACE = resolve_workload("mooncake-conversation")


@pytest.fixture
def conversation_trace() -> Path:
    # Bundled, so always present: a missing file is a packaging bug, not a reason to skip.
    assert CONVERSATION_TRACE.is_file(), f"bundled conversation trace missing: {CONVERSATION_TRACE}"
    return CONVERSATION_TRACE
