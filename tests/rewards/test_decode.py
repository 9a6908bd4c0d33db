"""RewardScorer.decode: one batched decode gives exactly the texts of the per-row decode it replaced."""
from __future__ import annotations

import pytest
import torch

from fleetrl.batch import Batch
from fleetrl.config.schema import RunConfig
from fleetrl.models import shapes, tiny
from fleetrl.rewards.scorer import RewardScorer, batch_decode


def per_row(tokenizer, responses: torch.Tensor, mask: torch.Tensor) -> list[str]:
    """The decode RewardScorer used before batching: a tensor mask and a decode call per row."""
    return [tokenizer.decode(r[m.bool()].tolist(), skip_special_tokens=True) for r, m in zip(responses, mask)]


def decode(tokenizer, responses: torch.Tensor, mask: torch.Tensor) -> list[str]:
    scorer = RewardScorer(RunConfig(), tokenizer)
    try:
        return scorer.decode(Batch({"responses": responses, "response_mask": mask}))
    finally:
        scorer.close()


def random_batch(vocab: int, special: list[int], rows: int = 24, width: int = 40) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    responses = torch.randint(0, vocab, (rows, width), generator=g)
    responses[::5, 3] = special[0]  # special tokens inside kept text: skip_special_tokens drops them
    responses[1::5, -1] = special[-1]
    mask = torch.ones(rows, width, dtype=torch.long)
    lengths = torch.randint(0, width + 1, (rows,), generator=g)
    mask[torch.arange(width)[None, :] >= lengths[:, None]] = 0  # right padding of random lengths, some 0
    mask[2, :] = 0  # a row with nothing kept
    mask[4, 5:9] = 0  # holes inside a row: masked-out positions are dropped wherever they are
    # Masked-out positions keep their random ids: only the mask can drop them.
    return responses, mask


def test_batched_decode_matches_per_row_decode_on_the_qwen_tokenizer():
    tok = shapes.qwen_tokenizer()
    special = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
    responses, mask = random_batch(151643, special)
    # Text-like ids too: random BPE ids alone rarely make multi-byte characters split across tokens.
    text = tok("héllo wörld 你好，世界 🙂 <|im_end|> done")["input_ids"]
    responses[7, :len(text)] = torch.tensor(text)
    mask[7, :] = 0
    mask[7, :len(text)] = 1
    got = decode(tok, responses, mask)
    assert got == per_row(tok, responses, mask)
    assert got[2] == "" and got[7] == "héllo wörld 你好，世界 🙂  done"


def test_batched_decode_matches_per_row_decode_on_the_tiny_tokenizer_and_a_bool_mask():
    tok = tiny.build_tiny_tokenizer()
    special = [tok.pad_token_id, tok.eos_token_id]
    responses, mask = random_batch(len(tok), special)
    assert decode(tok, responses, mask.bool()) == per_row(tok, responses, mask)


def test_slow_path_with_space_clean_up_on_and_empty_batch():
    # With clean_up_tokenization_spaces on, transformers' decode does more than the backend's, so the plain
    # batch_decode path is taken; it must agree with the per-row decode all the same.
    tok = tiny.build_tiny_tokenizer()
    tok.clean_up_tokenization_spaces = True
    responses, mask = random_batch(len(tok), [tok.pad_token_id, tok.eos_token_id])
    assert decode(tok, responses, mask) == per_row(tok, responses, mask)
    assert batch_decode(tok, []) == []
    assert decode(tok, torch.zeros(0, 5, dtype=torch.long), torch.zeros(0, 5, dtype=torch.long)) == []


@pytest.mark.parametrize("make", [shapes.qwen_tokenizer, tiny.build_tiny_tokenizer])
def test_the_backend_shortcut_is_taken_only_without_space_clean_up(make, monkeypatch):
    tok = make()
    calls = []
    monkeypatch.setattr(type(tok), "batch_decode", lambda self, *a, **k: calls.append(1) or ["x"], raising=True)
    assert batch_decode(tok, [[1, 2]]) != ["x"] and not calls  # clean-up off: one backend call
    tok.clean_up_tokenization_spaces = True
    assert batch_decode(tok, [[1, 2]]) == ["x"] and calls == [1]
