"""Our own training forward for the Llama / Qwen2 / Qwen3 / Mistral decoder families (`actor.forward: native`).

Why: compiling HF's decoder layers inside our log-prob path made the e2e update slower, not faster
(bench/RESULTS.md, "Training-side variants"), while the same compile in a plain loop gave +44%. HF's layer takes a
4-D mask, rotary tuples and cache arguments, and its attention dispatch is Python we do not control; this forward
is a few pure-torch functions that `torch.compile(fullgraph=True)` traces whole, with one static shape per
bucket (a varlen row's sizes are dynamic: `NativeDecoder.hidden`).

What it reads: the HF modules' own parameters, in place. Projections are *called* (`self_attn.q_proj(h)`), not
read as matrices, so biases (Qwen2's q/k/v), peft's LoRA wrappers (fleetrl/models/lora.py) and any hooks on them
apply unchanged, and gradients land on the HF parameters: the optimiser, checkpoints and weight sync see nothing
different. RMSNorm weights (Qwen3's per-head q_norm / k_norm included) and the rotary `inv_freq` are read from the
modules. Shapes come from `read_spec` (fleetrl/models/family.py, the families defined once), which the fast
engine reads too; it validates the same families; a Mistral sliding window is accepted only where no sample is longer than it (`NativeDecoder.check_lengths`),
since this forward attends to the whole sample.

Attention: padded rows are compacted so each row's real tokens come first (see `padded_native_logprobs`), after
which plain causal SDPA with no mask is exact for them; packed rows (fleetrl/models/packing.py) attend within
their sample through a flex-attention BlockMask or varlen segments (GPU), padded segments (CPU,
models/segments.py) or a dense block-diagonal causal mask (the fallback, tests).

FSDP2-sharded actors: each layer call runs inside that layer's FSDP2 hooks (models/gathered.py `gathered_call`),
and the caller wraps the whole forward in the root's. Not supported (checked when the model loads): attention dropout.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from fleetrl.config.families import family_gap
from fleetrl.errors import UserError
from fleetrl.models import segments, varlen
from fleetrl.models.family import SUPPORTED_MODEL_TYPES, DecoderSpec, apply_rope, check_window, read_spec, rms_norm
from fleetrl.models.gathered import gathered_call
from fleetrl.models.segments import PaddedSegments
from fleetrl.models.varlen import VarlenSegments

try:  # torch >= 2.5; absent builds fall back to the dense mask
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
except ImportError:  # pragma: no cover
    BlockMask = create_block_mask = flex_attention = None  # type: ignore[assignment,misc]

Mask = torch.Tensor | VarlenSegments | PaddedSegments | None  # or a flex BlockMask


class NativeForwardError(UserError, ValueError):
    """actor.forward=native was asked of a model it does not reproduce."""


def check_supported(model: nn.Module) -> DecoderSpec:
    """The decoder's shape; raises NativeForwardError naming the model type and what is supported."""
    cfg = getattr(model, "config", None)
    model_type = getattr(cfg, "model_type", type(model).__name__)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise NativeForwardError(f"actor.forward=native implements the decoder families {list(SUPPORTED_MODEL_TYPES)}; "
                                 f"this model's type is {model_type!r}{family_gap(str(model_type))}. Set "
                                 "actor.forward=hf (HF modelling code: "
                                 "the update ran 1.5x slower than native on the 0.5B GPU benchmark, bench/RESULTS.md)")
    try:
        spec = read_spec(model)
    except ValueError as err:
        raise NativeForwardError(f"actor.forward=native cannot reproduce this {model_type} model: {err}. "
                                 "Set actor.forward=hf") from None
    if float(getattr(cfg, "attention_dropout", 0.0) or 0.0) > 0:
        raise NativeForwardError(f"actor.forward=native has no attention dropout; this model has "
                                 f"attention_dropout={cfg.attention_dropout}. Set it to 0 or actor.forward=hf")
    return spec


def rope_cos_sin(model: nn.Module, position_ids_BL: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, L, Q] as HF's rotary module computes them (fp32 position * inv_freq, halves duplicated, times
    attention_scaling, cast to the activations' dtype); inv_freq carries rope_theta and any static rope scaling."""
    rotary = model.model.rotary_emb
    inv_freq = rotary.inv_freq.to(device=position_ids_BL.device, dtype=torch.float32)
    with torch.autocast(position_ids_BL.device.type, enabled=False):
        freqs = position_ids_BL[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = float(getattr(rotary, "attention_scaling", 1.0))
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask) -> torch.Tensor:
    """[B, H, L, Q] attention output; k, v have the KV heads (GQA: each serves num_heads // num_kv_heads)."""
    if isinstance(mask, VarlenSegments) or (BlockMask is not None and isinstance(mask, BlockMask)):
        q, k, v = _autocast_inputs(q, k, v)
    if BlockMask is not None and isinstance(mask, BlockMask):
        return _flex(q.device.type)(q, k, v, block_mask=mask, enable_gqa=True)
    if isinstance(mask, VarlenSegments):
        return varlen.attend(q, k, v, mask)
    if isinstance(mask, PaddedSegments):
        return segments.attend(q, k, v, mask)
    if mask is None:  # flash SDPA takes GQA directly when there is no mask
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    # With a mask, CUDA's SDPA would fall back to its math kernel for GQA; expand the KV heads instead (as HF's
    # sdpa integration does). Only the dense packed mask (packed_attention=sdpa, or the segments fallback) comes here.
    group = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                          attn_mask=mask)


def _autocast_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k, v in the autocast dtype where autocast is on, as SDPA's autocast rule casts them.

    Why: under autocast the projections come out in bf16, but RoPE multiplies q and k by cos/sin in the residual
    stream's dtype (fp32 with fp32 master weights, as HF does), so q and k reach attention in fp32 beside a bf16 v.
    SDPA is on autocast's list and casts all three; the flash varlen kernel (models/varlen.py) is not, and refused
    them ("FlashAttention only support fp16 and bf16 data type"). flex_attention has an autocast rule of its own in
    recent torch; casting here makes it explicit for both. The output stays in that dtype, as SDPA's does, and the
    o projection (autocast) reads it; the casts are differentiable, so gradients reach q, k, v in their dtype."""
    device = q.device.type
    if not torch.is_autocast_enabled(device):
        return q, k, v
    dtype = torch.get_autocast_dtype(device)
    return q.to(dtype), k.to(dtype), v.to(dtype)


@functools.lru_cache(maxsize=None)
def _flex(device_type: str) -> Callable[..., torch.Tensor]:
    """flex_attention, compiled on GPU: called eagerly it materialises the full score matrix (tokens² per head).
    Inside a compiled layer dynamo inlines this wrapper, so the layer's graph holds the fused kernel either way."""
    return torch.compile(flex_attention, dynamic=False) if device_type == "cuda" else flex_attention


def decoder_layer(layer: nn.Module, x_BLD: torch.Tensor, cos_BLQ: torch.Tensor, sin_BLQ: torch.Tensor,
                  spec: DecoderSpec, mask: Mask = None) -> torch.Tensor:
    """One pre-norm decoder layer of the HF module `layer`: x + attn(norm(x)), then + SwiGLU(norm(x)). [B, L, D]."""
    B, L, _ = x_BLD.shape
    att, mlp = layer.self_attn, layer.mlp
    h = rms_norm(x_BLD, layer.input_layernorm.weight, spec.rms_eps)
    q = att.q_proj(h).view(B, L, spec.num_heads, spec.head_dim)
    k = att.k_proj(h).view(B, L, spec.num_kv_heads, spec.head_dim)
    if spec.qk_norm:  # Qwen3: each head of q and k RMS-normalised over head_dim, before RoPE
        q, k = rms_norm(q, att.q_norm.weight, spec.rms_eps), rms_norm(k, att.k_norm.weight, spec.rms_eps)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    v = att.v_proj(h).view(B, L, spec.num_kv_heads, spec.head_dim).transpose(1, 2)
    cos, sin = cos_BLQ[:, None], sin_BLQ[:, None]
    o = _attend(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, mask)
    x_BLD = x_BLD + att.o_proj(o.transpose(1, 2).reshape(B, L, spec.num_heads * spec.head_dim))
    h = rms_norm(x_BLD, layer.post_attention_layernorm.weight, spec.rms_eps)
    return x_BLD + mlp.down_proj(F.silu(mlp.gate_proj(h)) * mlp.up_proj(h))


class NativeDecoder:
    """The backbone forward of one HF Llama/Qwen2/Qwen3/Mistral model, optionally with each layer compiled.

    `compile_backend`: None = eager; else `torch.compile(decoder_layer, fullgraph=True, dynamic=dynamic)` with that
    backend ("inductor"). One compiled function serves every layer: the layer module is an argument, and
    with dynamo's inlining of nn.Modules its parameters are graph inputs, not guards on the module's identity.
    `dynamic`: one graph for every row length (CPU: Inductor's C++ compile of each static shape costs ~20-40 s
    on 2 cores, and a dynamic graph measured as fast as a static one there) instead of one per shape (GPU:
    static shapes measured faster on an H200), except for a varlen row, whose length, segment count and key
    count are marked dynamic so that one graph serves every long-tailed micro-batch.
    `max_seq_len`: the longest sample (prompt + response) the run can make, when known; a Mistral sliding window
    narrower than it is refused here, at load, rather than at the first long batch (`check_lengths`).
    """

    def __init__(self, model: nn.Module, *, compile_backend: str | None = None, dynamic: bool = False,
                 max_seq_len: int | None = None) -> None:
        self.spec = check_supported(model)
        if max_seq_len is not None:
            self.check_lengths(max_seq_len, "data.max_prompt_length + rollout.max_response_tokens")
        self.layer_fn: Callable[..., torch.Tensor] = decoder_layer
        self.compiled = compile_backend is not None
        if compile_backend is not None:
            # Every (micro-batch rows, bucketed width) pair of a padded micro-batch is one static-shape compile of
            # this one function; a long-tailed run meets ~10 of them, past dynamo's default limit of 8, after which
            # it would silently run the layer eagerly.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            compiled = torch.compile(decoder_layer, backend=compile_backend, fullgraph=True, dynamic=dynamic)
            # Without duck sizing in either form: the varlen rows' sizes marked dynamic (`hidden`) must not be
            # tied to a size that happened to equal them in the first trace.
            self.layer_fn = _without_duck_sizing(compiled)

    def check_lengths(self, longest: int, what: str = "the longest sample (prompt + response) of a micro-batch") -> None:
        """Raises NativeForwardError when a Mistral sliding window is narrower than `longest` tokens: full causal
        attention, which this forward computes, is HF's windowed attention only up to the window (arch.check_window).
        A no-op for every other model."""
        try:
            check_window(self.spec, longest, what)
        except ValueError as err:
            raise NativeForwardError(f"actor.forward=native: {err}") from None

    def hidden(self, model: nn.Module, input_ids_BL: torch.Tensor, position_ids_BL: torch.Tensor,
               mask: Mask = None) -> torch.Tensor:
        """Final-norm hidden states [B, L, D]. mask: None = causal within each row, a bool [B|1, 1, L, L] (True =
        attend) or a flex BlockMask. Layers are checkpointed when the HF model has gradient checkpointing on."""
        x = model.model.embed_tokens(input_ids_BL)
        if self.compiled and torch.is_grad_enabled() and not x.requires_grad:
            # A frozen embedding (LoRA): without this the first layer's input alone would not require grad, and
            # dynamo would compile a second graph for it (~25 s on 2 CPU cores) to save one small input gradient.
            x = x.detach().requires_grad_()
        cos, sin = rope_cos_sin(model, position_ids_BL, x.dtype)
        recompute = _checkpointing(model) and model.training and torch.is_grad_enabled()
        # A varlen row is as long as its micro-batch's tokens (rounded to PACK_ALIGN, not padded to the budget:
        # `PackedForward.row_align`), so its length is a dynamic size of the one compiled graph.
        dynamic_row = self.compiled and isinstance(mask, VarlenSegments)
        if dynamic_row:
            for t in (cos, sin):
                torch._dynamo.mark_dynamic(t, 1)
        for layer in model.model.layers:
            # Sharded: the layer's FSDP2 hooks gather its weights around the call (outside the checkpoint, whose
            # recompute in backward runs after the pre-backward hook has gathered them again).
            args = (self._layer, layer, x, cos, sin, mask, dynamic_row)
            x = (gathered_call(layer, checkpoint, *args, use_reentrant=False) if recompute
                 else gathered_call(layer, *args))
        return rms_norm(x, model.model.norm.weight, self.spec.rms_eps)

    def _layer(self, layer: nn.Module, x_BLD: torch.Tensor, cos_BLQ: torch.Tensor, sin_BLQ: torch.Tensor,
               mask: Mask, dynamic_row: bool) -> torch.Tensor:
        if dynamic_row:
            # Marked here, on the tensor the compiled layer receives: FSDP2's pre-forward hook hands the layer a
            # new tensor (its backward hook's output), which would not carry a mark made on the embedding's.
            torch._dynamo.mark_dynamic(x_BLD, 1)
        return self.layer_fn(layer, x_BLD, cos_BLQ, sin_BLQ, self.spec, mask)


def _without_duck_sizing(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`fn` traced with one symbol per input size. Why: dynamo's duck sizing gives sizes that are equal at the first
    trace one symbol, so a row or segment length that happened to equal a model size (576, 64) would be specialised
    to it, and the next length would recompile the layer (~20-40 s on 2 CPU cores)."""
    @functools.wraps(fn)
    def call(*args: object, **kwargs: object) -> torch.Tensor:
        with torch.fx.experimental._config.patch(use_duck_shape=False):
            return fn(*args, **kwargs)
    return call


def _checkpointing(model: nn.Module) -> bool:
    """Whether HF's gradient checkpointing is on (transformers >= 5 names it activation checkpointing)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


def packed_mask(doc_N: torch.Tensor, seg_N: torch.Tensor, kind: str = "dense", max_segment: int = 0) -> Mask:
    """Who attends to whom in a packed row (models/packing.py `Packed`): query q sees key kv <= q of its own doc
    whose segment is 0 (the doc's prompt) or q's own, i.e. causal within a sample, and with shared prompts each
    response sees its prompt and itself, never a sibling. kind: "dense" (bool [1, 1, N, N]), "flex" (a BlockMask:
    work ∝ real blocks), "varlen" (segments for the flash varlen kernel, models/varlen.py, their length bounds
    at least `max_segment`) or "segments" (padded segments, models/segments.py; dense where padding would cost
    more)."""
    N = doc_N.shape[0]
    if kind == "varlen":
        return varlen.segments(doc_N, seg_N, floor=max_segment)
    if kind == "segments":
        padded = segments.build(doc_N, seg_N)
        if padded is not None:
            return padded
    if kind == "flex":
        def shared_prefix_causal(b, h, q, kv):  # noqa: ANN001, ANN202 - flex's mask_mod signature
            return (doc_N[q] == doc_N[kv]) & (kv <= q) & ((seg_N[kv] == 0) | (seg_N[kv] == seg_N[q]))

        # _compile on GPU: the eager builder evaluates mask_mod over a dense N x N grid (16k tokens: 268M cells).
        return create_block_mask(shared_prefix_causal, None, None, N, N, device=doc_N.device,
                                 _compile=doc_N.device.type == "cuda")
    idx = torch.arange(N, device=doc_N.device)
    same_doc = (doc_N[:, None] == doc_N[None, :]) & (idx[None, :] <= idx[:, None])
    return (same_doc & ((seg_N[None, :] == 0) | (seg_N[None, :] == seg_N[:, None])))[None, None]
