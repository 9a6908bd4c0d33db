import math

import pytest
import torch
from torch.testing import assert_close

from fleetrl.algo.losses import (
    AGGREGATIONS,
    POLICY_LOSSES,
    aggregate,
    apply_kl_penalty,
    entropy_from_logits,
    entropy_loss,
    kl_loss,
    ppo_policy_loss,
    value_loss,
)

ATOL = dict(atol=1e-5, rtol=1e-5)
E = math.e


def _t(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


# ----------------------------------------------------------------------------------------- PPO loss
def test_ppo_positive_advantage_clip_high():
    # ratio will be [e, e, e]; clipped ratio becomes [1.2, 1.2, 1.2]
    # loss = max(-1 * e, -1 * 1.2) = -1.2 per token
    logp, old, adv, mask = _t([[1.0, 1.0, 1.0]]), torch.zeros(1, 3), torch.ones(1, 3), torch.ones(1, 3)
    loss, m = ppo_policy_loss(logp, old, adv, mask)
    assert_close(loss, _t(-1.2))
    assert_close(m["clip_frac"], _t(1.0))
    assert_close(m["dual_clip_frac"], _t(0.0))
    assert_close(m["ratio_mean"], _t(E))
    # approx_kl = k3 of KL(old || new) = ratio - 1 - log ratio = e - 1 - 1 = 0.718282
    assert_close(m["approx_kl"], _t(0.718282), **ATOL)


def test_ppo_clipped_tokens_get_no_gradient():
    # token 0: ratio e (clipped, grad 0); token 1: ratio 1, grad of -A * ratio wrt logp = -A * ratio = -1,
    # divided by 2 tokens -> -0.5
    logp = _t([[1.0, 0.0]]).requires_grad_()
    loss, _ = ppo_policy_loss(logp, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2))
    loss.backward()
    assert_close(logp.grad, _t([[0.0, -0.5]]))


def test_ppo_negative_advantage_clip_low():
    # ratio will be [0.5, 0.5]; clipped ratio becomes [0.8, 0.8]
    # loss = max(-(-1) * 0.5, -(-1) * 0.8) = 0.8 per token
    logp = torch.full((1, 2), math.log(0.5))
    loss, m = ppo_policy_loss(logp, torch.zeros(1, 2), -torch.ones(1, 2), torch.ones(1, 2))
    assert_close(loss, _t(0.8))
    assert_close(m["clip_frac"], _t(1.0))


def test_ppo_inside_trust_region_is_unclipped():
    # ratio 1.1, A = 2: loss = max(-2.2, -2.2) = -2.2, nothing clipped
    logp = torch.full((1, 1), math.log(1.1))
    loss, m = ppo_policy_loss(logp, torch.zeros(1, 1), torch.full((1, 1), 2.0), torch.ones(1, 1))
    assert_close(loss, _t(-2.2))
    assert_close(m["clip_frac"], _t(0.0))


def test_ppo_asymmetric_clip_higher():
    # A = 1, ratios [e, 1.25], clip_low 0.2, clip_high 0.28 -> clip range [0.8, 1.28]
    # token 0: max(-e, -1.28) = -1.28 (clipped); token 1: 1.25 < 1.28 -> max(-1.25, -1.25) = -1.25
    # token-mean = (-1.28 - 1.25) / 2 = -1.265; clip_frac 1/2
    # (with symmetric 0.2 token 1 would have been clipped to -1.2)
    logp = _t([[1.0, math.log(1.25)]])
    loss, m = ppo_policy_loss(logp, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2), clip_high=0.28)
    assert_close(loss, _t(-1.265), **ATOL)
    assert_close(m["clip_frac"], _t(0.5))


def test_ppo_dual_clip():
    # ratios [e^2, e^2] = 7.389; A = [-1, +1]
    # token 0 (A < 0): max(7.389, 1.2) = 7.389, dual clip caps at -A * 3 = 3
    # token 1 (A > 0): max(-7.389, -1.2) = -1.2, dual clip does not apply
    # token-mean = (3 - 1.2) / 2 = 0.9; clipped branch active on token 1 only; dual clip on token 0
    logp, adv = _t([[2.0, 2.0]]), _t([[-1.0, 1.0]])
    loss, m = ppo_policy_loss(logp, torch.zeros(1, 2), adv, torch.ones(1, 2), dual_clip=3.0)
    assert_close(loss, _t(0.9), **ATOL)
    assert_close(m["clip_frac"], _t(0.5))
    assert_close(m["dual_clip_frac"], _t(0.5))
    # without dual clip: (7.389056 - 1.2) / 2 = 3.094528
    loss_no_dual, _ = ppo_policy_loss(logp, torch.zeros(1, 2), adv, torch.ones(1, 2))
    assert_close(loss_no_dual, _t(3.094528), **ATOL)


def test_ppo_dual_clip_must_exceed_one():
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        ppo_policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), dual_clip=1.0)


def test_ppo_ignores_masked_tokens():
    # token 1 is padding with a huge ratio and advantage; only token 0 counts: ratio 1, A 1 -> loss -1
    logp, adv = _t([[0.0, 50.0]]), _t([[1.0, -1e6]])
    loss, m = ppo_policy_loss(logp, torch.zeros(1, 2), adv, _t([[1.0, 0.0]]), dual_clip=3.0)
    assert_close(loss, _t(-1.0))
    assert_close(m["ratio_mean"], _t(1.0))


def test_vanilla_pg_same_signature_no_clipping():
    # ratio [e, e], A = 1: loss -e, no clipping even though clip args are given
    fn = POLICY_LOSSES.get("vanilla_pg")
    loss, m = fn(_t([[1.0, 1.0]]), torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2),
                 clip_low=0.2, clip_high=0.2, dual_clip=3.0, agg="token-mean")
    assert_close(loss, _t(-E))
    assert set(m) == {"clip_frac", "dual_clip_frac", "approx_kl", "ratio_mean"}


def test_policy_losses_share_metrics_keys():
    args = (torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), torch.ones(2, 3))
    keys = {frozenset(POLICY_LOSSES.get(name)(*args)[1]) for name in POLICY_LOSSES.names()}
    assert len(keys) == 1


# ---------------------------------------------------------------------------------------------- GSPO
def test_gspo_sequence_ratio_clips_whole_sequences():
    # seq 0: log-ratios [0.2, 0.4] -> s = e^0.3 = 1.349859 > 1.2 with A = 1 -> both tokens -1.2, no gradient
    # seq 1: log-ratios [0.5, -0.5] -> s = e^0 = 1, A = 2 -> both tokens -2, gradient -A * s / 4 tokens = -0.5
    #   (token-level PPO would clip token (1, 0): its own ratio e^0.5 = 1.65 > 1.2)
    # token-mean = (-1.2 - 1.2 - 2 - 2) / 4 = -1.6; clip_frac 2/4; ratio_mean (2 * 1.349859 + 2 * 1) / 4 = 1.174930
    logp = _t([[0.2, 0.4], [0.5, -0.5]]).requires_grad_()
    loss, m = POLICY_LOSSES.get("gspo")(logp, torch.zeros(2, 2), _t([[1.0, 1.0], [2.0, 2.0]]), torch.ones(2, 2))
    loss.backward()
    assert_close(loss, _t(-1.6), **ATOL)
    assert_close(logp.grad, _t([[0.0, 0.0], [-0.5, -0.5]]), **ATOL)
    assert_close(m["clip_frac"], _t(0.5))
    assert_close(m["ratio_mean"], _t(1.174930), **ATOL)
    ppo_logp = logp.detach().clone().requires_grad_()
    ppo_policy_loss(ppo_logp, torch.zeros(2, 2), _t([[1.0, 1.0], [2.0, 2.0]]), torch.ones(2, 2))[0].backward()
    assert ppo_logp.grad[1, 0] == 0.0


def test_gspo_token_form_matches_sequence_level_gradient():
    # seq 0 (2 tokens): log-ratios [0.3, 0.1] -> s0 = e^0.2 = 1.221403, A = 1, inside [0.8, 1.3]
    # seq 1 (1 token + padding holding junk 7.0): log-ratio 0 -> s1 = 1, A = -1
    # seq-mean-token-mean: loss = (mean(-1.221403, -1.221403) + mean(1)) / 2 = -0.110701
    # sequence-level GSPO: J = -(1/2) sum_b A_b s_b, d s_b / d logp_bt = s_b / |y_b|
    #   seq 0 tokens: -(1/2) * 1 * 1.221403 / 2 = -0.305351; seq 1: -(1/2) * (-1) * 1 / 1 = 0.5; padding 0
    logp = _t([[0.3, 0.1], [0.0, 7.0]]).requires_grad_()
    mask, adv = _t([[1, 1], [1, 0]]), _t([[1.0, 1.0], [-1.0, -1.0]])
    loss, m = POLICY_LOSSES.get("gspo")(logp, torch.zeros(2, 2), adv, mask, clip_high=0.3,
                                        agg="seq-mean-token-mean")
    loss.backward()
    assert_close(loss, _t(-0.110701), **ATOL)
    assert_close(logp.grad, _t([[-0.305351, -0.305351], [0.5, 0.0]]), **ATOL)
    assert_close(m["clip_frac"], _t(0.0))


# --------------------------------------------------------------------------------------------- CISPO
def test_cispo_clipped_stop_gradient_weight():
    # ratios [1.5, 0.5, 1], A [1, 1, -1], clip 0.2 -> weights w = clip(ratio, 0.8, 1.2) = [1.2, 0.8, 1.0]
    # loss_t = -A * w * logp = [-1.2 * 0.405465, -0.8 * -0.693147, 1 * 1 * 0] = [-0.486558, 0.554518, 0]
    # token-mean = 0.067960 / 3 = 0.022653; grad_t = -A * w / 3 = [-0.4, -0.266667, 0.333333]
    # (PPO would give token 0 no gradient: ratio 1.5 > 1.2 with A > 0); clip_frac: tokens 0 and 1 -> 2/3
    logp = _t([[math.log(1.5), math.log(0.5), 0.0]]).requires_grad_()
    loss, m = POLICY_LOSSES.get("cispo")(logp, torch.zeros(1, 3), _t([[1.0, 1.0, -1.0]]), torch.ones(1, 3))
    loss.backward()
    assert_close(loss, _t(0.022653), **ATOL)
    assert_close(logp.grad, _t([[-0.4, -0.266667, 0.333333]]), **ATOL)
    assert_close(m["clip_frac"], _t(2.0 / 3.0), **ATOL)
    assert_close(m["dual_clip_frac"], _t(0.0))


def test_cispo_upper_bound_only():
    # clip_low = 1.0 (the paper's setting): ratio 0.5 keeps w = 0.5; grad = -A * w = -0.5; ratio 3 -> w = 1.2
    logp = _t([[math.log(0.5), math.log(3.0)]]).requires_grad_()
    loss, m = POLICY_LOSSES.get("cispo")(logp, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2), clip_low=1.0,
                                         agg="seq-mean-token-sum")
    loss.backward()
    assert_close(logp.grad, _t([[-0.5, -1.2]]), **ATOL)
    assert_close(m["clip_frac"], _t(0.5))


# ------------------------------------------------------------------------------- per-token IS weights
@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_is_weights_scale_token_losses(name):
    # on-policy (ratio 1), A = 1: every loss gives each token -1 (cispo: -A * 1 * logp = 0, so use its gradient)
    # weights [2, 0.5] -> gradient per token -w / 2 tokens = [-1, -0.25]; None equals weights of 1, bit for bit
    logp = torch.zeros(1, 2, requires_grad=True)
    args = (torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2))
    loss, _ = POLICY_LOSSES.get(name)(logp, *args, is_weights_BT=_t([[2.0, 0.5]]))
    loss.backward()
    assert_close(logp.grad, _t([[-1.0, -0.25]]))
    plain, _ = POLICY_LOSSES.get(name)(logp, *args)
    ones, _ = POLICY_LOSSES.get(name)(logp, *args, is_weights_BT=torch.ones(1, 2))
    assert torch.equal(plain, ones)


def test_ppo_is_weights_value():
    # ratio 1, A = 1 -> per-token loss -1; weights [2, 0.5] -> (-2 - 0.5) / 2 = -1.25
    loss, _ = ppo_policy_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2),
                              is_weights_BT=_t([[2.0, 0.5]]))
    assert_close(loss, _t(-1.25))


# --------------------------------------------------------------------------------------- value loss
V, OLD_V, RET = _t([[1.5, 0.5]]), _t([[1.0, 1.0]]), _t([[2.0, 2.0]])


def test_value_loss_clipped():
    # token 0: (1.5 - 2)^2 = 0.25; clipped v = clip(1.5, 0.8, 1.2) = 1.2 -> (1.2 - 2)^2 = 0.64; max 0.64
    # token 1: (0.5 - 2)^2 = 2.25; clipped v = 0.8 -> (0.8 - 2)^2 = 1.44; max 2.25
    # 0.5 * (0.64 + 2.25) / 2 = 0.7225; clipped branch active on token 0 -> vf_clip_frac 0.5
    loss, m = value_loss(V, OLD_V, RET, torch.ones(1, 2), clip=0.2)
    assert_close(loss, _t(0.7225), **ATOL)
    assert_close(m["vf_clip_frac"], _t(0.5))


def test_value_loss_unclipped():
    # 0.5 * (0.25 + 2.25) / 2 = 0.625
    loss, m = value_loss(V, OLD_V, RET, torch.ones(1, 2), clip=None)
    assert_close(loss, _t(0.625))
    assert_close(m["vf_clip_frac"], _t(0.0))


# --------------------------------------------------------------------------------------- aggregation
LOSS = _t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = _t([[1, 1, 1], [1, 0, 0]])


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 2.5),  # (1 + 2 + 3 + 4) / 4 tokens
        ("seq-mean-token-sum", 5.0),  # (6 + 4) / 2 sequences
        ("seq-mean-token-mean", 3.0),  # (6/3 + 4/1) / 2 = (2 + 4) / 2
        ("seq-mean-token-sum-norm", 10.0 / 6.0),  # 10 / (2 sequences * norm_len 3)
    ],
)
def test_aggregation_modes(mode, expected):
    assert_close(aggregate(LOSS, MASK, mode, norm_len=3), _t(expected))


ALL_MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


@pytest.mark.parametrize("mode", ALL_MODES)
def test_split_batch_with_global_counts_equals_full_batch(mode):
    # 4 sequences of lengths 3, 1, 2, 3 (9 tokens), split into two "ranks" of 2 sequences each
    loss = _t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0], [1.5, 2.5, 3.5]])
    mask = _t([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]])
    counts = dict(num_tokens=9.0, num_seqs=4.0, norm_len=3.0)
    full = aggregate(loss, mask, mode, **counts)
    halves = aggregate(loss[:2], mask[:2], mode, **counts) + aggregate(loss[2:], mask[2:], mode, **counts)
    assert_close(halves, full)
    assert sorted(AGGREGATIONS.names()) == sorted(ALL_MODES)


def test_split_batch_with_local_counts_is_wrong():
    # why counts are parameters: halves [1,2,3] and [4] give token means 2 and 4; their average 3 != 2.5
    halves = [aggregate(LOSS[i:i + 1], MASK[i:i + 1], "token-mean") for i in range(2)]
    assert_close((halves[0] + halves[1]) / 2, _t(3.0))
    assert_close(aggregate(LOSS, MASK, "token-mean"), _t(2.5))


def test_token_sum_norm_needs_norm_len():
    with pytest.raises(ValueError, match="needs norm_len"):
        aggregate(LOSS, MASK, "seq-mean-token-sum-norm")


def test_unknown_aggregation():
    with pytest.raises(ValueError, match="did you mean 'seq-mean-token-mean'"):
        aggregate(LOSS, MASK, "seq-mean-tok-mean")


def test_policy_loss_uses_aggregation():
    # ratio 1, A = per-token [1, 2, 3 | 4, -, -] -> loss -A; seq-mean-token-mean = -(2 + 4) / 2 = -3
    loss, _ = ppo_policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), LOSS, MASK, agg="seq-mean-token-mean")
    assert_close(loss, _t(-3.0))


# ------------------------------------------------------------------------------------ KL and entropy
def test_kl_loss_k3():
    # log r = ref - logp = [-1, 1] -> k3 = [e^-1, e - 2] = [0.367879, 0.718282]; mean 0.543081
    loss, m = kl_loss(_t([[0.0, -1.0]]), _t([[-1.0, 0.0]]), torch.ones(1, 2), kind="k3")
    assert_close(loss, _t(0.543081), **ATOL)
    assert_close(m["kl"], _t(0.543081), **ATOL)


def test_kl_loss_k1_masked():
    # k1 = logp - ref = [1, -1]; second token masked -> 1
    loss, _ = kl_loss(_t([[0.0, -1.0]]), _t([[-1.0, 0.0]]), _t([[1.0, 0.0]]), kind="k1")
    assert_close(loss, _t(1.0))


def test_entropy_from_logits():
    logits = torch.stack([
        torch.zeros(4),  # uniform over 4 -> log 4 = 1.386294
        _t([1000.0, 1000.0, -1000.0, -1000.0]),  # two equal huge logits -> log 2 = 0.693147, no overflow
        _t([0.0, float("-inf"), float("-inf"), 0.0]),  # -inf logits (masked vocab) -> log 2, not NaN
        _t([100.0, 0.0, 0.0, 0.0]),  # near one-hot -> ~0 (3 * 101 * e^-100, far below atol)
    ]).view(2, 2, 4)
    expected = _t([[math.log(4), math.log(2)], [math.log(2), 0.0]])
    assert_close(entropy_from_logits(logits), expected, **ATOL)


def test_entropy_loss():
    # token-mean of LOSS under MASK (see aggregation test) = 2.5
    assert_close(entropy_loss(LOSS, MASK, agg="token-mean"), _t(2.5))


def test_apply_kl_penalty():
    # k1 = logp - ref = [1, -1, 7 (masked)]; token rewards = -0.1 * kl = [-0.1, 0.1, 0]
    rewards, kl = apply_kl_penalty(_t([1.0]), _t([[0.0, -1.0, 7.0]]), _t([[-1.0, 0.0, 0.0]]),
                                   _t([[1, 1, 0]]), coef=0.1, kind="k1")
    assert_close(kl, _t([[1.0, -1.0, 0.0]]))
    assert_close(rewards, _t([[-0.1, 0.1, 0.0]]))
