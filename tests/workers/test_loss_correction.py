"""The rollout correction computed in the actor loss, micro-batch by micro-batch (workers/actor.py), against the
controller's whole-batch `rollout_correction` on the same inputs, with hand-computed numbers."""
from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from fleetrl.algo.correction import rollout_correction
from fleetrl.batch import Batch
from fleetrl.workers.actor import _in_loss_correction
from fleetrl.workers.layout import micro_batches, pad_response, token_micro_batches
from fleetrl.workers.messages import CorrectionSpec, Extreme, UpdateMetrics, combine_extremes

# Token ratios pi_old / pi_rollout (rollout log-probs 0): seq 0 [3, 0.4, pad], seq 1 [1.5, 1.9, 0.8], seq 2
# [0.5, pad, pad]; padding holds a junk 9.0 that must never count. 6 valid tokens. Sequence ratios (products):
# 3 * 0.4 = 1.2, 1.5 * 1.9 * 0.8 = 2.28, 0.5.
OLD = torch.tensor([[math.log(3.0), math.log(0.4), 9.0], [math.log(1.5), math.log(1.9), math.log(0.8)],
                    [math.log(0.5), 9.0, 9.0]])
MASK = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
CASES = [
    # (mode, level, weights, weight_mean, clipped_frac, masked_frac, ratio_mean, ratio_max, ratio_min), cap 2
    # tis token: 3 -> 2; weights sum 2 + 0.4 + 1.5 + 1.9 + 0.8 + 0.5 = 7.1; 1 of 6 truncated;
    # ratios sum 3 + 0.4 + 1.5 + 1.9 + 0.8 + 0.5 = 8.1
    ("tis", "token", [[2, 0.4, 0], [1.5, 1.9, 0.8], [0.5, 0, 0]], 7.1 / 6, 1 / 6, 0.0, 8.1 / 6, 3.0, 0.4),
    # mis token: 3 -> 0; weights sum 5.1; 1 of 6 masked
    ("mis", "token", [[0, 0.4, 0], [1.5, 1.9, 0.8], [0.5, 0, 0]], 5.1 / 6, 0.0, 1 / 6, 8.1 / 6, 3.0, 0.4),
    # tis sequence: 2.28 -> 2 on seq 1's 3 tokens; weights 1.2·2 + 2·3 + 0.5 = 8.9; 3 of 6 truncated;
    # ratios 1.2·2 + 2.28·3 + 0.5 = 9.74
    ("tis", "sequence", [[1.2, 1.2, 0], [2, 2, 2], [0.5, 0, 0]], 8.9 / 6, 3 / 6, 0.0, 9.74 / 6, 2.28, 0.5),
    # mis sequence: seq 1 dropped whole; weights 2.4 + 0.5 = 2.9; 3 of 6 masked
    ("mis", "sequence", [[1.2, 1.2, 0], [0, 0, 0], [0.5, 0, 0]], 2.9 / 6, 0.0, 3 / 6, 9.74 / 6, 2.28, 0.5),
]
# prompt lengths 1, 1, 1 -> real tokens 3, 4, 2: a 6-token budget packs [seq 0], [seq 1, seq 2]
LAYOUTS = {"padded, 2 rows": lambda b: micro_batches(b, 2), "padded, 1 row": lambda b: micro_batches(b, 1),
           "packed, 6 tokens": lambda b: token_micro_batches(b, 6)}


def _batch() -> Batch:
    return Batch({"prompts": torch.ones(3, 1, dtype=torch.long), "prompt_mask": torch.ones(3, 1, dtype=torch.long),
                  "responses": torch.ones(3, 3, dtype=torch.long), "response_mask": MASK,
                  "old": OLD, "rollout_logprobs": torch.zeros(3, 3)})


def _in_loss(layout: str, spec: CorrectionSpec) -> tuple[torch.Tensor, dict[str, float]]:
    """The actor's way: per micro-batch, means as token shares of the 6 tokens, max / min as Extremes."""
    weights, shares, extremes = [], {}, {}
    for mb in LAYOUTS[layout](_batch()):
        mask = mb["response_mask"].float()
        w, m = _in_loss_correction(mb["old"], mb["rollout_logprobs"], mask, spec, share=mask.sum() / 6,
                                   has_tokens=bool(mask.any()))
        weights.append(pad_response(w, _batch()["response_mask"].shape[1]))
        for k, v in m.items():
            if not isinstance(v, Extreme):
                shares[k] = shares.get(k, 0.0) + v
        extremes = combine_extremes([extremes, {k: v for k, v in m.items() if isinstance(v, Extreme)}])
    # values are 0-dim tensors until the update reads them back (once per step)
    return torch.cat(weights), {**{k: float(v) for k, v in shares.items()},
                                **{k: float(v.value) for k, v in extremes.items()}}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("mode, level, weights, weight_mean, clipped, masked, r_mean, r_max, r_min", CASES)
def test_in_loss_weights_equal_the_whole_batch_correction(layout, mode, level, weights, weight_mean, clipped,
                                                           masked, r_mean, r_max, r_min):
    spec = CorrectionSpec(mode=mode, level=level, cap=2.0, low=0.5, high=5.0)
    w, metrics = _in_loss(layout, spec)
    assert_close(w, torch.tensor(weights, dtype=torch.float32), atol=1e-5, rtol=1e-5)
    expected = {"weight_mean": weight_mean, "clipped_frac": clipped, "masked_frac": masked, "ratio_mean": r_mean,
                "ratio_max": r_max, "ratio_min": r_min}
    assert metrics == pytest.approx({f"rollout_is/{k}": v for k, v in expected.items()}, rel=1e-5, abs=1e-6)
    # and the controller's whole-batch pass gives the same
    w_ref, m_ref = rollout_correction(OLD, torch.zeros(3, 3), MASK, mode=mode, level=level, cap=2.0)
    assert_close(w, w_ref, atol=1e-6, rtol=1e-6)
    assert metrics == pytest.approx({k: float(v) for k, v in m_ref.items()}, rel=1e-5, abs=1e-6)


def test_a_micro_batch_without_valid_tokens_reports_no_extremes():
    spec = CorrectionSpec(mode="tis", level="token", cap=2.0, low=0.5, high=5.0)
    w, m = _in_loss_correction(OLD[:1], torch.zeros(1, 3), torch.zeros(1, 3), spec, share=torch.tensor(0.0),
                               has_tokens=False)
    assert float(w.abs().sum()) == 0.0 and "rollout_is/ratio_max" not in m and "rollout_is/ratio_min" not in m
    assert m["rollout_is/ratio_mean"] == 0.0  # a share of 0 tokens


def test_update_metrics_reduce_extremes_by_max_and_min_over_ranks():
    same = {"actor/grad_norm": 1.0}
    ranks = [UpdateMetrics.of({"rollout_is/ratio_mean": 0.5}, same,
                              {"rollout_is/ratio_max": Extreme(3.0, "max"), "rollout_is/ratio_min": Extreme(0.4, "min")}),
             UpdateMetrics.of({"rollout_is/ratio_mean": 0.85}, same,
                              {"rollout_is/ratio_max": Extreme(2.28, "max"), "rollout_is/ratio_min": Extreme(0.5, "min")}),
             UpdateMetrics.of({"rollout_is/ratio_mean": 0.0}, same)]  # a rank with no valid token: no extremes
    # shares add (0.5 + 0.85 + 0); max(3, 2.28) = 3; min(0.4, 0.5) = 0.4
    assert UpdateMetrics.reduce(ranks) == pytest.approx({"rollout_is/ratio_mean": 1.35, "actor/grad_norm": 1.0,
                                                         "rollout_is/ratio_max": 3.0, "rollout_is/ratio_min": 0.4})
