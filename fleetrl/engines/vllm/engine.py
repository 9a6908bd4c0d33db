"""`vllm` rollout engine: the real vLLM (`vllm.LLM`) inside the rollout worker's own process.

Why in-process rather than `vllm serve` servers (docs/engines.md): the rollout worker already is the process that
owns the trainer's model (colocated) or its received copy (separate pool), so an in-process engine takes weights by
reference through vLLM's own `reload_weights` worker method (`LLM.collective_rpc`), needs no port, no health check
and no second process to watch, and its failures are the worker's failures, which the watchdog already handles.
vLLM's V1 engine core is kept in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so the tensors are not serialised.

The engine wraps an HF model like the other engines: `model` is the trainer's module (colocated) or the worker's
copy (separate pool). vLLM is built from that model's config and tokenizer with dummy weights, then every sync
(including the first, version 0) streams the model's tensors into vLLM and checks vLLM's log-probs on a probe
against the model's own forward (check.py).
"""
from __future__ import annotations

import functools
import os
import tempfile
import time
from typing import Iterable, Mapping

import torch
from torch import nn

from fleetrl import heartbeat
from fleetrl.engines.protocol import GenerationOutput, SamplingParams, response_limits
from fleetrl.engines.vllm import convert
from fleetrl.engines.vllm.check import check_gap, probe_tokens, prompt_logprobs, trainer_logprobs

# In-process engine core: the weights pass by reference and vLLM's worker is this process (module docstring).
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
# vLLM's CPU worker pins OpenMP threads to cores by default; the trainer shares this process and has its own
# thread budget (cluster pools' cpu_threads), so leave the threads where the worker put them.
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
# Block size of vLLM's paged KV cache on CPU; the cache is sized below in whole blocks of it.
KV_BLOCK = 128


class VLLMRolloutEngine:
    """RolloutEngine over vllm.LLM (see the module docstring).

    max_batch / max_seq_len: the Plan's EngineSizes (vLLM's max_num_seqs and max_model_len; on CPU the KV cache is
    sized for exactly that many full sequences). dtype: vLLM's compute dtype (None = the model's).
    gpu_memory_utilization: the share of the GPU vLLM may take (weights + KV cache), ignored on CPU.
    check_tokens / check_tol: the sync check's probe length and tolerance over the baseline (check.py; 0 tokens =
    no check). call_timeout_s: a generate call that has not finished by then aborts its requests and raises.
    """

    def __init__(self, model: nn.Module, tokenizer, *, device: str | torch.device = "cpu", seed: int = 0,
                 max_batch: int = 64, max_seq_len: int = 1024, dtype: torch.dtype | None = None,
                 gpu_memory_utilization: float = 0.5, check_tokens: int = 16, check_tol: float = 0.05,
                 call_timeout_s: float = 3600.0) -> None:
        if tokenizer.pad_token_id is None:
            raise ValueError("VLLMRolloutEngine needs a tokenizer with a pad token; load it with "
                             "fleetrl.models.hf.load_tokenizer, which falls back to EOS")
        self.model, self.tokenizer = model, tokenizer
        self.device = torch.device(device)
        self.check_tokens, self.check_tol, self.call_timeout_s = check_tokens, check_tol, call_timeout_s
        self.baseline_gap: float | None = None  # the first sync's gap (check.py)
        self.last_gap: float | None = None
        self.sync_s = 0.0  # seconds of the last sync's weight streaming (without the check)
        self._generator = torch.Generator().manual_seed(seed)
        self._asleep = False
        self._requests = 0
        self._dir = tempfile.TemporaryDirectory(prefix="fleetrl-vllm-")
        self.llm = self._build(seed, max_batch, max_seq_len, dtype or _model_dtype(model), gpu_memory_utilization)
        self.weights_version = 0
        self.sync(0)

    # ------------------------------------------------------------------ protocol
    def generate(self, prompts: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams) -> GenerationOutput:
        """prompts/prompt_mask [B, P] left-padded -> right-padded responses [B, R], outputs on CPU."""
        _check_inputs(prompts, prompt_mask, params)
        limits = response_limits(params, prompts.shape[0])
        self.wake()
        groups = convert.group_rows(prompts.cpu(), prompt_mask.cpu(), limits)
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,), generator=self._generator))
        stop_ids = self.stop_token_ids(params)
        make = _final_only_params()
        requests = [(g.prompt, convert.vllm_params(make, params, g, stop_ids, seed)) for g in groups]
        out = convert.assemble(groups, self._run(requests), stop_ids, params.stop_strings, self.tokenizer)
        if convert.filters_tokens(params):
            out.logprobs = self._unfiltered_logprobs(prompts, prompt_mask, out, params.temperature)
        return out

    def load_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Separate pool / async: copies `state` into the wrapped model, then syncs vLLM from it (checked)."""
        own = self.model.state_dict()
        unknown = sorted(set(state) - set(own))
        if unknown:
            raise ValueError(f"load_weights(version={version}): {len(unknown)} names are not in the engine's "
                             f"{type(self.model).__name__} (first: {unknown[:3]}); publish the state_dict of the "
                             "same architecture, unwrapped")
        with torch.no_grad():
            for name, tensor in state.items():
                if own[name].data_ptr() != tensor.data_ptr():  # the bus may have received into the model itself
                    own[name].copy_(tensor)
        self.sync(version, state.items())

    def sync(self, version: int, named: Iterable[tuple[str, torch.Tensor]] | None = None) -> None:
        """Streams `named` (default: the wrapped model's whole state) into vLLM, checks it, records `version`.
        Colocated runs call this at every trainer sync with the actor's own tensors (no copy on our side)."""
        self.wake()
        t0 = time.perf_counter()
        self.llm.collective_rpc("reload_weights", timeout=self.call_timeout_s,
                                kwargs={"weights_iterator": _beating(named if named is not None
                                                                     else self.model.state_dict().items())})
        self.llm.reset_prefix_cache()  # cached prompt KV was computed with the old weights
        self.sync_s = time.perf_counter() - t0
        if self.check_tokens > 0:
            self.last_gap = self.probe_gap()
            if self.baseline_gap is None:
                self.baseline_gap = self.last_gap
            check_gap(self.last_gap, self.baseline_gap, self.check_tol, version, self.check_tokens)
        self.weights_version = int(version)

    def probe_gap(self) -> float:
        """Largest |vLLM - trainer| log-prob over the probe's tokens (check.py)."""
        tokens = probe_tokens(int(self.model.config.vocab_size), self.check_tokens + 1)
        done = self._run([(tokens, _final_only_params()(max_tokens=1, temperature=0.0, prompt_logprobs=0))])
        ours = prompt_logprobs(done[0].prompt_logprobs, tokens)
        return float((ours - trainer_logprobs(self.model, tokens)).abs().max())

    def sleep(self) -> None:
        """Level 1: vLLM moves its weights to host memory and drops its KV cache (GPU only: vLLM's CPU worker
        ignores sleep, and the Plan refuses rollout.vllm.enable_sleep on a CPU pool)."""
        if self.device.type == "cuda" and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = True

    def wake(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    # ------------------------------------------------------------------ helpers
    def stop_token_ids(self, params: SamplingParams) -> list[int]:
        """Tokenizer EOS, the model's generation-config EOS ids, then the call's stop tokens (the hf engine's set)."""
        ids = [self.tokenizer.eos_token_id]
        config_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        ids += config_eos if isinstance(config_eos, (list, tuple)) else [config_eos]
        ids += list(params.stop_token_ids)
        return list(dict.fromkeys(int(i) for i in ids if i is not None))

    def _build(self, seed: int, max_batch: int, max_seq_len: int, dtype: torch.dtype, gpu_share: float):
        """vllm.LLM over the model's config and tokenizer, with dummy weights (the first sync loads the real ones)."""
        folder = self._dir.name
        self.model.config.save_pretrained(folder)
        self.tokenizer.save_pretrained(folder)
        from vllm import LLM

        on_cpu = self.device.type == "cpu"
        memory = ({"kv_cache_memory_bytes": kv_cache_bytes(self.model.config, max_batch, max_seq_len, dtype)}
                  if on_cpu else {"gpu_memory_utilization": gpu_share})
        set_threads = torch.set_num_threads  # vLLM's CPU worker replaces it for the whole process; the trainer
        try:                                 # shares this process and still sets its own threads
            return LLM(model=folder, tokenizer=folder, load_format="dummy", dtype=str(dtype).removeprefix("torch."),
                       seed=seed, max_model_len=max_seq_len, max_num_seqs=max_batch, enforce_eager=on_cpu,
                       logprobs_mode="processed_logprobs", generation_config="vllm", enable_prefix_caching=True,
                       **memory)
        finally:
            torch.set_num_threads = set_threads

    def _run(self, requests: list[tuple[list[int], object]]) -> dict[int, object]:
        """Feeds the requests to vLLM's engine and steps it to the end, one heartbeat per step, under the deadline.
        Returns the finished RequestOutputs by request index."""
        engine = self.llm.llm_engine
        ids = {}
        for i, (prompt, params) in enumerate(requests):
            self._requests += 1
            ids[str(self._requests)] = i
            engine.add_request(str(self._requests), {"prompt_token_ids": prompt}, params)
        done: dict[int, object] = {}
        deadline = time.monotonic() + self.call_timeout_s
        while engine.has_unfinished_requests():
            if time.monotonic() > deadline:
                engine.abort_request(list(ids))
                raise TimeoutError(f"vLLM generate did not finish {len(requests) - len(done)} of {len(requests)} "
                                   f"requests within {self.call_timeout_s:.0f} s")
            for out in engine.step():
                if out.finished:
                    done[ids[out.request_id]] = out
            heartbeat.beat()
        return done

    def _unfiltered_logprobs(self, prompts: torch.Tensor, prompt_mask: torch.Tensor, out: GenerationOutput,
                             temperature: float) -> torch.Tensor:
        """With top-k / top-p vLLM reports log-probs renormalised over the kept tokens; the protocol wants plain
        log softmax(logits / T), so they are recomputed with the wrapped model's forward, as the hf engine does."""
        from fleetrl.models.logprobs import sequence_logprobs

        device = next(self.model.parameters()).device
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                logp, _ = sequence_logprobs(self.model, prompts.to(device), prompt_mask.to(device),
                                            out.responses.to(device), out.response_mask.to(device),
                                            temperature=temperature)
        finally:
            self.model.train(was_training)
        return logp.float().cpu()


def kv_cache_bytes(config, max_batch: int, max_seq_len: int, dtype: torch.dtype) -> int:
    """Bytes of KV cache for max_batch full sequences of max_seq_len (each rounded up to whole blocks), + 1 block."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * heads * head_dim * torch.empty((), dtype=dtype).element_size()
    blocks = max_batch * -(-max_seq_len // KV_BLOCK) + 1
    return blocks * KV_BLOCK * per_token


def _beating(named: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
    """The tensors one at a time (vLLM copies each into its layout as it comes), a heartbeat for each."""
    for name, tensor in named:
        heartbeat.beat()
        yield name, tensor.detach()


def _final_only_params():
    """vLLM's SamplingParams, each request reported once, when all its n samples are done (a request stepped
    through the engine directly otherwise reports every sample as it finishes)."""
    from vllm import SamplingParams as VParams
    from vllm.sampling_params import RequestOutputKind

    return functools.partial(VParams, output_kind=RequestOutputKind.FINAL_ONLY)


def _model_dtype(model: nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


def _check_inputs(prompts: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams) -> None:
    if prompts.dim() != 2 or prompts.shape != prompt_mask.shape:
        raise ValueError(f"generate: prompts and prompt_mask must both be [B, P]; got {tuple(prompts.shape)} and "
                         f"{tuple(prompt_mask.shape)}")
    if prompts.shape[1] == 0 or not bool(prompt_mask.bool().any(1).all()):
        raise ValueError("generate: every prompt needs at least one token")
    if params.max_new_tokens < 1 or params.temperature < 0 or not 0 < params.top_p <= 1 or params.top_k < 0:
        raise ValueError(f"generate: invalid {params}; need max_new_tokens >= 1, temperature >= 0 (0 = greedy), "
                         "0 < top_p <= 1, top_k >= 0 (0 = off)")
