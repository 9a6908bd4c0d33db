"""PromptDataset: records rendered to prompt text, tokenized once, and filtered by length."""
from __future__ import annotations

import logging
from typing import Any, Sequence

from fleetrl.data.errors import DataError, row_error
from fleetrl.data.records import PromptRecord

logger = logging.getLogger("fleetrl.data")


class PromptDataset:
    """Tokenized prompts of one task. `dataset[i]` is `(record, prompt_ids)`.

    Rendering: chat messages go through the tokenizer's chat template (with the generation prompt) when it
    has one and `apply_chat_template` is set. Otherwise they are joined as "role: content" lines followed by
    an "assistant:" line, so a base model still sees whose turn it is. Plain-text prompts are used as is.

    Special tokens: a chat template already writes BOS (and any other special tokens) itself, so templated
    text is tokenized with add_special_tokens=False; untemplated text uses the tokenizer's default, which
    adds BOS for tokenizers that want one. This way no prompt starts with two BOS tokens.

    Prompts longer than `max_prompt_length` tokens are dropped; `num_filtered` counts them.
    """

    def __init__(self, records: Sequence[PromptRecord], tokenizer: Any, *, max_prompt_length: int,
                 apply_chat_template: bool = True) -> None:
        if max_prompt_length <= 0:
            raise DataError(f"data.max_prompt_length must be a positive number of tokens, got {max_prompt_length}")
        if not records:
            raise DataError("no prompts to build a dataset from; check the data config")
        use_template = apply_chat_template and bool(getattr(tokenizer, "chat_template", None))
        rendered = [render_prompt(r, tokenizer, use_template) for r in records]
        ids = _tokenize(tokenizer, [text for text, _ in rendered], [templated for _, templated in rendered])
        keep = [i for i, x in enumerate(ids) if len(x) <= max_prompt_length]
        self.records: list[PromptRecord] = [records[i] for i in keep]
        self.prompt_ids: list[list[int]] = [ids[i] for i in keep]
        self.num_filtered: int = len(records) - len(keep)
        self.max_prompt_length = max_prompt_length
        self._report_filtered(records)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> tuple[PromptRecord, list[int]]:
        return self.records[index], self.prompt_ids[index]

    @property
    def data_sources(self) -> set[str]:
        return {r.data_source for r in self.records}

    def _report_filtered(self, records: Sequence[PromptRecord]) -> None:
        files = sorted({r.source_file for r in records})
        if not self.records:
            raise DataError(f"all {len(records)} prompts in {files} are longer than data.max_prompt_length="
                            f"{self.max_prompt_length} tokens; raise data.max_prompt_length")
        if self.num_filtered:
            logger.warning("dropped %d of %d prompts longer than data.max_prompt_length=%d tokens (files: %s); "
                           "raise data.max_prompt_length to keep them", self.num_filtered, len(records),
                           self.max_prompt_length, ", ".join(files))


def render_prompt(record: PromptRecord, tokenizer: Any, use_template: bool) -> tuple[str, bool]:
    """The prompt text the model sees, and whether a chat template (which writes special tokens) made it."""
    if record.messages is None:
        return record.text or "", False
    if not use_template:
        lines = [f"{m['role']}: {m['content']}" for m in record.messages]
        return "\n".join(lines + ["assistant:"]), False
    try:
        text = tokenizer.apply_chat_template([dict(m) for m in record.messages], add_generation_prompt=True,
                                             tokenize=False)
    except Exception as exc:  # jinja raises TemplateError, templates raise their own messages
        raise row_error(record.source_file, record.row, "prompt", f"the tokenizer's chat template failed: {exc}",
                        "fix the messages (roles the template accepts) or set data.apply_chat_template=false"
                        ) from exc
    return text, True


def _tokenize(tokenizer: Any, texts: list[str], templated: list[bool]) -> list[list[int]]:
    """Batch-tokenizes (much faster than one call per prompt), grouping by the add_special_tokens setting."""
    ids: list[list[int]] = [[] for _ in texts]
    for flag in (True, False):
        index = [i for i, t in enumerate(templated) if t == flag]
        if not index:
            continue
        out = tokenizer([texts[i] for i in index], add_special_tokens=not flag)["input_ids"]
        for i, x in zip(index, out):
            ids[i] = list(x)
    return ids
