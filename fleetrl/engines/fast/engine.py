"""FastRolloutEngine: continuous-batching decode with a static KV cache and CUDA graphs, on the model's own weights.

Colocated use (the default): the engine is handed the trainer's HF model and reads its parameter tensors in
place at every step (`arch.model_weights`), so after an optimizer step the next `generate` samples from the new
policy. Two exceptions read copies, refreshed in place when `weights_version` is assigned, which the trainer's sync
does: `fuse_projections` (on by default on CUDA) reads q/k/v and gate/up from fused copies (fused.py), and a
`compute_dtype` other than the model's under CUDA graphs (fp32 master weights, bf16 decode) reads a copy of the
weights in that dtype kept at fixed addresses (cast.py). `load_weights` is for a separate rollout pool: it copies
named tensors into the parameters (in place, so captured graphs stay valid) and records the version. If the
model's parameters are re-allocated (e.g. `model.to(...)`), the next call notices the new addresses and
re-captures its graphs.

Scheduling: up to `max_batch` slots. Prompts wait in input order; whenever slots are free, waiting prompts are
prefilled into them (lowest slot first) and join the decode batch. A slot stops at its request's own limit
(SamplingParams.max_new_tokens_per_sample, else max_new_tokens), so a short sample frees its slot early for a
waiting prompt; when none waits, the live slots above the bucket their number needs move down into freed ones
(`_compact`), so a long tail decodes in a small batch. Identical prompts admitted together (GRPO's n samples of one prompt) are prefilled once and their
KV rows copied to the other slots. Every `sync_every` steps the host reads the slots' done flags once, harvests
finished responses and frees their slots. Nothing else syncs per token.

Memory: the KV cache is sized by the calls, not by the limits: the first call allocates slots for its batch
(a bucket: powers of two to 128, then steps of 64, at most `max_batch`) and positions for its longest prompt +
max_new_tokens (rounded up to SEQ_GRANULE, at most `max_seq_len`); a later call that needs more grows it. At the
limits' defaults (256 x 2048) a full cache of a 30-layer model would take 24 GB in fp32 on a laptop that needs 100 MB.

Tensor parallel (`tp_group`, tp.py): k processes, each with the whole HF model, run one engine together; each
holds 1/k of the attention heads, MLP columns and KV cache, and the forward all-reduces twice per layer. Every
rank is called with the same prompts and parameters and returns the same output: the LM head is replicated, the
all-reduce hands every rank the same sums, and the sampler is a pure function of (logits, seed, request, token
index), with the seed broadcast from the group's rank 0; so every rank samples the same tokens and makes the same
scheduling decisions (whose collectives must match), with no per-token broadcast. Two checks turn a divergence
into an error instead of a hang or silent drift: the inputs are compared across the group at the start of each
call and the sampled tokens at its end (one small all-gather each).
"""
from __future__ import annotations

import time
from collections import deque
from typing import Literal, Mapping

import torch
import torch.distributed as dist
from torch.profiler import record_function  # names the phases in a profile (bench/decode.py --longtail --profile)

from fleetrl.batch import upload
from fleetrl.engines.fast.arch import (
    DecoderSpec,
    check_window,
    model_weights,
    read_spec,
    weight_fingerprint,
)
from fleetrl.engines.fast.batching import SlotLoop
from fleetrl.engines.fast.forward import DecoderForward
from fleetrl.engines.fast.graphs import DecodeGraphs, batch_buckets, bucket_for
from fleetrl.engines.fast.postprocess import assemble_output
from fleetrl.engines.fast.sampling import SamplerKey, is_stop, sample
from fleetrl.engines.fast.state import MAX_STOP_IDS, SlotBuffers, device_index
from fleetrl.engines.fast.tp import TensorParallel, check_shape, intermediate_size, local_spec
from fleetrl.engines.protocol import GenerationOutput, SamplingParams, response_limits

KV_BUCKET = 256  # kv-length granularity of the torch-path graphs (the Triton path reads exact lengths)
SEQ_GRANULE = 64  # cache positions are allocated in multiples of this, so similar calls reuse one cache


class FastRolloutEngine:
    """RolloutEngine for Llama/Qwen2/Qwen3/Mistral HF models (see module docstring), on CUDA (graphs, Triton) or CPU.

    kernels: "auto" uses the fused Triton kernels on CUDA when triton is installed, else torch ops; "torch"
    forces torch ops. sync_every: decode steps between host reads of the done flags. prefill_tokens: the
    most (padded) prompt tokens prefilled in one forward. compute_dtype: the dtype to decode in when it differs
    from the model's (bf16 decode of an fp32 trainer: on a GPU, or on a CPU with AVX512-BF16); None = the model's
    (the rollout worker passes rollout.compute_dtype as the Plan resolved it). Sampled-token logprobs then come
    from the cast weights (the trainer's recomputation stays in its dtype). keep_cast: how the cast weights are
    held when compute_dtype differs. True: one copy at fixed addresses (cast.py), allocated at the first call,
    refreshed in place when the weights change and kept between calls (2 bytes x parameters for bf16, freed by
    `sleep`), which captured CUDA graphs read. False: a copy cast at the start of each call and freed at its end
    (2 bytes x parameters while generating, nothing between calls); no CUDA graphs then. None = True with CUDA
    graphs (on CUDA by default), else False (CPU).
    fuse_projections: decode with fused q/k/v and gate/up copies (fused.py: one more copy of those weights,
    0.47 GB for Qwen2.5-0.5B bf16, 1.72 GB for 1.5B; in compute_dtype, where they replace that share of the cast
    copy); None = on for CUDA, off on CPU. The fused and kept cast copies are refreshed where the engine learns
    the weights changed: `weights_version` assigned (the colocated trainer's sync sets it, `load_weights` too),
    parameters re-allocated, LoRA adapters merged (each call; the merges are rounded to compute_dtype and kept
    at fixed addresses too). A caller that changes the weights in place by other means assigns
    `weights_version` before the next `generate`.
    tp_group: a torch.distributed process group of k ranks that run this engine together, tensor parallel
    (module docstring; gloo for a CPU engine, NCCL for CUDA); every rank constructs its engine with its own group
    handle and calls `generate` with the same arguments. None (or one rank): no tensor parallelism. The model's
    num_heads, num_kv_heads and intermediate size must be multiples of k (ValueError naming the k that would do).
    own_weights: decode from the engine's own copy of every weight (owned.py: under tp this rank's slices of the
    projections, the embedding, norms and head whole; in compute_dtype, at fixed addresses), filled one decoder layer
    at a time where the weights changed. For a model FSDP2 shards (a colocated sharded actor): the engine then
    never needs it whole, each layer is gathered only while it is copied; the model stays sharded during the call.
    Freed by `sleep`. Replaces keep_cast (it is that copy).
    cache_budget_bytes: the most bytes the KV cache may take (rollout.gpu_memory_fraction of the card): max_batch is
    lowered to the slots of max_seq_len positions that fit (under tp, the fewest any rank's budget holds: the ranks
    decode the same slots), and a call's samples beyond them wait for a slot. ValueError when not one slot fits.
    """

    def __init__(self, model: torch.nn.Module, tokenizer: object | None, *, device: torch.device | str,
                 max_batch: int = 256, max_seq_len: int = 2048, use_cuda_graphs: bool | None = None, seed: int = 0,
                 kernels: Literal["auto", "triton", "torch"] = "auto", sync_every: int = 16,
                 prefill_tokens: int = 32768, compute_dtype: torch.dtype | None = None,
                 fuse_projections: bool | None = None, keep_cast: bool | None = None,
                 tp_group: object | None = None, own_weights: bool = False,
                 cache_budget_bytes: int | None = None) -> None:
        if max_batch < 1 or max_seq_len < 2 or sync_every < 1:
            raise ValueError(f"need max_batch >= 1, max_seq_len >= 2, sync_every >= 1; got {max_batch}, "
                             f"{max_seq_len}, {sync_every}")
        self.model, self.tokenizer = model, tokenizer
        self.device = _resolve(torch.device(device))
        self.spec: DecoderSpec = read_spec(model)
        # Mistral's sliding window: exact while no sequence outgrows it, and none outgrows max_seq_len (`_unpad`).
        check_window(self.spec, max_seq_len, "the engine's max_seq_len")
        self.max_batch, self.max_seq_len, self.sync_every = max_batch, max_seq_len, sync_every
        self.prefill_tokens = max(prefill_tokens, max_seq_len)
        self.model_dtype = self._check_weights()
        self.tp = TensorParallel.of(tp_group)
        # The shape this rank computes and caches: its heads / KV heads under tp (self.spec stays the model's).
        self.local_spec = self.spec
        if self.tp is not None:
            check_shape(self.spec, intermediate_size(model_weights(model)), self.tp.size)
            self.local_spec = local_spec(self.spec, self.tp.size)
        self.dtype = compute_dtype or self.model_dtype
        if cache_budget_bytes is not None:
            self.max_batch = self._slots_within(cache_budget_bytes)
        self.use_cuda_graphs = self.device.type == "cuda" if use_cuda_graphs is None else use_cuda_graphs
        if self.use_cuda_graphs and self.device.type != "cuda":
            raise ValueError("use_cuda_graphs=True needs a CUDA device; pass use_cuda_graphs=None or False on CPU")
        casting = self.dtype != self.model_dtype
        self.owns = own_weights
        self.keep_cast = casting and not own_weights and (self.use_cuda_graphs if keep_cast is None else keep_cast)
        if self.use_cuda_graphs and casting and not (self.keep_cast or self.owns):
            raise ValueError(f"compute_dtype={self.dtype} differs from the model's {self.model_dtype}, and a copy cast "
                             "per call would move under the captured CUDA graphs; pass keep_cast=None or True (one "
                             "copy kept at fixed addresses), or use_cuda_graphs=False")
        self.kernels = _load_kernels(kernels, self.device, self.local_spec, self.dtype)
        fuse = self.device.type == "cuda" if fuse_projections is None else fuse_projections
        self._fwd = DecoderForward(model, self.local_spec, max_seq_len, self.dtype, self.device, self.kernels, fuse,
                                   keep_cast=self.keep_cast, tp=self.tp, own=own_weights)
        self._eos = _eos_ids(model, tokenizer)
        self._rng = torch.Generator().manual_seed(seed)
        self._buckets = batch_buckets(self.max_batch)  # per-allocation buckets are these, capped at its slot count
        self._buf: SlotBuffers | None = None
        self._graphs: DecodeGraphs | None = None
        self._fingerprint: tuple[int, ...] = ()
        self.weights_version = 0  # a property: assigning it marks the fused and kept cast copies stale
        self.refresh_s: float | None = None  # own_weights: seconds the last call spent filling its copy
        self.stats = {"decode_steps": 0, "decode_rows": 0, "prefills": 0, "prefilled_prompts": 0, "syncs": 0,
                      "moved_slots": 0}

    # ------------------------------------------------------------------------------------------ protocol
    @torch.no_grad()
    def generate(self, prompts: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams) -> GenerationOutput:
        rows = self._unpad(prompts, prompt_mask, params)
        limits = response_limits(params, len(rows)).tolist()
        if self.tp is not None:
            self._check_same("the prompts, prompt masks and token limits", _fingerprint(rows, limits, params))
        buf, key = self._begin(len(rows), max(len(r) for r in rows) + params.max_new_tokens, params)
        try:
            tok, lp, counts = self._run(buf, rows, limits, key)
            if self.tp is not None:
                self._check_same("the sampled tokens", [_checksum(tok), *counts])
        finally:
            self._end()
        stop_set = set(self._eos) | set(params.stop_token_ids)
        return assemble_output(tok, lp, counts, stop_set, params.stop_strings, self.tokenizer, prompts.device)

    @property
    def _fixed_copies(self) -> bool:
        """Copies kept at fixed addresses between calls: where captured graphs hold them, or asked for (keep_cast)."""
        return self.use_cuda_graphs or self.keep_cast or self.owns

    def _begin(self, batch: int, seq_len: int, params: SamplingParams) -> tuple[SlotBuffers, SamplerKey]:
        """The buffers, sampler key and weights of a call (or of a stream's session), in the one order that holds:
        the buffers first, since finding the parameters re-allocated there marks the copies stale; then the copies
        refreshed, before any decode step or graph reads them."""
        if not self.owns:  # an owned copy merges each layer as it fills it (owned.py)
            # LoRA actor: merged W + ΔW of the adapted projections (before graphs are captured, which read them),
            # rounded to the compute dtype at once.
            self._fwd.merge_adapters(keep=self._fixed_copies,
                                     dtype=None if self.dtype == self.model_dtype else self.dtype)
        buf = self._ready(batch, seq_len)
        key = self._configure(buf, params)
        self._prepare_weights()
        return buf, key

    def _end(self) -> None:
        """Frees what a call made for itself: a per-call cast copy and per-call merges (kept ones stay)."""
        if not self.keep_cast:
            self._fwd.shadow = None
        if not self._fixed_copies:
            self._fwd.merged = None

    def _prepare_weights(self) -> None:
        """The weights this call decodes with: the kept compute-dtype copy refreshed in place where stale
        (cast.py), a copy cast for this call, or the model's own tensors with the fused copies refreshed; or the
        engine's own copy refreshed layer by layer (owned.py)."""
        if self.owns:
            t0 = time.perf_counter()
            self._fwd.refresh_owned()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the copies (and FSDP2's gathers) run asynchronously
            self.refresh_s = time.perf_counter() - t0
        elif self.keep_cast:
            self._fwd.refresh_cast()
        elif self.dtype != self.model_dtype:
            self._fwd.cast_for_call(self.dtype)
            self._fwd.merged = None  # the cast copy holds the merge now
        else:
            self._fwd.refresh_fused()

    @torch.no_grad()
    def load_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        named = dict(self.model.named_parameters(remove_duplicate=False))
        named.update(self.model.named_buffers(remove_duplicate=False))
        for name, tensor in state.items():
            target = named.get(name)
            if target is None:
                raise ValueError(f"load_weights: {name!r} is not a parameter of the rollout model; "
                                 f"expected HF names such as {next(iter(named))!r}")
            if target.shape != tensor.shape:
                raise ValueError(f"load_weights: {name!r} has shape {tuple(tensor.shape)}, "
                                 f"the model's is {tuple(target.shape)}")
            target.data.copy_(tensor)  # in place: captured graphs keep pointing at the right memory
        self.weights_version = version  # marks the fused and kept cast copies stale

    @property
    def weights_version(self) -> int:
        return self._weights_version

    @weights_version.setter
    def weights_version(self, version: int) -> None:
        """Recording a version is how the engine learns its weights changed (colocated sync, load_weights)."""
        self._weights_version = version
        self._fwd.mark_stale()

    def sleep(self) -> None:
        """Frees the KV cache, slot buffers, graphs, fused projection copies, the kept cast copy and the owned copy
        (the next call fills it again). The model's weights stay: they are the trainer's tensors."""
        self._buf, self._graphs = None, None
        self._fwd.release_copies()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake(self) -> None:
        """Nothing to restore: the next `generate` allocates a cache of the size it needs."""

    def cache_bytes(self) -> int:
        """The KV cache's bytes at its largest (max_batch slots of max_seq_len positions, this rank's KV heads)."""
        return self.slot_bytes() * self.max_batch

    def slot_bytes(self) -> int:
        """One slot's KV cache: max_seq_len positions of keys and values of this rank's KV heads in every layer."""
        s = self.local_spec
        per_token = 2 * s.num_layers * s.num_kv_heads * s.head_dim * torch.finfo(self.dtype).bits // 8
        return per_token * self.max_seq_len

    def _slots_within(self, budget: int) -> int:
        slots = min(self.max_batch, budget // self.slot_bytes())
        if self.tp is not None:  # the ranks decode the same slots: the smallest budget decides
            t = torch.tensor([slots], dtype=torch.long, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.tp.group)
            slots = int(t.item())
        if slots < 1:
            raise ValueError(f"the KV-cache budget of {budget / 2**30:.2f} GiB (rollout.gpu_memory_fraction) holds no "
                             f"slot of {self.max_seq_len} positions ({self.slot_bytes() / 2**30:.2f} GiB each); raise "
                             "rollout.gpu_memory_fraction, or shorten data.max_prompt_length / rollout.max_new_tokens")
        return slots

    # ------------------------------------------------------------------------------------------ setup
    def _check_weights(self) -> torch.dtype:
        from fleetrl.models.lora import lora_layers

        # An FSDP2-sharded model's parameters are DTensors: their local shards tell the device and dtype.
        tensors = [_local(t) for t in model_weights(self.model).tensors()]
        devices = {_resolve(t.device) for t in tensors}
        # A LoRA actor's adapted weights are never read as they are (each call merges them, arch.merged_weights),
        # and may be kept narrower than the rest (models/lora.py store_frozen_base).
        merged = {_local(layer.get_base_layer().weight.data).data_ptr() for layer in lora_layers(self.model).values()}
        dtypes = {t.dtype for t in tensors if t.data_ptr() not in merged}
        if devices != {self.device}:
            raise ValueError(f"model parameters are on {sorted(map(str, devices))} but the engine device is "
                             f"{self.device}; move the model there first (the engine decodes with the model's own "
                             "tensors and never copies them)")
        if len(dtypes) != 1:
            raise ValueError(f"model parameters mix dtypes {sorted(map(str, dtypes))}; cast the model to one dtype "
                             "(e.g. model.to(torch.bfloat16)) or give the engine a bf16 copy via load_weights")
        return dtypes.pop()

    def _ready(self, batch: int, seq_len: int) -> SlotBuffers:
        """Buffers with at least min(batch, max_batch) slots (a bucket size) and seq_len positions."""
        slots = bucket_for(min(batch, self.max_batch), self._buckets)
        positions = min(-(-seq_len // SEQ_GRANULE) * SEQ_GRANULE, self.max_seq_len)
        if self._buf is None or self._buf.slots < slots or self._buf.seq_len < positions:
            if self._buf is not None:  # grow to cover both the old and the new need
                slots, positions = max(slots, self._buf.slots), max(positions, self._buf.seq_len)
            self._buf = None  # drop the old cache before allocating the new one
            self._buf = SlotBuffers.allocate(self.local_spec, slots, positions, self.dtype, self.device)
            self._graphs = None
        fingerprint = weight_fingerprint(model_weights(self.model))
        if fingerprint != self._fingerprint:  # parameters re-allocated: graphs hold stale addresses
            self._fingerprint, self._graphs = fingerprint, None
            self._fwd.mark_stale()  # and new values, most likely (FSDP2 unshards each call)
        if self.use_cuda_graphs and self._graphs is None:
            self._graphs = DecodeGraphs(self._step, self._buf.step_state())
        return self._buf

    def _check_same(self, what: str, values: list[int]) -> None:
        """Raises on every rank of the tp group unless `values` are the same on all of them (one all-gather)."""
        mine = torch.tensor(values, dtype=torch.long, device=self.device)
        # the lengths first (all_gather needs one size on every rank); every rank sees the same and decides alike
        sizes = self.tp.gather(torch.tensor([mine.numel()], dtype=torch.long, device=self.device))
        if len({int(n) for n in sizes}) == 1:
            everyone = self.tp.gather(mine)
            if all(torch.equal(v, everyone[0]) for v in everyone):
                return
        raise RuntimeError(f"tensor-parallel rank {self.tp.rank} of {self.tp.size}: {what} differ between the ranks "
                           "of the group; every rank must call generate with the same prompts and SamplingParams (and "
                           "hold the same weights)")

    def _unpad(self, prompts: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams) -> list[torch.Tensor]:
        if prompts.shape != prompt_mask.shape or prompts.dim() != 2:
            raise ValueError(f"prompts {tuple(prompts.shape)} and prompt_mask {tuple(prompt_mask.shape)} must be "
                             "the same [B, P] shape")
        if params.max_new_tokens < 1 or params.temperature < 0 or not 0 < params.top_p <= 1 or params.top_k < 0:
            raise ValueError(f"invalid SamplingParams {params}: need max_new_tokens >= 1, temperature >= 0, "
                             "0 < top_p <= 1, top_k >= 0")
        ids, mask = prompts.cpu(), prompt_mask.cpu().bool()
        # one mask op and a split into views: a mask op per row cost ~15 µs each (4 ms at 256 rows, before the
        # call's first kernel)
        rows = list(torch.split(ids[mask], mask.sum(1).tolist()))
        for i, row in enumerate(rows):
            if len(row) == 0 or len(row) + params.max_new_tokens > self.max_seq_len:
                raise ValueError(f"prompt {i} has {len(row)} tokens; with max_new_tokens={params.max_new_tokens} "
                                 f"it needs 1..{self.max_seq_len - params.max_new_tokens} tokens to fit "
                                 f"max_seq_len={self.max_seq_len} (raise max_seq_len or shorten the prompt)")
        return rows

    def _configure(self, buf: SlotBuffers, params: SamplingParams) -> SamplerKey:
        stop = sorted(set(self._eos) | set(params.stop_token_ids))
        if len(stop) > MAX_STOP_IDS:
            raise ValueError(f"{len(stop)} stop token ids given; at most {MAX_STOP_IDS} are supported")
        buf.stop_ids.fill_(-1)
        if stop:
            buf.stop_ids[: len(stop)] = upload(torch.tensor(stop, dtype=torch.long), self.device)
        greedy = params.temperature == 0
        buf.temperature.fill_(1.0 if greedy else params.temperature)
        seed = params.seed if params.seed is not None else int(torch.randint(1 << 22, (1,), generator=self._rng))
        if self.tp is not None:  # one stream for the group: rank 0's (engines built with per-rank seeds agree too)
            seed = self.tp.broadcast_int(seed, self.device)
        buf.seed.fill_(seed % (1 << 22))
        return SamplerKey(True) if greedy else SamplerKey(False, params.top_k, params.top_p)

    # ------------------------------------------------------------------------------------- scheduling
    def _run(self, buf: SlotBuffers, rows: list[torch.Tensor], limits: list[int],
             key: SamplerKey) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Continuous batching over all requests (batching.py), request i decoding at most limits[i] tokens ->
        (tokens [B, max(limits)], logprobs [B, max(limits)], counts)."""
        max_new = max(limits)
        loop = SlotLoop(self, buf, key)
        pending = deque(loop.new_request(row, limits[i], i) for i, row in enumerate(rows))  # id i keys request i
        parts: list[tuple[list[int], torch.Tensor, torch.Tensor]] = []
        counts = [0] * len(rows)
        while pending or loop.running:
            reqs, finished_counts, toks, lps = loop.round(pending, width=max_new)
            if reqs:
                parts.append((reqs, toks, lps))
                for req, c in zip(reqs, finished_counts):
                    counts[req] = c
            loop.compact_if_idle(pending)
        reqs = [r for p in parts for r in p[0]]
        order = torch.empty(len(rows), dtype=torch.long)
        order[torch.tensor(reqs)] = torch.arange(len(rows))
        order = order.to(self.device)
        return (torch.cat([p[1] for p in parts])[order], torch.cat([p[2] for p in parts])[order], counts)

    def _decode_round(self, steps: int, running: dict[int, int], length: dict[int, int], sampled: dict[int, int],
                      limits: list[int], buckets: list[int], key: SamplerKey) -> int:
        """Up to `steps` decode steps of slots [0, bucket of the highest live one), fewer when every live slot
        reaches its limit sooner -> the steps run."""
        n = min(steps, max((limits[running[s]] - sampled[s] for s in running), default=0))
        nb = bucket_for(max(running) + 1, buckets) if n else 0
        with record_function("engine.decode"):
            for _ in range(n):
                self._decode(nb, max(length[s] + sampled[s] for s in running), key)
                for s in running:
                    sampled[s] = min(sampled[s] + 1, limits[running[s]])
        return n

    def _compact(self, buf: SlotBuffers, running: dict[int, int], length: dict[int, int], sampled: dict[int, int],
                 free: list[int], buckets: list[int]) -> None:
        """Moves the live slots above the bucket their number needs into free slots below it (KV rows and every
        per-slot buffer; the random stream is keyed by request and count, so the samples do not change). Without
        it a long tail decodes in the call's full bucket: a step computes every slot below the highest live one."""
        target = bucket_for(len(running), buckets)
        movers = sorted(s for s in running if s >= target)
        if not movers:
            return
        holes = sorted(s for s in free if s < target)[: len(movers)]  # enough: len(running) <= target
        src, dst = device_index(movers, self.device), device_index(holes, self.device)
        width = min(max(length[s] + sampled[s] for s in movers), buf.seq_len)
        buf.k[:, dst, :, :width] = buf.k[:, src, :, :width]
        buf.v[:, dst, :, :width] = buf.v[:, src, :, :width]
        for t in (buf.tokens, buf.pos, buf.done, buf.count, buf.limit, buf.req, buf.lead, buf.shared, buf.out_tok,
                  buf.out_lp):
            t[dst] = t[src]
        buf.done.index_fill_(0, src, True)  # not `done[src] = True`: a scalar setitem waits for the GPU (state.py)
        buf.release(src)  # a mover's rows are whole at its new slot; no slot reads its freed one
        for a, b in zip(movers, holes):
            running[b], length[b], sampled[b] = running.pop(a), length.pop(a), sampled.pop(a)
        free[:] = sorted((set(free) - set(holes)) | set(movers))  # a sorted list is a valid heap
        self.stats["moved_slots"] += len(movers)

    def _prefill(self, buf: SlotBuffers, rows: list[torch.Tensor], admit: list[tuple[int, int]], limits: list[int],
                 key: SamplerKey) -> None:
        """Prefills the admitted prompts (once per group of identical ones) into their slots. No host sync: it runs
        while the GPU still decodes the steps queued before it (`_run`), so every index goes up in one
        asynchronous copy and whether a group has followers is known on the host."""
        groups = _same_prompt_groups(admit, rows)
        by_leader = {g[0][0]: g for g in groups}
        for chunk in _chunks([g[0] for g in groups], rows, self.prefill_tokens):
            lens = [len(rows[r]) for _, r in chunk]
            toks = torch.zeros(len(chunk), max(lens), dtype=torch.long)
            for i, (_, r) in enumerate(chunk):
                toks[i, : lens[i]] = rows[r]
            # Every member of a leader's group starts from the leader's cache rows and last-token logits; its
            # own request index keys its random stream, so the n samples of one prompt still differ.
            members = [(i, s, r) for i, (slot, _) in enumerate(chunk) for s, r in by_leader[slot]]
            leaders = [slot for slot, _ in chunk]
            followers = [(leaders[i], s) for i, s, _ in members if s != leaders[i]]
            (toks, lens_d, leader_slots, of, slots, reqs, limit, src, dst) = self._upload(
                toks, lens, leaders, [i for i, _, _ in members], [s for _, s, _ in members],
                [r for _, _, r in members], [limits[r] for _, _, r in members],
                [a for a, _ in followers], [b for _, b in followers])
            lengths = lens_d[of]
            logits = self._fwd.prefill(buf.k, buf.v, toks, lens_d, leader_slots)
            if followers:
                width = max(lens)
                buf.k[:, dst, :, :width] = buf.k[:, src, :, :width]
                buf.v[:, dst, :, :width] = buf.v[:, src, :, :width]
            tok, lp = sample(logits[of], key, buf.temperature, buf.seed, reqs, torch.zeros_like(reqs), self.kernels)
            buf.out_tok[slots, 0], buf.out_lp[slots, 0] = tok, lp
            buf.tokens[slots], buf.pos[slots], buf.req[slots] = tok, lengths, reqs
            buf.lead[slots], buf.shared[slots] = leader_slots[of], lengths  # the prompt's rows, read at the leader
            buf.count.index_fill_(0, slots, 1)  # not `count[slots] = 1`, which waits for the GPU (state.py release)
            buf.limit[slots] = limit
            buf.done[slots] = is_stop(tok, buf.stop_ids) | (limit <= 1)
            self.stats["prefills"] += 1
            self.stats["prefilled_prompts"] += len(chunk)

    def _upload(self, toks: torch.Tensor, *lists: list[int]) -> list[torch.Tensor]:
        """toks and the int lists on the engine's device, in one `upload` (state.py)."""
        sizes = [toks.numel(), *map(len, lists)]
        flat = torch.cat([toks.flatten(), torch.tensor([v for vs in lists for v in vs], dtype=torch.long)])
        parts = list(torch.split(upload(flat, self.device), sizes))
        return [parts[0].view(toks.shape), *parts[1:]]

    def _decode(self, nb: int, kv_len: int, key: SamplerKey) -> None:
        self.stats["decode_steps"] += 1
        self.stats["decode_rows"] += nb  # slots a step computes, live or not
        if self._graphs is None:
            self._step((nb, kv_len, key))
            return
        kv = 0 if self.kernels is not None else min(-(-kv_len // KV_BUCKET) * KV_BUCKET, self._buf.seq_len)
        self._graphs.run((nb, kv, key))

    def _step(self, graph_key: tuple[int, int, SamplerKey]) -> None:
        """One decode step for slots [0, nb): forward, sample, append, update done. Device-only (capturable)."""
        nb, kv_len, key = graph_key
        buf = self._buf
        logits = self._fwd.decode(buf.k, buf.v, buf.tokens[:nb], buf.pos[:nb], kv_len, buf.lead[:nb], buf.shared[:nb])
        tok, lp = sample(logits, key, buf.temperature, buf.seed, buf.req[:nb], buf.count[:nb], self.kernels)
        if self.kernels is not None:
            self.kernels.step_update(tok, lp, buf.done[:nb], buf.count[:nb], buf.limit[:nb], buf.pos[:nb],
                                     buf.tokens[:nb], buf.out_tok[:nb], buf.out_lp[:nb], buf.stop_ids)
            return
        was_done = buf.done[:nb].clone()
        live = (~was_done).long()
        col = torch.where(was_done, buf.junk_col, buf.count[:nb])[:, None]
        buf.out_tok[:nb].scatter_(1, col, tok[:, None])
        buf.out_lp[:nb].scatter_(1, col, lp[:, None])
        buf.count[:nb] += live
        buf.pos[:nb] += live
        buf.tokens[:nb] = tok
        buf.done[:nb] = was_done | is_stop(tok, buf.stop_ids) | (buf.count[:nb] >= buf.limit[:nb])


def _fingerprint(rows: list[torch.Tensor], limits: list[int], params: SamplingParams) -> list[int]:
    """What the ranks of a tp group must agree on before a call: the prompts' tokens and every token limit."""
    lengths = [len(r) for r in rows]
    flat = torch.cat(rows).long()
    return [len(rows), *lengths, _checksum(flat), *limits, int(params.temperature * 1e6), params.top_k,
            int(params.top_p * 1e6), len(params.stop_token_ids), sum(params.stop_token_ids)]


def _checksum(t: torch.Tensor) -> int:
    """A position-weighted sum of an integer tensor (wrapping in int64): equal tensors give equal sums, and a
    swapped, shifted or changed token changes it."""
    flat = t.flatten().long()
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.long, device=flat.device) * 0x9E3779B1 + 1
    return int((flat * weights).sum())


def _same_prompt_groups(admit: list[tuple[int, int]], rows: list[torch.Tensor]) -> list[list[tuple[int, int]]]:
    """Admitted (slot, request) pairs grouped by identical prompt tokens, in admission order; the first pair of
    each group is its leader, the one that is prefilled."""
    groups: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for slot, req in admit:
        groups.setdefault(tuple(rows[req].tolist()), []).append((slot, req))
    return list(groups.values())


def _chunks(admit: list[tuple[int, int]], rows: list[torch.Tensor], budget: int) -> list[list[tuple[int, int]]]:
    """Splits admitted (slot, request) pairs so that n * longest prompt <= budget tokens per prefill."""
    out: list[list[tuple[int, int]]] = [[]]
    longest = 0
    for item in admit:
        n = len(rows[item[1]])
        if out[-1] and (len(out[-1]) + 1) * max(longest, n) > budget:
            out.append([])
            longest = 0
        out[-1].append(item)
        longest = max(longest, n)
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (an FSDP2-sharded parameter); any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _resolve(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _eos_ids(model: torch.nn.Module, tokenizer: object | None) -> list[int]:
    """EOS = the tokenizer's eos_token_id plus the model generation config's (int or list); may be empty."""
    ids: set[int] = set()
    for value in (getattr(tokenizer, "eos_token_id", None),
                  getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return sorted(ids)


def _load_kernels(choice: str, device: torch.device, spec: DecoderSpec, dtype: torch.dtype) -> object | None:
    if choice not in ("auto", "triton", "torch"):
        raise ValueError(f"kernels must be 'auto', 'triton' or 'torch', got {choice!r}")
    if choice == "torch" or (choice == "auto" and device.type != "cuda"):
        return None
    try:
        from fleetrl.engines.fast.triton_kernels import TritonKernels
    except ImportError as err:
        if choice == "triton":
            raise ValueError(f"kernels='triton' needs the triton package ({err}); install it or use 'torch'") from err
        return None
    if not TritonKernels.supports(spec, dtype):
        if choice == "triton":
            raise ValueError(f"the Triton kernels need a power-of-two head_dim >= 16, got {spec.head_dim}")
        return None
    return TritonKernels(device)
