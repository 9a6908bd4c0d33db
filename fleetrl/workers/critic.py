"""Critic: the policy's backbone with a scalar value head, trained on GAE returns."""
from __future__ import annotations

import torch

from fleetrl.algo import value_loss
from fleetrl.batch import Batch
from fleetrl.engines.training import DistInfo, TrainingEngine
from fleetrl.models.logprobs import build_inputs
from fleetrl.models.value_head import build_critic
from fleetrl.workers.actor import load_policy_model
from fleetrl.workers.context import WorkerContext
from fleetrl.workers.layout import micro_batches, pad_response
from fleetrl.workers.messages import MiniBatchCounts, UpdateMetrics, UpdateSpec
from fleetrl.workers.update import run_update


def response_values(critic: torch.nn.Module, mb: Batch) -> torch.Tensor:
    """V(s_t) for each response token t: the value read at the position that predicts token t."""
    ids, attn, pos = build_inputs(mb["prompts"], mb["prompt_mask"], mb["responses"], mb["response_mask"])
    values = critic(ids, attn, pos)  # [B, P+R]
    p, r = mb["prompts"].shape[1], mb["responses"].shape[1]
    return values[:, p - 1: p - 1 + r].float() * mb["response_mask"].float()


class CriticComponent:
    def __init__(self, ctx: WorkerContext, dist_info: DistInfo) -> None:
        self.ctx = ctx
        self.model = build_critic(load_policy_model(ctx)).to(ctx.device())
        self.engine = TrainingEngine(self.model, ctx.cfg.critic.optim, dist_info=dist_info,
                                     total_optimizer_steps=ctx.plan.critic_optimizer_steps, device=ctx.device(),
                                     sharded=ctx.sharded("critic"))

    @torch.no_grad()
    def compute_values(self, batch: Batch) -> Batch:
        self.model.eval()
        full_r = batch["responses"].shape[1]  # trimmed micro-batches padded back to the batch's width
        out = [pad_response(response_values(self.model, mb.to(self.ctx.device())).cpu(), full_r)
               for mb in micro_batches(batch, self.ctx.plan.micro_batch_size)]
        return Batch({"values": torch.cat(out)})

    def update(self, batch: Batch, spec: UpdateSpec) -> UpdateMetrics:
        return run_update(self.engine, batch, spec, epochs=self.ctx.cfg.algorithm.ppo_epochs,
                          micro_batch_size=self.ctx.plan.micro_batch_size, prefix="critic",
                          loss_fn=lambda mb, counts: self._loss(mb, counts, spec))

    def _loss(self, mb: Batch, counts: MiniBatchCounts, spec: UpdateSpec) -> tuple[torch.Tensor, dict[str, float]]:
        mb = mb.to(self.ctx.device())
        mask = mb[spec.loss_mask].float()  # environment tokens (rollout.env) are not the policy's states
        values = response_values(self.model, mb)
        # Value loss always averages over tokens: the policy's loss_agg choice is about the policy gradient.
        loss, m = value_loss(values, mb["values"], mb["returns"], mask, clip=self.ctx.cfg.algorithm.value_clip,
                             agg="token-mean", num_tokens=counts.num_tokens, num_seqs=counts.num_seqs,
                             norm_len=counts.norm_len)
        share = float(mask.sum()) / max(counts.num_tokens, 1.0)
        return loss, {"critic/vf_loss": float(loss.detach()), **{f"critic/{k}": float(v) * share for k, v in m.items()}}
