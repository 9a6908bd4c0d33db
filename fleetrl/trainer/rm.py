"""Controller side of the reward_model role: send each sample's (prompt, response) text to the RM pool, then
combine the RM scores with the rule rewards per data_source (rewards/combine.py).

Validation keeps scoring with the rule scorers only: held-out success is measured against the ground truth,
never against the model being optimised for (a policy that games the RM shows up there).
"""
from __future__ import annotations

import torch

from fleetrl.batch import Batch
from fleetrl.cluster.group import WorkerGroup
from fleetrl.config.reward_model import combine_weights
from fleetrl.config.schema import RunConfig
from fleetrl.rewards.combine import RunningNorm, combine_scores
from fleetrl.workers.reward_model import RM_PROMPT, RM_RESPONSE
from fleetrl.workers.worker import Worker


class ModelRewards:
    def __init__(self, cfg: RunConfig) -> None:
        assert cfg.rewards.model is not None
        self.rewards = cfg.rewards
        self.norm = RunningNorm() if cfg.rewards.model.normalize else None

    def request(self, batch: Batch, responses: list[str]) -> Batch:
        """What the RM workers get: masks (only for balancing the split by tokens) and the two texts."""
        return Batch({"prompt_mask": batch["prompt_mask"], "response_mask": batch["response_mask"]},
                     {RM_PROMPT: batch[RM_PROMPT], RM_RESPONSE: responses})

    def score(self, batch: Batch, rule_B: torch.Tensor, responses: list[str], group: WorkerGroup,
              stats: dict[str, float]) -> torch.Tensor:
        """[B] combined scores; adds rm_score_mean/std (raw), rule_score_mean and rm_unparsed to `stats`."""
        out = group.call_split(Worker.score_rm, self.request(batch, responses))
        return self.combine(batch, rule_B, out["rm_scores"], out["rm_unparsed"], stats)

    def combine(self, batch: Batch, rule_B: torch.Tensor, rm_B: torch.Tensor, unparsed_B: torch.Tensor,
                stats: dict[str, float]) -> torch.Tensor:
        stats["rm_score_mean"] = float(rm_B.mean())
        stats["rm_score_std"] = float(rm_B.std(unbiased=False))
        stats["rule_score_mean"] = float(rule_B.float().mean())
        stats["rm_unparsed"] = float(unparsed_B.sum())
        model_B = self.norm.normalize(rm_B) if self.norm is not None else rm_B
        return combine_scores(rule_B, model_B, list(batch["data_source"]),
                              lambda s: combine_weights(self.rewards, s))

    def state(self) -> dict:
        """The controller parts to checkpoint (the running normaliser, when on)."""
        return {"rm_norm": self.norm} if self.norm is not None else {}
