"""What a run reads before any worker exists: the prompt feeds and the reward scorer. Built once before Ray starts,
so a bad data file, an unknown data_source or a reward server that is down fail in seconds, with no run
directory left behind."""
from __future__ import annotations

from dataclasses import dataclass

from fleetrl.config.plan import Plan
from fleetrl.rewards.scorer import RewardScorer
from fleetrl.trainer.feed import PromptFeed


@dataclass
class RunInputs:
    train: PromptFeed
    val: PromptFeed | None
    scorer: RewardScorer

    @classmethod
    def load(cls, plan: Plan) -> "RunInputs":
        train = PromptFeed.for_train(plan)
        val = PromptFeed.for_val(plan, train.tokenizer)
        scorer = RewardScorer(plan.config, train.tokenizer)
        try:
            scorer.check_sources(train.data_sources() | (val.data_sources() if val else set()))
        except BaseException:
            scorer.close()
            raise
        return cls(train=train, val=val, scorer=scorer)
