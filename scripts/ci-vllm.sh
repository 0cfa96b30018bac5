#!/usr/bin/env bash
# CI for the vLLM integration: build the vLLM virtualenv (pip's cache on; skipped when the
# stamp says it is current), then run tests/vllm there with CI=true, so a missing vLLM fails
# instead of skipping. The main suite keeps its own environment (.ci/run).
#
#   bash scripts/ci-vllm.sh [VENV]      (default: .venv-vllm; KVLIFE_VLLM_VENV also sets it)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-${KVLIFE_VLLM_VENV:-.venv-vllm}}"

start=$SECONDS
bash scripts/install-vllm.sh "$VENV"
echo "ci-vllm: venv ready in $((SECONDS - start)) s, $(du -sh "$VENV" | cut -f1)"

start=$SECONDS
set +e
CI=true PYTHONWARNINGS=ignore "$VENV/bin/python" -m pytest tests/vllm -p no:warnings -o addopts="" -q \
  2>&1 | grep -v "Failed to import from vllm._C\|Triton not available" | tee .ci-vllm.log
status=${PIPESTATUS[0]}
set -e
summary=$(grep -E "^[0-9]+ (passed|failed)|passed|failed|error" .ci-vllm.log | tail -1 || true)
rm -f .ci-vllm.log
echo "ci-vllm: vLLM tests: ${summary:-no summary} ($((SECONDS - start)) s)"
exit "$status"
