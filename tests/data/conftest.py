"""Shared fixtures for data tests: a tiny word-level tokenizer and writers for hand-made data files."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

WORDS = "user assistant system : hello world what is 1 2 3 4 5 + = ? <|im_start|> <|im_end|>".split()
# Every turn is "<|im_start|> role content <|im_end|>"; words split on whitespace, so token counts are
# easy to compute by hand: one BOS, then three tokens per turn plus the content words.
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")


def make_tokenizer(chat_template: str | None = CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3}
    for w in WORDS:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # Adds BOS like Llama tokenizers do, so a double BOS after a chat template would show up.
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                 unk_token="<unk>")
    hf.chat_template = chat_template
    return hf


@pytest.fixture
def tokenizer() -> PreTrainedTokenizerFast:
    return make_tokenizer()


def verl_row(i: int, answer: str = "42", source: str = "openai/gsm8k") -> dict:
    return {"data_source": source, "prompt": [{"role": "user", "content": f"what is {i} + 1 ?"}],
            "ability": "math", "reward_model": {"ground_truth": answer, "style": "rule"},
            "extra_info": {"index": i, "split": "train"}}


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def write_parquet(path: Path, rows: list[dict]) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


# Helpers are handed out as fixtures, not imported, so test modules never depend on how pytest names conftest.
@pytest.fixture
def tokenizer_factory():
    return make_tokenizer


@pytest.fixture
def rows():
    return verl_row


@pytest.fixture
def jsonl():
    return write_jsonl


@pytest.fixture
def parquet():
    return write_parquet
