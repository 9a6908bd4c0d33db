"""The fast engine's own Llama/Qwen2/Qwen3/Mistral forward: prefill of new prompts and one batched decode step.

Written with torch ops (and optionally the fused Triton kernels of `triton_kernels.py` on CUDA), reading the
weights from the HF modules (`arch.model_weights`). The torch path mirrors the HF modules op for op (RMSNorm in
fp32 then cast, RoPE from HF's own inv_freq, residual adds in the model dtype), so that on CPU fp32 it matches
`model.generate` token for token. The Triton path with fused copies folds the norm weights into the projections
and adds the residual inside the GEMMs (`_decode_folded`): the same math, rounded in other places (bf16 log-prob
gap to the training forward unchanged, bench/RESULTS.md tenth round).

Cache layout: k/v [layers, slots, kv_heads, max_seq_len, head_dim]; slot s holds its sequence from position 0
(prompts are un-padded on admission, so no position offsets are needed).

Tensor parallel (`tp`, tp.py): the forward runs on one rank's shard, with `spec` that rank's shape (its query and
KV heads; hidden whole) and its weights the shard views of the model's (`_base`). The two row-parallel products
(attention output, MLP down) go through `_row_linear`: the rank's partial sum, one all-reduce, then the bias. Both
the torch and the Triton paths take it (the kernels read the heads from `spec` and the strides from the tensors);
the Triton path at k > 1 is written, not yet run on a GPU. With tp None every op is the k = 1 code, unchanged.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from fleetrl.engines.fast.arch import (
    DecoderSpec,
    ModelWeights,
    cast_weights,
    merged_weights,
    model_weights,
    rope_tables,
)
from fleetrl.engines.fast.cast import CastCopy
from fleetrl.engines.fast.fused import FusedProjections
from fleetrl.engines.fast.owned import OwnedWeights
from fleetrl.engines.fast.tp import TensorParallel, shard_weights
from fleetrl.models.family import apply_rope, rms_norm  # noqa: F401  (the family's ops; re-exported)


def head_norms(q: torch.Tensor, k: torch.Tensor, lw: Any, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's per-head q_norm / k_norm (RMSNorm over head_dim, HF's op for op) on q [..., H, d], k [..., KVH, d],
    between the projection and RoPE; unchanged for the families without them (lw.qn None)."""
    if lw.qn is None:
        return q, k
    return rms_norm(q, lw.qn, eps), rms_norm(k, lw.kn, eps)


def _mlp(h: torch.Tensor, lw: Any, down: Any = F.linear) -> torch.Tensor:
    """down: the down projection's (x, w, b) -> y (the forward's `_row_linear` under tensor parallelism)."""
    if lw.wgu is not None:
        gate, up = F.linear(h, lw.wgu, lw.bgu).chunk(2, dim=-1)
    else:
        gate, up = F.linear(h, lw.wg, lw.bg), F.linear(h, lw.wu, lw.bu)
    return down(F.silu(gate) * up, lw.wd, lw.bd)


def _qkv(h: torch.Tensor, lw: Any, spec: DecoderSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h [..., hidden] -> q [..., H·d], k, v [..., KVH·d]: one GEMM with the fused matrix, else three."""
    if lw.wqkv is None:
        return F.linear(h, lw.wq, lw.bq), F.linear(h, lw.wk, lw.bk), F.linear(h, lw.wv, lw.bv)
    kv = spec.num_kv_heads * spec.head_dim
    return F.linear(h, lw.wqkv, lw.bqkv).split((spec.num_heads * spec.head_dim, kv, kv), dim=-1)


class DecoderForward:
    def __init__(self, model: torch.nn.Module, spec: DecoderSpec, max_seq_len: int, dtype: torch.dtype,
                 device: torch.device, kernels: Any | None, fuse: bool = False, keep_cast: bool = False,
                 tp: TensorParallel | None = None, own: bool = False) -> None:
        """dtype: the compute dtype. keep_cast: hold the copy of the weights in it between calls, at fixed addresses
        (cast.py; the engine's choice under CUDA graphs when dtype is not the model's) instead of per call.
        tp: this rank's tensor-parallel group (tp.py); `spec` is then the rank's shape (tp.local_spec).
        own: decode from the engine's own copy of every weight (owned.py), filled layer by layer by `refresh_owned`;
        it is the kept copy in the compute dtype, so keep_cast is then False."""
        self.model = model
        self.spec = spec
        self.tp = tp
        # tp: this rank's views of the (merged) weights, kept between steps and rebuilt after `mark_stale`, a new
        # merge or `release_copies` (views: they read the model's memory, so an in-place change shows at once).
        self._shards: ModelWeights | None = None
        self.dtype = dtype
        self.kernels = kernels
        self.scale = spec.head_dim ** -0.5
        self.cos, self.sin = rope_tables(model, max_seq_len, dtype, device)
        # Decode GEMMs at batch <= 256 fill a fraction of the SMs; k/v (and up) run beside q (and gate) on a
        # second stream, which the CUDA graph captures as parallel branches.
        self._side = torch.cuda.Stream(device) if kernels is not None and device.type == "cuda" else None

        # The weights in the compute dtype when the model's own dtype differs (fp32 trainer, bf16 decode): a copy
        # made for one generate call (`cast_for_call`), or the kept copy's buffers (`refresh_cast`); None = decode
        # with the model's tensors in place.
        self.shadow: ModelWeights | None = None
        self.cast: CastCopy | None = CastCopy(dtype) if keep_cast else None
        # A LoRA actor's weights with its adapters merged (set by `merge_adapters`); None = no adapters.
        self.merged: ModelWeights | None = None
        # Fused q/k/v and gate/up copies (fused.py), read at fixed addresses; None = the model's own tensors. The
        # Triton decode folds the norms into them (`_decode_folded`); the torch path stays HF's op for op. Not in
        # fp16: a GEMM on the raw residual is rms(x) times larger, and fp16 tops out at 65,504.
        fold = kernels is not None and dtype != torch.float16
        self.fused: FusedProjections | None = FusedProjections(fold_norms=fold) if fuse else None
        assert not (own and keep_cast), "the owned copy is the kept copy in the compute dtype"
        self.owned: OwnedWeights | None = OwnedWeights(dtype, tp, self.fused) if own else None

    def weights(self) -> ModelWeights:
        if self.owned is not None:
            assert self.owned.weights is not None and not self.owned.stale, "owned weights used before refresh"
            return self.owned.weights
        if self.shadow is not None:
            return self.shadow
        base = self._base()
        return base if self.fused is None else self.fused.attach(base)

    def _base(self) -> ModelWeights:
        """The (merged) weights before fusing or casting: the whole model's, or under tp this rank's shard views."""
        base = self.merged if self.merged is not None else model_weights(self.model)
        if self.tp is None:
            return base
        if self._shards is None:
            self._shards = shard_weights(base, self.tp.rank, self.tp.size)
        return self._shards

    def _row_linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        """A row-parallel projection (attention output, MLP down): under tp the rank's partial product, summed over
        the group by one all-reduce, then the bias, added once; F.linear otherwise."""
        if self.tp is None:
            return F.linear(x, w, b)
        y = self.tp.all_reduce(F.linear(x, w))
        return y if b is None else y.add_(b)

    def refresh_fused(self) -> None:
        """Brings the fused copies up to the current (merged) weights when the engine marked them stale; a
        LoRA merge is new at every call, so it is always copied."""
        if self.fused is not None and (self.fused.stale or self.merged is not None):
            self.fused.refresh(self._base())

    def refresh_cast(self) -> None:
        """Points `shadow` at the kept compute-dtype copy (cast.py), brought up to the current (merged) weights in
        place where the engine marked it stale; the fused buffers are allocated in the compute dtype and refreshed
        as in `refresh_fused`, and read as they are: no unfused copy of q/k/v and gate/up is made."""
        base = self._base()
        if self.fused is not None:
            if self.fused.stale or self.merged is not None:
                self.fused.refresh(base, self.dtype)
            base = self.fused.attach(base)
        self.shadow = self.cast.refresh(base)

    def refresh_owned(self) -> None:
        """Brings the engine's own copy up to the model's current (merged) weights where stale (owned.py)."""
        self.owned.refresh(self.model)

    def mark_stale(self) -> None:
        """The weights changed: the fused and kept cast copies are refreshed before the next decode reads them."""
        self._shards = None  # the model's tensors may be new ones (FSDP2 unshards each call)
        for copy in (self.fused, self.cast, self.owned):
            if copy is not None:
                copy.stale = True

    def release_copies(self) -> None:
        """Frees the fused and kept cast copies (captured graphs that read them must be dropped too)."""
        self.shadow, self._shards = None, None
        for copy in (self.fused, self.cast, self.owned):
            if copy is not None:
                copy.release()

    def merge_adapters(self, keep: bool, dtype: torch.dtype | None = None) -> None:
        """Merges the model's LoRA adapters (which change between calls) for the next call. `keep`: into the
        buffers of the previous merge, so their addresses stay fixed for captured CUDA graphs. `dtype`: round
        each merge to it at once (the call decodes in it)."""
        self.merged = merged_weights(self.model, self.merged if keep else None, dtype=dtype)
        self._shards = None  # sliced from this merge (or from the model's tensors) at the next read

    def cast_for_call(self, dtype: torch.dtype) -> None:
        """Takes a `dtype` copy of the model's current (merged) weights (they change in place between calls)."""
        self.shadow = None  # free the previous copy first
        base = self._base()
        if self.fused is not None:  # cast straight into fused buffers of this call: no unfused copy is made
            call = FusedProjections(fold_norms=self.fused.fold_norms)
            call.refresh(base, dtype)
            base = call.attach(base)
        self.shadow = cast_weights(base, dtype)

    # ----------------------------------------------------------------------------------------- prefill
    def prefill(self, k_cache: torch.Tensor, v_cache: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor,
                slots: torch.Tensor) -> torch.Tensor:
        """tokens [n, P] RIGHT-padded prompts, lengths [n], slots [n] -> logits of the last prompt token [n, V].

        Right padding means causal attention alone is exact for every real token (pads only ever come after),
        so the flash/causal SDPA path is used; the pads' K/V land past each prompt's end and are never read.
        """
        s, w = self.spec, self.weights()
        n, plen = tokens.shape
        x = F.embedding(tokens, w.embed)
        cos, sin = self.cos[:plen][None, None], self.sin[:plen][None, None]
        for layer, lw in enumerate(w.layers):
            q, k, v = _qkv(rms_norm(x, lw.ln1, s.rms_eps), lw, s)
            q, k = head_norms(q.reshape(n, plen, s.num_heads, s.head_dim),
                              k.reshape(n, plen, s.num_kv_heads, s.head_dim), lw, s.rms_eps)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            v = v.reshape(n, plen, s.num_kv_heads, s.head_dim).transpose(1, 2)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            k_cache[layer][slots, :, :plen] = k
            v_cache[layer][slots, :, :plen] = v
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                               enable_gqa=s.group > 1)
            x = x + self._row_linear(o.transpose(1, 2).reshape(n, plen, -1), lw.wo, lw.bo)
            x = x + _mlp(rms_norm(x, lw.ln2, s.rms_eps), lw, self._row_linear)
        last = x[torch.arange(n, device=x.device), lengths - 1]
        return F.linear(rms_norm(last, w.norm, s.rms_eps), w.lm_head)

    # ------------------------------------------------------------------------------------------ decode
    def decode(self, k_cache: torch.Tensor, v_cache: torch.Tensor, tokens: torch.Tensor, pos: torch.Tensor,
               kv_len: int, lead: torch.Tensor | None = None, shared: torch.Tensor | None = None) -> torch.Tensor:
        """One token per slot: tokens [nb] at positions pos [nb] (slots 0..nb-1) -> logits [nb, V].

        Writes each token's K/V at its position, then attends over positions <= pos. kv_len bounds the cache
        span read by the torch path (>= max(pos) + 1 over live slots); the Triton path reads each slot's own
        length and ignores it. lead, shared [nb]: the Triton path reads slot b's positions below shared[b] at
        slot lead[b] (equal rows: state.py; None: own rows); the torch path reads every slot's own rows.
        """
        if self.kernels is not None:
            return self._decode_triton(k_cache, v_cache, tokens, pos, lead, shared)
        s, w = self.spec, self.weights()
        nb = tokens.shape[0]
        x = F.embedding(tokens, w.embed)
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]
        rows = torch.arange(nb, device=tokens.device)
        # [nb, 1, 1, kv_len]; a slot whose pos >= kv_len (a done slot) just sees all of it, never an empty row
        mask = (torch.arange(kv_len, device=tokens.device)[None, :] <= pos[:, None])[:, None, None, :]
        for layer, lw in enumerate(w.layers):
            q, k, v = _qkv(rms_norm(x, lw.ln1, s.rms_eps), lw, s)
            q, k = head_norms(q.reshape(nb, s.num_heads, s.head_dim), k.reshape(nb, s.num_kv_heads, s.head_dim),
                              lw, s.rms_eps)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            v = v.reshape(nb, s.num_kv_heads, s.head_dim)
            k_cache[layer][rows, :, pos] = k
            v_cache[layer][rows, :, pos] = v
            # GQA without repeating K/V: the G query heads of a KV head act as G query rows of one head.
            o = F.scaled_dot_product_attention(
                q.view(nb, s.num_kv_heads, s.group, s.head_dim), k_cache[layer, :nb, :, :kv_len],
                v_cache[layer, :nb, :, :kv_len], attn_mask=mask, scale=self.scale)
            x = x + self._row_linear(o.reshape(nb, -1), lw.wo, lw.bo)
            x = x + _mlp(rms_norm(x, lw.ln2, s.rms_eps), lw, self._row_linear)
        return F.linear(rms_norm(x, w.norm, s.rms_eps), w.lm_head)

    def _decode_triton(self, k_cache: torch.Tensor, v_cache: torch.Tensor, tokens: torch.Tensor,
                       pos: torch.Tensor, lead: torch.Tensor | None, shared: torch.Tensor | None) -> torch.Tensor:
        """Same math as `decode`, with RMSNorm+residual, (q/k norm+)RoPE+cache write+attention and SiLU*up fused."""
        kn, s, w = self.kernels, self.spec, self.weights()
        if lead is None or shared is None:
            lead, shared = torch.arange(len(tokens), device=tokens.device), torch.zeros_like(pos)
        x = F.embedding(tokens, w.embed)  # residual stream, updated in place (add_rmsnorm, or addmm_ when folded)
        if w.layers[0].ln1 is None:
            return self._decode_folded(w, x, pos, k_cache, v_cache, lead, shared)
        h = torch.empty_like(x)
        delta = None
        for layer, lw in enumerate(w.layers):
            kn.add_rmsnorm(x, delta, lw.ln1, s.rms_eps, h)
            if lw.wqkv is not None:  # one GEMM; q, k, v are column views of its rows (the kernels take strides)
                q, k, v = _qkv(h, lw, s)
            else:
                q, k, v = self._linears(h, (lw.wq, lw.bq), (lw.wk, lw.bk), (lw.wv, lw.bv))
            o = kn.decode_attention(q, k, v, self.cos, self.sin, pos, k_cache[layer], v_cache[layer], s, self.scale,
                                    lead, shared, q_norm=lw.qn, k_norm=lw.kn)
            kn.add_rmsnorm(x, self._row_linear(o, lw.wo, lw.bo), lw.ln2, s.rms_eps, h)
            if lw.wgu is not None:
                gate, up = F.linear(h, lw.wgu, lw.bgu).chunk(2, dim=-1)
            else:
                gate, up = self._linears(h, (lw.wg, lw.bg), (lw.wu, lw.bu))
            delta = self._row_linear(kn.silu_mul(gate, up), lw.wd, lw.bd)
        kn.add_rmsnorm(x, delta, w.norm, s.rms_eps, h)
        return F.linear(h, w.lm_head)

    def _decode_folded(self, w: ModelWeights, x: torch.Tensor, pos: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, lead: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
        """`_decode_triton` with the norms folded into the fused projections (fused.py): a layer is 6 launches,
        not 8. The attention and SiLU·up kernels take each row's 1/rms from the residual stream x and add the
        biases; the o and down GEMMs add into x in place (cuBLAS beta = 1), which is the residual add. At batch
        256 each launch costs ~3 µs however small (bench/RESULTS.md, fifth and seventh rounds)."""
        kn, s = self.kernels, self.spec
        kv = s.num_kv_heads * s.head_dim
        for layer, lw in enumerate(w.layers):
            q, k, v = torch.mm(x, lw.wqkv.t()).split((s.num_heads * s.head_dim, kv, kv), dim=-1)
            o = kn.decode_attention(q, k, v, self.cos, self.sin, pos, k_cache[layer], v_cache[layer], s, self.scale,
                                    lead, shared, norm_of=x, bias=lw.bqkv, q_norm=lw.qn, k_norm=lw.kn)
            self._add_row(x, o, lw.wo)
            if lw.bo is not None:
                x.add_(lw.bo)
            gate, up = torch.mm(x, lw.wgu.t()).chunk(2, dim=-1)
            self._add_row(x, kn.silu_mul(gate, up, norm_of=x, eps=s.rms_eps, bias=lw.bgu), lw.wd)
            if lw.bd is not None:
                x.add_(lw.bd)
        h = torch.empty_like(x)
        kn.add_rmsnorm(x, None, w.norm, s.rms_eps, h)
        return F.linear(h, w.lm_head)

    def _add_row(self, x: torch.Tensor, a: torch.Tensor, w: torch.Tensor) -> None:
        """x += a @ w.T for a row-parallel w: inside the GEMM (cuBLAS beta = 1) at k = 1; under tp the partial
        product is all-reduced first, then added (adding it into x on every rank would count x k times)."""
        if self.tp is None:
            x.addmm_(a, w.t())
        else:
            x.add_(self.tp.all_reduce(torch.mm(a, w.t())))

    def _linears(self, h: torch.Tensor, *wb: tuple[torch.Tensor, torch.Tensor | None]) -> list[torch.Tensor]:
        """[h @ w.T + b for each (w, b)]; all but the first on the side stream when there is one."""
        if self._side is None:
            return [F.linear(h, w, b) for w, b in wb]
        outs = [h.new_empty(h.shape[0], w.shape[0]) for w, _ in wb]  # allocated on the main stream
        main = torch.cuda.current_stream()
        self._side.wait_stream(main)
        with torch.cuda.stream(self._side):
            for (w, b), out in zip(wb[1:], outs[1:]):
                _linear_into(h, w, b, out)
        _linear_into(h, *wb[0], outs[0])
        main.wait_stream(self._side)
        return outs


def _linear_into(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, out: torch.Tensor) -> None:
    if b is None:
        torch.mm(h, w.t(), out=out)
    else:
        torch.addmm(b, h, w.t(), out=out)
