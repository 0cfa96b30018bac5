#!/usr/bin/env bash
# vLLM's own tests as kvlife's peer suite (docs/vllm.md, "vLLM's own tests as a peer suite"):
# vllm 0.33.0's sdist ships tests/; scripts/vllm_peer/suite.py runs two sets of them twice in
# the vLLM virtualenv, as shipped and with kvlife in the connector's place, and fails when the
# outcomes differ where scripts/vllm_peer/exclusions.toml gives no reason.
#
#   bash scripts/vllm-peer-suite.sh [VENV] [suite.py flags: --sets core,unit --out DIR --json --verbose]
#
# VENV defaults to .venv-vllm (KVLIFE_VLLM_VENV also sets it); scripts/install-vllm.sh builds it.
# The sdist is fetched once (47 MB, sha256-pinned) into ~/.cache/kvlife/vllm-peer.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${KVLIFE_VLLM_VENV:-.venv-vllm}"
if [[ $# -gt 0 && $1 != -* ]]; then
  VENV=$1
  shift
fi
if [[ ! -x "$VENV/bin/python" ]]; then
  echo "vllm-peer: no vLLM virtualenv at $VENV: build it with \`bash scripts/install-vllm.sh\`" >&2
  exit 2
fi

# What vLLM's tests import beyond what its scheduler side needs (scripts/install-vllm.sh):
# tblib (tests/conftest.py), msgpack (the MoRIIO tests), httpx, uvicorn and pytest-asyncio (the
# Mooncake tests: `@pytest.mark.asyncio`).
TEST_PACKAGES=(tblib==3.2.2 msgpack==1.2.4 httpx==0.28.1 uvicorn==0.54.0 pytest-asyncio==1.5.0)
"$VENV/bin/python" -m pip install -q -c "$VENV/kvlife-constraints.txt" "${TEST_PACKAGES[@]}" \
  2> >(grep -v "^WARNING: Location" >&2 || true)

start=$SECONDS
set +e
PYTHONWARNINGS=ignore "$VENV/bin/python" scripts/vllm_peer/suite.py "$@"
status=$?
set -e
echo "vllm-peer: $((SECONDS - start)) s"
exit "$status"
