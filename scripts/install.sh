#!/usr/bin/env bash
# Installs fleetrl (editable) with its test extras. torch is only pre-installed here when missing:
#   - a machine with an NVIDIA GPU (nvidia-smi works) gets pip's default (CUDA) torch;
#   - a machine without one gets a CPU build: the local wheelhouse's torch==2.13.0+cpu when pip can find it,
#     else the CPU wheel from the PyTorch CPU index. An existing torch is never replaced.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$PY" -m pip install "torch>=2.4"
  elif ! "$PY" -m pip install "torch==2.13.0+cpu" 2>/dev/null && ! "$PY" -m pip install "torch==2.13.0" --only-binary=:all: --no-index 2>/dev/null; then
    "$PY" -m pip install "torch>=2.4" --index-url https://download.pytorch.org/whl/cpu
  fi
fi
"$PY" -m pip install -e ".[dev,smol]"  # smol: SmolLM2 for the real-model learning test
