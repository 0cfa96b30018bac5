"""vLLM tests: run them in the vLLM virtualenv (scripts/install-vllm.sh)::

    bash scripts/install-vllm.sh            # once: .venv-vllm, about 2.3 GB, 3-4 min cold
    .venv-vllm/bin/python -m pytest tests/vllm

Without vLLM this folder is one skipped collector with the hint (tests/conftest.py, which
also makes a missing vLLM fail the run under CI=true when tests/vllm is asked for by name,
as scripts/ci-vllm.sh does).
One scheduler config costs a model inspection (~10 s, cached in a private VLLM_CACHE_ROOT),
so the offline model folder is built once per session.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvlife.lifecycle.drivers.vllm.harness import offline_model_dir

    return offline_model_dir(tmp_path_factory.mktemp("vllm"))
