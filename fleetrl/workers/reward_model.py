"""Reward-model component: a frozen reward model (scalar head or generative judge) hosted by the workers of the
pool that `cluster.roles.reward_model` names. The controller sends each rank its share of (prompt, response)
texts; the rank returns one score per sample. Nothing here trains, so nothing is checkpointed."""
from __future__ import annotations

import torch

from fleetrl import heartbeat
from fleetrl.batch import Batch
from fleetrl.config.reward_model import RewardModelConfig
from fleetrl.rewards.model import load_rm_tokenizer
from fleetrl.workers.context import WorkerContext

RM_PROMPT, RM_RESPONSE = "raw_prompt", "response_text"
"""Fields of the Batch the controller sends: the prompt (text or chat messages) and the decoded response."""


def build_scorer(cfg: RewardModelConfig, device: torch.device):  # noqa: ANN201 (ScalarRewardModel | JudgeRewardModel)
    """The scorer `cfg.kind` names, loaded on `device` (also used by `fleetrl serve-reward --reward-model`)."""
    tokenizer = load_rm_tokenizer(cfg.tokenizer or cfg.path, trust_remote_code=cfg.trust_remote_code)
    if cfg.kind == "judge":
        from fleetrl.models.hf import load_causal_lm
        from fleetrl.rewards.judge import JudgeRewardModel

        model = load_causal_lm(cfg.path, dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code)
        return JudgeRewardModel(model, tokenizer, template=cfg.template, max_length=cfg.max_length,
                                max_new_tokens=cfg.max_new_tokens, micro_batch_size=cfg.micro_batch_size,
                                score_scale=cfg.score_scale, failed_score=cfg.failed_score, device=device)
    from fleetrl.rewards.model import ScalarRewardModel, load_scalar_rm

    model = load_scalar_rm(cfg.path, dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code)
    return ScalarRewardModel(model, tokenizer, max_length=cfg.max_length, micro_batch_size=cfg.micro_batch_size,
                             device=device)


def score_texts(scorer, prompts: list, responses: list[str]) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """[B] scores and [B] float 0/1: the judge's verdict could not be parsed (always 0 for a scalar RM)."""
    out = scorer.score(prompts, responses)
    if isinstance(out, tuple):  # a judge also says which verdicts it could not parse
        return out[0], out[1].float()
    return out, torch.zeros(len(out))


class RewardModelComponent:
    def __init__(self, ctx: WorkerContext) -> None:
        assert ctx.cfg.rewards.model is not None  # the Plan activates this role only with rewards.model set
        self.ctx = ctx
        self.scorer = build_scorer(ctx.cfg.rewards.model, ctx.device())

    def score(self, batch: Batch) -> Batch:
        """Batch with fields raw_prompt, response_text -> Batch({rm_scores [B], rm_unparsed [B] 0/1})."""
        heartbeat.beat()
        scores, unparsed = score_texts(self.scorer, list(batch[RM_PROMPT]), [str(r) for r in batch[RM_RESPONSE]])
        return Batch({"rm_scores": scores, "rm_unparsed": unparsed})
