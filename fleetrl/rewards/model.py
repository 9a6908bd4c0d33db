"""Scalar reward models: a sequence-classification model with one label reads (prompt, response) as text and its
logit is the score.

The RM gets text, not the policy's token ids: a reward model usually has its own tokenizer and chat template
(e.g. a Skywork or ArmoRM head on a different base than the policy). The pair is rendered through the RM
tokenizer's chat template when it has one (user turn = prompt, assistant turn = response), else joined with a
space. `load_scalar_rm("tiny:...")` builds a seeded random classifier on the tiny tokenizer so tests need no
download.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Protocol, Sequence

import torch
from transformers import AutoModelForSequenceClassification, PreTrainedModel, PreTrainedTokenizerBase

from fleetrl import heartbeat
from fleetrl.config.reward_model import RewardModelConfig
from fleetrl.models import tiny
from fleetrl.models.hf import DTYPES, TINY_PREFIX, _from_pretrained, _parse_tiny, _resolve, load_tokenizer

Prompt = str | Sequence[dict]  # raw text or a list of chat messages {role, content}


class RMScores(NamedTuple):
    """What every reward-model kind returns for B (prompt, response) pairs."""

    scores_B: torch.Tensor
    """[B] float32."""
    unparsed_B: torch.Tensor
    """[B] bool: a judge's verdict held no `score: N` and scored failed_score (always False for a scalar RM)."""


class RewardModel(Protocol):
    """A scalar RM or a judge (rewards/judge.py): B (prompt, response) pairs in, B scores out."""

    def score(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> RMScores: ...


def load_scalar_rm(path: str, *, dtype: str = "float32", trust_remote_code: bool = False) -> PreTrainedModel:
    """An AutoModelForSequenceClassification with one label, in eval mode on CPU."""
    if path.startswith(TINY_PREFIX):
        return build_tiny_rm(**_parse_tiny(path)).to(DTYPES[dtype])
    source, kwargs = _resolve(path)
    model = _from_pretrained(AutoModelForSequenceClassification, "sequence-classification reward model", path,
                             source, trust_remote_code=trust_remote_code, dtype=DTYPES[dtype], **kwargs)
    if model.config.num_labels != 1:
        raise ValueError(f"reward model {path!r} has num_labels={model.config.num_labels}; a scalar reward model "
                         f"has one output (num_labels=1). Use a reward-model checkpoint, or rewards.model.kind=judge "
                         f"for a chat model")
    return model.eval()


def build_tiny_rm(**model_kwargs: Any) -> PreTrainedModel:
    """The tiny test LM's architecture (models/tiny.py) with a one-label classification head, weights seeded."""
    tok = tiny.build_tiny_tokenizer()
    lm = tiny.build_tiny_model(tok, **model_kwargs)
    config = lm.config
    config.num_labels = 1
    cls = {"LlamaConfig": "LlamaForSequenceClassification", "Qwen2Config": "Qwen2ForSequenceClassification"}
    import transformers

    model_cls = getattr(transformers, cls[type(config).__name__])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(model_kwargs.get("seed", 0)))
        model = model_cls(config)
    return model.to(torch.float32).eval()


def load_rm_tokenizer(path: str, *, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    return load_tokenizer(path, trust_remote_code=trust_remote_code)


def prompt_text(prompt: Prompt) -> str:
    """The user-visible text of a prompt: the content of its messages, one per line."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(str(m.get("content", "")) for m in prompt)


def render_pair(tokenizer: PreTrainedTokenizerBase, prompt: Prompt, response: str) -> str:
    """(prompt, response) as the text the RM reads: its chat template over [..prompt messages, assistant
    response], or "prompt response" when it has none."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        return tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": response}], tokenize=False)
    return f"{prompt_text(prompt)} {response}"


def encode_pairs(tokenizer: PreTrainedTokenizerBase, texts: list[str], max_length: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and mask [B, L], L <= max_length; an overlong text keeps its last max_length tokens (the
    response, which is what is being scored)."""
    rows = [tokenizer(t, add_special_tokens=False)["input_ids"][-max_length:] for t in texts]
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r):] = torch.tensor(r)
            mask[i, width - len(r):] = 1
    return ids.to(device), mask.to(device)


class ScalarRewardModel:
    """Scores (prompt, response) pairs with a one-label sequence classifier."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *, max_length: int,
                 micro_batch_size: int, device: torch.device | str = "cpu") -> None:
        self.model, self.tokenizer = model.to(device).eval(), tokenizer
        self.max_length, self.micro = max_length, micro_batch_size
        self.device = torch.device(device)
        if self.model.config.pad_token_id is None:  # HF classifiers find the last real token through the pad id
            self.model.config.pad_token_id = tokenizer.pad_token_id

    @torch.no_grad()
    def score(self, prompts: Sequence[Prompt], responses: Sequence[str]) -> RMScores:
        """The logit of each pair."""
        texts = [render_pair(self.tokenizer, p, r) for p, r in zip(prompts, responses)]
        out = []
        for i in range(0, len(texts), self.micro):
            heartbeat.beat()  # progress for the watchdog's stall check (cluster.stall_s)
            ids, mask = encode_pairs(self.tokenizer, texts[i:i + self.micro], self.max_length, self.device)
            pos = (mask.cumsum(-1) - 1).clamp(min=0)  # left padding: positions start at each row's first token
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
            out.append(logits[:, 0].float().cpu())
        scores = torch.cat(out) if out else torch.zeros(0)
        return RMScores(scores, torch.zeros(len(scores), dtype=torch.bool))


def build_scorer(cfg: RewardModelConfig, device: torch.device) -> RewardModel:
    """The scorer `cfg.kind` names, loaded on `device` (the reward_model role and `fleetrl serve-reward --model`)."""
    tokenizer = load_rm_tokenizer(cfg.tokenizer or cfg.path, trust_remote_code=cfg.trust_remote_code)
    if cfg.kind == "judge":
        from fleetrl.models.hf import load_causal_lm
        from fleetrl.rewards.judge import JudgeRewardModel

        model = load_causal_lm(cfg.path, dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code,
                               key="rewards.model.path")
        return JudgeRewardModel(model, tokenizer, template=cfg.template, max_length=cfg.max_length,
                                max_new_tokens=cfg.max_new_tokens, micro_batch_size=cfg.micro_batch_size,
                                score_scale=cfg.score_scale, failed_score=cfg.failed_score, device=device)
    model = load_scalar_rm(cfg.path, dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code)
    return ScalarRewardModel(model, tokenizer, max_length=cfg.max_length, micro_batch_size=cfg.micro_batch_size,
                             device=device)


def pick_device() -> torch.device:
    """The first GPU when there is one (a reward server started outside Ray), else CPU."""
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
