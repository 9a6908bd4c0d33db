"""Host-side end of a call: finish reasons, stop strings, exact masks, right padding (protocol layout)."""
from __future__ import annotations

from typing import Sequence

import torch

from fleetrl.engines.protocol import FINISH_LENGTH, FINISH_STOP, GenerationOutput


def first_stop_string_end(ids: list[int], tokenizer: object, stop_strings: Sequence[str]) -> int | None:
    """Smallest t such that decode(ids[:t]) contains a stop string, or None (binary search over prefixes)."""
    def hit(t: int) -> bool:
        text = tokenizer.decode(ids[:t])
        return any(s in text for s in stop_strings)

    if not ids or not hit(len(ids)):
        return None
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if hit(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def assemble_output(tok: torch.Tensor, lp: torch.Tensor, counts: list[int], stop_ids: set[int],
                    stop_strings: Sequence[str], tokenizer: object | None,
                    device: torch.device) -> GenerationOutput:
    """tok/lp [B, >= max(counts)] (any device) -> GenerationOutput on `device`.

    A response finishes with "stop" when its last kept token is a stop id or a stop string was found (the
    response is then cut right after the token that completes it), else with "length".
    """
    width = max(counts)
    tok, lp = tok[:, :width].cpu(), lp[:, :width].cpu()
    # each row's last token in one gather: an int(tok[i, c]) per row cost ~8 µs, 2 ms at 256 rows
    last = tok[torch.arange(len(counts)), torch.tensor(counts) - 1].tolist()
    counts, reasons = list(counts), []
    for i, c in enumerate(counts):
        reasons.append(FINISH_STOP if last[i] in stop_ids else FINISH_LENGTH)
        if stop_strings and tokenizer is not None:
            cut = first_stop_string_end(tok[i, :c].tolist(), tokenizer, stop_strings)
            if cut is not None:
                counts[i], reasons[i] = cut, FINISH_STOP
    width = max(counts)
    mask = (torch.arange(width)[None, :] < torch.tensor(counts)[:, None]).long()
    return GenerationOutput(responses=(tok[:, :width] * mask).to(device), response_mask=mask.to(device),
                            logprobs=(lp[:, :width] * mask).to(device), finish_reasons=reasons)
