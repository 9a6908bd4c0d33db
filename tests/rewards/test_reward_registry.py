"""resolve_scorer specs and RewardRouter routing by data_source."""
from __future__ import annotations

import pytest

from fleetrl.rewards import SCORERS, RewardError, RewardRouter, resolve_scorer

USER_FILE = """
def length_reward(response, ground_truth, extra_info):
    return min(len(response) / 10, 1.0)

NOT_CALLABLE = 3
"""


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "reward.py"
    path.write_text(USER_FILE)
    return str(path)


def test_builtins_and_user_file(user_file, tmp_path):
    assert resolve_scorer("gsm8k") is SCORERS["gsm8k"]
    fn = resolve_scorer(f"{user_file}:length_reward")
    assert fn("12345", None, {}) == 0.5
    # A second file with the same base name must load as a separate module.
    other = tmp_path / "sub"
    other.mkdir()
    (other / "reward.py").write_text("def length_reward(r, g, e):\n    return 7.0\n")
    assert resolve_scorer(f"{other / 'reward.py'}:length_reward")("", None, {}) == 7.0
    assert resolve_scorer(f"{user_file}:length_reward") is fn


@pytest.mark.parametrize("spec_suffix, match", [
    ("nope.py:f", "does not exist"),
    ("reward.py:missing", "has no attribute 'missing'.*length_reward"),
    ("reward.py:NOT_CALLABLE", "is a int, not a function"),
])
def test_bad_file_specs_name_the_spec(user_file, tmp_path, spec_suffix, match):
    spec = str(tmp_path / spec_suffix)
    with pytest.raises(RewardError, match=match) as info:
        resolve_scorer(spec)
    assert spec in str(info.value)


def test_unknown_name_and_broken_import(tmp_path):
    with pytest.raises(RewardError, match="unknown reward scorer 'gsm9k'.*builtins"):
        resolve_scorer("gsm9k")
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(RewardError, match="importing .*broken.py failed: RuntimeError: boom"):
        resolve_scorer(f"{broken}:f")


def test_router_order(user_file):
    router = RewardRouter({"openai/gsm8k": "exact_match", "lighteval/*": "prefix_match", "lighteval/MATH": "math",
                           "custom": f"{user_file}:length_reward"}, default=None)
    assert router.spec_for("openai/gsm8k") == "exact_match"  # exact key beats the gsm8k family default
    assert router.spec_for("openai/gsm8k_socratic") == "exact_match"  # prefix
    assert router.spec_for("lighteval/MATH") == "math"  # exact beats a prefix
    assert router.spec_for("lighteval/other") == "prefix_match"
    assert router.spec_for("my_gsm8k_copy") == "gsm8k"  # family default
    assert router.spec_for("DigitalLearning/MATH-lighteval") == "math"
    assert router.spec_for("custom").endswith("reward.py:length_reward")
    assert router.scorer_for("custom")("1234567890", None, {}) == 1.0


def test_unknown_sources_fail_before_training():
    router = RewardRouter({"a": "exact_match"}, default=None)
    router.check_sources(["a", "gsm8k", "MATH"])
    with pytest.raises(RewardError) as info:
        router.check_sources(["a", "trivia", "code"])
    message = str(info.value)
    assert "'code', 'trivia'" in message and "['a']" in message and "rewards.sources.<name>: <scorer>" in message
    with pytest.raises(RewardError, match="'trivia'"):
        router.spec_for("trivia")
    RewardRouter({}, default="exact_match").check_sources(["trivia"])


def test_router_rejects_bad_specs_at_construction():
    with pytest.raises(RewardError, match=r"rewards.sources.qa: unknown reward scorer 'exakt'"):
        RewardRouter({"qa": "exakt"})
    with pytest.raises(RewardError, match=r"rewards.default: .*does not exist"):
        RewardRouter({}, default="missing_file.py:f")
