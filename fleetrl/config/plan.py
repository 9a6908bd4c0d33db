"""The ONE validate-and-derive step: RunConfig -> frozen Plan (world sizes, per-rank batch sizes, pools).

Every check raises ConfigError with the numbers involved and which keys to change. Nothing downstream
re-derives these numbers or mutates the config.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal, Mapping

from fleetrl.algo.advantages import is_outcome_estimator
from fleetrl.config.async_plan import AsyncPlan, derive_async
from fleetrl.config.checks import (
    check_env,
    check_lora,
    check_names,
    check_ranges,
    check_resume,
    check_sampling,
    check_share_prompts,
    did_you_mean,
    divisors,
    one_of,
)
from fleetrl.config.frozen import FrozenDict
from fleetrl.config.load import ConfigError
from fleetrl.config.precision import (
    HALF,
    AttentionPass,
    attention_dtype,
    check_attention_passes,
    check_optimizer_dtype,
    resolve_compute_dtype,
    resolve_precision,
)
from fleetrl.config.rollout_checks import check_family, check_memory_fraction, check_tensor_parallel, owns_weights
from fleetrl.config.schema import PoolConfig, RunConfig
from fleetrl.config.tensor_parallel import folder_config
from fleetrl.config.vllm_check import check_vllm

ROLES = ("actor", "rollout", "ref", "critic", "reward_model")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


SeedPurpose = Literal["worker", "engine", "generate", "validate", "sampler", "sync_check"]


@dataclass(frozen=True, kw_only=True)
class PoolPlan:
    name: str
    nodes: int
    bundles_per_node: int
    bundle: Mapping[str, float]
    roles: tuple[str, ...]
    cpu_threads: int
    """torch intra-op threads of each worker when it runs on CPU: its whole-CPU share of the bundle (Ray sets
    OMP_NUM_THREADS to the share too; a fractional share gets one thread)."""

    @property
    def world_size(self) -> int:
        return self.nodes * self.bundles_per_node

    @property
    def uses_gpu(self) -> bool:
        return self.bundle.get("GPU", 0) > 0


@dataclass(frozen=True, kw_only=True)
class EngineSizes:
    """What a rollout engine must hold at once on one worker (the fast engine sizes its KV cache by these)."""
    max_batch: int
    """Most sequences one generate call of one rollout engine carries (training step or validation): one worker's,
    or at rollout.tensor_parallel = k the k workers' of the engine together."""
    max_seq_len: int
    """data.max_prompt_length + rollout.max_response_tokens (a whole episode with an environment)."""


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Every number the run uses, derived once from the config (and the training set's size in epoch mode)."""
    config: RunConfig
    pools: Mapping[str, PoolPlan]
    roles: Mapping[str, str]
    """Active role -> pool name."""
    world: Mapping[str, int]
    """Active role -> data-parallel size."""
    use_critic: bool
    use_ref: bool
    rollout_colocated: bool
    """The rollout shares the actor's pool: the engine reads the actor's parameters in place (no weight bus)."""
    samples_per_step: int
    mini_batch_samples: int
    num_mini_batches: int
    micro_batch_size: int
    """Samples per data-parallel rank per forward/backward."""
    micro_batch_tokens: int | None
    """Token budget of a packed actor micro-batch (algorithm.micro_batch_tokens); None = micro_batch_size."""
    total_steps: int
    actor_optimizer_steps: int
    """Optimiser steps of the whole run (the LR schedule's length): steps after the critic warm-up ×
    mini-batches × epochs."""
    critic_optimizer_steps: int
    kl_into_score: bool
    """KL in the reward with an outcome estimator (grpo, drgrpo, rloo), which sees one number per sequence: the
    penalty coef·Σ_t kl_t is folded into the sequence score (algo.fold_kl_into_scores) instead of token rewards."""
    rollout_correction: bool
    """algorithm.rollout_correction.mode != none: importance weights old/rollout multiply the policy loss."""
    recompute_logprobs: bool
    """False when the update is fully on-policy (1 epoch, 1 mini-batch): the old (proximal) log-probs are the
    update's own, detached, and the rollout's stand for them wherever they are needed before the update. Also
    in async mode and with a rollout correction; but a stale pipeline with a KL penalty in the reward or an
    adaptive KL controller recomputes, as those read the trained policy's log-probs before the update."""
    correction_in_loss: bool = False
    """rollout_correction without a recompute pass: the actor loss computes the weights from its own detached
    log-probs (workers/messages.py CorrectionSpec); otherwise the controller computes them from the pass's."""
    rollout: EngineSizes
    val_batch_prompts: int
    """Prompts per validation generate call (at least one per rollout worker)."""
    action_mask: Literal["response_mask", "loss_mask"] = "response_mask"
    """The batch key marking the tokens the policy generated: what KL, advantages, the entropy metric, the
    rollout correction and the value loss weigh. With rollout.env it is `loss_mask` (the rollout's model-token
    mask; environment tokens are context with zero weight), and the forward passes still attend over all of
    response_mask. The actor's policy loss also reads `loss_mask` under overlong.mask_truncated."""
    rank_local: bool = False
    """The step runs rank-local (trainer.rank_local and the plan allows it: every role in one pool, sync, no
    dynamic sampling, no environment, no reward-model role): the samples never leave the rank that generated them."""
    ref_from_actor: bool = False
    """actor.lora is set and the ref shares the actor's pool: the reference log-probs come from the actor's own
    model with its adapters switched off (peft's disable_adapter), which IS the base model: no second copy."""
    lora_base_dtype: str | None = None
    """The dtype the LoRA actor keeps its frozen adapted weights in: actor.autocast's when it is on and no colocated
    HF `generate` reads them. Under autocast every matmul rounds those weights to that dtype anyway, so the update
    is the same bit for bit and the weights take half the memory (SmolLM2 LoRA: 2.9 -> 2.2 GiB peak RSS, bench/
    RESULTS.md); the HF engine's `generate` runs outside autocast and would meet mixed dtypes. Without autocast
    (actor.lora.frozen_dtype=bfloat16, model.dtype=float32): bfloat16, widened at each matmul (`lora_base_upcast`).
    None = model.dtype."""
    gradient_checkpointing: bool = False
    """model.gradient_checkpointing with auto resolved: on for an actor trained on a CPU without autocast."""
    lora_base_upcast: bool = False
    """The frozen LoRA base is stored in lora_base_dtype but computed in model.dtype, each layer's weight widened at
    its matmul (models/lora.py UpcastLinear): no autocast to round it (a CPU without native bf16)."""
    pipeline: AsyncPlan | None = None
    """trainer.mode=async: the overlap window (config/async_plan.py); None = synchronous steps."""
    actor_autocast: str = "off"
    """actor.autocast with `auto` resolved (config/precision.py): off, bfloat16 or float16."""
    rollout_compute_dtype: str = "model"
    """rollout.compute_dtype with `auto` resolved (config/precision.py): model or a dtype name; always `model` for
    the hf engine, which decodes in model.dtype."""
    sync_check: bool = False
    """The policy check's probe runs after every sync (rollout.sync_check with source=probe, engines/sync_check.py):
    tokens > 0, a synchronous run (async engines install weights inside their generate calls) and the hf or fast
    engine (vLLM checks its own syncs, engines/vllm/check.py)."""
    step_sync_check: bool = False
    """The policy check on each step's own samples (rollout.sync_check with source=step, the default): as
    `sync_check`, but judged on the step's mean rollout-vs-trainer log-prob gap, which costs nothing extra."""
    flash_attention_ok: bool = False
    """Every pass of the actor's own forward (the update; the old log-prob recompute where it runs) feeds attention
    fp16/bf16 q/k/v, which FlashAttention kernels need (they have no fp32): actor.packed_attention=auto picks the
    varlen kernel only then (workers/actor.py `packed_forward`), flex attention otherwise."""
    rollout_owns_weights: bool = False
    """rollout.own_weights resolved: the fast engine decodes from its own copy, filled layer by layer (owned.py)."""

    @property
    def correction_on_controller(self) -> bool:
        """The controller weighs the recomputed log-probs against the rollout's and sends `is_weights`."""
        return self.rollout_correction and not self.correction_in_loss

    def actor_updates_at(self, step: int) -> bool:
        """The actor stays frozen for the first critic.warmup_steps steps of a run with a critic."""
        return not self.use_critic or step >= self.config.critic.warmup_steps

    def seed(self, purpose: SeedPurpose, step: int = 0, rank: int = 0) -> int:
        """The one place seeds come from, so (seed, step, rank) fixes every random draw of a run and a resumed run
        draws exactly what a straight one would."""
        s = self.config.trainer.seed
        if purpose == "worker":  # python/numpy/torch global generators of a worker
            return s * 1000 + rank
        if purpose == "engine":  # a rollout engine's running generator (calls without their own seed)
            return s + rank
        if purpose == "generate":  # one training generate call on one rollout worker
            return (s * 100_003 + step) * 1009 + rank
        if purpose == "validate":
            return (s + 7) * 1009 + rank
        if purpose == "sampler":  # the prompt sampler's shuffle
            return s
        if purpose == "sync_check":  # the policy check's probe after the sync to weights version `step`
            return ((s + 13) * 100_003 + step) * 1009 + rank
        raise ValueError(f"unknown seed purpose {purpose!r}")

    def disk_bytes(self, params: int) -> int:
        """At most what the run writes under trainer.output_dir for a model of `params` parameters: the checkpoints
        held at once (keep_last, plus the one being written before the oldest goes, plus the saved ones keep_every
        keeps; each the actor's weights in model.dtype and its Adam moments, up to 8 bytes a parameter, the critic's
        alike, and the delta against the base with trainer.delta_checkpoints) and the Hugging Face exports. An
        upper bound: a LoRA checkpoint holds far less (adapters only). `fleetrl doctor` checks free space against it."""
        t = self.config.trainer
        saves = -(-self.total_steps // t.save_every) if t.save_every else 1
        held = saves if t.keep_last == 0 else t.keep_last + 1
        if t.keep_every and t.save_every:  # only saved steps are kept: multiples of both
            held += self.total_steps // math.lcm(t.save_every, t.keep_every)
        held = min(saves, held)
        weights = params * DTYPE_BYTES[self.config.model.dtype]
        delta = {"off": 0, "exact": weights, "int8": params}[t.delta_checkpoints]
        checkpoint = (weights + 8 * params) * (2 if self.use_critic else 1) + delta
        exports = self.total_steps // t.export_every if t.export_every else 0
        return held * checkpoint + exports * weights

    def summary(self) -> dict:
        return {
            "roles": {r: f"{p} (dp={self.world[r]})" for r, p in self.roles.items()},
            "pools": {n: {"nodes": p.nodes, "bundles_per_node": p.bundles_per_node, "bundle": dict(p.bundle),
                          "roles": list(p.roles), "cpu_threads": p.cpu_threads} for n, p in self.pools.items()},
            "samples_per_step": self.samples_per_step,
            "mini_batch_samples": self.mini_batch_samples,
            "num_mini_batches": self.num_mini_batches,
            "micro_batch_size_per_rank": self.micro_batch_size,
            "micro_batch_tokens": self.micro_batch_tokens,
            "use_critic": self.use_critic,
            "use_ref": self.use_ref,
            "rollout_colocated": self.rollout_colocated,
            "recompute_logprobs": self.recompute_logprobs,
            "kl_into_score": self.kl_into_score,
            "rollout_correction": self.rollout_correction,
            "correction_in_loss": self.correction_in_loss,
            "ref_from_actor": self.ref_from_actor,
            "lora_base_dtype": self.lora_base_dtype,
            "lora_base_upcast": self.lora_base_upcast,
            "gradient_checkpointing": self.gradient_checkpointing,
            "actor_autocast": self.actor_autocast,
            "rollout_compute_dtype": self.rollout_compute_dtype,
            "flash_attention_ok": self.flash_attention_ok,
            "rollout_owns_weights": self.rollout_owns_weights,
            "total_steps": self.total_steps,
            "actor_optimizer_steps": self.actor_optimizer_steps,
            "critic_optimizer_steps": self.critic_optimizer_steps,
            "rollout_engine": {"max_batch": self.rollout.max_batch, "max_seq_len": self.rollout.max_seq_len},
            "val_batch_prompts": self.val_batch_prompts,
            "action_mask": self.action_mask,
            "rank_local": self.rank_local,
            "pipeline": None if self.pipeline is None else {
                "max_staleness": self.pipeline.max_staleness, "stale": self.pipeline.stale,
                "chunk_groups": self.pipeline.chunk_groups, "window_groups": self.pipeline.window_groups,
                **({} if self.pipeline.segment_tokens is None else
                   {"partial_segment_tokens": self.pipeline.segment_tokens}),
                **({"stream_calls": self.pipeline.stream_calls} if self.pipeline.stream else {}),
                "weights": self.pipeline.weights},
        }


def check_plan(cfg: RunConfig) -> Plan:
    """derive_plan where the run is prepared rather than run (a sweep's grid points, a slurm or dstack recipe):
    epoch mode sizes the run from its training set, which the run reads and tokenizes when it starts, so one
    step's prompts stand in for it and everything else is checked in milliseconds."""
    return derive_plan(cfg, train_prompts=None if cfg.trainer.total_steps is not None else cfg.data.prompts_per_step)


def derive_plan(cfg: RunConfig, *, train_prompts: int | None = None) -> Plan:
    """`train_prompts` (the training set's size) is needed only in epoch mode (trainer.total_steps: null)."""
    check_ranges(cfg)
    check_resume(cfg)
    check_names(cfg)
    fallback = _fallback_config(cfg)
    if fallback is not None:  # checked now, not at the moment a node is lost
        try:
            derive_plan(fallback, train_prompts=train_prompts)
        except ConfigError as e:
            raise ConfigError(f"the fallback placement (cluster.fallback_pools / fallback_roles) is invalid: {e}") from None
    check_sampling(cfg)
    check_env(cfg)
    check_lora(cfg)
    check_share_prompts(cfg)
    use_critic = cfg.algorithm.advantage == "gae"
    use_ref = cfg.algorithm.kl.placement != "none"
    use_rm = cfg.rewards.model is not None  # the reward_model role exists only with rewards.model set
    active = [r for r in ROLES if (r != "critic" or use_critic) and (r != "ref" or use_ref)
              and (r != "reward_model" or use_rm)]
    roles = _map_roles(cfg, active)
    pools = {name: _pool_plan(name, pc, tuple(r for r in active if roles[r] == name))
             for name, pc in cfg.cluster.pools.items() if any(roles[r] == name for r in active)}
    world = {r: pools[roles[r]].world_size for r in active}
    if cfg.cluster.backend == "local" and any(w > 1 for w in world.values()):
        raise ConfigError(f"cluster.backend=local holds workers in the driver process, so every pool must have "
                          f"one worker; got world sizes {world}. Use cluster.backend=ray for data parallelism")
    samples, mini, n_mini, micro = _batch_arithmetic(cfg, world)
    total = _total_steps(cfg, train_prompts)
    epochs = cfg.algorithm.ppo_epochs
    actor_steps = (total - (cfg.critic.warmup_steps if use_critic else 0)) * n_mini * epochs
    on_policy = n_mini == 1 and epochs == 1
    correction = cfg.algorithm.rollout_correction.mode != "none"
    pipeline = derive_async(cfg, roles, world["rollout"],
                            same_device=pools[roles["actor"]].uses_gpu == pools[roles["rollout"]].uses_gpu)
    # Decoupled PPO (AReaL, Fu et al. 2025): proximal policy = the one being trained, behaviour = the rollout's,
    # weighed by the rollout correction. With one optimiser step per batch the proximal policy is the update
    # forward's own, so no pass recomputes it, even for stale samples. Only a KL read before the update (reward
    # penalty, adaptive controller) needs it then: the rollout's log-probs are k versions old.
    stale = pipeline is not None and pipeline.max_staleness > 0
    kl = cfg.algorithm.kl
    kl_before_update = use_ref and (kl.placement == "reward" or kl.controller == "adaptive")
    recompute = cfg.algorithm.recompute_logprobs == "always" or not on_policy or (stale and kl_before_update)
    # the policy check (engines/sync_check.py): synchronous runs only (async samples mix versions); vLLM checks itself
    check_syncs = cfg.rollout.sync_check.tokens > 0 and pipeline is None and cfg.rollout.engine != "vllm"
    # A validation call fills the rollout engines as a training step does (its samples / val_n prompts), so the
    # engines need no more room than training. Why: at 8 prompts a call, 200 held-out prompts took 25 calls, ~1.6 s
    # on an H200 and ~45% of the SmolLM2 race's wall-clock (bench/RESULTS.md, the race's third round).
    val_prompts = max(world["rollout"], cfg.data.prompts_per_step, samples // cfg.rollout.val_n)
    gpu = {r: pools[roles[r]].uses_gpu for r in active}
    check_optimizer_dtype(cfg, [r for r in ("actor", "critic") if r in gpu and not gpu[r]])
    autocast = resolve_precision("actor.autocast", cfg.actor.autocast, gpu["actor"], "off")
    compute_dtype = resolve_compute_dtype(cfg, gpu["rollout"])
    check_vllm(cfg, gpu["rollout"])
    check_memory_fraction(cfg, gpu["rollout"])
    folder = folder_config(cfg.model.path)  # a local checkpoint's config.json, read once for both checks
    check_tensor_parallel(cfg, world["rollout"], folder)
    check_family(cfg, folder)
    ref_from_actor = use_ref and cfg.actor.lora is not None and roles["ref"] == roles["actor"]
    lora_base = _lora_base_dtype(cfg, autocast, colocated=roles["rollout"] == roles["actor"])
    passes, flash_ok = _attention_passes(cfg, autocast, lora_base, recompute=recompute,
                                         ref=None if not use_ref else "actor" if ref_from_actor else "copy", gpu=gpu)
    check_attention_passes(passes)
    rank_local = (cfg.trainer.rank_local and pipeline is None and not cfg.algorithm.dynamic_sampling.enabled
                  and cfg.rollout.env is None and "reward_model" not in roles and len(set(roles.values())) == 1)
    return Plan(config=cfg, pools=FrozenDict(pools), roles=FrozenDict(roles), world=FrozenDict(world),
                rank_local=rank_local, use_critic=use_critic, use_ref=use_ref, rollout_colocated=roles["rollout"] == roles["actor"],
                samples_per_step=samples, mini_batch_samples=mini, num_mini_batches=n_mini, micro_batch_size=micro,
                micro_batch_tokens=_packing(cfg),
                total_steps=total, actor_optimizer_steps=max(actor_steps, 1),
                critic_optimizer_steps=total * n_mini * epochs,
                kl_into_score=cfg.algorithm.kl.placement == "reward" and is_outcome_estimator(cfg.algorithm.advantage),
                rollout_correction=correction, recompute_logprobs=recompute, correction_in_loss=correction and not recompute,
                rollout=_engine_sizes(cfg, world["rollout"], samples, val_prompts, pipeline),
                val_batch_prompts=val_prompts, pipeline=pipeline,
                action_mask="loss_mask" if cfg.rollout.env else "response_mask",
                ref_from_actor=ref_from_actor, lora_base_dtype=lora_base,
                lora_base_upcast=lora_base is not None and autocast == "off",
                gradient_checkpointing=_checkpointing(cfg, autocast, on_gpu=gpu["actor"]),
                actor_autocast=autocast, rollout_compute_dtype=compute_dtype, flash_attention_ok=flash_ok,
                sync_check=(check_syncs and cfg.rollout.sync_check.source == "probe"),
                step_sync_check=(check_syncs and cfg.rollout.sync_check.source == "step"),
                rollout_owns_weights=owns_weights(cfg, colocated=roles["rollout"] == roles["actor"]))


def _attention_passes(cfg: RunConfig, autocast: str, lora_base: str | None, *, recompute: bool,
                      ref: Literal["actor", "copy"] | None, gpu: Mapping[str, bool]) -> tuple[list[AttentionPass], bool]:
    """The packed forwards of a step with the attention each runs and the dtype it feeds it (config/precision.py
    `check_attention_passes` refuses FlashAttention fed fp32); and Plan.flash_attention_ok. The update runs under
    actor.autocast; a pass outside it (the old log-prob recompute, the reference with the LoRA actor's adapters off)
    under it only where the LoRA base is kept in its dtype (workers/actor.py `ActorComponent.precision`), else in
    model.dtype, as a reference copy does. ref: None (no KL), "actor" (Plan.ref_from_actor) or "copy"."""
    model, packed = cfg.model.dtype, cfg.actor.packed_attention
    update = attention_dtype(model, autocast)
    outside = attention_dtype(model, autocast if lora_base is not None else "off")
    flash_ok = update in HALF and (not recompute or outside in HALF)
    if cfg.algorithm.micro_batch_tokens is None:  # padded forwards: SDPA, which takes any dtype
        return [], flash_ok
    outside_fix = f"set model.dtype=bfloat16 (that pass runs outside actor.autocast, in model.dtype={model})"
    passes = [AttentionPass(name="the update", attention=packed, dtype=update, on_gpu=gpu["actor"],
                            fix="set actor.autocast=auto (bf16 on a GPU) or model.dtype=bfloat16")]
    if recompute:
        passes.append(AttentionPass(name="the old log-prob recompute (Plan.recompute_logprobs)", attention=packed,
                                    dtype=outside, on_gpu=gpu["actor"], fix=outside_fix))
    if ref is not None:  # the reference's packed forward is HF's, `auto` for the native-only kernels (workers/actor.py)
        passes.append(AttentionPass(name="the reference log-prob pass", on_gpu=gpu["ref"],
                                    attention="auto" if packed in ("varlen", "segments") else packed,
                                    dtype=outside if ref == "actor" else model, fix=outside_fix))
    return passes, flash_ok


def _checkpointing(cfg: RunConfig, autocast: str, on_gpu: bool) -> bool:
    """Plan.gradient_checkpointing: model.gradient_checkpointing, auto = on where the update's activations are
    fp32 on a CPU (actor.autocast resolved off there): memory, not speed, is what a CPU run runs out of."""
    g = cfg.model.gradient_checkpointing
    return g is True or (g == "auto" and not on_gpu and autocast == "off")


def _lora_base_dtype(cfg: RunConfig, autocast: str, colocated: bool) -> str | None:
    """Plan.lora_base_dtype (actor.lora.frozen_dtype auto or bfloat16, model.dtype=float32): the autocast dtype for a
    LoRA actor trained under autocast (`autocast`: actor.autocast resolved), unless the HF engine generates with the
    actor's own modules (colocated: transformers' generate runs outside autocast); without autocast, bf16 storage
    widened at each matmul where frozen_dtype=bfloat16 asks for it (Plan.lora_base_upcast: the HF engine's generate
    calls those same modules, so it runs), else None."""
    if cfg.actor.lora is None or cfg.actor.lora.frozen_dtype == "model" or cfg.model.dtype != "float32":
        return None
    if autocast == "off":
        return "bfloat16" if cfg.actor.lora.frozen_dtype == "bfloat16" else None
    if colocated and cfg.rollout.engine == "hf":
        return None
    return autocast


def _total_steps(cfg: RunConfig, train_prompts: int | None) -> int:
    t = cfg.trainer
    if t.total_steps is not None:
        return t.total_steps
    if train_prompts is None:
        raise ConfigError("trainer.total_epochs needs the training set's size: derive the plan with "
                          "train_prompts=... (fleetrl train does), or set trainer.total_steps")
    per_epoch = train_prompts // cfg.data.prompts_per_step
    if per_epoch < 1:
        raise ConfigError(f"the training set has {train_prompts} prompts, fewer than one step's "
                          f"data.prompts_per_step={cfg.data.prompts_per_step}; lower data.prompts_per_step")
    return per_epoch * t.total_epochs


def _engine_sizes(cfg: RunConfig, world: int, samples: int, val_prompts: int,
                  pipeline: AsyncPlan | None) -> EngineSizes:
    val_samples = val_prompts * cfg.rollout.val_n
    per_worker = max(samples // world, -(-val_samples // world))
    if pipeline is not None:  # one async generate call carries chunk_groups whole groups on one worker
        per_worker = max(per_worker, pipeline.chunk_groups * cfg.rollout.n)
    if pipeline is not None and pipeline.stream:  # one loop may hold every sample of the window's chunks on it
        per_worker = max(per_worker, -(-pipeline.window_groups * cfg.rollout.n // world))
    # Partial rollouts: a segment's call sizes every row for its largest budget, so a row near its limit (prompt +
    # max_new_tokens - 1 tokens so far) beside a row with a whole segment left needs segment_tokens more positions.
    extra = pipeline.segment_tokens if pipeline is not None and pipeline.segment_tokens else 0
    # An engine of rollout.tensor_parallel = k ranks decodes the samples of its k ranks in one call.
    return EngineSizes(max_batch=per_worker * cfg.rollout.tensor_parallel,
                       max_seq_len=cfg.data.max_prompt_length + cfg.rollout.max_response_tokens + extra)


def fallback_plan(plan: Plan) -> Plan | None:
    """The Plan of cluster.fallback_pools/fallback_roles (a new config object; the original is untouched)."""
    cfg = _fallback_config(plan.config)
    return None if cfg is None else derive_plan(cfg)


def _fallback_config(cfg: RunConfig) -> RunConfig | None:
    c = cfg.cluster
    if c.fallback_pools is None:
        return None
    cluster = dataclasses.replace(c, pools=c.fallback_pools, roles=c.fallback_roles or c.roles,
                                  fallback_pools=None, fallback_roles=None)
    return dataclasses.replace(cfg, cluster=cluster)


def _map_roles(cfg: RunConfig, active: list[str]) -> dict[str, str]:
    for role in cfg.cluster.roles:
        if role not in ROLES:
            raise ConfigError(did_you_mean(f"cluster.roles.{role}", role, ROLES, "role"))
    roles = {}
    for role in active:
        pool = cfg.cluster.roles.get(role, cfg.cluster.roles.get("actor", "main"))
        if pool not in cfg.cluster.pools:
            raise ConfigError(did_you_mean(f"cluster.roles.{role}", pool, list(cfg.cluster.pools), "pool")
                              + " — define it under cluster.pools")
        roles[role] = pool
    return roles


def _pool_plan(name: str, pc: PoolConfig, roles: tuple[str, ...]) -> PoolPlan:
    if pc.nodes < 1 or pc.workers_per_node < 1:
        raise ConfigError(f"cluster.pools.{name}: nodes and workers_per_node must be >= 1")
    for key, amount in (("cpus_per_worker", pc.cpus_per_worker), ("gpus_per_worker", pc.gpus_per_worker),
                        *((f"resources.{k}", v) for k, v in pc.resources.items())):
        if not amount >= 0:  # else a meaningless bundle reaches Ray placement, after the run directory exists
            raise ConfigError(f"cluster.pools.{name}.{key} must be >= 0, got {amount}")
    if pc.cpus_per_worker <= 0 and pc.gpus_per_worker <= 0:
        raise ConfigError(f"cluster.pools.{name}: a worker needs cpus_per_worker > 0 or gpus_per_worker > 0")
    bundle = {"CPU": pc.cpus_per_worker}
    if pc.gpus_per_worker:
        bundle["GPU"] = pc.gpus_per_worker
    bundle.update(pc.resources)
    return PoolPlan(name=name, nodes=pc.nodes, bundles_per_node=pc.workers_per_node, bundle=FrozenDict(bundle),
                    roles=roles, cpu_threads=max(1, int(pc.cpus_per_worker)))


def _batch_arithmetic(cfg: RunConfig, world: dict[str, int]) -> tuple[int, int, int, int]:
    n, prompts = cfg.rollout.n, cfg.data.prompts_per_step
    samples = prompts * n
    # A GRPO group (a prompt and its n samples) is never split across ranks (batch.py GroupPartition): every
    # data-parallel role gets whole prompts, as many on each rank.
    for role, dp in world.items():
        if role == "reward_model" and samples % dp:  # scores samples, not groups
            raise ConfigError(
                f"data.prompts_per_step × rollout.n = {prompts} × {n} = {samples} samples do not split over the "
                f"{dp} data-parallel workers of role '{role}'; make data.prompts_per_step a multiple of "
                f"{dp // _gcd(dp, n)} or change that pool's nodes/workers_per_node")
        # an async rollout pool takes chunks of whole groups one worker at a time (trainer/pipeline.py)
        skip = role == "reward_model" or (role == "rollout" and cfg.trainer.mode == "async")
        if not skip and prompts % dp:
            raise ConfigError(
                f"data.prompts_per_step={prompts} prompts (each a group of rollout.n={n} samples, never split) do not "
                f"divide over the {dp} data-parallel workers of role '{role}'; make data.prompts_per_step a "
                f"multiple of {dp} or change that pool's nodes/workers_per_node")
    mini_prompts = cfg.algorithm.mini_batch_prompts or prompts
    if prompts % mini_prompts:
        raise ConfigError(f"algorithm.mini_batch_prompts={mini_prompts} does not divide data.prompts_per_step="
                          f"{prompts}; choose a divisor (e.g. {divisors(prompts)})")
    mini = mini_prompts * n
    micro = cfg.algorithm.micro_batch_size
    # A micro-batch larger than a rank's share of the mini-batch just means one micro-batch per rank.
    per_rank_sizes = [mini // world[r] for r in ("actor", "critic") if r in world and mini_prompts % world[r] == 0]
    if per_rank_sizes and micro > min(per_rank_sizes):
        micro = min(per_rank_sizes)
    for role in ("actor", "critic"):
        dp = world.get(role)
        if dp is None:
            continue
        if mini_prompts % dp:
            raise ConfigError(f"a mini-batch of {mini_prompts} prompts (groups of {n} samples, never split) does not "
                              f"divide over {dp} '{role}' workers; make algorithm.mini_batch_prompts a multiple "
                              f"of {dp}")
        per_rank = mini // dp
        if per_rank % micro:  # micro >= 1: check_ranges
            raise ConfigError(f"each '{role}' worker gets {per_rank} samples per mini-batch "
                              f"({mini} / {dp} workers), which is not a multiple of algorithm.micro_batch_size="
                              f"{micro}; set micro_batch_size to a divisor of {per_rank} "
                              f"(e.g. {divisors(per_rank)})")
    return samples, mini, prompts // mini_prompts, micro


def _packing(cfg: RunConfig) -> int | None:
    """Validates the packed-forward keys; returns the token budget of an actor micro-batch (None = off)."""
    budget, chunk, a = cfg.algorithm.micro_batch_tokens, cfg.actor.fused_logprob_chunk, cfg.actor
    if budget is not None and budget < 1:
        raise ConfigError(f"algorithm.micro_batch_tokens={budget} must be a positive token count (e.g. 16384) or "
                          "null for micro_batch_size samples per micro-batch")
    if chunk is not None and chunk < 1:
        raise ConfigError(f"actor.fused_logprob_chunk={chunk} must be a positive token count (e.g. 4096) or null")
    one_of("actor.packed_attention", a.packed_attention,
            ["auto", "varlen", "segments", "flex_attention", "flash_attention_2", "flash_attention_3", "sdpa", "eager"])
    if a.packed_attention in ("varlen", "segments") and a.forward != "native":
        raise ConfigError(f"actor.packed_attention={a.packed_attention} is the native forward's (models/"
                          f"{a.packed_attention}.py); with actor.forward=hf choose auto, flex_attention, "
                          "flash_attention_2, sdpa or eager, or set actor.forward=native")
    return budget


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a
