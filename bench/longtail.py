"""A synthetic stop rule that gives random-weight rollouts the long-tailed response lengths of real RL.

Random weights almost never sample EOS, so every response would run to max_new_tokens. The rule: response i
of the generate call of step s stops after L_i tokens, L_i = clip(round(LogNormal(mu, sigma)), 1, max_new_tokens),
drawn from a generator seeded with (seed, step); mu = ln(mean) - sigma²/2 makes the unclipped mean `mean`.
bench/e2e.py's default, mean 335 with sigma 1 and max 1024, gives (measured over 51,200 draws) a mean of 300
after clipping, median 203, 5.3% of responses clipped at 1024.

It is applied to the rollout component's output (the cut token stands for EOS: its sampled id and log-prob
are kept, so the rollout log-probs stay exact and finish_reason says "stop"). Decoding itself still runs to
max_new_tokens, so the `generate` time of this workload is an upper bound; the training phases (log-probs,
update) see exactly the long-tailed batch. In-process only: patch before the run (cluster.backend=local).
"""
from __future__ import annotations

import math

import torch

from fleetrl.batch import Batch
from fleetrl.workers import rollout

SIGMA = 1.0


def draw_lengths(n: int, *, mean: float, max_len: int, seed: int, step: int) -> torch.Tensor:
    """[n] long response lengths in [1, max_len] (see the module docstring)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    mu = math.log(mean) - SIGMA ** 2 / 2
    x = torch.exp(mu + SIGMA * torch.randn(n, generator=g, dtype=torch.float64))
    return x.round().clamp(1, max_len).long()


def cut(out: Batch, lengths: torch.Tensor) -> Batch:
    """Responses cut after lengths[i] tokens (never lengthened); columns past the longest one dropped."""
    mask = out["response_mask"]
    keep = torch.minimum(lengths, mask.sum(1))
    cols = torch.arange(mask.shape[1])[None, :]
    new_mask = (cols < keep[:, None]).long() * mask
    width = max(int(keep.max()), 1)
    reasons = ["stop" if k < int(n) else r for k, n, r in zip(keep.tolist(), mask.sum(1).tolist(),
                                                               out.fields["finish_reason"])]
    per_sample = {k: v for k, v in out.tensors.items() if v.dim() == 1}  # e.g. weights_version: kept as is
    return Batch({**per_sample, "responses": (out["responses"] * new_mask)[:, :width],
                  "response_mask": new_mask[:, :width], "rollout_logprobs": (out["rollout_logprobs"] * new_mask)[:, :width]},
                 {**out.fields, "finish_reason": reasons}, dict(out.meta))


def install(*, mean: float | None, max_len: int, seed: int, stats: list[dict]) -> None:
    """Patches RolloutComponent.generate with the stop rule (none when `mean` is None: fixed lengths) and
    appends per-call token counts to `stats` (for the update's FLOPs)."""
    original = rollout.RolloutComponent.generate

    def generate(self, batch, req):  # noqa: ANN001, ANN202
        out = original(self, batch, req)
        if mean is not None:
            out = cut(out, draw_lengths(len(batch), mean=mean, max_len=max_len, seed=seed, step=req.step))
        seq = batch["prompt_mask"].sum(1) + out["response_mask"].sum(1)
        stats.append({"step": req.step, "samples": len(batch), "response_tokens": int(out["response_mask"].sum()),
                      "tokens": int(seq.sum()), "sum_len_sq": float((seq.double() ** 2).sum()),
                      "max_response": int(out["response_mask"].sum(1).max())})
        return out

    rollout.RolloutComponent.generate = generate
