"""Rollout component: a rollout engine over the actor's own model (colocated) or its own copy (separate pool)."""
from __future__ import annotations

import os
import time
from contextlib import contextmanager, nullcontext
from typing import Callable, ContextManager, Iterator

import torch
import torch.distributed as dist

from fleetrl.batch import Batch
from fleetrl.engines.protocol import GenerationOutput, RolloutEngine, SamplingParams
from fleetrl.engines.sync_check import SyncProbe, sample_probe
from fleetrl.models.hf import load_run_tokenizer, release_freed_memory
from fleetrl.workers.context import WorkerContext, dtype_of
from fleetrl.workers.messages import GenerateRequest
from fleetrl.workers.sync_faults import StaleView, skipped_patterns
from fleetrl.workers.tp_group import EngineGroup


@contextmanager
def unsharded(model: torch.nn.Module) -> Iterator[float | None]:
    """FSDP2-sharded actor: gather every parameter group once for the whole generate call (otherwise each
    decode step would all-gather, and ranks that finish at different steps would deadlock), reshard after.
    Yields the gather's seconds (device synced: the unshard is asynchronous), None when nothing is sharded."""
    from torch.distributed.fsdp import FSDPModule

    groups = [m for m in model.modules() if isinstance(m, FSDPModule)]
    t0 = time.perf_counter()
    for m in groups:
        m.set_reshard_after_forward(False)  # keep the gathered weights across decode steps
        m.unshard()
    if groups and torch.cuda.is_available():
        torch.cuda.synchronize()
    try:
        yield time.perf_counter() - t0 if groups else None
    finally:
        for m in groups:
            m.reshard()
            m.set_reshard_after_forward(True)


def make_engine(ctx: WorkerContext, model: torch.nn.Module, tokenizer,
                engine_group: EngineGroup | None = None) -> RolloutEngine:
    seed = ctx.plan.seed("engine", rank=ctx.rank)
    if ctx.cfg.rollout.engine == "fast":
        from fleetrl.engines.fast import FastRolloutEngine

        sizes = ctx.plan.rollout  # per engine: k ranks' samples at rollout.tensor_parallel = k
        dtype = ctx.plan.rollout_compute_dtype  # rollout.compute_dtype, auto resolved (config/precision.py)
        return FastRolloutEngine(model, tokenizer, device=ctx.device(), seed=seed, max_batch=sizes.max_batch,
                                 max_seq_len=sizes.max_seq_len, compute_dtype=None if dtype == "model" else dtype_of(dtype),
                                 tp_group=None if engine_group is None else engine_group.group,
                                 own_weights=ctx.plan.rollout_owns_weights, cache_budget_bytes=cache_budget(ctx))
    if ctx.cfg.rollout.engine == "vllm":
        from fleetrl.engines.vllm import VLLMRolloutEngine

        v, dtype = ctx.cfg.rollout.vllm, ctx.plan.rollout_compute_dtype
        return VLLMRolloutEngine(model, tokenizer, device=ctx.device(), seed=seed, max_batch=ctx.plan.rollout.max_batch,
                                 max_seq_len=ctx.plan.rollout.max_seq_len,
                                 dtype=None if dtype == "model" else dtype_of(dtype),
                                 gpu_memory_utilization=v.gpu_memory_utilization, check_tokens=v.sync_check_tokens,
                                 check_tol=v.sync_check_tol)
    from fleetrl.engines.hf import HFRolloutEngine

    # the engine's log-prob pass is chunked like the trainer's, so no B×T×V fp32 logits are built
    return HFRolloutEngine(model, tokenizer, device=ctx.device(), seed=seed,
                           logprob_chunk_size=ctx.cfg.actor.logprob_chunk)


def cache_budget(ctx: WorkerContext, total_bytes: int | None = None) -> int | None:
    """rollout.gpu_memory_fraction of this worker's GPU (`total_bytes`: its memory, read from the device when None),
    the fast engine's KV-cache budget; None without the key (the Plan refuses it on a CPU pool)."""
    fraction = ctx.cfg.rollout.gpu_memory_fraction
    if fraction is None:
        return None
    if total_bytes is None:
        total_bytes = torch.cuda.get_device_properties(ctx.device()).total_memory
    return int(fraction * total_bytes)


CACHE_SHARE = 0.25  # rollout.free_cache=auto on a GPU: free a cache larger than this share of the card


def frees_cache(ctx: WorkerContext, engine: RolloutEngine) -> bool:
    """rollout.free_cache: whether a colocated fast engine frees its KV cache (and graphs, fused copies) after each
    call. On a CPU, auto frees it: otherwise the update runs on top of it and glibc keeps the call's freed pages
    (SmolLM2 LoRA on an AVX2 CPU: 0.72 GiB held through the update, bench/RESULTS.md "RSS over a whole run, third
    round"; re-allocating costs ~1 ms). An engine that owns its weights (rollout.own_weights) frees too: its copy
    is refilled at every step anyway, and every rank of the pool then frees, refills and gathers at the same calls
    (the refill's FSDP2 gathers are collectives of the whole pool). On a GPU, freeing otherwise costs the graphs'
    capture at the next call, so auto frees only a cache over CACHE_SHARE of the card: Qwen3-8B colocated with 128
    slots of 4,256 tokens holds 75 GB, and its update ran out of memory on an H200 beside it."""
    r = ctx.cfg.rollout
    if r.engine != "fast" or not ctx.plan.rollout_colocated or r.free_cache is False:
        return False
    device = ctx.device()
    if r.free_cache is True or device.type == "cpu" or ctx.plan.rollout_owns_weights:
        return True
    return engine.cache_bytes() > CACHE_SHARE * torch.cuda.get_device_properties(device).total_memory


def versioned_batch(gen: GenerationOutput, versions: torch.Tensor, now: int, **extra: torch.Tensor) -> Batch:
    """A generation whose tokens record the weights version that sampled each (`token_versions` [B, R], 0 past a
    response's end) as a Batch; a sample's `weights_version` is its first token's (its oldest), an empty response's
    `now`, the engine's version at the end of the call."""
    now_t = torch.full((len(gen.responses),), now, dtype=torch.long)
    first = torch.where(gen.response_mask[:, 0].bool(), versions[:, 0], now_t) if versions.shape[1] else now_t
    return Batch({"responses": gen.responses, "response_mask": gen.response_mask.long(),
                  "rollout_logprobs": gen.logprobs.float(), "token_versions": versions,
                  "weights_version": first.long(), **extra}, {"finish_reason": list(gen.finish_reasons)})


class RolloutComponent:
    def __init__(self, ctx: WorkerContext, model: torch.nn.Module, engine_group: EngineGroup | None = None) -> None:
        self.ctx = ctx
        self.engine_group = engine_group  # rollout.tensor_parallel > 1: the ranks this engine runs on (tp_group.py)
        m = ctx.cfg.model
        self.tokenizer = load_run_tokenizer(m)
        self.model = model
        # FSDP2: the engine decodes with the whole weights, gathered for each call (and checked at build here), or
        # fills its own copy one layer at a time (rollout.own_weights): then nothing gathers the model whole.
        self.whole = nullcontext if ctx.plan.rollout_owns_weights else (lambda: unsharded(model))
        with self.whole():
            self.engine = make_engine(ctx, model, self.tokenizer, engine_group)
        # vLLM keeps its own copy of the weights: a colocated sync streams the actor's tensors into it (and checks
        # it); the hf and fast engines read the actor's parameters in place, so only the version moves.
        self.engine_holds_copy = ctx.cfg.rollout.engine == "vllm"
        self.release_after_call = frees_cache(ctx, self.engine)
        if engine_group is not None and not ctx.plan.rollout_owns_weights:
            # An engine's ranks free (and capture again) together, or their collectives would not match: freeing
            # is decided per card, and a pool may mix cards.
            flag = torch.tensor([int(self.release_after_call)], device=ctx.device())
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=engine_group.group)
            self.release_after_call = bool(flag.item())
        # FLEETRL_FAULT_SYNC_SKIP (tests of the policy check): a colocated engine that never sees some parameters'
        # updates; a separate pool's skip is in Worker.install_weights.
        self.stale = StaleView(model) if skipped_patterns() and ctx.plan.rollout_colocated else None
        self.stream = None  # trainer.stream_rollouts: the engine loop every call goes through (`start_stream`)
        self.episodes = None
        if ctx.cfg.rollout.env is not None:  # multi-turn: the environment plays against the engine
            from fleetrl.workers.episodes import EpisodeRunner

            self.episodes = EpisodeRunner(ctx.cfg.rollout.env)

    def engine_model(self) -> torch.nn.Module:
        return self.model

    def start_stream(self, install: Callable[[], None]) -> None:
        """trainer.stream_rollouts: from now on every generate call and every weights load goes through one engine
        loop on its own thread (engines/fast/stream.py); `install` loads the newest weights offered to this worker."""
        from fleetrl.engines.fast.stream import EngineStream

        self.stream = EngineStream(self.engine, install, seed=self.ctx.plan.seed("engine", rank=self.ctx.rank))

    def on_engine(self, fn: Callable[[], object]) -> object:
        """fn() where it may touch the engine: on the stream's thread between its sessions, or here without one."""
        return fn() if self.stream is None else self.stream.exclusive(fn)

    def generate(self, batch: Batch, req: GenerateRequest, before_segment: Callable[[], None] | None = None) -> Batch:
        """batch: prompts/prompt_mask, already repeated n times (plus the per-sample fields with an env).
        req.segment_tokens (partial rollouts): the call decodes in segments, `before_segment` running before each
        (the async worker installs the newest published weights there: workers/partial.py). Under tensor
        parallelism the engine's ranks decode their batches together and each returns its own rows."""
        if self.stream is not None:
            return self._stream_generate(batch, req)
        if self.engine_group is None:
            return self._generate(batch, req, before_segment)
        t0 = time.perf_counter()
        whole, mine = self.engine_group.gather(batch)
        t_gather = time.perf_counter() - t0
        out = self._generate(whole, req, before_segment)
        own = out.select(mine)
        own.meta.setdefault("timing", {})["generate/tp_gather"] = t_gather
        return own

    def _generate(self, batch: Batch, req: GenerateRequest, before_segment: Callable[[], None] | None) -> Batch:
        if self.engine.weights_version < req.min_weights_version:
            raise RuntimeError(f"rollout worker {self.ctx.rank} holds weights version {self.engine.weights_version} "
                               f"but the step needs {req.min_weights_version}: weight sync did not arrive")
        params = self.sampling_params(batch, req)
        t0 = time.perf_counter()
        with self.whole() as t_unshard, self.engine_view():
            if self.episodes is not None:
                if params.max_new_tokens_per_sample is not None:
                    raise ValueError("SamplingParams.max_new_tokens_per_sample limits one generation per sample; "
                                     "with rollout.env an episode's turns are bounded by rollout.env instead")
                out = self.episodes.play(self.engine, self.tokenizer, batch, params)
            elif req.segment_tokens is not None:
                out = self._generate_in_segments(batch, params, req.segment_tokens, before_segment)
            else:
                gen = self.engine.generate(batch["prompts"], batch["prompt_mask"], params)
                out = Batch({"responses": gen.responses.cpu(), "response_mask": gen.response_mask.long().cpu(),
                             "rollout_logprobs": gen.logprobs.float().cpu()},
                            {"finish_reason": list(gen.finish_reasons)})
        if self.engine_holds_copy and self.ctx.cfg.rollout.vllm.enable_sleep:
            self.engine.sleep()  # frees vLLM's GPU memory for the update; the next sync or generate wakes it
        elif self.release_after_call:
            self.engine.sleep()
            release_freed_memory(collect=False)
        if "token_versions" not in out.tensors:
            # The version that actually generated each sample: what staleness is measured from (docs/async.md).
            version = self.engine.weights_version
            out.tensors["weights_version"] = torch.full((len(out),), version, dtype=torch.long)
            out.tensors["token_versions"] = out["response_mask"].long() * version
        timing = out.meta.setdefault("timing", {})
        timing["generate/rollout"] = time.perf_counter() - t0
        if t_unshard is not None:  # FSDP2: the gather of every layer before decoding
            timing["generate/unshard"] = t_unshard
        if self.ctx.plan.rollout_owns_weights:  # the engine's layer-by-layer fill of its own copy
            timing["generate/own_weights"] = self.engine.refresh_s
        return out

    def _stream_generate(self, batch: Batch, req: GenerateRequest) -> Batch:
        """One call through the engine loop, once the engine holds req.min_weights_version: per token the version
        that sampled it (the loop installs newer weights between decode rounds), per sample its first token's."""
        params = self.sampling_params(batch, req)
        t0 = time.perf_counter()
        gen, versions = self.stream.generate(batch["prompts"], batch["prompt_mask"], params,
                                             min_version=req.min_weights_version)
        out = versioned_batch(gen, versions, self.engine.weights_version)
        out.meta["timing"] = {"generate/rollout": time.perf_counter() - t0}
        return out

    def _generate_in_segments(self, batch: Batch, params: SamplingParams, segment_tokens: int,
                              before_segment: Callable[[], None] | None) -> Batch:
        """Partial rollouts (workers/partial.py): per token the version of the weights that sampled it; per sample
        the oldest (its first segment's) as `weights_version` and how many segments it took (`segments`)."""
        from fleetrl.engines.hf import _stop_string_end
        from fleetrl.workers.partial import SEGMENT_LOG_ENV, generate_in_segments, segment_logger

        stops = params.stop_strings
        stop_end = (lambda toks: _stop_string_end(self.tokenizer, toks, stops)) if stops else None  # noqa: E731
        path = os.environ.get(SEGMENT_LOG_ENV)
        log = segment_logger(path, self.ctx.rank, self.engine_model()) if path else None
        gen, versions, segments = generate_in_segments(self.engine, batch["prompts"], batch["prompt_mask"], params,
                                                       segment_tokens, self.tokenizer.pad_token_id, before_segment,
                                                       stop_end, log)
        return versioned_batch(gen, versions, self.engine.weights_version, segments=segments)

    def engine_view(self) -> ContextManager:
        """The weights the engine decodes with: the model's, or with FLEETRL_FAULT_SYNC_SKIP some stale ones."""
        return nullcontext() if self.stale is None else self.stale.swapped()

    def probe(self, version: int) -> SyncProbe:
        """The policy check's engine side (engines/sync_check.py): a few tokens sampled after the sync to `version`."""
        with self.whole(), self.engine_view():
            return sample_probe(self.engine, int(self.model.config.vocab_size), self.ctx.cfg.rollout.sync_check,
                                seed=self.ctx.plan.seed("sync_check", version, self.ctx.rank), version=version,
                                rank=self.ctx.rank)

    def sampling_params(self, batch: Batch, req: GenerateRequest) -> SamplingParams:
        """The engine settings of one generate call (a seam benchmarks wrap, e.g. bench/longtail.py's per-sample
        limits)."""
        r = self.ctx.cfg.rollout
        return SamplingParams(max_new_tokens=r.max_new_tokens, temperature=req.temperature, top_p=r.top_p,
                              top_k=r.top_k, stop_token_ids=r.stop_token_ids, stop_strings=r.stop,
                              seed=self.ctx.plan.seed(req.purpose, req.step,
                                                      self.ctx.rank if req.seed_slot is None else req.seed_slot))

    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        self.engine.load_weights(state, version)

    def mark_version(self, version: int) -> None:
        """Colocated sync: the actor's parameters are the new weights."""
        if not self.engine_holds_copy:
            self.engine.weights_version = version
            return
        with unsharded(self.model):  # FSDP2: vLLM takes whole tensors
            self.engine.sync(version)
