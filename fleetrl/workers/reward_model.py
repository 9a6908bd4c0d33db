"""Reward-model component: a frozen reward model (scalar head or generative judge) hosted by the workers of the
pool that `cluster.roles.reward_model` names. The controller sends each rank its share of (prompt, response)
texts; the rank returns one score per sample. Nothing here trains, so nothing is checkpointed."""
from __future__ import annotations

from fleetrl import heartbeat
from fleetrl.batch import Batch
from fleetrl.rewards.model import build_scorer
from fleetrl.workers.context import WorkerContext

RM_PROMPT, RM_RESPONSE = "raw_prompt", "response_text"
"""Fields of the Batch the controller sends: the prompt (text or chat messages) and the decoded response."""


class RewardModelComponent:
    def __init__(self, ctx: WorkerContext) -> None:
        assert ctx.cfg.rewards.model is not None  # the Plan activates this role only with rewards.model set
        self.ctx = ctx
        self.scorer = build_scorer(ctx.cfg.rewards.model, ctx.device())

    def score(self, batch: Batch) -> Batch:
        """Batch with fields raw_prompt, response_text -> Batch({rm_scores [B], rm_unparsed [B] 0/1})."""
        heartbeat.beat()
        out = self.scorer.score(list(batch[RM_PROMPT]), [str(r) for r in batch[RM_RESPONSE]])
        return Batch({"rm_scores": out.scores_B, "rm_unparsed": out.unparsed_B.float()})
