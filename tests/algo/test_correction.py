import math

import pytest
import torch
from torch.testing import assert_close

from fleetrl.algo.correction import (
    ROLLOUT_CORRECTIONS,
    check_correction,
    rollout_correction,
)

ATOL = {"atol": 1e-5, "rtol": 1e-5}

# Token ratios pi_old / pi_rollout: seq 0 [3, 0.4, padding], seq 1 [1.5, 1.9, 0.8]. The padding holds a junk
# old log-prob 9.0 that must never count. Sequence-level ratios (products): seq 0 3 * 0.4 = 1.2,
# seq 1 1.5 * 1.9 * 0.8 = 2.28.
OLD = torch.tensor([[math.log(3.0), math.log(0.4), 9.0], [math.log(1.5), math.log(1.9), math.log(0.8)]])
ROLLOUT = torch.zeros(2, 3)
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])

CASES = [
    # (mode, level, bounds, weights, weight_mean, clipped_frac, masked_frac); 5 valid tokens
    ("none", "token", {}, [[1, 1, 0], [1, 1, 1]], 1.0, 0.0, 0.0),
    # tis cap 2: 3 -> 2; sum 2 + 0.4 + 1.5 + 1.9 + 0.8 = 6.6 -> 6.6 / 5 = 1.32; 1 of 5 truncated
    ("tis", "token", {"cap": 2.0}, [[2, 0.4, 0], [1.5, 1.9, 0.8]], 1.32, 0.2, 0.0),
    # mis cap 2: 3 -> 0; sum 4.6 -> 0.92; 1 of 5 masked
    ("mis", "token", {"cap": 2.0}, [[0, 0.4, 0], [1.5, 1.9, 0.8]], 0.92, 0.0, 0.2),
    # icepop [0.5, 2.5]: 3 (above) and 0.4 (below) -> 0; sum 4.2 -> 0.84; 2 of 5 masked
    ("icepop", "token", {"low": 0.5, "high": 2.5}, [[0, 0, 0], [1.5, 1.9, 0.8]], 0.84, 0.0, 0.4),
    ("none", "sequence", {}, [[1, 1, 0], [1, 1, 1]], 1.0, 0.0, 0.0),
    # tis cap 2: seq 1 2.28 -> 2 on its 3 tokens; (1.2 * 2 + 2 * 3) / 5 = 8.4 / 5 = 1.68; 3 of 5 truncated
    ("tis", "sequence", {"cap": 2.0}, [[1.2, 1.2, 0], [2, 2, 2]], 1.68, 0.6, 0.0),
    # mis cap 2: the whole of seq 1 dropped; 2.4 / 5 = 0.48; 3 of 5 masked
    ("mis", "sequence", {"cap": 2.0}, [[1.2, 1.2, 0], [0, 0, 0]], 0.48, 0.0, 0.6),
    # icepop [0.5, 2]: 2.28 > 2 drops seq 1, 1.2 is inside; as mis
    ("icepop", "sequence", {"low": 0.5, "high": 2.0}, [[1.2, 1.2, 0], [0, 0, 0]], 0.48, 0.0, 0.6),
]


@pytest.mark.parametrize("mode, level, bounds, weights, weight_mean, clipped, masked", CASES)
def test_rollout_correction_modes_and_levels(mode, level, bounds, weights, weight_mean, clipped, masked):
    w, m = rollout_correction(OLD, ROLLOUT, MASK, mode=mode, level=level, **bounds)
    assert_close(w, torch.tensor(weights, dtype=torch.float32), **ATOL)
    assert_close(m["rollout_is/weight_mean"], torch.tensor(weight_mean), **ATOL)
    assert_close(m["rollout_is/clipped_frac"], torch.tensor(clipped), **ATOL)
    assert_close(m["rollout_is/masked_frac"], torch.tensor(masked), **ATOL)
    # raw ratio statistics do not depend on the mode:
    # token: mean (3 + 0.4 + 1.5 + 1.9 + 0.8) / 5 = 1.52, max 3, min 0.4
    # sequence: mean (1.2 * 2 + 2.28 * 3) / 5 = 9.24 / 5 = 1.848, max 2.28, min 1.2
    stats = {"token": (1.52, 3.0, 0.4), "sequence": (1.848, 2.28, 1.2)}[level]
    got = [m[f"rollout_is/ratio_{k}"] for k in ("mean", "max", "min")]
    assert_close(torch.stack(got), torch.tensor(stats), **ATOL)


def test_every_mode_is_covered():
    assert sorted({c[0] for c in CASES}) == ROLLOUT_CORRECTIONS.names()


def test_identical_log_probs_give_unit_weights_in_every_mode():
    for mode in ROLLOUT_CORRECTIONS.names():
        w, m = rollout_correction(ROLLOUT, ROLLOUT, MASK, mode=mode, level="sequence")
        assert_close(w, MASK.float())
        assert_close(m["rollout_is/masked_frac"], torch.tensor(0.0))


@pytest.mark.parametrize("kwargs, match", [
    ({"mode": "tiss"}, "did you mean 'tis'"),
    ({"mode": "tis", "level": "seq"}, "level must be one of"),
    ({"mode": "mis", "cap": 0.0}, "cap must be > 0 for mode 'mis'"),
    ({"mode": "icepop", "low": 1.2, "high": 5.0}, "0 <= low < 1 < high"),
])
def test_bad_settings_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        check_correction(**kwargs)
    with pytest.raises(ValueError, match=match):
        rollout_correction(OLD, ROLLOUT, MASK, **kwargs)


def test_no_valid_token_gives_placeholder_extremes_without_a_host_read():
    # An all-masked micro-batch (and an empty one) reports ratio max = min = 1, the placeholder; the statistics
    # are computed on the device with torch.where, so CUDA's sync debug mode would not fire (GPU variant:
    # tests/models/test_host_packing.py).
    for old, mask in ((OLD, torch.zeros_like(MASK)), (OLD[:, :0], MASK[:, :0])):
        _, m = rollout_correction(old, torch.zeros_like(old), mask, mode="tis", level="token", cap=2.0)
        assert float(m["rollout_is/ratio_max"]) == 1.0 and float(m["rollout_is/ratio_min"]) == 1.0
        assert float(m["rollout_is/weight_mean"]) == 0.0
