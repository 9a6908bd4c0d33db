"""`hf` rollout engine: transformers' `model.generate` on the trainer's own model object.

The engine holds no copy of the weights: it samples with exactly the module the trainer updates (colocated,
so there is nothing to sync and `load_weights` is only needed when weights come from elsewhere). It is the
reference engine: slow, but every other engine's output is checked against it token by token.

Reported logprobs are recomputed by a forward pass (fleetrl.models.logprobs.sequence_logprobs) rather than
taken from generate's scores; see `HFRolloutEngine._logprobs`.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Mapping, Sequence

import torch
from torch import nn
from transformers import (
    GenerationConfig,
    PreTrainedTokenizerBase,
    StoppingCriteria,
    StoppingCriteriaList,
)

from fleetrl import heartbeat
from fleetrl.engines.protocol import (
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationOutput,
    SamplingParams,
    response_limits,
)
from fleetrl.models.logprobs import sequence_logprobs


class HFRolloutEngine:
    """RolloutEngine over `model.generate`.

    `model` is used as given (not copied) and moved to `device` in place; outputs come back on CPU. `seed` starts the engine's running
    generator, which seeds calls whose SamplingParams.seed is None; the caller's global RNG is never touched.
    `logprob_chunk_size` bounds the logprob pass's B x chunk x V fp32 logits (None: all at once).
    `offload_on_sleep` moves the weights to CPU in `sleep`; leave it off when the trainer shares this model on
    the GPU, since moving the module moves the trainer's parameters too.
    """

    def __init__(self, model: nn.Module, tokenizer: PreTrainedTokenizerBase, *, device: str | torch.device = "cpu",
                 seed: int = 0, logprob_chunk_size: int | None = None, offload_on_sleep: bool = False) -> None:
        if tokenizer.pad_token_id is None:
            raise ValueError("HFRolloutEngine needs a tokenizer with a pad token; load it with "
                             "fleetrl.models.hf.load_tokenizer, which falls back to EOS")
        self.model = model
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.weights_version = 0
        self.logprob_chunk_size = logprob_chunk_size
        self.offload_on_sleep = offload_on_sleep
        self._generator = torch.Generator().manual_seed(seed)
        self._asleep = False
        self.model.to(self.device)

    # ------------------------------------------------------------------ protocol
    def generate(self, prompts: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams) -> GenerationOutput:
        """prompts/prompt_mask [B, P] left-padded -> right-padded responses [B, R], R <= max_new_tokens."""
        _check_inputs(prompts, prompt_mask, params)
        limits = response_limits(params, prompts.shape[0])
        if self._asleep:
            raise RuntimeError("HFRolloutEngine.generate called while asleep; call wake() first")
        prompts, prompt_mask = prompts.to(self.device), prompt_mask.to(self.device)
        stop_ids = self._stop_token_ids(params)
        seed = params.seed if params.seed is not None else int(
            torch.randint(0, 2**62, (1,), generator=self._generator))
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                # no row needs more than the largest limit; the rows below it are cut after the fact (_finish)
                sequences = self._sample(prompts, prompt_mask, params, stop_ids, seed, int(limits.max()))
                responses, mask, finish = _finish(sequences[:, prompts.shape[1]:], stop_ids, params.stop_strings,
                                                  self.tokenizer, limits.to(sequences.device))
                logprobs = self._logprobs(prompts, prompt_mask, responses, mask, params)
        finally:
            self.model.train(was_training)
        return GenerationOutput(responses=responses.cpu(), response_mask=mask.cpu(), logprobs=logprobs.cpu(),
                                finish_reasons=finish)

    def load_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Copies a full state dict into the model (checked before anything is copied) and records `version`."""
        own = self.model.state_dict()
        missing = sorted(set(own) - set(state))
        unexpected = sorted(set(state) - set(own))
        wrong_shape = [f"{k}: {tuple(state[k].shape)} vs {tuple(own[k].shape)}"
                       for k in sorted(set(own) & set(state)) if state[k].shape != own[k].shape]
        if missing or unexpected or wrong_shape:
            raise ValueError(f"load_weights(version={version}): the state does not match the engine's "
                             f"{type(self.model).__name__}: missing {_head(missing)}, unexpected {_head(unexpected)}, "
                             f"wrong shape {_head(wrong_shape)}; publish the full model.state_dict() of the same "
                             "architecture (unwrapped: no 'module.' or '_orig_mod.' prefixes)")
        with torch.no_grad():
            result = self.model.load_state_dict(dict(state), strict=False)
        assert not result.missing_keys and not result.unexpected_keys, result
        self.weights_version = int(version)

    def sleep(self) -> None:
        if self.offload_on_sleep and self.device.type != "cpu":
            self.model.to("cpu")
            self._asleep = True
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def wake(self) -> None:
        if self._asleep:
            self.model.to(self.device)
            self._asleep = False

    # ------------------------------------------------------------------ helpers
    def _stop_token_ids(self, params: SamplingParams) -> list[int]:
        """Tokenizer EOS, the checkpoint's generation-config EOS ids (chat models list their end-of-turn token
        there, e.g. <|im_end|> and <|endoftext|>), then the call's stop tokens."""
        ids = [self.tokenizer.eos_token_id]
        config_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        ids += config_eos if isinstance(config_eos, (list, tuple)) else [config_eos]
        ids += list(params.stop_token_ids)
        return list(dict.fromkeys(i for i in ids if i is not None))

    def _sample(self, prompts: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams,
                stop_ids: list[int], seed: int, max_new_tokens: int) -> torch.Tensor:
        pad_id, bos_id = self.tokenizer.pad_token_id, self.tokenizer.bos_token_id
        sampling = ({"do_sample": True, "temperature": params.temperature, "top_p": params.top_p,
                     "top_k": params.top_k} if params.temperature > 0 else {"do_sample": False})
        config = GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=stop_ids, pad_token_id=pad_id,
                                  bos_token_id=bos_id, use_cache=True, **sampling)
        criteria = StoppingCriteriaList([_Beat()])
        if params.stop_strings:
            criteria.append(_StopStrings(self.tokenizer, params.stop_strings, prompts.shape[1]))
        # generate() fills every setting we leave unset from model.generation_config, so a checkpoint's
        # generation_config.json (repetition_penalty, top_k=20, ...) would silently change the sampling
        # distribution; a neutral config stands in for the duration of the call.
        saved = self.model.generation_config
        self.model.generation_config = GenerationConfig(pad_token_id=pad_id, bos_token_id=bos_id, eos_token_id=stop_ids)
        try:
            with _seeded(seed, self.device):
                return self.model.generate(input_ids=prompts, attention_mask=prompt_mask, generation_config=config,
                                           stopping_criteria=criteria)
        finally:
            self.model.generation_config = saved

    def _logprobs(self, prompts: torch.Tensor, prompt_mask: torch.Tensor, responses: torch.Tensor,
                  mask: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        # A forward pass rather than generate's `scores`: those come after the top-k/top-p warpers (filtered
        # tokens at -inf, the rest renormalised), while the protocol and the trainer want the plain
        # log softmax(logits / T). Recomputing with the same code the trainer runs also makes the two agree to
        # float rounding. Greedy (T = 0) reports logprobs at T = 1.
        temperature = params.temperature if params.temperature > 0 else 1.0
        logp, _ = sequence_logprobs(self.model, prompts, prompt_mask, responses, mask, temperature=temperature,
                                    chunk_size=self.logprob_chunk_size)
        return logp.float()


class _Beat(StoppingCriteria):
    """Never stops anything: reports one unit of progress per decode step to the watchdog (fleetrl.heartbeat)."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        heartbeat.beat()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class _StopStrings(StoppingCriteria):
    """Finishes a row at the first step where its decoded response contains a stop string.

    transformers' own StopStringCriteria matches against concatenated vocab strings, which differs from the
    decoded text for tokenizers whose decoder inserts spaces; decoding the text keeps this criterion and the
    mask computed in `_finish` in exact agreement."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop_strings: Sequence[str], prompt_width: int) -> None:
        self.tokenizer, self.stop_strings, self.prompt_width = tokenizer, tuple(stop_strings), prompt_width
        self.done: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: object) -> torch.Tensor:
        if self.done is None:
            self.done = torch.zeros(input_ids.shape[0], dtype=torch.bool)
        rows = (~self.done).nonzero().flatten().tolist()
        texts = self.tokenizer.batch_decode(input_ids[rows, self.prompt_width:], skip_special_tokens=True)
        for row, text in zip(rows, texts):
            self.done[row] = any(s in text for s in self.stop_strings)
        return self.done.to(input_ids.device)


def _finish(responses: torch.Tensor, stop_ids: list[int], stop_strings: Sequence[str],
            tokenizer: PreTrainedTokenizerBase,
            limits_B: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Cuts each row after its first stop token or stop-string match, or at its own limit (limits_B [B], per-sample
    max new tokens; a row cut there finishes with "length"): (responses, mask, finish_reasons), with pad ids after
    the end and R trimmed to the longest response. generate() itself ran every row to the batch's end: the cut is
    after the fact, so the tokens before a limit are exactly an unlimited call's."""
    B, R = responses.shape
    is_stop = torch.isin(responses, torch.tensor(stop_ids, dtype=responses.dtype, device=responses.device))
    end = torch.where(is_stop.any(1), is_stop.int().argmax(1), torch.full((B,), R, device=responses.device))
    if stop_strings:
        for row in range(B):
            hit = _stop_string_end(tokenizer, responses[row, :int(end[row])].tolist(), stop_strings)
            if hit is not None:
                end[row] = hit
    stopped = end < R
    length = torch.where(stopped, end + 1, end)
    if limits_B is not None:
        over = length > limits_B
        length, stopped = torch.where(over, limits_B, length), stopped & ~over
    mask = (torch.arange(R, device=responses.device)[None, :] < length[:, None]).long()
    width = int(length.max()) if B else 0
    responses = torch.where(mask.bool(), responses, torch.full_like(responses, tokenizer.pad_token_id))
    finish = [FINISH_STOP if s else FINISH_LENGTH for s in stopped.tolist()]
    return responses[:, :width], mask[:, :width], finish


def _stop_string_end(tokenizer: PreTrainedTokenizerBase, tokens: list[int], stop_strings: Sequence[str]) -> int | None:
    """Index of the first token after which the decoded text contains a stop string, or None."""
    if not any(s in tokenizer.decode(tokens, skip_special_tokens=True) for s in stop_strings):
        return None
    for t in range(len(tokens)):
        if any(s in tokenizer.decode(tokens[:t + 1], skip_special_tokens=True) for s in stop_strings):
            return t
    return None


@contextmanager
def _seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Seeds the RNGs generate() draws from, restoring the caller's state afterwards."""
    cuda = device.type == "cuda"
    index = (device.index if device.index is not None else torch.cuda.current_device()) if cuda else None
    with torch.random.fork_rng(devices=[index] if cuda else []):
        torch.default_generator.manual_seed(seed)
        if cuda:
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
        yield


def _check_inputs(prompts: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams) -> None:
    if prompts.dim() != 2 or prompts.shape != prompt_mask.shape:
        raise ValueError(f"generate: prompts and prompt_mask must both be [B, P]; got {tuple(prompts.shape)} and "
                         f"{tuple(prompt_mask.shape)}")
    if prompts.shape[1] == 0:
        raise ValueError("generate: prompts have width 0; every prompt needs at least one token")
    if params.max_new_tokens < 1 or params.temperature < 0 or not 0 < params.top_p <= 1 or params.top_k < 0:
        raise ValueError(f"generate: invalid {params}; need max_new_tokens >= 1, temperature >= 0 (0 = greedy), "
                         "0 < top_p <= 1, top_k >= 0 (0 = off)")


def _head(items: list[str], n: int = 5) -> str:
    return "[]" if not items else f"{items[:n]}{f' (+{len(items) - n} more)' if len(items) > n else ''}"
