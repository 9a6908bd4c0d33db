"""The run config: typed, frozen dataclasses, one per owner. Loaded by `config/load.py`, checked and turned
into a `Plan` by `config/plan.py`. Nothing mutates a config after loading: derived numbers live in the Plan.

Batch sizes follow verl's conventions so users can carry numbers over: `data.prompts_per_step` and
`algorithm.mini_batch_prompts` count PROMPTS (each yields `rollout.n` samples); `algorithm.micro_batch_size`
counts SAMPLES per data-parallel rank per forward/backward.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    path: str = "tiny:"
    """HF folder, hub id, `tiny:` (random tiny model for tests) or `gguf:FILE.gguf`."""
    tokenizer: str | None = None
    """Defaults to `path`."""
    dtype: str = "float32"
    """float32 | bfloat16 | float16: parameter dtype of the trained model."""
    trust_remote_code: bool = False
    gradient_checkpointing: bool = False


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    train: Any = "synthetic:copy"
    """A path (parquet/jsonl), `synthetic:NAME?k=v`, or a mixture `{task: path}`."""
    val: Any = None
    """Same forms as `train`; None = no validation."""
    weights: dict[str, float] | None = None
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
class RolloutConfig:
    engine: str = "hf"
    """Rollout engine name: hf | fast."""
    n: int = 8
    """Samples per prompt (group size for GRPO-family estimators)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    val_temperature: float = 0.0
    """0 = greedy validation."""
    val_n: int = 1
    """k for mean@k / pass@k at validation."""


@dataclass(frozen=True, kw_only=True)
class KLConfig:
    placement: str = "none"
    """none | reward (per-token penalty in the reward) | loss (a KL term in the actor loss)."""
    estimator: str = "k3"
    """k1 | k2 | k3."""
    coef: float = 0.001
    controller: str = "fixed"
    """fixed | adaptive (Ziegler et al. 2019)."""
    target: float = 0.1
    horizon: int = 10000


@dataclass(frozen=True, kw_only=True)
class AlgorithmConfig:
    advantage: str = "grpo"
    """gae | grpo | drgrpo | rloo | reinforce_plus_plus | reinforce_plus_plus_baseline."""
    policy_loss: str = "ppo"
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
    ppo_epochs: int = 1
    mini_batch_prompts: int | None = None
    """Prompts per optimiser step; None = all prompts of the step (one update per epoch)."""
    micro_batch_size: int = 8
    """Samples per data-parallel rank per forward/backward."""
    recompute_logprobs: str = "auto"
    """auto | always. Fully on-policy updates (1 epoch, 1 mini-batch) need no separate old-logprob pass: the
    importance ratio is exactly 1, so `auto` uses the update's own detached log-probs as the old ones."""


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    lr: float = 1e-6
    schedule: str = "constant"
    """constant | linear | cosine (decay to min_lr_ratio*lr after warm-up)."""
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8


@dataclass(frozen=True, kw_only=True)
class ActorConfig:
    optim: OptimConfig = field(default_factory=OptimConfig)
    sharding: str = "none"
    """none (each data-parallel rank holds the full model; gradients all-reduced) | fsdp2 (GPU: parameters,
    gradients and optimiser state sharded with FSDP2; a colocated rollout unshards once per generate)."""
    logprob_chunk: int | None = None
    """Tokens per chunk when computing log-softmax over the vocabulary (None = whole sequence at once)."""
    compile: bool = False
    """torch.compile each decoder layer for the training forward/backward (GPU; the first step compiles)."""
    offload_optimizer: bool = False
    """Move the optimiser state to CPU memory during generation (colocated rollout) and back for the update."""


@dataclass(frozen=True, kw_only=True)
class CriticConfig:
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    sharding: str = "none"
    """none | fsdp2, as for the actor."""
    warmup_steps: int = 0
    """RL steps during which only the critic is updated (actor frozen)."""


@dataclass(frozen=True, kw_only=True)
class RewardsConfig:
    sources: dict[str, str] = field(default_factory=dict)
    """data_source -> scorer (builtin name or path/to/file.py:fn)."""
    default: str | None = None
    """Scorer for data sources not listed (None = unknown data_source is an error before training)."""
    timeout_s: float = 10.0
    default_score: float = 0.0
    num_workers: int = 4
    isolation: str = "auto"
    """auto | thread | process. A timed-out process is terminated; a timed-out thread cannot be and keeps running.
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


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    total_steps: int | None = 20
    total_epochs: int | None = None
    """Used when total_steps is None."""
    val_every: int = 5
    val_before_train: bool = True
    save_every: int = 0
    """0 = no periodic checkpoints."""
    seed: int = 0
    name: str = "run"
    output_dir: str | None = None
    """Default runs/<name>-<timestamp>."""
    keep_last: int = 3
    """Checkpoints kept (older ones deleted), 0 = keep all."""
    keep_every: int = 0
    """Also keep every checkpoint whose step is a multiple of this (0 = off)."""
    delta_checkpoints: str = "off"
    """off | exact | int8: also store the actor's change from the base model (changed tensors only) as
    step_N/delta.safetensors; `fleetrl export --from-deltas` rebuilds full weights from base + deltas."""
    export_every: int = 0
    """Write a Hugging Face model folder every N steps under OUT/hf/step_N (0 = off)."""
    resume: str = "never"
    """auto | never | PATH."""
    max_restarts: int = 0
    """Automatic recoveries from a lost worker/node before the run gives up."""
    restart_wait_s: float = 120.0
    """How long a recovery waits for the cluster to have room for the plan again."""
    on_nonfinite: str = "skip"
    """skip | abort: what a NaN/inf loss or gradient does to the update."""


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
    resources: dict[str, float] = field(default_factory=dict)
    """Extra custom resources per bundle, e.g. {"node_a": 0.01} to pin a pool to a node."""


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    address: str | None = None
    """None = start a local Ray; `auto` or HOST:PORT joins a running cluster."""
    backend: str = "ray"
    """ray | local (workers in the driver process, for debugging; world size 1 per pool)."""
    num_cpus: int | None = None
    """CPUs of the local Ray started when address is None (default: the machine's)."""
    pools: dict[str, PoolConfig] = field(default_factory=lambda: {"main": PoolConfig()})
    roles: dict[str, str] = field(default_factory=lambda: {"actor": "main", "rollout": "main",
                                                           "ref": "main", "critic": "main"})
    """Role -> pool. Roles in the same pool share one Ray actor per bundle."""
    fallback_pools: dict[str, PoolConfig] | None = None
    """Placement to switch to when, after a lost node, the cluster cannot hold `pools` again within
    trainer.restart_wait_s (e.g. every role on the surviving node). None = keep waiting/fail."""
    fallback_roles: dict[str, str] | None = None
    """Role -> pool of the fallback placement (default: `roles`)."""
    placement_timeout_s: float = 60.0
    init_timeout_s: float = 120.0
    env: dict[str, str] = field(default_factory=dict)
    """Environment for every worker (through Ray's runtime env)."""


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
