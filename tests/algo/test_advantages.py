from dataclasses import replace

import pytest
import torch
from torch.testing import assert_close

from fleetrl.algo.advantages import (
    ADVANTAGES,
    OUTCOME_ESTIMATORS,
    AdvantageInputs,
    fold_kl_into_scores,
    gae_advantages,
    is_outcome_estimator,
    place_scores_on_last_token,
    turn_index,
)

ATOL = dict(atol=1e-5, rtol=1e-5)


def _inputs(**kw) -> AdvantageInputs:
    return AdvantageInputs(**kw)


# ----------------------------------------------------------------------------------------- helpers
def test_place_scores_on_last_token():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 1], [0, 0, 0]])
    # last valid index per row: 2, 1, 2 (hole at 1 skipped), none (empty row gets nothing)
    out = place_scores_on_last_token(torch.tensor([1.0, 2.0, 3.0, 4.0]), mask)
    assert_close(out, torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0], [0.0, 0.0, 3.0], [0.0, 0.0, 0.0]]))


# --------------------------------------------------------------------------------------------- GAE
def test_gae_gamma_lam_one():
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.6, 0.7]])
    # gamma = lam = 1: A_t = (sum of rewards from t) - V_t = 1 - V_t = [0.5, 0.4, 0.3]; returns = A + V = 1
    adv, ret = gae_advantages(r, v, torch.ones(1, 3), gamma=1.0, lam=1.0)
    assert_close(adv, torch.tensor([[0.5, 0.4, 0.3]]), **ATOL)
    assert_close(ret, torch.tensor([[1.0, 1.0, 1.0]]), **ATOL)


def test_gae_gamma_09_lam_08():
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.6, 0.7]])
    # t=2: delta = 1 + 0.9*0 - 0.7 = 0.3                      A2 = 0.3
    # t=1: delta = 0 + 0.9*0.7 - 0.6 = 0.03                   A1 = 0.03 + 0.72*0.3 = 0.246
    # t=0: delta = 0 + 0.9*0.6 - 0.5 = 0.04                   A0 = 0.04 + 0.72*0.246 = 0.21712
    # returns = A + V = [0.71712, 0.846, 1.0]
    adv, ret = gae_advantages(r, v, torch.ones(1, 3), gamma=0.9, lam=0.8)
    assert_close(adv, torch.tensor([[0.21712, 0.246, 0.3]]), **ATOL)
    assert_close(ret, torch.tensor([[0.71712, 0.846, 1.0]]), **ATOL)


def test_gae_mask_ends_before_T():
    # same as above plus a padding token whose reward 5 and value 9 must be ignored (bootstrap 0 after t=2)
    r = torch.tensor([[0.0, 0.0, 1.0, 5.0]])
    v = torch.tensor([[0.5, 0.6, 0.7, 9.0]])
    adv, ret = gae_advantages(r, v, torch.tensor([[1, 1, 1, 0]]), gamma=0.9, lam=0.8)
    assert_close(adv, torch.tensor([[0.21712, 0.246, 0.3, 0.0]]), **ATOL)
    assert_close(ret, torch.tensor([[0.71712, 0.846, 1.0, 0.0]]), **ATOL)


def test_gae_skips_holes_in_mask():
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 9.0, 0.7]])
    # t=1 is masked (e.g. tool output): t=0 bootstraps from t=2.
    # A2 = 0.3; delta0 = 0 + 0.9*0.7 - 0.5 = 0.13; A0 = 0.13 + 0.72*0.3 = 0.346
    adv, ret = gae_advantages(r, v, torch.tensor([[1, 0, 1]]), gamma=0.9, lam=0.8)
    assert_close(adv, torch.tensor([[0.346, 0.0, 0.3]]), **ATOL)
    assert_close(ret, torch.tensor([[0.846, 0.0, 1.0]]), **ATOL)


def test_gae_registered_whitens_and_places_score():
    inputs = _inputs(
        scores_B=torch.tensor([1.0]), mask_BT=torch.tensor([[1, 1, 1, 0]]), group_B=torch.tensor([0]),
        values_BT=torch.tensor([[0.5, 0.6, 0.7, 9.0]]),
    )
    # score 1 lands on t=2; un-whitened A = [0.5, 0.4, 0.3] (see gamma=lam=1 case)
    # whiten: mean 0.4, unbiased var (0.01 + 0 + 0.01) / 2 = 0.01, std 0.1 -> [1, 0, -1]
    adv, ret = ADVANTAGES.get("gae")(inputs)
    assert_close(adv, torch.tensor([[1.0, 0.0, -1.0, 0.0]]), **ATOL)
    assert_close(ret, torch.tensor([[1.0, 1.0, 1.0, 0.0]]), **ATOL)


def test_gae_needs_values():
    inputs = _inputs(scores_B=torch.ones(1), mask_BT=torch.ones(1, 2), group_B=torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError, match="needs values_BT"):
        ADVANTAGES.get("gae")(inputs)


# ----------------------------------------------------------------------------- group estimators
# groups: id 0 -> scores [1, 0, 1, 0]; id 1 -> [1, 1]. Response masks of different lengths (T = 2).
SCORES = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0])
GROUPS = torch.tensor([0, 0, 0, 0, 1, 1])
MASK = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1], [1, 0], [1, 1]])


def _group_inputs(**kw) -> AdvantageInputs:
    return _inputs(scores_B=SCORES, mask_BT=MASK, group_B=GROUPS, **kw)


def test_grpo_with_std():
    # group 0: mean 0.5; unbiased var (4 * 0.25) / 3 = 1/3, std 0.57735 -> +-0.5 / 0.57735 = +-0.866025
    # group 1: mean 1, std 0 -> 0 / (0 + eps) = 0
    adv, ret = ADVANTAGES.get("grpo")(_group_inputs())
    a = 0.866025
    expected = torch.tensor([[a, a], [-a, 0.0], [a, a], [-a, -a], [0.0, 0.0], [0.0, 0.0]])
    assert_close(adv, expected, **ATOL)
    assert_close(ret, expected, **ATOL)


def test_grpo_without_std():
    # mean-centred only: group 0 -> +-0.5, group 1 -> 0
    adv, _ = ADVANTAGES.get("grpo")(_group_inputs(norm_by_std=False))
    expected = torch.tensor([[0.5, 0.5], [-0.5, 0.0], [0.5, 0.5], [-0.5, -0.5], [0.0, 0.0], [0.0, 0.0]])
    assert_close(adv, expected, **ATOL)


def test_grpo_group_of_one_and_unsorted_ids():
    # ids 7 and 3 interleaved; id 9 alone -> 0. Group 7: scores [2, 0] mean 1, std sqrt(2) -> +-1/sqrt(2)
    inputs = _inputs(
        scores_B=torch.tensor([2.0, 5.0, 0.0, 5.0, 3.0]), group_B=torch.tensor([7, 3, 7, 3, 9]),
        mask_BT=torch.ones(5, 1),
    )
    adv, _ = ADVANTAGES.get("grpo")(inputs)
    assert_close(adv[:, 0], torch.tensor([0.707106, 0.0, -0.707106, 0.0, 0.0]), **ATOL)


def test_drgrpo_never_divides_by_std():
    # norm_by_std=True is ignored: same as centring only, +-0.5 and 0
    adv, _ = ADVANTAGES.get("drgrpo")(_group_inputs(norm_by_std=True))
    expected = torch.tensor([[0.5, 0.5], [-0.5, 0.0], [0.5, 0.5], [-0.5, -0.5], [0.0, 0.0], [0.0, 0.0]])
    assert_close(adv, expected, **ATOL)


def test_grpo_family_ignores_token_rewards():
    extra = torch.full((6, 2), 10.0)
    for name in ("grpo", "grpo_turns", "drgrpo", "rloo"):
        with_extra, _ = ADVANTAGES.get(name)(_group_inputs(token_rewards_BT=extra))
        without, _ = ADVANTAGES.get(name)(_group_inputs())
        assert_close(with_extra, without)


def test_rloo_group_of_three_and_singleton():
    # group 0 scores [1, 2, 6]: baselines (2+6)/2 = 4, (1+6)/2 = 3.5, (1+2)/2 = 1.5
    #   -> advantages 1-4 = -3, 2-3.5 = -1.5, 6-1.5 = 4.5 ; group 1 has one sample -> 0
    inputs = _inputs(
        scores_B=torch.tensor([1.0, 2.0, 6.0, 4.0]), group_B=torch.tensor([0, 0, 0, 1]),
        mask_BT=torch.tensor([[1, 1], [1, 1], [1, 0], [1, 1]]),
    )
    adv, _ = ADVANTAGES.get("rloo")(inputs)
    assert_close(adv, torch.tensor([[-3.0, -3.0], [-1.5, -1.5], [4.5, 0.0], [0.0, 0.0]]), **ATOL)


# ------------------------------------------------------------------------------------- REINFORCE++
RPP_MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def test_reinforce_plus_plus_gamma_one():
    inputs = _inputs(scores_B=torch.tensor([1.0, 0.0]), mask_BT=RPP_MASK, group_B=torch.tensor([0, 1]))
    # return-to-go: row 0 [1, 1, 1], row 1 [0, 0, -]
    # whiten over 5 tokens: mean 0.6; unbiased var (3*0.16 + 2*0.36) / 4 = 0.3, std 0.547723
    #   -> 0.4 / 0.547723 = 0.730297 and -0.6 / 0.547723 = -1.095445
    adv, ret = ADVANTAGES.get("reinforce_plus_plus")(inputs)
    assert_close(ret, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]), **ATOL)
    assert_close(adv, torch.tensor([[0.730297, 0.730297, 0.730297], [-1.095445, -1.095445, 0.0]]), **ATOL)


def test_reinforce_plus_plus_with_token_kl_penalty():
    # token rewards -coef*KL; the 5.0 at a padded position must be ignored
    token_rewards = torch.tensor([[-0.1, -0.2, 0.0], [0.0, -0.1, 5.0]])
    inputs = _inputs(
        scores_B=torch.tensor([1.0, 0.0]), mask_BT=RPP_MASK, group_B=torch.tensor([0, 1]),
        token_rewards_BT=token_rewards,
    )
    # rewards row 0 [-0.1, -0.2, 1.0] -> return-to-go [0.7, 0.8, 1.0]; row 1 [0, -0.1] -> [-0.1, -0.1]
    # whiten: mean 2.3 / 5 = 0.46; deviations .24 .34 .54 -.56 -.56; sum of squares 1.092;
    #   var 1.092 / 4 = 0.273, std 0.522494 -> [0.459335, 0.650725, 1.033505], [-1.071783, -1.071783]
    adv, ret = ADVANTAGES.get("reinforce_plus_plus")(inputs)
    assert_close(ret, torch.tensor([[0.7, 0.8, 1.0], [-0.1, -0.1, 0.0]]), **ATOL)
    expected = torch.tensor([[0.459335, 0.650725, 1.033505], [-1.071783, -1.071783, 0.0]])
    assert_close(adv, expected, **ATOL)


def test_reinforce_plus_plus_discount():
    # gamma 0.5 on rewards [-0.1, -0.2, 1.0]: G2 = 1, G1 = -0.2 + 0.5*1 = 0.3, G0 = -0.1 + 0.5*0.3 = 0.05
    inputs = _inputs(
        scores_B=torch.tensor([1.0]), mask_BT=torch.ones(1, 3), group_B=torch.tensor([0]),
        token_rewards_BT=torch.tensor([[-0.1, -0.2, 0.0]]), gamma=0.5,
    )
    _, ret = ADVANTAGES.get("reinforce_plus_plus")(inputs)
    assert_close(ret, torch.tensor([[0.05, 0.3, 1.0]]), **ATOL)


def test_reinforce_plus_plus_baseline():
    inputs = _inputs(
        scores_B=torch.tensor([1.0, 0.0, 1.0, 1.0]), group_B=torch.tensor([0, 0, 1, 1]), mask_BT=torch.ones(4, 2),
    )
    # group means 0.5 and 1 -> centred [0.5, -0.5, 0, 0]; gamma 1 -> every token of a row gets its score
    # whiten over 8 tokens: mean 0, unbiased var 4*0.25 / 7 = 1/7, std 0.377964 -> +-1.322876, 0
    adv, ret = ADVANTAGES.get("reinforce_plus_plus_baseline")(inputs)
    assert_close(ret, torch.tensor([[0.5, 0.5], [-0.5, -0.5], [0.0, 0.0], [0.0, 0.0]]), **ATOL)
    a = 1.322876
    assert_close(adv, torch.tensor([[a, a], [-a, -a], [0.0, 0.0], [0.0, 0.0]]), **ATOL)


# ----------------------------------------------------------------------------------- all estimators
@pytest.mark.parametrize("name", ADVANTAGES.names())
def test_zero_where_masked_and_no_grad(name):
    values = torch.randn(4, 3, requires_grad=True)
    inputs = _inputs(
        scores_B=torch.tensor([1.0, 0.0, 0.5, 2.0]), group_B=torch.tensor([0, 0, 1, 1]),
        mask_BT=torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]]), values_BT=values,
    )
    adv, ret = ADVANTAGES.get(name)(inputs)
    pad = inputs.mask_BT == 0
    assert (adv[pad] == 0).all() and (ret[pad] == 0).all()
    assert not adv.requires_grad and not ret.requires_grad
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()


def test_inputs_shape_mismatch():
    with pytest.raises(ValueError, match=r"values_BT has shape \(2, 4\); expected \(2, 3\)"):
        _inputs(scores_B=torch.ones(2), mask_BT=torch.ones(2, 3), group_B=torch.zeros(2),
                values_BT=torch.ones(2, 4))


# ------------------------------------------------------------------------------- KL in the reward, outcome
def test_fold_kl_into_scores():
    # kl per token (k1 = logp - ref): seq 0 [1, 2, pad 50] -> 3; seq 1 [0.5, -0.5, 0] -> 0
    # coef 0.1: [1 - 0.3, 2 - 0] = [0.7, 2.0]; the padded 50 must not count
    kl = torch.tensor([[1.0, 2.0, 50.0], [0.5, -0.5, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert_close(fold_kl_into_scores(torch.tensor([1.0, 2.0]), kl, mask, coef=0.1), torch.tensor([0.7, 2.0]))


def test_drgrpo_with_kl_in_reward_differs_from_without():
    # The issue-13 example: two groups of two, scores [1, 0 | 1, 0], coef 0.1.
    # Without the penalty: drgrpo = score - group mean = [0.5, -0.5, 0.5, -0.5]; passing the penalty as
    # token_rewards_BT changes nothing (outcome estimators ignore it).
    # Per-token kl sums [3, 0, 9, 0] -> folded scores [1 - 0.3, 0, 1 - 0.9, 0] = [0.7, 0, 0.1, 0]
    # group means 0.35 and 0.05 -> drgrpo [0.35, -0.35, 0.05, -0.05]
    scores, group = torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.tensor([0, 0, 1, 1])
    mask = torch.ones(4, 2)
    kl = torch.tensor([[1.0, 2.0], [0.0, 0.0], [4.0, 5.0], [0.0, 0.0]])
    drgrpo = ADVANTAGES.get("drgrpo")
    plain, _ = drgrpo(_inputs(scores_B=scores, mask_BT=mask, group_B=group))
    ignored, _ = drgrpo(_inputs(scores_B=scores, mask_BT=mask, group_B=group, token_rewards_BT=-0.1 * kl))
    folded, _ = drgrpo(_inputs(scores_B=fold_kl_into_scores(scores, kl, mask, 0.1), mask_BT=mask, group_B=group))
    assert_close(plain[:, 0], torch.tensor([0.5, -0.5, 0.5, -0.5]))
    assert torch.equal(ignored, plain)
    assert_close(folded[:, 0], torch.tensor([0.35, -0.35, 0.05, -0.05]), **ATOL)


@pytest.mark.parametrize("name", ADVANTAGES.names())
def test_outcome_estimators_are_exactly_those_ignoring_token_rewards(name):
    # A token reward on the first token of sequence 0 only: estimators that read token rewards must change.
    base = {"scores_B": torch.tensor([1.0, 0.0, 0.5]), "mask_BT": torch.ones(3, 2),
            "group_B": torch.tensor([0, 0, 0]), "values_BT": torch.tensor([[0.1, 0.2], [0.3, 0.4], [0.5, 0.6]])}
    without, _ = ADVANTAGES.get(name)(_inputs(**base))
    bonus = torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    with_bonus, _ = ADVANTAGES.get(name)(_inputs(**base, token_rewards_BT=bonus))
    assert is_outcome_estimator(name) == torch.equal(without, with_bonus)
    assert is_outcome_estimator(name) == (name in OUTCOME_ESTIMATORS)


def test_is_outcome_estimator_rejects_unknown_names():
    with pytest.raises(ValueError, match="did you mean 'drgrpo'"):
        is_outcome_estimator("drgrp")


# ------------------------------------------------------------------------------------- per-turn GRPO
# Loss masks of a multi-turn batch (0 = environment token or padding). Rows 0 and 2 call a tool (turn 0), read
# its reply and answer (turn 1); rows 1 and 3 answer at once (row 3's answer is two tokens).
TURN_MASK = torch.tensor([[1, 0, 0, 1, 0], [1, 0, 0, 0, 0], [1, 0, 0, 1, 0], [1, 1, 0, 0, 0]])


def test_turn_index_numbers_the_runs_of_model_tokens():
    assert turn_index(TURN_MASK).tolist() == [[0, -1, -1, 1, -1], [0, -1, -1, -1, -1], [0, -1, -1, 1, -1],
                                              [0, 0, -1, -1, -1]]


def test_grpo_turns_gives_the_call_bonus_to_the_call_not_to_wrong_answers():
    # Every answer is wrong; the callers (rows 0, 2) get the 0.1 call bonus: scores [0.1, 0, 0.1, 0].
    # grpo: mean 0.05, unbiased std sqrt(4 * 0.0025 / 3) = 0.057735 -> +-0.866025 on EVERY token, so the callers'
    #   wrong answers (position 3) are reinforced with +0.866.
    # grpo_turns: turn 0 is the same over all four rows (+-0.866025); turn 1 is compared among rows 0 and 2
    #   only: scores [0.1, 0.1], mean 0.1 -> 0 (nothing for a wrong answer).
    inputs = _inputs(scores_B=torch.tensor([0.1, 0.0, 0.1, 0.0]), mask_BT=TURN_MASK, group_B=torch.zeros(4))
    a = 0.866025
    plain, _ = ADVANTAGES.get("grpo")(inputs)
    assert_close(plain[:, 3], torch.tensor([a, 0.0, a, 0.0]), **ATOL)
    adv, ret = ADVANTAGES.get("grpo_turns")(inputs)
    expected = torch.tensor([[a, 0, 0, 0, 0], [-a, 0, 0, 0, 0], [a, 0, 0, 0, 0], [-a, -a, 0, 0, 0]])
    assert_close(adv, expected, **ATOL)
    assert_close(ret, expected, **ATOL)


def test_grpo_turns_answer_credit_and_groups():
    # Group 0 as above but row 0 answered right: scores [1.1, 0, 0.1, 0].
    #   turn 0: mean 0.3, deviations [0.8, -0.3, -0.2, -0.3], unbiased var 0.86 / 3, std 0.535413
    #           -> [1.494176, -0.560316, -0.373544, -0.560316]
    #   turn 1: rows 0, 2: [1.1, 0.1], mean 0.6, std sqrt(0.5) -> +-0.707107 (without std: +-0.5)
    # Group 1 (rows 4, 5): one turn each, [1, 0] -> +-0.707107, exactly grpo.
    mask = torch.cat([TURN_MASK, torch.tensor([[1, 1, 0, 0, 0], [1, 0, 0, 0, 0]])])
    inputs = _inputs(scores_B=torch.tensor([1.1, 0.0, 0.1, 0.0, 1.0, 0.0]), mask_BT=mask,
                     group_B=torch.tensor([0, 0, 0, 0, 1, 1]))
    adv, _ = ADVANTAGES.get("grpo_turns")(inputs)
    r = 0.707107
    expected = torch.tensor([[1.494176, 0, 0, r, 0], [-0.560316, 0, 0, 0, 0], [-0.373544, 0, 0, -r, 0],
                             [-0.560316, -0.560316, 0, 0, 0], [r, r, 0, 0, 0], [-r, 0, 0, 0, 0]])
    assert_close(adv, expected, **ATOL)
    centred, _ = ADVANTAGES.get("grpo_turns")(replace(inputs, norm_by_std=False))
    assert_close(centred[[0, 2], 3], torch.tensor([0.5, -0.5]), **ATOL)


def test_grpo_turns_is_grpo_for_single_turn_responses():
    # No holes in MASK: one turn per row, so the per-turn baseline is the group's.
    assert_close(ADVANTAGES.get("grpo_turns")(_group_inputs())[0], ADVANTAGES.get("grpo")(_group_inputs())[0])
