"""vLLM tests: run them in the vLLM virtualenv (scripts/install-vllm.sh)::

    bash scripts/install-vllm.sh            # once: .venv-vllm, about 2.3 GB, 3-4 min cold
    .venv-vllm/bin/python -m pytest tests/vllm

Without vLLM the tests skip with that hint; under CI=true a missing vLLM fails the run.
One scheduler config costs a model inspection (~10 s, cached in a private VLLM_CACHE_ROOT),
so the offline model folder is built once per session.
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

import pytest

HINT = ("vLLM is not importable here: build its virtualenv with `bash scripts/install-vllm.sh` and run "
        "`.venv-vllm/bin/python -m pytest tests/vllm`")

def vllm_installed() -> bool:
    try:  # the distribution, not the import: this folder would pass as a namespace package "vllm"
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


if not vllm_installed():
    if os.environ.get("CI") == "true":
        raise pytest.UsageError(f"CI=true: {HINT}")
    pass  # each test module skips itself with HINT (pytest.importorskip)


def pytest_report_header(config: pytest.Config) -> str:
    return "" if vllm_installed() else "vllm: not installed (tests skipped): " + HINT


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvlife.lifecycle.drivers.vllm.harness import offline_model_dir

    return offline_model_dir(tmp_path_factory.mktemp("vllm"))
