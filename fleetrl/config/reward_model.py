"""Config of the reward-model role (`rewards.model`) and of how its scores combine with rule rewards
(`rewards.combine`). Checked once by `check_reward_model`, which the Plan calls."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from fleetrl.config.schema import RewardsConfig

DEFAULT_JUDGE_TEMPLATE = (
    "Rate the response to the prompt from 0 (wrong) to 10 (perfect).\n"
    "Prompt: {prompt}\nResponse: {response}\nEnd with a line 'score: N'.\n"
)
COMBINE_DEFAULT = "default"


@dataclass(frozen=True, kw_only=True)
class RewardModelConfig:
    """A neural reward model placed as role `reward_model` (cluster.roles), data-parallel over its pool."""

    path: str
    """HF folder, hub id or `tiny:` (a random tiny model for tests). scalar: a sequence-classification model
    (AutoModelForSequenceClassification, one label); judge: a causal LM."""
    kind: Literal["scalar", "judge"] = "scalar"
    """scalar: the model's single logit is the score; judge: the model writes a verdict that is parsed."""
    tokenizer: str | None = None
    """Defaults to `path`. The RM reads text, so it need not share the policy's tokenizer."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    trust_remote_code: bool = False
    max_length: int = 1024
    """Tokens of (prompt, response) the RM reads; longer inputs keep their END (the response) and lose the
    prompt's beginning."""
    micro_batch_size: int = 8
    """Samples per forward pass on one RM worker."""
    template: str = DEFAULT_JUDGE_TEMPLATE
    """judge: the prompt, with `{prompt}` and `{response}` filled in (applied through the judge's chat template
    when it has one)."""
    max_new_tokens: int = 32
    """judge: verdict length."""
    score_scale: float = 0.1
    """judge: the parsed number is multiplied by this (a 0-10 verdict becomes 0-1)."""
    failed_score: float = 0.0
    """judge: score of a verdict with no parsable `score: N` (counted in train/rm_unparsed)."""
    normalize: bool = False
    """Standardise RM scores by a running mean/std over all scores seen so far (checkpointed) before combining."""


@dataclass(frozen=True, kw_only=True)
class CombineWeights:
    """score = rule × rule_score + model × rm_score, for one data_source."""

    rule: float = 1.0
    model: float = 1.0


def check_reward_model(rewards: RewardsConfig) -> None:
    """Raises ConfigError naming the field and the fix."""
    from fleetrl.config.load import ConfigError

    m = rewards.model
    if m is None:
        used = sorted(k for k, w in rewards.combine.items() if w.model != 0)
        if used:
            raise ConfigError(f"rewards.combine gives model weight != 0 for {used} but rewards.model is not set; "
                              f"set rewards.model.path (and cluster.roles.reward_model) or drop rewards.combine")
        return
    if not m.path.strip():
        raise ConfigError("rewards.model.path is empty; give an HF folder, a hub id or `tiny:`")
    for key in ("max_length", "micro_batch_size", "max_new_tokens"):
        if getattr(m, key) < 1:
            raise ConfigError(f"rewards.model.{key} must be >= 1, got {getattr(m, key)}")
    if m.kind == "judge":
        missing = [f for f in ("{prompt}", "{response}") if f not in m.template]
        if missing:
            raise ConfigError(f"rewards.model.template must contain {' and '.join(missing)} (where the prompt and "
                              f"the response go), got {m.template!r}")
    for source, w in rewards.combine.items():
        if w.rule == 0 and w.model == 0:
            raise ConfigError(f"rewards.combine.{source}: rule and model weights are both 0, so every sample would "
                              f"score 0; give one a non-zero weight (e.g. model: 1 for RM-only)")


def combine_weights(rewards: RewardsConfig, source: str) -> CombineWeights:
    """The weights of `source`: its own entry, else `default`, else rule + model (both 1)."""
    return rewards.combine.get(source) or rewards.combine.get(COMBINE_DEFAULT) or CombineWeights()
