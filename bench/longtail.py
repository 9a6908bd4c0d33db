"""A synthetic stop rule that gives random-weight rollouts the long-tailed response lengths of real RL.

Random weights almost never sample EOS, so every response would run to max_new_tokens. The rule: response i
of the generate call of step s stops after L_i tokens, L_i = clip(round(LogNormal(mu, sigma)), 1, max_new_tokens),
drawn from a generator seeded with (seed, step); mu = ln(mean) - sigma²/2 makes the unclipped mean `mean`.
bench/e2e.py's default, mean 335 with sigma 1 and max 1024, gives (measured over 51,200 draws) a mean of 300
after clipping, median 203, 5.3% of responses clipped at 1024.

The drawn lengths go into generation as SamplingParams.max_new_tokens_per_sample, so decoding stops there: the
fast engine frees the slot and refills it with a waiting prompt, or, when none waits (a call no larger than the
engine's max_batch, as in these benches), moves the live tail into a smaller decode batch; the hf engine cuts after
the fact (engines/protocol.py). The number of decode steps is still the longest drawn length of the call. The limit stands for EOS: a response that ends at its drawn
length below max_new_tokens is relabelled finish_reason "stop" (the engine reports "length"); one drawn at
max_new_tokens stays "length". Its sampled tokens and log-probs are the engine's own, so the rollout log-probs
stay exact. `install` patches the rollout component of the process it runs in: call it in-process
(cluster.backend=local, bench/e2e.py) or in every Ray worker (a worker_process_setup_hook, bench/async_e2e.py).
"""
from __future__ import annotations

import dataclasses
import math

import torch

from fleetrl.batch import Batch
from fleetrl.workers import rollout

SIGMA = 1.0
DEFAULT_MEAN = 335.0  # lognormal mean before clipping at 1024: 300 after (module docstring)


def draw_lengths(n: int, *, mean: float, max_len: int, seed: int, step: int) -> torch.Tensor:
    """[n] long response lengths in [1, max_len] (see the module docstring)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    mu = math.log(mean) - SIGMA ** 2 / 2
    x = torch.exp(mu + SIGMA * torch.randn(n, generator=g, dtype=torch.float64))
    return x.round().clamp(1, max_len).long()


def mark_synthetic_stops(out: Batch, max_new_tokens: int) -> Batch:
    """finish_reason "stop" for responses that ended at their drawn limit below max_new_tokens (see above)."""
    lengths = out["response_mask"].sum(1).tolist()
    reasons = ["stop" if r == "length" and n < max_new_tokens else r
               for r, n in zip(out.fields["finish_reason"], lengths)]
    return Batch(dict(out.tensors), {**out.fields, "finish_reason": reasons}, dict(out.meta))


def install(*, mean: float | None, max_len: int, seed: int, stats: list[dict]) -> None:
    """Patches RolloutComponent with the stop rule (none when `mean` is None: fixed lengths) and appends per-call
    token counts to `stats` (for the update's FLOPs)."""
    original_params, original_generate = rollout.RolloutComponent.sampling_params, rollout.RolloutComponent.generate

    def sampling_params(self, batch, req):  # noqa: ANN001, ANN202
        params = original_params(self, batch, req)
        if mean is None:
            return params
        limits = draw_lengths(len(batch), mean=mean, max_len=max_len, seed=seed, step=req.step)
        return dataclasses.replace(params, max_new_tokens_per_sample=limits)

    def generate(self, batch, req):  # noqa: ANN001, ANN202
        out = original_generate(self, batch, req)
        if mean is not None:
            out = mark_synthetic_stops(out, self.ctx.cfg.rollout.max_new_tokens)
        seq = batch["prompt_mask"].sum(1) + out["response_mask"].sum(1)
        stats.append({"step": req.step, "samples": len(batch), "response_tokens": int(out["response_mask"].sum()),
                      "tokens": int(seq.sum()), "sum_len_sq": float((seq.double() ** 2).sum()),
                      "max_response": int(out["response_mask"].sum(1).max())})
        return out

    rollout.RolloutComponent.sampling_params = sampling_params
    rollout.RolloutComponent.generate = generate
