"""Scalar reward model (tiny classifier) and the generative judge's prompt, parse and end-to-end path."""
import pytest
import torch

from fleetrl.config.reward_model import RewardModelConfig
from fleetrl.models.tiny import build_tiny_tokenizer
from fleetrl.rewards.judge import fill_template, parse_verdict
from fleetrl.rewards.model import (
    ScalarRewardModel,
    build_scorer,
    encode_pairs,
    load_scalar_rm,
    render_pair,
)

PROMPT = [{"role": "user", "content": "copy a b 7 ="}]


def test_render_pair_uses_the_chat_template():
    assert render_pair(build_tiny_tokenizer(), PROMPT, "7") == "user : copy a b 7 = assistant : 7"


def test_encode_keeps_the_end_of_overlong_text():
    tok = build_tiny_tokenizer()
    ids, mask = encode_pairs(tok, ["a b c d", "x"], 3, torch.device("cpu"))
    # "a b c d" keeps its last 3 words; "x" is left-padded with two pads (id 0)
    assert ids.tolist() == [tok.convert_tokens_to_ids(["b", "c", "d"]), [0, 0, tok.convert_tokens_to_ids("x")]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_scalar_scores_do_not_depend_on_batch_padding():
    tok = build_tiny_tokenizer()
    rm = ScalarRewardModel(load_scalar_rm("tiny:seed=3"), tok, max_length=64, micro_batch_size=4)
    together, unparsed = rm.score([PROMPT, PROMPT], ["7", "7 a b c"])
    alone = rm.score([PROMPT], ["7"]).scores_B
    assert unparsed.tolist() == [False, False]
    assert together.shape == (2,) and together.dtype == torch.float32
    assert together[0].item() == pytest.approx(alone.item(), abs=1e-5)  # left padding is masked out
    assert together[0].item() != pytest.approx(together[1].item(), abs=1e-6)


def test_multi_label_classifier_is_refused(tmp_path):
    from transformers import LlamaForSequenceClassification

    lm = load_scalar_rm("tiny:")
    lm.config.num_labels = 2
    LlamaForSequenceClassification(lm.config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="num_labels=2; a scalar reward model has one output"):
        load_scalar_rm(str(tmp_path))


@pytest.mark.parametrize("text,expected", [
    ("score: 7", 7.0),
    ("The answer is right.\nScore = 9.5", 9.5),
    ("a score: 3 would be harsh ... score: 8", 8.0),  # the last one counts
    ("SCORE:-2", -2.0),
    ("score: ten", None),
    ("I rate it 7/10", None),
    ("", None),
])
def test_parse_verdict(text, expected):
    assert parse_verdict(text) == expected


def test_template_keeps_braces_of_the_text():
    assert fill_template("P={prompt} R={response}", PROMPT, "f(x) = {x}") == "P=copy a b 7 = R=f(x) = {x}"


def test_judge_runs_end_to_end_and_scores_its_parsed_verdicts():
    cfg = RewardModelConfig(path="tiny:", kind="judge", max_new_tokens=6, score_scale=0.5, failed_score=-1.0)
    judge = build_scorer(cfg, torch.device("cpu"))
    prompts, responses = [PROMPT, PROMPT, PROMPT], ["7", "3", "7 a"]
    verdicts = judge.verdicts(prompts, responses)
    scores, unparsed = judge.score(prompts, responses)
    parsed = [parse_verdict(v) for v in verdicts]
    assert scores.tolist() == [-1.0 if p is None else 0.5 * p for p in parsed]
    assert unparsed.tolist() == [p is None for p in parsed]
    assert judge.verdicts(prompts, responses) == verdicts  # greedy: the same verdicts again


def _judge_that_says_score_8(path):
    """A tiny LM taught (a few dozen Adam steps) to answer every judge prompt with `score : 8`."""
    from fleetrl.models.tiny import DEFAULT_WORDS, build_tiny_model

    tok = build_tiny_tokenizer([*DEFAULT_WORDS, "score"])
    lm = build_tiny_model(tok, seed=0).train()
    texts = [f"user : copy {a} b {d} = ? {r} assistant : score : 8" for a in "abc" for d in "123" for r in "37"]
    ids = torch.tensor([tok(t)["input_ids"] + [tok.eos_token_id] for t in texts])
    opt = torch.optim.Adam(lm.parameters(), lr=1e-2)
    for _ in range(40):
        loss = lm(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    lm.eval().save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def test_judge_verdict_becomes_the_scaled_score(tmp_path):
    path = _judge_that_says_score_8(tmp_path)
    cfg = RewardModelConfig(path=path, kind="judge", template="{prompt} ? {response}", max_new_tokens=4,
                            score_scale=0.5)
    judge = build_scorer(cfg, torch.device("cpu"))
    scores, unparsed = judge.score([PROMPT, PROMPT], ["7", "3"])
    assert judge.verdicts([PROMPT], ["7"]) == ["score : 8"]
    assert scores.tolist() == [4.0, 4.0] and unparsed.tolist() == [False, False]  # 8 × score_scale 0.5
