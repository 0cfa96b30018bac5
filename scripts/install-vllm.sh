#!/usr/bin/env bash
# Build a virtualenv that runs vLLM 0.33.0's real v1 scheduler on a CPU-only machine, plus kvlife.
#
#   bash scripts/install-vllm.sh [VENV]        (default: .venv-vllm in the repository root)
#
# Why not `pip install vllm==0.33.0`: it does not resolve here (it wants certifi>=2026.10.19,
# newer than the registry serves) and its torch==2.14.0 pin resolves only to the CUDA build
# (2.9 GB with its nvidia-* packages). What works (shared/notes/vllm-cpu.md):
#   1. torch==2.13.0, the CPU build, first, and a constraints file pinning it for every later step;
#   2. vllm==0.33.0 and xgrammar==0.2.8 with --no-deps (xgrammar's own dependencies pull triton);
#   3. the ~30 small packages vLLM's scheduler side imports, under the constraints;
#   4. kvlife itself, editable, with its dev extras, under the same constraints.
# `pip check` then lists unmet requirements of vLLM's GPU side: expected, never run it.
# Every process prints "Failed to import from vllm._C": harmless for scheduler-only use.
#
# Idempotent: a stamp file records what was installed (versions, this script's hash, the repo
# path of the editable kvlife); a second run with the same stamp does nothing. pip's cache is used
# (set PIP_NO_CACHE_DIR to turn it off, as with plain pip).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venv-vllm}"
PYTHON="${PYTHON:-python3}"

TORCH_VERSION=2.13.0
VLLM_VERSION=0.33.0
XGRAMMAR_VERSION=0.2.8
# The packages vLLM's scheduler, configs and connectors import (found by trial; see the notes).
SMALL_PACKAGES=(
  packaging numpy psutil "pydantic>=2.12.0" msgspec "pyzmq>=25.0.0" cloudpickle pyyaml regex
  cachetools tqdm "requests>=2.33.0" "transformers>=5.16.1,<5.21.0" "huggingface_hub>=1.31.0"
  "tokenizers>=0.23.2" "safetensors>=0.6.2" blake3 py-cpuinfo "prometheus_client>=0.18.0" cbor2
  "aiohttp>=3.14.4" "oss-harmony>=0.0.11" "openai>=2.25.0" "pillow>=13.0.0" pybase64 uvloop
  "fastapi>=0.133.0,<0.137.0" partial-json-parser "llguidance>=1.7.0,<1.8.0" einops
  "apache-tvm-ffi==0.1.11"
)

script_hash="$(sha256sum "${BASH_SOURCE[0]}" | cut -c1-16)"
pyproject_hash="$(sha256sum "$ROOT/pyproject.toml" | cut -c1-16)"
stamp_text="torch=$TORCH_VERSION vllm=$VLLM_VERSION xgrammar=$XGRAMMAR_VERSION script=$script_hash pyproject=$pyproject_hash kvlife=$ROOT"
STAMP="$VENV/.kvlife-vllm-stamp"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$stamp_text" && -x "$VENV/bin/python" ]]; then
  echo "install-vllm: $VENV is up to date ($stamp_text)"
  exit 0
fi

# pip's expected complaints: vLLM's GPU-side requirements, and index folders this machine lacks.
NOISE="dependency conflicts\|requires .*, which is not installed\|but you have\|^WARNING: Location\|is ignored: it is neither"
start=$SECONDS
if [[ ! -x "$VENV/bin/python" ]]; then
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install -q --upgrade pip

CONSTRAINTS="$VENV/kvlife-constraints.txt"
printf 'torch==%s\n' "$TORCH_VERSION" >"$CONSTRAINTS"

echo "install-vllm: torch==$TORCH_VERSION (CPU build)"
"${PIP[@]}" install -q "torch==$TORCH_VERSION" -c "$CONSTRAINTS"
echo "install-vllm: vllm==$VLLM_VERSION, xgrammar==$XGRAMMAR_VERSION (--no-deps)"
"${PIP[@]}" install -q --no-deps "vllm==$VLLM_VERSION"
"${PIP[@]}" install -q --no-deps "xgrammar==$XGRAMMAR_VERSION"
echo "install-vllm: ${#SMALL_PACKAGES[@]} small packages vLLM's scheduler side imports"
# pip warns that vLLM's own (GPU-side) requirements are not all met: expected, see the header.
"${PIP[@]}" install -q -c "$CONSTRAINTS" "${SMALL_PACKAGES[@]}" 2> >(grep -v "$NOISE" >&2 || true)
echo "install-vllm: kvlife (editable, dev extras) from $ROOT"
"${PIP[@]}" install -q -c "$CONSTRAINTS" -e "$ROOT[dev]" 2> >(grep -v "$NOISE" >&2 || true)

# A smoke import: the scheduler and the connector base class are what the tests need.
"$VENV/bin/python" - <<'PY' 2> >(grep -v "Failed to import from vllm._C" >&2 || true)
import torch, vllm
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: F401
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: F401
print(f"install-vllm: vllm {vllm.__version__}, torch {torch.__version__}")
PY

printf '%s\n' "$stamp_text" >"$STAMP"
echo "install-vllm: built $VENV in $((SECONDS - start)) s"
