"""Partial rollouts (trainer.partial_rollouts, docs/async.md): one generate call decoded in segments, the weights
allowed to change between them, every token recording the version that produced it.

How a call is cut, and why so. The rollout worker installs weights only between engine calls (its engine verbs run
one at a time, cluster/group.py), and an engine call cannot be interrupted. So a call decodes in segments of at most
`segment_tokens` new tokens per sample (the Plan's budget, trainer.partial_segment_tokens); before each segment the
worker installs the newest version the controller published (offered to the worker outside its serial queue, so
the offer does not wait behind the generation), and the samples not yet finished go on from their prompt plus the
tokens they have so far, re-prefilled on those weights, for at most the rest of their own limit. The chunk stays
one call of the async schedule (trainer/schedule.py): the window, hold / drop, the resume ledger and the watchdog's
per-call deadlines are unchanged, no partial sample travels back to the controller, and an unfinished sample is not
queued behind later chunks. A budget cut rather than an abort from the controller keeps the engines as they are:
any engine that takes per-sample limits continues a prefix this way (hf, fast).

Per sample this keeps the tokens, the behaviour log-probs (each from the weights that sampled it: what the loss's
rollout correction reads) and `token_versions`, the engine's weights version at the segment that produced each
token. The sample's `weights_version` is its first segment's, the oldest of its tokens. Stop conditions are those
of one uncut generation: EOS and stop tokens end a sample in the segment that samples them; a stop string that
spans a cut is found on the whole response after the segment and the response is cut where it first appears;
per-sample limits (SamplingParams.max_new_tokens_per_sample) bound the sum of the segments.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import torch

from fleetrl.batch import left_pad
from fleetrl.engines.protocol import (
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationOutput,
    RolloutEngine,
    SamplingParams,
    response_limits,
)

# Test hooks (no-ops unless set; cluster.env carries them to Ray workers):
SEGMENT_LOG_ENV = "FLEETRL_SEGMENT_LOG"
"""A file each rollout worker appends one JSON line per segment to: the engine's weights version and a fingerprint
of the weights it decoded with, and per row the prompt, the tokens it had and the tokens the segment added
(tests/integration/test_partial_rollouts.py checks the batch's token_versions against it)."""
SEGMENT_DELAY_ENV = "FLEETRL_SEGMENT_DELAY_S"
"""Seconds slept before every segment after the first (a slow rollout, so that versions are published mid-call)."""


def segment_seed(seed: int | None, index: int) -> int | None:
    """The seed of a call's segment `index`: the call's own for the first (so one segment is an uncut call)."""
    if seed is None or index == 0:
        return seed
    return (seed * 1_000_003 + index * 7919) % (2**62)


@dataclass
class PartialSamples:
    """The samples of one segmented call, as Python lists (a handful of tokens per segment and row)."""
    prompts: list[list[int]]
    limits: list[int]
    segment_tokens: int
    tokens: list[list[int]]
    logprobs: list[list[float]]
    versions: list[list[int]]
    finish: list[str | None]
    segments: list[int]

    @classmethod
    def start(cls, prompts: torch.Tensor, prompt_mask: torch.Tensor, limits: Sequence[int],
              segment_tokens: int) -> "PartialSamples":
        assert segment_tokens >= 1
        rows = [prompts[b][prompt_mask[b].bool()].tolist() for b in range(prompts.shape[0])]
        B = len(rows)
        return cls(prompts=rows, limits=[int(x) for x in limits], segment_tokens=segment_tokens,
                   tokens=[[] for _ in range(B)], logprobs=[[] for _ in range(B)], versions=[[] for _ in range(B)],
                   finish=[None] * B, segments=[0] * B)

    def active(self) -> list[int]:
        """Rows not finished, in order."""
        return [b for b, f in enumerate(self.finish) if f is None]

    def budgets(self, rows: Sequence[int]) -> list[int]:
        """Each row's new tokens in the next segment: the segment budget, or what is left of its own limit."""
        return [min(self.segment_tokens, self.limits[b] - len(self.tokens[b])) for b in rows]

    def inputs(self, rows: Sequence[int], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' prompts plus their tokens so far, left-padded: [len(rows), L] ids and mask."""
        return left_pad([self.prompts[b] + self.tokens[b] for b in rows], pad_id)

    def absorb(self, rows: Sequence[int], out: GenerationOutput, version: int,
               stop_end: Callable[[list[int]], int | None] | None = None) -> None:
        """The segment's output for `rows` (in that order), generated at weights `version`. `stop_end(tokens)`: the
        index of the first token after which the decoded response holds a stop string, or None (a continued row's
        whole response is checked: a stop string may span the cut)."""
        lengths = out.response_mask.long().sum(1).tolist()
        for i, b in enumerate(rows):
            n = int(lengths[i])
            self.tokens[b] += out.responses[i, :n].tolist()
            self.logprobs[b] += out.logprobs[i, :n].float().tolist()
            self.versions[b] += [int(version)] * n
            self.segments[b] += 1
            end = stop_end(self.tokens[b]) if stop_end is not None and self.segments[b] > 1 else None
            if end is not None and end + 1 <= len(self.tokens[b]):
                del self.tokens[b][end + 1:], self.logprobs[b][end + 1:], self.versions[b][end + 1:]
                self.finish[b] = FINISH_STOP
            elif out.finish_reasons[i] == FINISH_STOP:
                self.finish[b] = FINISH_STOP
            elif len(self.tokens[b]) >= self.limits[b] or n == 0:  # n == 0: nothing more will come
                self.finish[b] = FINISH_LENGTH

    def output(self, pad_id: int) -> tuple[GenerationOutput, torch.Tensor, torch.Tensor]:
        """(the call's GenerationOutput, token_versions [B, R] long (0 past the response), segments [B] long)."""
        B = len(self.tokens)
        width = max((len(t) for t in self.tokens), default=0)
        responses = torch.full((B, width), pad_id, dtype=torch.long)
        mask = torch.zeros((B, width), dtype=torch.long)
        logprobs = torch.zeros((B, width), dtype=torch.float32)
        versions = torch.zeros((B, width), dtype=torch.long)
        for b in range(B):
            n = len(self.tokens[b])
            if n:
                responses[b, :n] = torch.tensor(self.tokens[b])
                mask[b, :n] = 1
                logprobs[b, :n] = torch.tensor(self.logprobs[b])
                versions[b, :n] = torch.tensor(self.versions[b])
        finish = [f if f is not None else FINISH_LENGTH for f in self.finish]
        gen = GenerationOutput(responses=responses, response_mask=mask, logprobs=logprobs, finish_reasons=finish)
        return gen, versions, torch.tensor(self.segments, dtype=torch.long)


def generate_in_segments(engine: RolloutEngine, prompts: torch.Tensor, prompt_mask: torch.Tensor,
                         params: SamplingParams, segment_tokens: int, pad_id: int,
                         before_segment: Callable[[], None] | None = None,
                         stop_end: Callable[[list[int]], int | None] | None = None,
                         log: Callable[[int, Sequence[int], PartialSamples, GenerationOutput], None] | None = None
                         ) -> tuple[GenerationOutput, torch.Tensor, torch.Tensor]:
    """One generate call in segments (module docstring): (output, token_versions [B, R], segments [B]).
    `before_segment` runs before every segment (the worker installs the newest published weights there);
    `log(version, rows, state, out)` sees each segment (the test hook)."""
    limits = response_limits(params, prompts.shape[0]).tolist()
    state = PartialSamples.start(prompts.cpu(), prompt_mask.cpu(), limits, segment_tokens)
    delay = float(os.environ.get(SEGMENT_DELAY_ENV, "0") or 0)
    index = 0
    while rows := state.active():
        if index and delay > 0:
            time.sleep(delay)
        if before_segment is not None:
            before_segment()
        ids, mask = state.inputs(rows, pad_id)
        budgets = state.budgets(rows)
        seg = replace(params, max_new_tokens=max(budgets), seed=segment_seed(params.seed, index),
                      max_new_tokens_per_sample=torch.tensor(budgets, dtype=torch.long))
        out = engine.generate(ids, mask, seg)
        version = int(engine.weights_version)
        if log is not None:
            log(version, rows, state, out)
        state.absorb(rows, out, version, stop_end)
        index += 1
    return state.output(pad_id)


def weights_fingerprint(model: torch.nn.Module) -> float:
    """A number that changes with the weights: the float64 sum of every state tensor (the test hook's)."""
    with torch.no_grad():
        return float(sum(t.detach().double().sum() for t in model.state_dict().values() if t.is_floating_point()))


def segment_logger(path: str, rank: int, model: torch.nn.Module
                   ) -> Callable[[int, Sequence[int], PartialSamples, GenerationOutput], None]:
    """The FLEETRL_SEGMENT_LOG hook: one JSON line per segment, written before the segment is absorbed."""
    def log(version: int, rows: Sequence[int], state: PartialSamples, out: GenerationOutput) -> None:
        lengths = out.response_mask.long().sum(1).tolist()
        entry = {"rank": rank, "version": version, "fingerprint": weights_fingerprint(model),
                 "rows": [{"prompt": state.prompts[b], "before": list(state.tokens[b]),
                           "new": out.responses[i, :int(lengths[i])].tolist()} for i, b in enumerate(rows)]}
        with open(path, "a") as f:
            f.write(json.dumps(entry) + "\n")
    return log
