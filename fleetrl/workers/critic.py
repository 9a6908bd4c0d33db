"""Critic: the policy's backbone with a scalar value head, trained on GAE returns."""
from __future__ import annotations

import torch

from fleetrl.algo import value_loss
from fleetrl.batch import Batch
from fleetrl.engines.training import DistInfo, TrainingEngine
from fleetrl.models.logprobs import build_inputs
from fleetrl.models.value_head import build_critic
from fleetrl.workers.actor import load_policy_model, micro_batches, optimizer_steps, pad_response, run_update
from fleetrl.workers.context import WorkerContext


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
                                     total_optimizer_steps=optimizer_steps(ctx), device=ctx.device(),
                                     sharded=ctx.cfg.critic.sharding == "fsdp2")

    @torch.no_grad()
    def compute_values(self, batch: Batch) -> Batch:
        self.model.eval()
        out = [pad_response(response_values(self.model, mb.to(self.ctx.device())).cpu(),
                            mb.meta.get("full_response_len", mb["responses"].shape[1]))
               for mb in micro_batches(batch, self.ctx.plan.micro_batch_size)]
        return Batch({"values": torch.cat(out)})

    def update(self, batch: Batch) -> dict[str, float]:
        return run_update(self.engine, batch, self.ctx, self._loss, "critic")

    def _loss(self, mb: Batch, counts: dict) -> tuple[torch.Tensor, dict[str, float]]:
        mb = mb.to(self.ctx.device())
        mask = mb["response_mask"].float()
        values = response_values(self.model, mb)
        # Value loss always averages over tokens: the policy's loss_agg choice is about the policy gradient.
        loss, m = value_loss(values, mb["values"], mb["returns"], mask, clip=self.ctx.cfg.algorithm.value_clip,
                             agg="token-mean", **counts)
        share = float(mask.sum()) / max(float(counts["num_tokens"]), 1.0)
        return loss, {"vf_loss": float(loss.detach()), **{k: float(v) * share for k, v in m.items()}}
