"""PromptDataset rendering/tokenization, length filtering, and collate."""
from __future__ import annotations

import logging

import pytest
import torch

from fleetrl.data import DataError, PromptDataset, PromptRecord, collate
from fleetrl.data.dataset import render_prompt


def chat(content: str, row: int = 0, file: str = "t.jsonl") -> PromptRecord:
    return PromptRecord(messages=({"role": "user", "content": content},), text=None, data_source="s", ability=None,
                        ground_truth="1", extra_info={}, source_file=file, row=row)


def text(content: str, row: int = 0) -> PromptRecord:
    return PromptRecord(messages=None, text=content, data_source="s", ability=None, ground_truth="1",
                        extra_info={}, source_file="t.jsonl", row=row)


def test_chat_template_applied_with_a_single_bos(tokenizer):
    ds = PromptDataset([chat("hello world")], tokenizer, max_prompt_length=64)
    record, ids = ds[0]
    tokens = tokenizer.convert_ids_to_tokens(ids)
    # The template writes BOS itself; the tokenizer's own BOS must not be added a second time.
    assert tokens == ["<bos>", "<|im_start|>", "user", "hello", "world", "<|im_end|>", "<|im_start|>", "assistant"]
    assert record.uid == "t.jsonl:0"


def test_plain_text_prompt_gets_the_tokenizers_bos(tokenizer):
    _, ids = PromptDataset([text("hello world")], tokenizer, max_prompt_length=64)[0]
    assert tokenizer.convert_ids_to_tokens(ids) == ["<bos>", "hello", "world"]


@pytest.mark.parametrize("has_template, apply", [(False, True), (True, False)])
def test_role_lines_fallback_without_template(tokenizer_factory, has_template, apply):
    tok = tokenizer_factory(None if not has_template else tokenizer_factory().chat_template)
    record = PromptRecord(messages=({"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}),
                          text=None, data_source="s", ability=None, ground_truth=1, extra_info={})
    use = apply and bool(tok.chat_template)
    assert render_prompt(record, tok, use) == ("system: be brief\nuser: hi\nassistant:", False)
    PromptDataset([record], tok, max_prompt_length=64, apply_chat_template=apply)  # builds without error


def test_long_prompts_are_filtered_counted_and_logged_once(tokenizer, caplog):
    # Chat prompt length = 7 template tokens + content words; text prompt length = 1 (BOS) + words.
    records = [chat("hello"), chat("1 2 3 4 5", row=1), text("1 2 3 4 5 1 2 3", row=2), text("hello", row=3)]
    with caplog.at_level(logging.WARNING, logger="fleetrl.data"):
        ds = PromptDataset(records, tokenizer, max_prompt_length=8)
    assert len(ds) == 2 and ds.num_filtered == 2
    assert [r.row for r in ds.records] == [0, 3]
    assert all(len(ids) <= 8 for ids in ds.prompt_ids)
    warnings = [r.getMessage() for r in caplog.records if r.name == "fleetrl.data"]
    assert len(warnings) == 1 and "dropped 2 of 4" in warnings[0] and "t.jsonl" in warnings[0] and "=8" in warnings[0]


def test_everything_filtered_says_to_raise_the_limit(tokenizer):
    with pytest.raises(DataError, match="raise data.max_prompt_length"):
        PromptDataset([chat("hello world")], tokenizer, max_prompt_length=3)


def test_template_failure_names_the_row(tokenizer_factory):
    tok = tokenizer_factory("{% for m in messages %}{% if m['role'] == 'system' %}"
                            "{{ raise_exception('system role not supported') }}{% endif %}"
                            "{{ m['content'] }}{% endfor %}")
    record = PromptRecord(messages=({"role": "system", "content": "x"},), text=None, data_source="s", ability=None,
                          ground_truth=1, extra_info={}, source_file="t.jsonl", row=5)
    with pytest.raises(DataError, match=r"t\.jsonl: row 5 \(0-based\), field 'prompt'.*system role not supported"):
        PromptDataset([record], tok, max_prompt_length=64)


def test_collate_left_pads_and_keeps_fields(tokenizer):
    ds = PromptDataset([chat("hello", row=0), text("hello world", row=1)], tokenizer, max_prompt_length=64)
    batch = collate([ds[0], ds[1]], pad_id=0)
    n0, n1 = len(ds[0][1]), len(ds[1][1])
    assert batch["prompts"].shape == (2, n0) and batch["prompts"].dtype == torch.long
    assert batch["prompt_mask"].tolist() == [[1] * n0, [0] * (n0 - n1) + [1] * n1]
    assert batch["prompts"][1].tolist() == [0] * (n0 - n1) + ds[1][1]
    assert list(batch["uid"]) == ["t.jsonl:0", "t.jsonl:1"]
    assert batch["raw_prompt"][0] == [{"role": "user", "content": "hello"}] and batch["raw_prompt"][1] == "hello world"
    assert list(batch["data_source"]) == ["s", "s"] and list(batch["ground_truth"]) == ["1", "1"]
    assert "extra_info" in batch and "ability" in batch
