"""The run config: typed, frozen dataclasses, one per owner. Loaded by `config/load.py`, checked and turned
into a `Plan` by `config/plan.py`. Nothing mutates a config after loading: derived numbers live in the Plan.

Batch sizes follow verl's conventions so users can carry numbers over: `data.prompts_per_step` and
`algorithm.mini_batch_prompts` count PROMPTS (each yields `rollout.n` samples); `algorithm.micro_batch_size`
counts SAMPLES per data-parallel rank per forward/backward.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

from fleetrl.config.frozen import FrozenDict
from fleetrl.config.reward_model import CombineWeights, RewardModelConfig


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    path: str = "tiny:"
    """HF folder, hub id, `tiny:` (random tiny model for tests) or `gguf:FILE.gguf`."""
    tokenizer: str | None = None
    """Defaults to `path`."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype of the trained model."""
    trust_remote_code: bool = False
    gradient_checkpointing: bool | Literal["auto"] = False
    """Recompute each decoder layer's activations in the backward instead of keeping them (one more forward per
    update). auto: on where the actor trains on a CPU without autocast (no native bf16), whose fp32 activations
    are twice the size: the SmolLM2 LoRA job's update peak on such a CPU falls by ~1 GiB (bench/RESULTS.md "RSS
    over a whole run, third round"). Plan.gradient_checkpointing."""


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    train: Any = "synthetic:copy"
    """A path (parquet/jsonl), `synthetic:NAME?k=v`, or a mixture `{task: path}`."""
    val: Any = None
    """Same forms as `train`; None = no validation."""
    weights: Mapping[str, float] | None = None
    """Mixture sampling weights by task (default: proportional to size)."""
    input_key: str = "prompt"
    label_key: str | None = None
    """OpenRLHF-style column holding the ground truth (default: verl's reward_model.ground_truth)."""
    default_data_source: str | None = None
    apply_chat_template: bool = True
    max_prompt_length: int = 512
    prompts_per_step: int = 32
    """Prompts per RL step (verl: data.train_batch_size)."""
    val_max_prompts: int | None = None
    shuffle: bool = True


@dataclass(frozen=True, kw_only=True)
class EnvConfig:
    """A multi-turn environment (docs/envs.md): the model and `name` take turns until the episode ends; the
    episode's reward comes from the environment, not from `rewards`."""

    name: str
    """A registered environment (`tools`, `lookup`, `single_turn`) or `path/to/file.py:Class`."""
    kwargs: Mapping[str, Any] = field(default_factory=FrozenDict)
    """Keyword arguments of every instance (one instance per episode)."""
    max_turns: int = 4
    """Model turns per episode."""
    max_total_tokens: int = 512
    """Model + environment tokens after the prompt (the response width the trainer sees)."""
    max_tokens_per_turn: int | None = None
    """None: rollout.max_new_tokens."""
    timeout_s: float = 60.0
    """Deadline of each reset/step call; an episode whose environment passes it ends (finish reason timeout)."""


@dataclass(frozen=True, kw_only=True)
class VllmConfig:
    """rollout.engine=vllm (engines/vllm, docs/engines.md): the real vLLM inside each rollout worker."""

    gpu_memory_utilization: float = 0.5
    """Share of the GPU vLLM may take for its weights and KV cache (OpenRLHF --vllm_gpu_memory_utilization); leave
    room for the trainer when colocated. On CPU the KV cache is sized by the Plan's EngineSizes instead."""
    enable_sleep: bool = False
    """Colocated on GPUs: vLLM frees its weights and KV cache after each generate and takes them back at the next
    sync (OpenRLHF --vllm_enable_sleep). vLLM's CPU build has no sleep mode: refused on a CPU pool."""
    sync_check_tokens: int = 16
    """After every weight sync, vLLM's and the trainer's log-probs are compared on a probe of this many tokens
    (0 = no check)."""
    sync_check_tol: float = 0.05
    """The largest log-prob gap allowed above the first sync's (the baseline); beyond it the sync is an error."""


@dataclass(frozen=True, kw_only=True)
class SyncCheckConfig:
    """rollout.sync_check (engines/sync_check.py, docs/engines.md): after every weight sync the rollout engine samples
    a few tokens and the trainer scores them; a log-prob gap beyond the threshold means the engine does not hold the
    trained weights. The hf and fast engines; rollout.engine=vllm has its own check (rollout.vllm.sync_check_*)."""

    source: Literal["step", "probe"] = "step"
    """What is compared. step: the step's own samples, which the rollout generated right after the previous sync: the
    mean |rollout - trainer| log-prob over all their tokens, which the update computes anyway (no extra work; the
    error names the sync the samples came from, one step after it). probe: right after each sync the engine samples
    `sequences` x `tokens` and the trainer scores them (extra engine and trainer calls, ~2.4% of a CPU SmolLM2 step;
    the largest gap over so few tokens is noisy with bf16 rollouts: on an H200 the SmolLM2 GPU job's honest gaps
    reached 3.1, so use it with fp32 engines or a larger threshold)."""
    tokens: int = 2
    """New tokens each probe sequence samples (0 = no check, either source). The first comes from the engine's prefill, each later
    one from a decode step (which may read other copies of the weights: the fast engine's fused or cast ones), and on
    a CPU each decode step costs about what a training step's does, whatever the batch: 2 checks both paths."""
    sequences: int = 4
    """Probe sequences per rollout worker and sync (all in one engine call)."""
    threshold: float = 0.05
    """The largest |engine - trainer| log-prob gap allowed (source=step: the step's mean; probe: the largest over the
    probe's tokens): above the run's own baseline (the gap
    of its first check, before any update, or at resume) with mode=baseline, or as it is with mode=absolute."""
    mode: Literal["baseline", "absolute"] = "baseline"
    on_mismatch: Literal["error", "restart"] = "error"
    """error: stop the run naming the sync, the weights version and the gap. restart: rebuild the groups and resume
    from the last checkpoint (counts against trainer.max_restarts), as after a lost worker."""


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    engine: Literal["hf", "fast", "vllm"] = "hf"
    """Rollout engine: `hf` (transformers generate, the reference), `fast` (engines/fast) or `vllm` (the real vLLM,
    `pip install fleetrl[vllm]`; engines/vllm)."""
    vllm: VllmConfig = field(default_factory=VllmConfig)
    sync_check: SyncCheckConfig = field(default_factory=SyncCheckConfig)
    """The policy check after every weight sync (hf and fast engines)."""
    n: int = 8
    """Samples per prompt (group size for GRPO-family estimators)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    compute_dtype: Literal["model", "auto", "bfloat16", "float16", "float32"] = "model"
    """fast engine: decode in this dtype when it differs from the model's: on a GPU from one copy of the weights in
    it, kept between calls and refreshed in place at each sync (CUDA graphs read it: engines/fast/cast.py), on CPU
    from a copy made per call. Its log-probs then differ slightly from the trainer's (~0.035 mean |diff| for
    SmolLM2 bf16 vs fp32). auto: bfloat16 on a GPU or a CPU with native bf16 matmuls (AVX512-BF16 or AMX), else the
    model's (Plan.rollout_compute_dtype). The hf engine decodes in model.dtype: auto means that there, and another
    dtype is refused."""
    tensor_parallel: int = 1
    """fast engine: ranks per engine, tensor parallel (engines/fast/tp.py: heads, MLP columns and KV cache split k
    ways, two all-reduces per layer; workers/tp_group.py: rollout workers [e·k, (e+1)·k) run engine e). The model's
    heads, KV heads and MLP width must be multiples of it, and the rollout world size too (rollout workers / k
    engines). Synchronous single-turn runs: the Plan refuses it with trainer.mode=async or rollout.env."""
    free_cache: bool | Literal["auto"] = "auto"
    """A fast engine colocated with the trainer frees its KV cache, CUDA graphs and fused copies after each generate
    call, so the update runs without them (verl's free_cache_engine); the next call allocates and captures again.
    auto: always on a CPU (glibc keeps the pages otherwise); on a GPU when the cache would take more than a quarter
    of the card (Qwen3-8B with 128 slots of 4,256 tokens: 75 GB, which ran the update out of memory on an H200).
    A separate rollout pool keeps its cache."""
    gpu_memory_fraction: float | None = None
    """fast engine on GPUs: the share of each rollout GPU's memory its KV cache may take (OpenRLHF's
    --vllm_gpu_memory_utilization, verl's rollout.gpu_memory_utilization, which count vLLM's weights too; here the
    weights are the actor's or the engine's own and are not counted). The engine then keeps as many sequence slots
    (Plan.rollout.max_seq_len positions each, its KV heads) as fit, at most Plan.rollout.max_batch; the samples
    beyond them wait for a slot (continuous batching). None: a slot for every sample of the call. vLLM has its own:
    rollout.vllm.gpu_memory_utilization."""
    own_weights: bool | Literal["auto"] = "auto"
    """The fast engine decodes from its own copy of the weights (engines/fast/owned.py): under tensor_parallel = k
    each rank's 1/k of the projections and the embedding, norms and LM head whole, in the compute dtype, filled one
    decoder layer at a time, so an FSDP2-sharded colocated actor is never gathered whole (Qwen2.5-72B in bf16 is 145
    GB; each TP-4 rank then holds ~40 GB of it). false: the model's tensors in place (under FSDP2 the whole model is
    gathered for each call). auto: on for a fast engine colocated with an FSDP2 actor at tensor_parallel > 1
    (Plan.rollout_owns_weights). free_cache=auto frees it with the cache after each call (it is refilled at every
    step anyway: the weights change at each update)."""
    val_temperature: float = 0.0
    """0 = greedy validation."""
    val_n: int = 1
    """k for mean@k / pass@k at validation."""
    env: EnvConfig | None = None
    """None: one response per prompt, scored by `rewards`. Set: multi-turn episodes with this environment."""

    @property
    def max_response_tokens(self) -> int:
        """The widest response a rollout returns: a whole episode with an environment, else one generation."""
        return self.max_new_tokens if self.env is None else self.env.max_total_tokens


@dataclass(frozen=True, kw_only=True)
class KLConfig:
    placement: Literal["none", "reward", "loss"] = "none"
    """reward: a per-token penalty in the reward; loss: a KL term in the actor loss."""
    estimator: str = "k3"
    """A name in algo.KL_ESTIMATORS."""
    coef: float = 0.001
    controller: Literal["fixed", "adaptive"] = "fixed"
    """adaptive: Ziegler et al. 2019."""
    target: float = 0.1
    horizon: int = 10000


@dataclass(frozen=True, kw_only=True)
class RolloutCorrectionConfig:
    """Importance weights pi_old / pi_rollout for the rollout-trainer log-prob mismatch (`algo/correction.py`). In
    trainer.mode=async the same weights correct staleness (the off-policy correction, docs/async.md)."""

    mode: Literal["none", "tis", "mis", "icepop"] = "none"
    """tis: truncate at cap (Yao et al. 2025); mis: zero weights above cap; icepop: zero outside [low, high]."""
    level: Literal["token", "sequence"] = "token"
    """sequence: the product of a sequence's token ratios, acting on the whole sequence)."""
    cap: float = 2.0
    """Upper bound for tis / mis."""
    low: float = 0.5
    """icepop: lower edge of the kept band."""
    high: float = 5.0
    """icepop: upper edge of the kept band."""


@dataclass(frozen=True, kw_only=True)
class OverlongConfig:
    """DAPO's overlong handling (`algo/dapo.py`)."""

    buffer: int = 0
    """Tokens before rollout.max_new_tokens over which a penalty ramps linearly from 0 to -factor; 0 = off."""
    factor: float = 1.0
    mask_truncated: bool = False
    """Leave responses cut off at max_new_tokens out of the loss (DAPO overlong filtering)."""


@dataclass(frozen=True, kw_only=True)
class DynamicSamplingConfig:
    """DAPO dynamic sampling: drop groups whose rewards are all equal and generate more prompts to refill."""

    enabled: bool = False
    max_rounds: int = 3
    """Generation rounds per step at most (the first included); a batch still short after them trains on
    what it has, and the shortfall is reported."""


@dataclass(frozen=True, kw_only=True)
class AlgorithmConfig:
    advantage: str = "grpo"
    """A name in algo.ADVANTAGES (gae uses a critic)."""
    policy_loss: str = "ppo"
    """A name in algo.POLICY_LOSSES."""
    norm_adv_by_std: bool = True
    gamma: float = 1.0
    lam: float = 1.0
    clip_low: float = 0.2
    clip_high: float = 0.2
    """Set above clip_low for DAPO-style clip-higher."""
    dual_clip: float | None = None
    value_clip: float | None = 0.2
    kl: KLConfig = field(default_factory=KLConfig)
    entropy_coef: float = 0.0
    loss_agg: str = "token-mean"
    """A name in algo.AGGREGATIONS."""
    ppo_epochs: int = 1
    mini_batch_prompts: int | None = None
    """Prompts per optimiser step; None = all prompts of the step (one update per epoch)."""
    micro_batch_size: int = 8
    """Samples per data-parallel rank per forward/backward."""
    micro_batch_tokens: int | None = None
    """Token budget (prompt + response tokens) per actor forward/backward; the samples of a micro-batch are
    packed into one row without padding (fleetrl/models/packing.py). None = micro_batch_size samples, padded."""
    recompute_logprobs: Literal["auto", "always"] = "auto"
    """Fully on-policy updates (1 epoch, 1 mini-batch) need no separate old-logprob pass: the
    importance ratio is exactly 1, so `auto` uses the update's own detached log-probs as the old ones."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    lr: float = 1e-6
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Decay to min_lr_ratio*lr after warm-up, over the run's optimiser steps (Plan.optimizer_steps)."""
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """Low-rank adapters on the actor (`fleetrl/models/lora.py`, through peft): W' = W + (alpha/rank)·B·A."""

    rank: int = 8
    alpha: float = 16.0
    """Scale of the update is alpha/rank."""
    dropout: float = 0.0
    """Dropout on the adapter's input during updates (log-prob passes and generation run without it)."""
    targets: tuple[str, ...] = ("all-linear",)
    """Linear modules to adapt, by name or name suffix (`q_proj`, `self_attn.v_proj`); `all-linear` = every
    linear layer except the LM head, which may be added by name (`lm_head`) when it is not tied to the embedding."""
    frozen_dtype: Literal["auto", "model", "bfloat16"] = "auto"
    """The frozen base weights of the adapted layers with model.dtype=float32 (Plan.lora_base_dtype). auto: in the
    autocast dtype under actor.autocast (which rounds them to it at every matmul anyway: the same update in half the
    memory), else in model.dtype. bfloat16: in bf16 without autocast too (a CPU without native bf16), each layer's
    weight widened to fp32 at its matmul: half the memory, the base rounded once as a bf16 checkpoint's is (an export
    reloads the base at full precision). model: always model.dtype."""


@dataclass(frozen=True, kw_only=True)
class ActorConfig:
    optim: OptimConfig = field(default_factory=OptimConfig)
    sharding: Literal["none", "fsdp2"] = "none"
    """none (each data-parallel rank holds the full model; gradients all-reduced) | fsdp2 (parameters,
    gradients and optimiser state sharded with FSDP2 over the pool's ranks, NCCL on GPU or gloo on CPU, one shard
    on one rank; every actor.forward, micro-batch layout and LoRA works on it; a colocated rollout unshards once
    per generate, or one layer at a time into its own copy: rollout.own_weights)."""
    logprob_chunk: int | None = None
    """Tokens per chunk when computing log-softmax over the vocabulary (None = whole sequence at once)."""
    fused_logprob_chunk: int | None = None
    """Tokens per chunk of the fused LM-head + log-softmax + entropy pass of packed forwards and of the padded
    `forward: native` (algo/fused_logprobs.py: no [tokens, vocab] tensor is kept for backward); None = plain LM
    head. On CPU each chunk's softmax math is one Inductor kernel, compiled at the first step (~10 s).
    `logprob_chunk` applies to the other padded forwards."""
    packed_attention: str = "auto"
    """Attention of packed forwards. forward=hf: the transformers implementation: auto (flex_attention on GPU,
    the model's own on CPU) | flex_attention | flash_attention_2 | sdpa | eager (sdpa/eager build a dense tokens²
    mask). forward=native: auto (on GPU varlen with share_prompts where every pass feeds it fp16/bf16, which
    FlashAttention needs: Plan.flash_attention_ok; else flex_attention; segments on CPU) |
    varlen (torch's flash varlen kernel, one sequence per prompt or response, models/varlen.py) | segments (the
    same sequences padded into one batched attention, models/segments.py) | flex_attention | sdpa (dense)."""
    forward: Literal["hf", "native"] = "hf"
    """Modelling code of the actor's log-prob forwards: hf (transformers' own, any causal LM) | native (our own
    pure-torch Llama/Qwen2 decoder, models/decoder.py: reads the HF modules' parameters in place, so LoRA,
    optimiser, checkpoints and weight sync are unchanged; padded rows run causal SDPA with no mask, packed rows
    flex attention (shared prompts with share_prompts); FSDP2-sharded too)."""
    compile: bool = False
    """torch.compile each decoder layer for the training forward/backward (the first step compiles). With
    forward=native (GPU and CPU): our layer function, fullgraph; static shapes on GPU (padded widths rounded to
    quarter-octave buckets, packed rows to the token budget), one dynamic-shape graph on CPU; with forward=hf
    (GPU only): HF's decoder layers (measured slower in the e2e update, bench/RESULTS.md)."""
    autocast: Literal["off", "auto", "bfloat16", "float16"] = "off"
    """Run the training forward under torch.autocast in this dtype (weights, gradients and Adam state stay in
    model.dtype); on CPU bf16 autocast measured 1.2x faster updates for SmolLM2 (bench/RESULTS.md) where the CPU
    has native bf16 matmuls, and 8x slower matmuls on an AVX2-only CPU. auto: bfloat16 on a GPU or such a CPU,
    else off (Plan.actor_autocast)."""
    offload_optimizer: bool = False
    """Move the optimiser state to CPU memory during generation (colocated rollout) and back for the update."""
    share_prompts: bool = False
    """GRPO's n samples of a prompt pay for it once in the update. forward=hf: padded chunked forwards (needs
    logprob_chunk) run each distinct prompt of a micro-batch once and gather its KV cache per sample
    (models/logprobs.py); keep micro_batch_size a multiple of rollout.n so a micro-batch holds whole groups.
    forward=native: packed micro-batches (needs micro_batch_tokens) hold one copy of each prompt followed by its
    samples' responses, each attending to the prompt and itself (models/packing.py), and the token budget counts
    the prompt once. Equal to rounding; on CPU 1.7x less update work for SmolLM2 arithmetic (bench/RESULTS.md)."""
    lora: LoraConfig | None = None
    """None = full fine-tuning; else only the adapters train (base frozen, optimiser state for adapters only)."""


@dataclass(frozen=True, kw_only=True)
class CriticConfig:
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    sharding: Literal["none", "fsdp2"] = "none"
    """As for the actor."""
    warmup_steps: int = 0
    """RL steps during which only the critic is updated (actor frozen)."""


@dataclass(frozen=True, kw_only=True)
class RewardsConfig:
    sources: Mapping[str, str] = field(default_factory=FrozenDict)
    """data_source -> scorer (builtin name or path/to/file.py:fn)."""
    default: str | None = None
    """Scorer for data sources not listed (None = unknown data_source is an error before training)."""
    timeout_s: float = 10.0
    default_score: float = 0.0
    num_workers: int = 4
    isolation: Literal["auto", "thread", "process"] = "auto"
    """A timed-out process is terminated; a timed-out thread cannot be and keeps running in the background.
    auto: threads until the first timeout, then processes."""
    remote_urls: tuple[str, ...] = ()
    """Remote reward servers (`fleetrl serve-reward`); when set they score every sample."""
    remote_token: str | None = None
    remote_timeout_s: float = 120.0
    """HTTP timeout of one batched request to a reward server (the server applies timeout_s per sample)."""
    max_failure_rate: float = 0.5
    """Stop the run (ScorerFailureError naming the scorer) when a scorer fails — error, timeout, or not run because
    it hung — on more than this fraction of its samples in one step. 1.0 = never stop, train on default_score."""
    remote_connect_timeout_s: float = 5.0
    """Start-up /health check of each reward server: connect and answer within this (not remote_timeout_s)."""
    remote_retries: int = 2
    """Retries of a failed or timed-out /score on the next server; then the step fails with RewardServerLostError,
    which the supervisor handles like a lost worker (trainer.max_restarts). Worst case per sub-batch:
    (remote_retries + 1) × remote_timeout_s + the backoffs."""
    remote_backoff_s: float = 1.0
    """Backoff before retry k (k = 0, 1, ...): remote_backoff_s × 2**k."""
    model: RewardModelConfig | None = None
    """A neural reward model, placed as role `reward_model` (config/reward_model.py, docs/reward_models.md)."""
    combine: Mapping[str, CombineWeights] = field(default_factory=FrozenDict)
    """data_source (or `default`) -> {rule: W, model: W}; unlisted sources use rule 1 + model 1."""


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    total_steps: int | None = 20
    total_epochs: int | None = None
    """Used when total_steps is None."""
    val_every: int = 5
    val_before_train: bool = True
    save_every: int = 0
    """Checkpoint every N steps (0 = no periodic checkpoints). The last step is checkpointed anyway: see save_last."""
    seed: int = 0
    name: str = "run"
    output_dir: str | None = None
    """Default runs/<name>-<timestamp>."""
    keep_last: int = 3
    """Checkpoints kept (older ones deleted), 0 = keep all."""
    keep_every: int = 0
    """Also keep every checkpoint whose step is a multiple of this (0 = off)."""
    delta_checkpoints: Literal["off", "exact", "int8"] = "off"
    """Also store the actor's change from the base model (changed tensors only) as
    step_N/delta.safetensors; `fleetrl export --from-deltas` rebuilds full weights from base + deltas."""
    export_every: int = 0
    """Write a Hugging Face model folder every N steps under OUT/hf/step_N (0 = off)."""
    resume: str = "never"
    """auto | never | PATH."""
    max_restarts: int = 0
    """Automatic recoveries from a lost worker/node before the run gives up."""
    restart_wait_s: float = 120.0
    """How long a recovery waits for the cluster to have room for the plan again."""
    save_last: bool = True
    """Checkpoint the last complete step when the run ends (total_steps) or stops on SIGINT (Ctrl-C) or SIGTERM
    (what SLURM and Kubernetes send before preemption), whatever save_every says; a step is never saved twice.
    false: only save_every's checkpoints, for a run never meant to be resumed or exported (a benchmark, a
    throwaway sweep point); a stopped run then has nothing to continue from."""
    on_nonfinite: Literal["skip", "abort"] = "skip"
    """What a NaN/inf loss or gradient does to the update."""
    rank_local: bool = True
    """Where the plan allows it (every role in one pool, a synchronous step, no dynamic sampling, no environment,
    no reward-model role), each rank generates, scores, computes advantages for and trains on its own whole groups,
    and the controller exchanges only typed requests and scalar reports with it (workers/local_step.py,
    docs/architecture.md). false: the step's data passes through the controller, as it must when roles live in
    different pools (for comparisons)."""
    mode: Literal["sync", "async"] = "sync"
    """sync: generate, then train, then sync weights, one step at a time. async (docs/async.md): generation of the
    next max_staleness steps runs on a separate rollout pool while the actor trains (trainer/pipeline.py)."""
    max_staleness: int = 1
    """async: a sample is trained on at most this many weight versions after the one that generated it
    (0 = exactly the synchronous schedule). Correct for it with algorithm.rollout_correction (e.g. tis)."""
    stale: Literal["hold", "drop"] = "hold"
    """async: hold = a step takes generations oldest first, so none ever exceeds max_staleness and none is
    wasted; drop = a step takes generations as they finish (a slow one never holds the trainer), and one that
    finishes more than max_staleness versions behind is dropped, counted and replaced."""
    chunk_groups: int | None = None
    """async: prompt groups per generate call (one call = one rollout worker); results stream back and are
    scored call by call. Must divide data.prompts_per_step. None: the step's prompts split over the workers."""
    partial_rollouts: bool = False
    """async (docs/async.md, Partial rollouts): a generate call decodes in segments of `partial_segment_tokens` new
    tokens; between segments the rollout worker installs the newest published weights, and the unfinished samples
    go on from their prompt plus the tokens so far (re-prefilled) on them. Each token records the version that
    produced it (`token_versions`); the staleness bound holds per token. hf and fast engines, single-turn only."""
    partial_segment_tokens: int | None = None
    """partial_rollouts: new tokens per sample per segment; None = ceil(rollout.max_new_tokens / 4) (at most three
    re-prefills per sample, a newer version taken up within a quarter of the longest response)."""
    stream_rollouts: bool = False
    """async, fast engine (docs/async.md, Streamed rollouts): each rollout worker runs one continuous-batching loop for
    all its generate calls (engines/fast/stream.py): the next calls' samples take the slots that finishing samples
    free, so no call waits out its longest sample in an emptying engine, and weights published meanwhile are
    installed between decode rounds, the running samples decoding on with them (their KV caches kept; PipelineRL's
    in-flight updates). Each token records the version that sampled it (`token_versions`); the staleness bound holds
    per token. Its engine holds up to the window's samples per worker (bound it with rollout.gpu_memory_fraction).
    Not with partial_rollouts (it supersedes them) or rollout.env."""
    async_weights: Literal["auto", "store", "bus"] = "auto"
    """async: how each published version reaches the rollout pool. bus = a broadcast from actor rank 0 to every
    rollout worker over a process group of their own (NCCL on GPUs, Gloo on CPUs), received beside the running
    decode into a staging copy of the weights that the engine loop installs between two decode rounds (one more
    copy of the synced weights per rollout GPU); stream_rollouts only. store = actor rank 0
    writes the version to Ray's object store once and each rollout worker reads it (no staging on the GPU, nothing
    waits for a collective). auto = bus where it can run, else store."""


@dataclass(frozen=True, kw_only=True)
class TrackingConfig:
    console: bool = True
    progress: bool = True
    tensorboard: bool = True
    wandb_project: str | None = None
    mlflow_uri: str | None = None


@dataclass(frozen=True, kw_only=True)
class PoolConfig:
    nodes: int = 1
    workers_per_node: int = 1
    """Data-parallel workers (bundles) per node; on GPU one per GPU."""
    gpus_per_worker: float = 0.0
    cpus_per_worker: float = 0.25
    """Fractional on purpose: a bundle that asks for a whole CPU per worker is a classic cause of hangs."""
    resources: Mapping[str, float] = field(default_factory=FrozenDict)
    """Extra custom resources per bundle, e.g. {"node_a": 0.01} to pin a pool to a node."""


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    address: str | None = None
    """None = start a local Ray; `auto` or HOST:PORT joins a running cluster."""
    backend: Literal["ray", "local"] = "ray"
    """local: workers in the driver process, for debugging; world size 1 per pool)."""
    num_cpus: int | None = None
    """CPUs of the local Ray started when address is None (default: the machine's)."""
    pools: Mapping[str, PoolConfig] = field(default_factory=lambda: FrozenDict({"main": PoolConfig()}))
    roles: Mapping[str, str] = field(default_factory=lambda: FrozenDict(
        {"actor": "main", "rollout": "main", "ref": "main", "critic": "main"}))
    """Role -> pool. Roles in the same pool share one Ray actor per bundle."""
    fallback_pools: Mapping[str, PoolConfig] | None = None
    """Placement to switch to when, after a lost node, the cluster cannot hold `pools` again within
    trainer.restart_wait_s (e.g. every role on the surviving node). None = keep waiting/fail."""
    fallback_roles: Mapping[str, str] | None = None
    """Role -> pool of the fallback placement (default: `roles`)."""
    placement_timeout_s: float = 60.0
    init_timeout_s: float = 120.0
    env: Mapping[str, str] = field(default_factory=FrozenDict)
    """Environment for every worker (through Ray's runtime env)."""
    call_timeout_s: float | Literal["auto"] = "auto"
    """Deadline of a worker call. auto: first_call_timeout_s for the first call of each verb, then
    max(300 s, 5 × the slowest of its last 10 calls); a number fixes it for every verb."""
    first_call_timeout_s: float = 1800.0
    """auto deadline of the first call of a verb (model load, compile, CUDA-graph capture happen there)."""
    call_timeouts: Mapping[str, float] = field(default_factory=FrozenDict)
    """Per-verb deadlines, e.g. {generate: 900, update_actor: 1200}; the rank-local step's verbs (rollout_local,
    prepare_local, update_actor_local, update_critic_local) take their own name or their phase's (generate,
    compute_logprobs, update_actor, update_critic)."""
    stall_s: float = 120.0
    """A worker call whose progress (decode steps, micro-batches, weight buckets) has not moved, or whose worker
    does not answer at all, for this long is a stall: stacks are dumped and the run recovers (docs/hangs.md)."""
    first_call_stall_s: float = 900.0
    """The stall limit in the first call of each verb for a worker that still answers its progress pings: kernel
    compilation (flex attention, torch.compile, Triton autotuning) runs there for minutes without a progress
    tick. A worker that stops answering (frozen process or node) is still a stall after stall_s."""


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
