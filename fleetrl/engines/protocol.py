"""The rollout-engine protocol every engine implements (`hf`, `fast`, adapters).

An engine turns a batch of left-padded prompts into right-padded responses with, for every sampled token,
the log-probability the engine sampled it with (after temperature/top-p/top-k filtering is NOT applied to the
reported logprob: it is log softmax(logits / temperature) at the sampled id, the quantity the trainer's
forward pass recomputes, so the two can be compared token by token).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Protocol, runtime_checkable

import torch

FINISH_STOP = "stop"      # EOS, a stop token or a stop string
FINISH_LENGTH = "length"  # hit max_new_tokens


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """Per-call sampling settings; `n` copies are made by the caller (Batch.repeat_interleave)."""

    max_new_tokens: int = 64
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    stop_token_ids: tuple[int, ...] = ()  # in addition to the tokenizer's EOS
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None  # generator seed for this call; None = engine's running generator
    max_new_tokens_per_sample: torch.Tensor | None = field(default=None, compare=False)
    """[B] integer tensor, each sample's own limit in 1..max_new_tokens (None: max_new_tokens for all). A sample
    that reaches it finishes with FINISH_LENGTH. The fast engine stops that slot there (and refills it with a
    waiting prompt, or moves the live slots into a smaller decode batch); the hf engine generates to the largest
    limit and cuts each sample afterwards (the same tokens, faster only when every limit is below max_new_tokens)."""


def response_limits(params: SamplingParams, batch: int) -> torch.Tensor:
    """[batch] long: each sample's max new tokens, validated (ValueError naming the field)."""
    limits = params.max_new_tokens_per_sample
    if limits is None:
        return torch.full((batch,), params.max_new_tokens, dtype=torch.long)
    if limits.shape != (batch,) or limits.dtype.is_floating_point or limits.dtype == torch.bool:
        raise ValueError(f"SamplingParams.max_new_tokens_per_sample must be an integer tensor of shape [{batch}] "
                         f"(one limit per prompt of the call); got {limits.dtype} of shape {tuple(limits.shape)}")
    limits = limits.detach().cpu().long()
    bad = ((limits < 1) | (limits > params.max_new_tokens)).nonzero().flatten()
    if len(bad):
        i = int(bad[0])
        raise ValueError(f"SamplingParams.max_new_tokens_per_sample[{i}] = {int(limits[i])} is outside "
                         f"1..max_new_tokens={params.max_new_tokens} ({len(bad)} of {batch} samples are); raise "
                         "max_new_tokens or clamp the limits")
    return limits


@dataclass
class GenerationOutput:
    """Right-padded responses [B, R] where R = longest response in this call (<= max_new_tokens).

    response_mask is 1 up to and including the finishing token (EOS/stop token) and 0 after it, exactly.
    logprobs are 0 where the mask is 0. finish_reasons is FINISH_STOP or FINISH_LENGTH per sample.
    """

    responses: torch.Tensor       # [B, R] long
    response_mask: torch.Tensor   # [B, R] long (0/1)
    logprobs: torch.Tensor        # [B, R] float32
    finish_reasons: list[str] = field(default_factory=list)


@runtime_checkable
class RolloutEngine(Protocol):
    weights_version: int

    def generate(self, prompts: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams) -> GenerationOutput:
        """prompts/prompt_mask: [B, P] left-padded."""
        ...

    def load_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Copies named weights in and records `version` (the weights version the trainer published)."""
        ...

    def sleep(self) -> None:
        """Frees what the engine holds beyond the weights (KV cache, graphs); may move weights off device."""
        ...

    def wake(self) -> None:
        ...
