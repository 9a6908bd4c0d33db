"""Actor (policy being trained) and reference model, as plain in-process components of a worker."""
from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext
from typing import Sequence

import torch

from fleetrl import heartbeat
from fleetrl.algo import POLICY_LOSSES, entropy_loss, kl_loss, rollout_correction
from fleetrl.batch import Batch
from fleetrl.engines.replicas import check_same
from fleetrl.engines.sharding import gathered_call
from fleetrl.engines.sync_check import SyncProbe, probe_gap
from fleetrl.engines.training import DistInfo, TrainingEngine
from fleetrl.models import shapes, varlen
from fleetrl.models.decoder import NativeDecoder
from fleetrl.models.hf import load_causal_lm
from fleetrl.models.logprobs import sequence_logprobs
from fleetrl.models.lora import apply_lora, store_frozen_base
from fleetrl.models.meta_init import is_deferred, materialize
from fleetrl.models.native import NativeForward
from fleetrl.models.packing import CPU_ALIGN, PACK_ALIGN, HostRows, PackedForward, padded_token_slots
from fleetrl.workers.context import WorkerContext, dtype_of
from fleetrl.workers.layout import pad_response, split_micro_batches, update_micro_batches
from fleetrl.workers.messages import CorrectionSpec, Extreme, MiniBatchCounts, UpdateMetrics, UpdateSpec
from fleetrl.workers.update import run_update


def load_policy_model(ctx: WorkerContext, *, trainable: bool = False) -> torch.nn.Module:
    """The policy's model, loaded or drawn straight on the worker's device. The trained actor of a random: shape under
    FSDP2 or with LoRA stays on the meta device (adapters are injected there too): ActorComponent draws it once its
    engine has sharded it, so each rank allocates only its shard (Qwen2.5-72B in bf16 is 145 GB: no card holds it
    whole). LoRA takes that path unsharded too, so its adapters are drawn alike at every world size (meta_init)."""
    m = ctx.cfg.model
    meta = (trainable and m.path.startswith(shapes.RANDOM_PREFIX)
            and (ctx.sharded("actor") or ctx.cfg.actor.lora is not None))
    model = load_causal_lm(m.path, dtype=m.dtype, trust_remote_code=m.trust_remote_code, key="model.path",
                           device="meta" if meta else ctx.device())
    if ctx.plan.gradient_checkpointing:
        # transformers 5 renamed it (the old name warns that it will go in v6); older versions have only the old one
        enable = getattr(model, "activation_checkpointing_enable", None) or getattr(
            model, "gradient_checkpointing_enable", None)
        if enable is not None:
            enable()
    if trainable and ctx.cfg.actor.compile and ctx.cfg.actor.forward == "hf" and ctx.device().type == "cuda":
        # Per decoder layer rather than the whole model: one graph reused by every layer, no graph breaks
        # from the HF wrapper code, and the fast rollout engine (own forward) is unaffected.
        from fleetrl.engines.training import _decoder_layers

        for layer in _decoder_layers(model):
            layer.compile(dynamic=False)  # static shapes: dynamic=True measured slower on H200
    return model


@torch.no_grad()
def batched_logprobs(model: torch.nn.Module, batch: Batch, *, micro: int, temperature: float,
                     chunk: int | None, entropy: bool, packed: PackedForward | None = None,
                     share_prompts: bool = False, native: NativeForward | None = None,
                     engine: TrainingEngine | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropy) [B, R] of the response tokens under `model`, micro-batch by micro-batch
    (token-budget micro-batches through the packed forward when `packed` is given; through our own decoder
    forward, padded or packed as it was built, when `native` is given). engine: `model`'s training engine, whose
    FSDP2 ranks must all run as many micro-batches (`TrainingEngine.aligned`)."""
    model.eval()
    device = next(model.parameters()).device
    logps, ents = [], []
    full_r = batch["response_mask"].shape[1]  # each micro-batch's outputs are padded back to the batch's width
    tokens, share = (packed.max_tokens if packed else None), bool(packed and packed.share_prompts)
    mbs = update_micro_batches(batch, micro, tokens, share)
    # FSDP2: a rank with fewer micro-batches than another re-cuts its rows into as many (each row still once, in
    # order, so the outputs concatenate as before) rather than repeating one to keep the gathers in step.
    passes = (engine.aligned(mbs, split=lambda n: split_micro_batches(batch, n, tokens, share)) if engine is not None
              else [(mb, True) for mb in mbs])
    for mb, real in passes:
        heartbeat.beat()
        mb = mb.to(device)
        args = (model, mb["prompts"], mb["prompt_mask"], mb["responses"], mb["response_mask"])
        forward = native or packed
        extra = {} if forward else dict(chunk_size=chunk, share_prompts=share_prompts and chunk is not None)
        # Sharded (FSDP2): these forwards read the root's weights (embedding, LM head) outside model.forward.
        lp, ent = gathered_call(model, forward or sequence_logprobs, *args, temperature=temperature,
                                return_entropy=entropy, **extra)
        if not real:  # a repeat that keeps FSDP2's gathers in step with other ranks
            continue
        logps.append(pad_response(lp.float().cpu(), full_r))
        if entropy:
            ents.append(pad_response(ent.float().cpu(), full_r))
    return torch.cat(logps), (torch.cat(ents) if entropy else None)


def gen_temperature(ctx: WorkerContext) -> float:
    # Logprobs are taken at the sampling temperature (as the rollout engine reports them); greedy rollouts
    # (temperature 0) are scored at temperature 1.
    t = ctx.cfg.rollout.temperature
    return t if t > 0 else 1.0


NATIVE_ONLY_ATTENTION = ("varlen", "segments")  # actor.packed_attention values only the native forward runs


def packed_forward(ctx: WorkerContext, native: bool = False) -> PackedForward | None:
    """The packed forward of this run (algorithm.micro_batch_tokens set), or None for padded micro-batches.
    native: for actor.forward=native, the one packed forward that can share prompts (actor.share_prompts)."""
    if ctx.plan.micro_batch_tokens is None:
        return None
    a = ctx.cfg.actor
    # The native forward's own kernels name no transformers implementation: HF's forward (the reference's, beside a
    # native actor) takes `auto` for them (KeyError "`segments` is not a valid attention implementation").
    name = "auto" if not native and a.packed_attention in NATIVE_ONLY_ATTENTION else a.packed_attention
    attention = PackedForward.choose_attention(name, ctx.device())
    if (native and a.share_prompts and a.packed_attention == "auto" and varlen.available(ctx.device())
            and ctx.plan.flash_attention_ok):
        # Shared-prompt rows as flex blocks are mostly partial blocks (measured 0.61 s updates against 0.49 s with
        # varlen); plain packed rows keep flex, measured on long-tailed lengths (bench/RESULTS.md). Not where a pass
        # feeds attention fp32, which the flash kernel refuses (Plan.flash_attention_ok).
        attention = "varlen"
    elif native and a.packed_attention == "auto" and ctx.device().type == "cpu":
        # CPU SDPA over the dense block-diagonal mask visits every pair of the row (models/segments.py: 35 ms
        # against 7.8 ms per layer's attention, forward and backward, on a GRPO row).
        attention = "segments"
    align = CPU_ALIGN if ctx.device().type == "cpu" else PACK_ALIGN
    return PackedForward(max_tokens=ctx.plan.micro_batch_tokens, fused_chunk=a.fused_logprob_chunk, align=align,
                         attention=attention, share_prompts=native and a.share_prompts,
                         max_segment=ctx.plan.rollout.max_seq_len)


def native_forward(ctx: WorkerContext, model: torch.nn.Module, packed: PackedForward | None,
                   chunk: int | None) -> NativeForward | None:
    """Our own decoder forward (actor.forward=native; models/decoder.py), layers compiled by Inductor under
    actor.compile (static shapes on GPU, one dynamic-shape graph on CPU); None for HF's modelling code."""
    a = ctx.cfg.actor
    if a.forward != "native":
        return None
    on_cpu = ctx.device().type == "cpu"
    # max_seq_len: a Mistral sliding window narrower than the run's longest sample is refused at load (decoder.py)
    decoder = NativeDecoder(model, compile_backend="inductor" if a.compile else None, dynamic=on_cpu,
                            max_seq_len=ctx.plan.rollout.max_seq_len)
    return NativeForward(decoder, packed=packed, chunk=chunk,
                         fused_chunk=a.fused_logprob_chunk)


class ActorComponent:
    def __init__(self, ctx: WorkerContext, model: torch.nn.Module, dist_info: DistInfo) -> None:
        self.ctx = ctx
        self.model = model
        # actor.lora: adapters injected into `model` in place (a colocated rollout engine shares them); only they
        # require grad, so the optimiser below holds state for them alone.
        lora = ctx.cfg.actor.lora
        self.adapters = None if lora is None else apply_lora(
            model, lora, gradient_checkpointing=ctx.plan.gradient_checkpointing)
        if ctx.plan.lora_base_dtype is not None:
            store_frozen_base(model, dtype_of(ctx.plan.lora_base_dtype), upcast=ctx.plan.lora_base_upcast)
        t0 = time.perf_counter()
        self.engine = TrainingEngine(model, ctx.cfg.actor.optim, dist_info=dist_info,
                                     total_optimizer_steps=ctx.plan.actor_optimizer_steps, device=ctx.device(),
                                     sharded=ctx.sharded("actor"),
                                     autocast_dtype=None if ctx.plan.actor_autocast == "off" else dtype_of(ctx.plan.actor_autocast))
        self.startup_s = {"engine": time.perf_counter() - t0}  # sharding, the all-reduce probe, the optimiser
        if is_deferred(model):
            # Built on the meta device (load_policy_model) and sharded by the engine: each rank keeps its shard of
            # whole tensors drawn alike on every rank, and the ranks compare a few of those.
            t0 = time.perf_counter()
            stats = materialize(model, ctx.device())
            if dist_info.active:
                check_same(stats, dist_info.group, "actor")
            self.startup_s["materialize"] = time.perf_counter() - t0
        self.packed = packed_forward(ctx, native=ctx.cfg.actor.forward == "native")
        self.native = native_forward(ctx, model, self.packed, ctx.cfg.actor.logprob_chunk)

    def precision(self) -> AbstractContextManager:
        """The context of a log-prob pass outside the update: the update's autocast where the frozen base is
        kept in its dtype (Plan.lora_base_dtype: the weights need it), else the model's own precision."""
        return self.engine.autocast() if self.ctx.plan.lora_base_dtype is not None else nullcontext()

    def compute_logprobs(self, batch: Batch) -> Batch:
        with self.precision():
            logp, ent = batched_logprobs(self.model, batch, micro=self.ctx.plan.micro_batch_size,
                                         temperature=gen_temperature(self.ctx), chunk=self.ctx.cfg.actor.logprob_chunk,
                                         entropy=True, packed=self.packed,
                                         share_prompts=self.ctx.cfg.actor.share_prompts, native=self.native,
                                         engine=self.engine)
        return Batch({"old_logprobs": logp, "entropy": ent})

    def probe_gaps(self, probes: Sequence[SyncProbe]) -> list[float]:
        """The policy check's trainer side (engines/sync_check.py): each probe's largest gap to this model's log-probs
        of its sampled tokens, at temperature 1 as the engine reported them. Every rank of a sharded actor runs it."""
        gaps = []
        for probe in probes:
            batch = Batch({"prompts": probe.prompts, "prompt_mask": probe.prompt_mask, "responses": probe.responses,
                           "response_mask": probe.response_mask})
            with self.precision():
                logp, _ = batched_logprobs(self.model, batch, micro=len(batch), temperature=1.0,
                                           chunk=self.ctx.cfg.actor.logprob_chunk, entropy=False, engine=self.engine)
            gaps.append(probe_gap(probe, logp))
        return gaps

    def update(self, batch: Batch, spec: UpdateSpec) -> UpdateMetrics:
        return run_update(self.engine, batch, spec, epochs=self.ctx.cfg.algorithm.ppo_epochs,
                          micro_batch_size=self.ctx.plan.micro_batch_size,
                          loss_fn=lambda mb, counts: self._loss(mb, counts, spec), prefix="actor",
                          micro_batch_tokens=self.packed.max_tokens if self.packed else None,
                          share_prompts=bool(self.packed and self.packed.share_prompts))

    def _loss(self, mb: Batch, counts: MiniBatchCounts,
              spec: UpdateSpec) -> tuple[torch.Tensor, dict[str, float | Extreme]]:
        algo = self.ctx.cfg.algorithm
        forward = self.native or self.packed
        # Token counts from the host copy (no device read); then an asynchronous copy: from pageable memory
        # a host-to-device copy first waits for the GPU to drain.
        slots = (forward.token_slots(mb["prompt_mask"], mb["response_mask"], mb["prompts"]) if forward
                 else padded_token_slots(mb["prompt_mask"], mb["response_mask"]))
        host_mask = mb[spec.loss_mask]
        host = HostRows(mb["prompts"], mb["prompt_mask"], mb["responses"], mb["response_mask"])
        mb = mb.to(self.ctx.device(), non_blocking=True)
        on_policy = spec.old_logprobs == "current"
        need_entropy = algo.entropy_coef > 0 or on_policy  # on-policy: the entropy metric comes from here
        args = (self.model, mb["prompts"], mb["prompt_mask"], mb["responses"], mb["response_mask"])
        # Without an entropy bonus the entropy is a metric only: computed detached, which saves its autograd graph.
        entropy = (True if algo.entropy_coef > 0 else "metric") if need_entropy else False
        kw = dict(temperature=gen_temperature(self.ctx), return_entropy=entropy)
        if forward:
            kw["host"] = host
        else:
            chunk = self.ctx.cfg.actor.logprob_chunk
            kw.update(chunk_size=chunk, share_prompts=self.ctx.cfg.actor.share_prompts and chunk is not None)
        # Sharded (FSDP2): the root's hooks gather the embedding and LM head, which these forwards read directly.
        logp, ent = gathered_call(self.model, forward or sequence_logprobs, *args, **kw)
        mask = mb[spec.loss_mask].float()
        agg = dict(agg=algo.loss_agg, num_tokens=counts.num_tokens, num_seqs=counts.num_seqs, norm_len=counts.norm_len)
        # On-policy (no recompute pass): old = this forward's own detached log-probs, so the ratio is exactly 1
        # and the gradient is the policy gradient.
        old = logp.detach().float() if on_policy else mb["old_logprobs"]
        # Metrics are returned as shares of the global mean: the micro-batch's token fraction weights them,
        # so summing over micro-batches and ranks gives the mini-batch mean.
        # Metric values stay 0-dim device tensors (read back once per optimiser step by the engine).
        share = mask.sum() / max(counts.num_tokens, 1.0)
        metrics: dict[str, torch.Tensor | float | Extreme] = {}
        is_weights = mb["is_weights"] if spec.is_weights else None
        if spec.correction is not None:  # old = this forward, so pi_old / pi_rollout is known only now
            is_weights, corr = _in_loss_correction(old, mb["rollout_logprobs"], mask, spec.correction, share,
                                                   has_tokens=bool(host_mask.any()))
            metrics.update(corr)
        loss, m = POLICY_LOSSES.get(algo.policy_loss)(
            logp.float(), old, mb["advantages"], mask, clip_low=algo.clip_low,
            clip_high=algo.clip_high, dual_clip=algo.dual_clip, is_weights_BT=is_weights, **agg)
        metrics["actor/pg_loss"] = loss.detach()
        # Totals (summed over micro-batches and ranks), for padding waste = 1 - real / slots.
        metrics.update({"actor/tokens_real": float(slots[0]), "actor/tokens_slots": float(slots[1])})
        metrics.update({f"actor/{k}": (v.detach() if isinstance(v, torch.Tensor) else v) * share for k, v in m.items()})
        if on_policy:  # the recompute pass did not run, so its per-token metrics are measured here
            metrics.update(_rollout_agreement(logp, ent, mb["rollout_logprobs"], mask, share))
        if algo.kl.placement == "loss":
            kl, _ = kl_loss(logp.float(), mb["ref_logprobs"], mask, kind=algo.kl.estimator, **agg)
            loss = loss + spec.kl_coef * kl
            metrics["actor/kl_loss"] = kl.detach()
        if algo.entropy_coef > 0:
            ent_term = entropy_loss(ent.float(), mask, **agg)
            loss = loss - algo.entropy_coef * ent_term
            metrics["actor/entropy_bonus"] = ent_term.detach()
        return loss, metrics


@torch.no_grad()
def _rollout_agreement(logp_BT: torch.Tensor, ent_BT: torch.Tensor, rollout_logp_BT: torch.Tensor,
                       mask_BT: torch.Tensor, share: torch.Tensor) -> dict[str, torch.Tensor | Extreme]:
    """Entropy and |trainer − rollout| log-prob gap, as shares of the mini-batch mean, and the gap's max (named
    as the controller names them when the recompute pass measures them instead)."""
    tokens = mask_BT.sum().clamp(min=1)
    diff = (logp_BT.float() - rollout_logp_BT).abs() * mask_BT
    return {"entropy": (ent_BT.float() * mask_BT).sum() / tokens * share,
            "rollout_logprob_diff_mean": diff.sum() / tokens * share,
            "rollout_logprob_diff_max": Extreme(diff.max(), "max")}


def _in_loss_correction(old_logp_BT: torch.Tensor, rollout_logp_BT: torch.Tensor, mask_BT: torch.Tensor,
                        c: CorrectionSpec, share: torch.Tensor,
                        has_tokens: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor | Extreme]]:
    """The rollout-correction weights [B, T] of one micro-batch and its statistics: means as shares of the
    mini-batch mean, max / min as Extremes (so they reduce to the whole batch's, as the controller's pass gives).
    Per micro-batch equals per batch: token weights are elementwise, and a sequence's weight reads only its own
    row, which a micro-batch always holds whole (workers/layout.py)."""
    w_BT, stats = rollout_correction(old_logp_BT, rollout_logp_BT, mask_BT, mode=c.mode, level=c.level, cap=c.cap,
                                     low=c.low, high=c.high)
    means = ("ratio_mean", "weight_mean", "clipped_frac", "masked_frac")
    out: dict[str, torch.Tensor | Extreme] = {f"rollout_is/{k}": torch.as_tensor(stats[f"rollout_is/{k}"]) * share
                                              for k in means}
    if has_tokens:  # no valid token: no max / min to report (the statistic's placeholder is 1)
        out["rollout_is/ratio_max"] = Extreme(torch.as_tensor(stats["rollout_is/ratio_max"]), "max")
        out["rollout_is/ratio_min"] = Extreme(torch.as_tensor(stats["rollout_is/ratio_min"]), "min")
    return w_BT, out


class RefComponent:
    """The initial policy for KL: a frozen copy of it, or (Plan.ref_from_actor) the LoRA actor's own model
    with its adapters switched off, which computes exactly the base model's function."""

    def __init__(self, ctx: WorkerContext, actor: ActorComponent | None = None) -> None:
        self.ctx = ctx
        self.adapters = actor.adapters if actor is not None else None
        self.precision = actor.precision if actor is not None else nullcontext
        self.engine = actor.engine if actor is not None else None  # the actor's model is the reference here
        if actor is not None:
            assert actor.adapters is not None, "ref_from_actor needs a LoRA actor"
            self.model = actor.model
            return
        # Its weights keep requires_grad as loaded, like the actor's, though nothing ever trains them: every
        # pass here runs under no_grad, so no graph or gradient is made. On CPU torch picks a different linear
        # kernel for a strided input (HF's LM head on the kept positions) when the weight is frozen, and on
        # AVX-512/AMX hosts the two round differently (~5e-7 in the log-probs): a frozen copy then disagreed with
        # the actor it equals, and the step-1 KL was that noise instead of exactly 0.
        self.model = load_policy_model(ctx).eval()

    def compute_ref_logprobs(self, batch: Batch) -> Batch:
        with self.adapters.disable_adapter() if self.adapters is not None else nullcontext(), self.precision():
            logp, _ = batched_logprobs(self.model, batch, micro=self.ctx.plan.micro_batch_size,
                                       temperature=gen_temperature(self.ctx), chunk=self.ctx.cfg.actor.logprob_chunk,
                                       entropy=False, packed=packed_forward(self.ctx), engine=self.engine)
        return Batch({"ref_logprobs": logp})
