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
