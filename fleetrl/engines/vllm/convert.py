"""Between fleetrl's padded tensors and vLLM's requests: prompts in, GenerationOutput out.

A call's rows become vLLM requests; a run of identical rows with the same limit (GRPO's n samples of a prompt, made
by Batch.repeat_interleave) becomes ONE request with `n` samples, so vLLM prefills the prompt once for all of them.
Nothing here imports vllm: the engine hands in vLLM's SamplingParams class, so this module stays testable and cheap
to import.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from fleetrl.engines.fast.postprocess import assemble_output
from fleetrl.engines.protocol import GenerationOutput, SamplingParams

# Row r of a call seeded s samples from seed s * STRIDE + r. vLLM seeds the k-th sample of a request seeded q with
# q + k, so a group's request is seeded by its FIRST ROW: then every row has its own stream. (Seeding requests 0, 1,
# 2, ... gave request 1 the stream of request 0's second sample: neighbouring prompts drew the same noise, and the
# copy task learned half as fast.)
SEED_STRIDE = 1_000_003


@dataclass(frozen=True)
class Group:
    """Rows [first, first + n) of the call: one prompt (no padding), sampled n times with one token limit."""

    first: int
    n: int
    prompt: list[int]
    limit: int


def group_rows(prompts: torch.Tensor, prompt_mask: torch.Tensor, limits: torch.Tensor) -> list[Group]:
    """Consecutive rows with equal unpadded prompts and equal limits, in row order."""
    groups: list[Group] = []
    for row in range(prompts.shape[0]):
        ids = prompts[row][prompt_mask[row].bool()].tolist()
        limit = int(limits[row])
        last = groups[-1] if groups else None
        if last is not None and last.prompt == ids and last.limit == limit:
            groups[-1] = Group(last.first, last.n + 1, ids, limit)
        else:
            groups.append(Group(row, 1, ids, limit))
    return groups


def filters_tokens(params: SamplingParams) -> bool:
    """top-k / top-p change which tokens can be drawn, so vLLM's processed log-probs are then renormalised over the
    kept tokens, not the protocol's plain log softmax(logits / T)."""
    return params.temperature > 0 and (params.top_k > 0 or params.top_p < 1)


def vllm_params(make: Callable[..., Any], params: SamplingParams, group: Group, stop_ids: Sequence[int],
                seed: int) -> Any:
    """vLLM SamplingParams for one group. `ignore_eos` with our stop ids listed: the stop tokens are exactly the
    ones fleetrl's other engines stop at (tokenizer EOS + generation-config EOS + the call's), not vLLM's own choice."""
    return make(n=group.n, max_tokens=group.limit, temperature=params.temperature, top_p=params.top_p,
                top_k=params.top_k if params.top_k > 0 else -1, stop_token_ids=list(stop_ids), ignore_eos=True,
                stop=list(params.stop_strings) or None, seed=(seed * SEED_STRIDE + group.first) % 2**63,
                logprobs=0, skip_special_tokens=False)


def sample_logprobs(token_ids: Sequence[int], logprobs: Sequence[dict] | None) -> list[float]:
    """The log-prob of each sampled token from vLLM's per-position {token id: Logprob} dicts."""
    if logprobs is None or len(logprobs) < len(token_ids):
        raise RuntimeError(f"vLLM returned {0 if logprobs is None else len(logprobs)} log-prob entries for "
                           f"{len(token_ids)} sampled tokens; the engine asks for logprobs=0, which should give one each")
    return [float(step[t].logprob) for t, step in zip(token_ids, logprobs)]


def assemble(groups: list[Group], finished: dict[int, Any], stop_ids: Sequence[int],
             stop_strings: Sequence[str], tokenizer: Any) -> GenerationOutput:
    """vLLM's finished requests (by group index) -> right-padded GenerationOutput in the call's row order.

    The response is cut exactly like the fast engine's (fast/postprocess.py): through the first stop token, or right
    after the token whose decoded prefix first contains a stop string, so the three engines' masks agree."""
    rows: list[tuple[list[int], list[float]]] = []
    for index, group in enumerate(groups):
        samples = sorted(finished[index].outputs, key=lambda s: s.index)
        assert len(samples) == group.n, (len(samples), group.n)
        for s in samples:
            ids = list(s.token_ids)
            rows.append((ids, sample_logprobs(ids, s.logprobs)))
    counts = [max(len(ids), 1) for ids, _ in rows]  # a 0-token answer cannot happen (max_tokens >= 1)
    width = max(counts)
    tok = torch.zeros(len(rows), width, dtype=torch.long)
    lp = torch.zeros(len(rows), width, dtype=torch.float32)
    for i, (ids, logp) in enumerate(rows):
        tok[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        lp[i, :len(logp)] = torch.tensor(logp, dtype=torch.float32)
    out = assemble_output(tok, lp, counts, set(stop_ids), stop_strings, tokenizer, torch.device("cpu"))
    # pad ids after the end, as the hf reference engine writes them (the fast engine's helper writes 0)
    out.responses = out.responses.masked_fill(out.response_mask == 0, tokenizer.pad_token_id)
    return out
