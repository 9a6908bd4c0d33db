import pytest

from fleetrl.algo import ADVANTAGES, AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES, Registry
from fleetrl.algo.kl import kl_estimate, make_kl_controller


def test_register_get_names_contains():
    reg: Registry[int] = Registry("widget")
    reg.register("b")(2)
    reg.register("a")(1)
    assert reg.get("a") == 1 and reg.names() == ["a", "b"]
    assert "a" in reg and "c" not in reg


def test_duplicate_registration_rejected():
    reg: Registry[int] = Registry("widget")
    reg.register("a")(1)
    with pytest.raises(ValueError, match="already registered"):
        reg.register("a")(2)


def test_unknown_name_suggests_closest():
    with pytest.raises(ValueError) as e:
        ADVANTAGES.get("grpoo")
    assert str(e.value) == (
        "unknown advantage estimator 'grpoo'; did you mean 'grpo'? known: "
        "drgrpo, gae, grpo, grpo_turns, reinforce_plus_plus, reinforce_plus_plus_baseline, rloo"
    )


def test_unknown_name_without_close_match_lists_known():
    with pytest.raises(ValueError, match=r"^unknown widget 'zzz'; known: a$"):
        reg: Registry[int] = Registry("widget")
        reg.register("a")(1)
        reg.get("zzz")


@pytest.mark.parametrize(
    "lookup, suggestion",
    [
        (lambda: POLICY_LOSSES.get("ppo2"), "'ppo'"),
        (lambda: AGGREGATIONS.get("token_mean"), "'token-mean'"),
        (lambda: KL_ESTIMATORS.get("kl3"), "'k3'"),
        (lambda: kl_estimate(None, None, "k33"), "'k3'"),
        (lambda: make_kl_controller("adaptiv", 0.1, 6.0, 1e4), "'adaptive'"),
    ],
)
def test_did_you_mean_everywhere(lookup, suggestion):
    with pytest.raises(ValueError, match=f"did you mean {suggestion}"):
        lookup()
