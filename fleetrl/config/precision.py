"""`auto` precision settings (actor.autocast, rollout.compute_dtype) resolved for the device a role runs on.

Why: bf16 matmuls are fast on GPUs and on CPUs with native bf16 instructions (AVX512-BF16, AMX), and slow
everywhere else. On an AVX2-only CPU (AMD EPYC, 2026-11-26) a 256×576 by 576×1536 bf16 matmul took 48.8 ms against
6.1 ms in fp32 (torch 2.13, one thread), so the SmolLM2 LoRA example's bf16 settings, measured on an AVX512-BF16/AMX
host, made its run several times slower there. `auto` takes bf16 where it pays and the full-precision setting
elsewhere; an explicit bfloat16 on a CPU without native bf16 is kept and warned about. The CPU checked is the
driver's, which is the workers' for the local and single-machine runs where CPU pools are used.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import lru_cache

from fleetrl.config.load import ConfigError
from fleetrl.config.schema import RunConfig

log = logging.getLogger("fleetrl.config")


@lru_cache(maxsize=1)
def native_bf16_cpu() -> bool:
    """True when this CPU runs bf16 matmuls natively (AVX512-BF16 or AMX tiles), as torch's CPU kernels see it."""
    import torch

    cpu = torch.cpu
    return bool(getattr(cpu, "_is_avx512_bf16_supported", lambda: False)()
                or getattr(cpu, "_is_amx_tile_supported", lambda: False)())


def resolve_precision(key: str, value: str, on_gpu: bool, full: str) -> str:
    """The dtype setting `key` takes on this device: `value`, with auto → bfloat16 on a GPU or a native-bf16 CPU,
    else `full` (the setting that keeps the model's precision: "off" for autocast, "model" for compute_dtype)."""
    fast = on_gpu or native_bf16_cpu()
    if value == "auto":
        return "bfloat16" if fast else full
    if value == "bfloat16" and not fast:
        log.warning("%s=bfloat16 on a CPU without native bf16 matmuls (AVX512-BF16 or AMX): they run several times "
                    "slower than fp32 here; set %s=auto (bf16 only where it is fast) or %s=%s", key, key, key, full)
    return value


HALF = ("bfloat16", "float16")
# Packed attentions whose kernels are FlashAttention's, which takes fp16/bf16 q/k/v alone: the native forward's
# varlen (models/varlen.py) and transformers' flash integrations.
FLASH_ONLY = ("varlen", "flash_attention_2", "flash_attention_3")


def resolve_compute_dtype(cfg: RunConfig, on_gpu: bool) -> str:
    """rollout.compute_dtype as the rollout engine runs it (Plan.rollout_compute_dtype). Only the fast engine casts
    (engines/fast/engine.py: per call on CPU, a kept copy under CUDA graphs); the hf engine runs transformers'
    `generate` on the model itself, in model.dtype, so there auto resolves to `model` and another dtype is refused
    rather than silently ignored."""
    r, model = cfg.rollout, cfg.model.dtype
    if r.engine != "hf":
        return resolve_precision("rollout.compute_dtype", r.compute_dtype, on_gpu, "model")
    if r.compute_dtype not in ("model", "auto", model):
        raise ConfigError(f"rollout.compute_dtype={r.compute_dtype} needs rollout.engine=fast: the hf engine decodes in "
                          f"model.dtype={model}; set rollout.compute_dtype=model (or auto), or rollout.engine=fast")
    return "model"


def attention_dtype(model_dtype: str, autocast: str) -> str:
    """The dtype a forward's q/k/v reach attention in: the autocast dtype under autocast (models/decoder.py casts
    them for the kernels autocast does not cover; transformers' flash integration does too), else the model's."""
    return model_dtype if autocast == "off" else autocast


@dataclass(frozen=True, kw_only=True)
class AttentionPass:
    """One forward over packed rows that a role runs each step: which attention it runs, fed in which dtype."""
    name: str
    attention: str
    """actor.packed_attention as this pass runs it (`auto` never picks a FlashAttention kernel it cannot feed)."""
    dtype: str
    on_gpu: bool
    fix: str
    """What makes this pass's attention inputs fp16/bf16, for the error."""


def check_attention_passes(passes: list[AttentionPass]) -> None:
    """FlashAttention kernels take fp16/bf16 only ("FlashAttention only support fp16 and bf16 data type", raised at
    the first step): every pass that runs one on a GPU must feed it that. On CPU the varlen segments run through SDPA
    (models/varlen.py `_reference`), any dtype."""
    for p in passes:
        if p.on_gpu and p.attention in FLASH_ONLY and p.dtype not in HALF:
            raise ConfigError(f"actor.packed_attention={p.attention} runs FlashAttention, which takes fp16/bf16 only, "
                              f"but {p.name} feeds it {p.dtype} on a GPU; {p.fix}, or set actor.packed_attention="
                              "flex_attention (any dtype)")


def check_optimizer_dtype(cfg: RunConfig, cpu_roles: list[str]) -> None:
    """Trained fp16 weights on CPU: torch's CPU AdamW (the per-parameter loop, engines/training.py) adds eps=1e-8
    in the parameter's dtype, where it is 0, so a weight whose gradient is 0 (an unused embedding row, a LoRA A at
    the first step) becomes 0/0 = NaN, and the next generate fails on NaN probabilities. CUDA's fused AdamW
    computes in fp32. bf16 has fp32's exponent range: eps survives."""
    if cfg.model.dtype == "float16" and cpu_roles:
        raise ConfigError(f"model.dtype=float16 trains {' and '.join(cpu_roles)} on CPU, where AdamW's eps (1e-8) "
                          "is 0 in fp16 and turns every weight with a zero gradient into NaN at the first step; set "
                          "model.dtype=float32 (with actor.autocast=auto for bf16 matmuls) or bfloat16")
