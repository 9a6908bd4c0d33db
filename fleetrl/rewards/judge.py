"""Generative judge: an LLM is prompted with a template holding (prompt, response), writes a verdict, and the
verdict's LAST `score: N` is the score (× score_scale). Generation is greedy through the rollout engine code
(engines/hf.py), so a verdict is a deterministic function of the judge's weights and its input.

Why the last match: judges that reason first ("... a score: 3 would be too low ... score: 8") state their final
number at the end, and a template's own example line comes before the verdict.
"""
from __future__ import annotations

import re
from typing import Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fleetrl.engines.hf import HFRolloutEngine
from fleetrl.engines.protocol import SamplingParams
from fleetrl.rewards.model import Prompt, RMScores, encode_pairs, prompt_text

_SCORE = re.compile(r"score\s*[:=]\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)


def parse_verdict(text: str) -> float | None:
    """The number of the last `score: N` (or `score = N`, any case) in `text`; None when there is none."""
    found = _SCORE.findall(text)
    return float(found[-1]) if found else None


def fill_template(template: str, prompt: Prompt, response: str) -> str:
    # str.replace, not str.format: prompts and responses (code, LaTeX) are full of braces.
    return template.replace("{prompt}", prompt_text(prompt)).replace("{response}", response)


class JudgeRewardModel:
    """Scores (prompt, response) pairs by a causal LM's parsed verdict."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *, template: str,
                 max_length: int, max_new_tokens: int, micro_batch_size: int, score_scale: float,
                 failed_score: float, device: torch.device | str = "cpu") -> None:
        self.engine = HFRolloutEngine(model, tokenizer, device=device)
        self.tokenizer, self.template = tokenizer, template
        self.max_length, self.max_new_tokens, self.micro = max_length, max_new_tokens, micro_batch_size
        self.scale, self.failed = score_scale, failed_score

    def judge_prompt(self, prompt: Prompt, response: str) -> str:
        text = fill_template(self.template, prompt, response)
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                      add_generation_prompt=True)
        return text

    def verdicts(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> list[str]:
        """The judge's greedy verdict text for each pair."""
        texts = [self.judge_prompt(p, r) for p, r in zip(prompts, responses)]
        params = SamplingParams(max_new_tokens=self.max_new_tokens, temperature=0.0)
        out: list[str] = []
        for i in range(0, len(texts), self.micro):
            ids, mask = encode_pairs(self.tokenizer, texts[i:i + self.micro], self.max_length, torch.device("cpu"))
            gen = self.engine.generate(ids, mask, params)
            out += [self.tokenizer.decode(r[m.bool()].tolist(), skip_special_tokens=True)
                    for r, m in zip(gen.responses, gen.response_mask)]
        return out

    def score(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> RMScores:
        """Parsed verdicts × score_scale; failed_score where a verdict has no `score: N`."""
        parsed = [parse_verdict(v) for v in self.verdicts(prompts, responses)]
        scores = [self.failed if p is None else p * self.scale for p in parsed]
        return RMScores(torch.tensor(scores, dtype=torch.float32), torch.tensor([p is None for p in parsed]))
