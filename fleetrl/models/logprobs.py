"""Per-token log-probabilities of responses under a causal LM: the one function the engines and the trainer share.

Layout: prompts [B, P] left-padded, responses [B, R] right-padded (see fleetrl/batch.py). Concatenated, every
row's prompt ends at column P-1 and its response starts at column P, so the logits that predict response
token r sit at column P-1+r for every row: one slice, no per-row gather.
"""
from __future__ import annotations

import inspect
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from fleetrl.algo.losses import entropy_from_logits

# Config attributes that transform logits after the LM head; the chunked path applies the head itself and
# would silently skip them.
_LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")

EntropyMode = bool | Literal["metric"]
"""False: no entropy; True: differentiable entropy (an entropy bonus in the loss); "metric": detached entropy,
computed without an autograd graph (the entropy metric of an update whose loss has no entropy term)."""


def build_inputs(
    prompts_BP: torch.Tensor, prompt_mask_BP: torch.Tensor, responses_BR: torch.Tensor, response_mask_BR: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (input_ids, attention_mask, position_ids), each [B, P+R].

    position_ids count real tokens only (cumsum(mask) - 1), so a left-padded prompt starts at position 0 as it
    would unpadded; pad slots get 0 (their value is irrelevant: they are masked as keys and ignored as queries).
    """
    input_ids = torch.cat([prompts_BP, responses_BR], dim=1)
    attention_mask = torch.cat([prompt_mask_BP, response_mask_BR], dim=1).long()
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return input_ids, attention_mask, position_ids


def sequence_logprobs(
    model: nn.Module,
    prompts_BP: torch.Tensor,
    prompt_mask_BP: torch.Tensor,
    responses_BR: torch.Tensor,
    response_mask_BR: torch.Tensor,
    *,
    temperature: float = 1.0,
    return_entropy: EntropyMode = False,
    chunk_size: int | None = None,
    share_prompts: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / temperature) at each response token, [B, R] float32; 0 where response_mask is 0.

    Also returns the entropy of that distribution per response token ([B, R], 0 where masked) when
    `return_entropy` (True: differentiable, for an entropy bonus; "metric": detached and cheaper). With `chunk_size`, the LM head and log-softmax run over `chunk_size` response positions
    at a time (B x chunk x V fp32 at most); under autograd each chunk is checkpointed so its logits are
    recomputed in backward instead of kept. Without it, the model's own forward produces all logits at once.
    With `share_prompts` (chunked path only), rows with the same prompt run it once (`_shared_prompt_hidden`).
    Differentiable; call under torch.no_grad() for rollouts.
    """
    if temperature <= 0:
        raise ValueError(f"sequence_logprobs: temperature must be > 0, got {temperature} (greedy rollouts report "
                         "logprobs at temperature 1.0)")
    if chunk_size is not None and chunk_size <= 0:
        raise ValueError(f"sequence_logprobs: chunk_size must be a positive int or None, got {chunk_size}")
    P, R = prompts_BP.shape[1], responses_BR.shape[1]
    if P == 0:
        raise ValueError("sequence_logprobs: prompts have width 0; every sample needs at least one prompt token "
                         "(e.g. BOS) to condition the first response token on")
    mask = response_mask_BR.to(torch.float32)
    if R == 0:
        return torch.zeros_like(mask), (torch.zeros_like(mask) if return_entropy else None)
    input_ids, attention_mask, position_ids = build_inputs(prompts_BP, prompt_mask_BP, responses_BR, response_mask_BR)
    if chunk_size is None:
        logits = _full_logits(model, input_ids, attention_mask, position_ids, R)
        logp_BR, entropy_BR = _chunk_stats(logits, responses_BR, None, temperature, return_entropy)
    else:
        hidden = (_shared_prompt_hidden(model, prompts_BP, prompt_mask_BP, responses_BR, attention_mask, position_ids)
                  if share_prompts else _response_hidden(model, input_ids, attention_mask, position_ids, P, R))
        logp_BR, entropy_BR = head_stats(hidden, responses_BR, _lm_head(model), temperature, return_entropy,
                                         chunk_size)
    return logp_BR * mask, (entropy_BR * mask if return_entropy else None)


def head_stats(hidden_BRH: torch.Tensor, responses_BR: torch.Tensor, head: nn.Module, temperature: float,
               return_entropy: EntropyMode, chunk_size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """logp, entropy [B, R] of `responses_BR` from the hidden states that predict them, through `head`.

    With `chunk_size`, `chunk_size` positions at a time, each chunk checkpointed under autograd so its logits are
    recomputed in backward instead of kept; None = one chunk (logits [B, R, V] kept for backward)."""
    R = responses_BR.shape[1]
    if chunk_size is None:
        return _chunk_stats(hidden_BRH, responses_BR, head, temperature, return_entropy)
    pieces = []
    for start in range(0, R, chunk_size):
        args = (hidden_BRH[:, start:start + chunk_size], responses_BR[:, start:start + chunk_size], head,
                temperature, return_entropy)
        pieces.append(checkpoint(_chunk_stats, *args, use_reentrant=False) if torch.is_grad_enabled()
                      else _chunk_stats(*args))
    logp_BR, entropy_BR = (torch.cat(t, dim=1) for t in zip(*pieces))
    return logp_BR, entropy_BR


def _chunk_stats(
    x: torch.Tensor, targets: torch.Tensor, head: nn.Module | None, temperature: float, return_entropy: EntropyMode
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: hidden states [B, c, H] (head given) or logits [B, c, V] (head None). Returns logp, entropy [B, c]."""
    # A column slice of [B, R, H] is not contiguous, and a linear layer then runs as a batched matmul over B
    # copies of the head weight (measured 3x slower on CPU with bf16 weights); one small copy avoids that.
    raw = head(x.contiguous()) if head is not None else x
    if return_entropy is not True and _triton_logprobs(raw):  # True (not "metric"): the entropy needs its gradient
        from fleetrl.algo.triton_logprobs import logprobs_from_logits

        logp, entropy = logprobs_from_logits(raw.flatten(0, -2), targets.flatten(), temperature)
        return logp.view(targets.shape), entropy.view(targets.shape)
    logits = raw.float() / temperature
    logp_all = F.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    if not return_entropy:
        return logp, torch.zeros_like(logp)
    if return_entropy == "metric":  # a metric only: no autograd graph (it would save B x c x V activations)
        with torch.no_grad():
            return logp, entropy_from_logits(logits.detach())
    return logp, entropy_from_logits(logits)  # the one (tested) entropy function, also used by the losses


def _full_logits(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 position_ids: torch.Tensor, R: int) -> torch.Tensor:
    """Logits at the R positions that predict the response tokens: [B, R, V]."""
    kwargs = {}
    if _accepts(model, "logits_to_keep"):
        kwargs["logits_to_keep"] = R + 1  # the last R+1 columns; the final one predicts past the end
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
                **kwargs)
    return out.logits[:, -(R + 1):-1]


def _response_hidden(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     position_ids: torch.Tensor, P: int, R: int) -> torch.Tensor:
    """Final hidden states at the R positions that predict the response tokens: [B, R, H]."""
    check_head_only(model, "sequence_logprobs(chunk_size=...)")
    from fleetrl.models.value_head import (
        backbone_of,  # local import: value_head imports this module
    )

    out = backbone_of(model)(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             use_cache=False)
    return out.last_hidden_state[:, P - 1:P + R - 1]


def _shared_prompt_hidden(model: nn.Module, prompts_BP: torch.Tensor, prompt_mask_BP: torch.Tensor,
                          responses_BR: torch.Tensor, attention_mask: torch.Tensor,
                          position_ids: torch.Tensor) -> torch.Tensor:
    """As `_response_hidden`, but each distinct prompt row runs through the backbone once: GRPO's n samples of a
    prompt share it, and on CPU the prompt is most of the update's tokens (SmolLM2 arithmetic: ~50 prompt tokens
    to <= 48 response tokens, n = 8). The distinct prompts' KV cache is then gathered per row, with autograd, so
    the responses attend to it and the gradient still flows into the prompt's keys and values. The same sums as
    the full forward in another order: equal to rounding. Returns [B, R, H]."""
    from fleetrl.models.value_head import backbone_of  # local import: value_head imports this module

    check_head_only(model, "sequence_logprobs(share_prompts=True)")
    P, R = prompts_BP.shape[1], responses_BR.shape[1]
    # Pad slots compare equal after masking, so rows differing only in padding content are one prompt.
    keyed = torch.cat([prompts_BP * prompt_mask_BP, prompt_mask_BP], dim=1)
    unique, row_of = torch.unique(keyed, dim=0, return_inverse=True)
    backbone = backbone_of(model)
    first = backbone(input_ids=unique[:, :P], attention_mask=unique[:, P:], position_ids=(unique[:, P:].cumsum(-1) - 1).clamp(min=0), use_cache=True)
    cache = first.past_key_values
    cache.reorder_cache(row_of)  # [G, ...] -> [B, ...] by index_select: differentiable
    cache_position = torch.arange(P, P + R, device=responses_BR.device)
    rest = backbone(input_ids=responses_BR, attention_mask=attention_mask, position_ids=position_ids[:, P:],
                    past_key_values=cache, use_cache=True, cache_position=cache_position)
    # The last prompt column predicts response token 0; response column r predicts token r + 1.
    return torch.cat([first.last_hidden_state[row_of, P - 1:P], rest.last_hidden_state[:, :R - 1]], dim=1)


TRITON_LOGPROBS = True
"""Use algo/triton_logprobs.py for log-probs (and the entropy metric) from logits on CUDA when Triton is installed;
False forces the torch path (tests compare the two)."""


def _triton_logprobs(logits: torch.Tensor) -> bool:
    if not (TRITON_LOGPROBS and logits.is_cuda):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def check_head_only(model: nn.Module, caller: str) -> None:
    """Raises if the model transforms logits after its LM head (callers that apply the head themselves)."""
    for name in _LOGIT_POSTPROCESSING:
        if getattr(getattr(model, "config", None), name, None) not in (None, 1.0):
            raise ValueError(f"{caller} applies the LM head itself and cannot reproduce this model's `{name}`; "
                             f"use chunk_size=None and algorithm.micro_batch_tokens=null for {type(model).__name__}")


def _lm_head(model: nn.Module) -> nn.Module:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        raise ValueError(f"sequence_logprobs(chunk_size=...) needs a causal LM with an output embedding (LM head); "
                         f"{type(model).__name__} has none")
    return head


def _accepts(model: nn.Module, name: str) -> bool:
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
