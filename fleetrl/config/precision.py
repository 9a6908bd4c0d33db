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
from functools import lru_cache

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
