"""Actor (policy being trained) and reference model, as plain in-process components of a worker."""
from __future__ import annotations

import math

import torch

from fleetrl.algo import POLICY_LOSSES, entropy_loss, kl_loss
from fleetrl.batch import Batch
from fleetrl.engines.training import DistInfo, TrainingEngine
from fleetrl.models.hf import load_causal_lm
from fleetrl.models.logprobs import sequence_logprobs
from fleetrl.workers.context import WorkerContext


def load_policy_model(ctx: WorkerContext, *, trainable: bool = False) -> torch.nn.Module:
    m = ctx.cfg.model
    model = load_causal_lm(m.path, dtype=m.dtype, trust_remote_code=m.trust_remote_code)
    if m.gradient_checkpointing and hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable()
    model = model.to(ctx.device())
    if trainable and ctx.cfg.actor.compile and ctx.device().type == "cuda":
        # Per decoder layer rather than the whole model: one graph reused by every layer, no graph breaks
        # from the HF wrapper code, and the fast rollout engine (own forward) is unaffected.
        from fleetrl.engines.training import _decoder_layers

        for layer in _decoder_layers(model):
            layer.compile(dynamic=False)  # static shapes: dynamic=True measured slower on H200
    return model


def micro_batches(batch: Batch, size: int) -> list[Batch]:
    """Consecutive micro-batches, each with the padding columns that ALL its rows share removed (prompt columns
    on the left, response columns on the right): a batch padded to its longest sample wastes compute on every
    shorter micro-batch otherwise. Outputs per response token are padded back with `pad_response`."""
    n = len(batch)
    return [trim_padding(batch.select(range(i, min(i + size, n)))) for i in range(0, n, size)]


def trim_padding(mb: Batch) -> Batch:
    if "prompt_mask" not in mb or "response_mask" not in mb:
        return mb
    p_cols = mb["prompt_mask"].any(0).nonzero()
    r_cols = mb["response_mask"].any(0).nonzero()
    p0 = int(p_cols[0]) if len(p_cols) else mb["prompt_mask"].shape[1] - 1
    r1 = int(r_cols[-1]) + 1 if len(r_cols) else 1
    full_r = mb["response_mask"].shape[1]
    tensors = {}
    for k, v in mb.tensors.items():
        if k in ("prompts", "prompt_mask"):
            tensors[k] = v[:, p0:]
        elif v.dim() >= 2 and v.shape[1] == full_r:
            tensors[k] = v[:, :r1]
        else:
            tensors[k] = v
    return Batch(tensors, dict(mb.fields), {**mb.meta, "full_response_len": full_r})


def pad_response(x_BR: torch.Tensor, full_r: int) -> torch.Tensor:
    return torch.nn.functional.pad(x_BR, (0, full_r - x_BR.shape[1]))


@torch.no_grad()
def batched_logprobs(model: torch.nn.Module, batch: Batch, *, micro: int, temperature: float,
                     chunk: int | None, entropy: bool) -> Batch:
    """Log-probs (and entropy) of the response tokens under `model`, micro-batch by micro-batch."""
    model.eval()
    device = next(model.parameters()).device
    logps, ents = [], []
    for mb in micro_batches(batch, micro):
        mb = mb.to(device)
        lp, ent = sequence_logprobs(model, mb["prompts"], mb["prompt_mask"], mb["responses"], mb["response_mask"],
                                    temperature=temperature, return_entropy=entropy, chunk_size=chunk)
        full_r = mb.meta.get("full_response_len", lp.shape[1])
        logps.append(pad_response(lp.float().cpu(), full_r))
        if entropy:
            ents.append(pad_response(ent.float().cpu(), full_r))
    out = {"logprobs": torch.cat(logps)}
    if entropy:
        out["entropy"] = torch.cat(ents)
    return Batch(out)


def gen_temperature(ctx: WorkerContext) -> float:
    # Logprobs are taken at the sampling temperature (as the rollout engine reports them); greedy rollouts
    # (temperature 0) are scored at temperature 1.
    t = ctx.cfg.rollout.temperature
    return t if t > 0 else 1.0


def optimizer_steps(ctx: WorkerContext) -> int | None:
    """Optimiser steps of the whole run (for the LR schedule): steps × mini-batches × epochs."""
    plan = ctx.plan
    return plan.total_steps * plan.num_mini_batches * ctx.cfg.algorithm.ppo_epochs if plan.total_steps else None


def run_update(engine: TrainingEngine, batch: Batch, ctx: WorkerContext, loss_fn, prefix: str) -> dict[str, float]:
    """PPO-style epochs × mini-batches of optimiser steps over this rank's batch.

    `batch` is this rank's share of every mini-batch in mini-batch order (the controller arranged it), with the
    GLOBAL token/sequence counts of each mini-batch in meta, so losses are normalised as for the full batch.
    Returns metrics averaged over optimiser steps, plus the count of skipped (non-finite) updates.
    """
    plan, epochs = ctx.plan, ctx.cfg.algorithm.ppo_epochs
    minis = batch.chunk(plan.num_mini_batches)
    sums: dict[str, float] = {}
    for _ in range(epochs):
        for m, mini in enumerate(minis):
            counts = {"num_tokens": batch.meta["mini_num_tokens"][m], "num_seqs": batch.meta["mini_num_seqs"][m],
                      "norm_len": batch.meta["norm_len"]}
            metrics = engine.step(iter(micro_batches(mini, plan.micro_batch_size)), lambda mb: loss_fn(mb, counts))
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + v
    steps = plan.num_mini_batches * epochs
    out = {f"{prefix}/{k}": v / steps for k, v in sums.items() if k != "skipped"}
    out[f"{prefix}/skipped_updates"] = sums.get("skipped", 0.0)
    return out


class ActorComponent:
    def __init__(self, ctx: WorkerContext, model: torch.nn.Module, dist_info: DistInfo) -> None:
        self.ctx = ctx
        self.model = model
        self.engine = TrainingEngine(model, ctx.cfg.actor.optim, dist_info=dist_info,
                                     total_optimizer_steps=optimizer_steps(ctx), device=ctx.device(),
                                     sharded=ctx.cfg.actor.sharding == "fsdp2")

    @property
    def chunk(self) -> int | None:
        # The chunked path calls the backbone and LM head directly, bypassing the root FSDP2 module's hooks
        # that gather the embedding and head; sharded models go through model(...) unchunked.
        return None if self.engine.sharded else self.ctx.cfg.actor.logprob_chunk

    def compute_logprobs(self, batch: Batch) -> Batch:
        out = batched_logprobs(self.model, batch, micro=self.ctx.plan.micro_batch_size,
                               temperature=gen_temperature(self.ctx), chunk=self.chunk,
                               entropy=True)
        return Batch({"old_logprobs": out["logprobs"], "entropy": out["entropy"]})

    def update(self, batch: Batch) -> dict[str, float]:
        return run_update(self.engine, batch, self.ctx, self._loss, "actor")

    def _loss(self, mb: Batch, counts: dict) -> tuple[torch.Tensor, dict[str, float]]:
        cfg = self.ctx.cfg
        algo = cfg.algorithm
        mb = mb.to(self.ctx.device())
        on_policy = "old_logprobs" not in mb
        need_entropy = algo.entropy_coef > 0 or on_policy  # on-policy: the entropy metric comes from here
        logp, ent = sequence_logprobs(self.model, mb["prompts"], mb["prompt_mask"], mb["responses"],
                                      mb["response_mask"], temperature=gen_temperature(self.ctx),
                                      return_entropy=need_entropy, chunk_size=self.chunk)
        mask = mb["response_mask"].float()
        agg = dict(agg=algo.loss_agg, **counts)
        # On-policy (no recompute pass): old = this forward's own detached log-probs, so the ratio is exactly 1
        # and the gradient is the policy gradient.
        old = logp.detach().float() if on_policy else mb["old_logprobs"]
        loss, m = POLICY_LOSSES.get(algo.policy_loss)(
            logp.float(), old, mb["advantages"], mask, clip_low=algo.clip_low,
            clip_high=algo.clip_high, dual_clip=algo.dual_clip, **agg)
        # Metrics are returned as shares of the global mean: the micro-batch's token fraction weights them,
        # so summing over micro-batches and ranks gives the mini-batch mean.
        share = float(mask.sum()) / max(float(counts["num_tokens"]), 1.0)
        metrics = {"pg_loss": float(loss.detach())}
        metrics.update({k: float(v) * share for k, v in m.items()})
        if on_policy:
            with torch.no_grad():
                tokens = mask.sum().clamp(min=1)
                metrics["entropy"] = float((ent.float() * mask).sum() / tokens) * share
                diff = (logp.float() - mb["rollout_logprobs"]).abs() * mask
                metrics["rollout_logprob_diff_mean"] = float(diff.sum() / tokens) * share
        if algo.kl.placement == "loss":
            kl, _ = kl_loss(logp.float(), mb["ref_logprobs"], mask, kind=algo.kl.estimator, **agg)
            loss = loss + mb.meta["kl_coef"] * kl
            metrics["kl_loss"] = float(kl.detach())
        if algo.entropy_coef > 0:
            ent_term = entropy_loss(ent.float(), mask, **agg)
            loss = loss - algo.entropy_coef * ent_term
            metrics["entropy_bonus"] = float(ent_term.detach())
        if not math.isfinite(float(loss.detach())):
            metrics["nonfinite_loss"] = 1.0
        return loss, metrics

    def state_for_sync(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.model.state_dict().items()}


class RefComponent:
    """Frozen copy of the initial policy for KL."""

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.model = load_policy_model(ctx).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)

    def compute_ref_logprobs(self, batch: Batch) -> Batch:
        out = batched_logprobs(self.model, batch, micro=self.ctx.plan.micro_batch_size,
                               temperature=gen_temperature(self.ctx), chunk=self.ctx.cfg.actor.logprob_chunk,
                               entropy=False)
        return Batch({"ref_logprobs": out["logprobs"]})
