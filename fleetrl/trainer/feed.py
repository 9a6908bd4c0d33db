"""Controller-side data: datasets, the resumable sampler, and collated prompt batches."""
from __future__ import annotations

from typing import Any

import fleetrl.data.tasks  # noqa: F401  (registers the built-in synthetic tasks)
from fleetrl.batch import Batch
from fleetrl.config.plan import Plan
from fleetrl.config.schema import RunConfig
from fleetrl.data.collate import collate
from fleetrl.data.mixture import MixtureDataset, load_dataset
from fleetrl.models.hf import load_run_tokenizer


class PromptFeed:
    def __init__(self, cfg: RunConfig, spec: Any, tokenizer: Any, *, seed: int, shuffle: bool,
                 key: str = "data.train") -> None:
        d = cfg.data
        self.tokenizer = tokenizer
        self.dataset: MixtureDataset = load_dataset(
            spec, tokenizer, weights=d.weights, key=key, input_key=d.input_key, label_key=d.label_key,
            default_data_source=d.default_data_source, max_prompt_length=d.max_prompt_length,
            apply_chat_template=d.apply_chat_template)
        self.sampler = self.dataset.make_sampler(seed=seed, shuffle=shuffle)

    @classmethod
    def for_train(cls, plan: Plan, tokenizer: Any = None) -> PromptFeed:
        cfg = plan.config
        return cls(cfg, cfg.data.train, tokenizer or _tokenizer(cfg), seed=plan.seed("sampler"),
                   shuffle=cfg.data.shuffle)

    @classmethod
    def for_val(cls, plan: Plan, tokenizer: Any = None) -> PromptFeed | None:
        cfg = plan.config
        if cfg.data.val is None:
            return None
        return cls(cfg, cfg.data.val, tokenizer or _tokenizer(cfg), seed=plan.seed("sampler"), shuffle=False,
                   key="data.val")

    @property
    def pad_id(self) -> int:
        return int(self.tokenizer.pad_token_id)

    def next_batch(self, size: int) -> Batch:
        return self.dataset.next_batch(self.sampler, size, self.pad_id)

    def collate(self, keys: list[tuple[str, int]]) -> Batch:
        """The prompts of (task, index) keys the sampler drew (the async pipeline draws first, then collates)."""
        return collate([self.dataset[k] for k in keys], self.pad_id)

    def all_batches(self, size: int, limit: int | None = None) -> list[Batch]:
        """Every prompt once, in order (validation)."""
        keys = [(t, i) for t, d in self.dataset.datasets.items() for i in range(len(d))]
        if limit is not None:
            keys = keys[:limit]
        return [collate([self.dataset[k] for k in keys[j:j + size]], self.pad_id) for j in range(0, len(keys), size)]

    def data_sources(self) -> set[str]:
        return set(self.dataset.data_sources)


def _tokenizer(cfg: RunConfig) -> Any:
    return load_run_tokenizer(cfg.model)


def count_train_prompts(cfg: RunConfig) -> int:
    """The training set's size (the Plan needs it in epoch mode); the prompts are read as training reads them."""
    return len(PromptFeed(cfg, cfg.data.train, _tokenizer(cfg), seed=0, shuffle=False).dataset)
