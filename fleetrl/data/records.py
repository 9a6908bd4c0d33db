"""PromptRecord: one prompt after normalisation, whatever schema (verl, OpenRLHF) it was read from."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class PromptRecord:
    """One training prompt and what the reward needs to score its responses.

    Exactly one of `messages` (chat) and `text` (raw prompt) is set. `source_file` and `row` (0-based)
    point back at the input so any later error (reward, template) can say where the sample came from.
    """

    messages: tuple[dict[str, str], ...] | None
    text: str | None
    data_source: str
    ability: str | None
    ground_truth: Any
    extra_info: dict = field(default_factory=dict)
    source_file: str = ""
    row: int = 0

    def __post_init__(self) -> None:
        assert (self.messages is None) != (self.text is None), "exactly one of messages/text must be set"

    @property
    def uid(self) -> str:
        """Stable across runs and processes: the same row of the same file always has the same uid."""
        return f"{self.source_file}:{self.row}"

    @property
    def raw_prompt(self) -> list[dict[str, str]] | str:
        """The prompt as the user wrote it: a list of chat messages or the raw text."""
        if self.messages is not None:
            return [dict(m) for m in self.messages]
        assert self.text is not None
        return self.text
