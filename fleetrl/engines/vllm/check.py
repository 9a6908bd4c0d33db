"""The check after every weight sync: does vLLM now compute what the trainer computes?

vLLM holds its own copy of the weights (its own layout: fused qkv / gate-up, maybe another dtype or TP shards), so
a sync can go wrong in ways the trainer never sees: a name that maps nowhere, a shard loaded twice, a stale prefix
cache. After each sync the engine scores one fixed probe sequence both ways, vLLM's prompt log-probs against the
trainer model's forward, and compares the largest gap with the gap recorded at the first sync (the baseline: the
two implementations' honest rounding difference, ~1e-6 in fp32, ~1e-2 in bf16). A gap beyond baseline + tol is
an error, not a warning: training on samples from other weights than the trainer's is silently off-policy.
"""
from __future__ import annotations

import torch
from torch import nn

from fleetrl.engines.sync_check import PROBE_SEED  # the probe's token ids depend only on it and the vocabulary size


class VLLMSyncError(RuntimeError):
    """vLLM's log-probs after a sync do not match the trainer's: the sync (not the model) is wrong."""


def probe_tokens(vocab_size: int, length: int) -> list[int]:
    """`length` token ids drawn from the vocabulary by a fixed generator (the same probe at every sync)."""
    g = torch.Generator().manual_seed(PROBE_SEED)
    return torch.randint(0, vocab_size, (length,), generator=g).tolist()


@torch.no_grad()
def trainer_logprobs(model: nn.Module, tokens: list[int]) -> torch.Tensor:
    """[len(tokens) - 1] float32: log softmax(logits) of tokens[1:] from one forward of the trainer's model."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        ids = torch.tensor([tokens], device=device)
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, :-1].float()
    finally:
        model.train(was_training)
    return torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0].cpu()


def prompt_logprobs(entries: list[dict | None], tokens: list[int]) -> torch.Tensor:
    """[len(tokens) - 1] float32 from vLLM's prompt_logprobs (entry 0 is None: the first token has no context)."""
    return torch.tensor([float(entries[i][t].logprob) for i, t in enumerate(tokens) if i > 0], dtype=torch.float32)


def check_gap(gap: float, baseline: float, tol: float, version: int, tokens: int) -> None:
    """Raises VLLMSyncError when the gap exceeds baseline + tol (see the module docstring)."""
    if gap > baseline + tol:
        raise VLLMSyncError(
            f"vLLM weight sync to version {version} is wrong: vLLM's log-probs differ from the trainer's by up to "
            f"{gap:.4g} on the {tokens}-token probe, beyond the baseline gap {baseline:.4g} + tolerance {tol:g} "
            "(rollout.vllm.sync_check_tol); the weights vLLM now holds are not the trainer's. Check that the "
            "state's names match the model vLLM built, or raise the tolerance if the baseline itself is noisy")
