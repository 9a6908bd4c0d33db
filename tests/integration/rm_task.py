"""A tiny scalar-head reward model trained in seconds to prefer correct answers of the synthetic copy task
(`copy a b 7 =` -> `7`), saved as an HF folder that `rewards.model.path` loads like any checkpoint."""
from __future__ import annotations

import random
from pathlib import Path

import torch

from fleetrl.data.tasks import copy_task
from fleetrl.models.tiny import DEFAULT_WORDS, build_tiny_tokenizer
from fleetrl.rewards.model import build_tiny_rm, encode_pairs, render_pair

_WORDS = [*DEFAULT_WORDS, ""]  # digits first


def _pair(row: dict, rng: random.Random, tok, hard: float = 0.5) -> tuple[str, float]:  # noqa: ANN001
    """A one-word answer (the learning test samples one token): right half the time, else a wrong digit with
    probability `hard` (an RM that only checks "a digit" is what a policy learns to exploit), else any other
    word or nothing (special tokens decode to "")."""
    gt = row["reward_model"]["ground_truth"]
    if rng.random() < 0.5:
        return render_pair(tok, row["prompt"], gt), 1.0
    wrong = [w for w in (_WORDS[:10] if rng.random() < hard else _WORDS) if w != gt]
    return render_pair(tok, row["prompt"], rng.choice(wrong)), 0.0


def _logits(rm: torch.nn.Module, tok, texts: list[str]) -> torch.Tensor:  # noqa: ANN001
    ids, mask = encode_pairs(tok, texts, 64, torch.device("cpu"))
    return rm(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits[:, 0]


def train_copy_rm(out: Path, *, steps: int = 800, seed: int = 0) -> tuple[Path, float, float]:
    """Trains with BCE on balanced good/bad pairs; returns the saved folder, the accuracy on held-out prompts
    against wrong-digit answers (the hard case), and the held-out top-1: how often the RM's best-scored answer
    among every one-word answer is the right one, which bounds what a policy trained on it reaches.

    The learning rate decays linearly to 0: at a constant 3e-3 the top-1 swung between 0.88 and 1.0 from one
    hundred steps to the next, and where the run stopped decided it (0.95 after 700 steps on one CPU host, 0.915 on
    another, where the policy then plateaued at 75%). With the decay it holds at 1.0 from step 300 (AVX-512) or
    500 (AVX2 kernels) on."""
    tok = build_tiny_tokenizer()
    rm = build_tiny_rm(hidden_size=64, seed=seed).train()
    rng = random.Random(seed)
    rows = copy_task(n=1000, split="train")
    opt = torch.optim.Adam(rm.parameters(), lr=3e-3)
    decay = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 - step / steps)
    for _ in range(steps):
        batch = [_pair(rng.choice(rows), rng, tok) for _ in range(64)]
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            _logits(rm, tok, [t for t, _ in batch]), torch.tensor([y for _, y in batch]))
        opt.zero_grad()
        loss.backward()
        opt.step()
        decay.step()
    rm.eval()
    held_out = [_pair(r, rng, tok, hard=1.0) for r in copy_task(n=200, split="val")]  # wrong digits only
    with torch.no_grad():
        pred = _logits(rm, tok, [t for t, _ in held_out]) > 0
    accuracy = float((pred == torch.tensor([y > 0 for _, y in held_out])).float().mean())
    rm.save_pretrained(out)
    tok.save_pretrained(out)
    return out, accuracy, _top1(rm, tok, copy_task(n=200, split="val"))


@torch.no_grad()
def _top1(rm: torch.nn.Module, tok, rows: list[dict]) -> float:  # noqa: ANN001
    right = 0
    for row in rows:
        scores = _logits(rm, tok, [render_pair(tok, row["prompt"], w) for w in _WORDS])
        right += _WORDS[int(scores.argmax())] == row["reward_model"]["ground_truth"]
    return right / len(rows)
