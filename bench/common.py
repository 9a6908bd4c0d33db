"""Shared helpers for the GPU micro-benchmarks: model shapes, measured device ceilings, timing, JSON and tables.

Run from the repository root with PYTHONPATH=. (fleetrl need not be installed).
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from fleetrl.models.shapes import QWEN3, QWEN25

# Published Qwen2.5 dimensions live in fleetrl/models/shapes.py (the trainer's `random:` models use them too).
QWEN2_SHAPES: dict[str, dict[str, Any]] = {
    **{name: {**dims, "vocab_size": 151936} for name, dims in QWEN25.items()},
    # CPU smoke-test shape (not a real model)
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=256, vocab_size=1000, tie_word_embeddings=True),
}

# The other two families the fast engine and the native forward implement; `model_type` picks the HF class
# (`build_model`). Qwen3's published dimensions live in fleetrl/models/shapes.py (the trainer's `random:` models use
# them too), with Qwen2.5's vocabulary and RoPE settings. config.json of mistralai/Mistral-7B-v0.1: its 4096-token
# sliding window is full attention for every benchmark length below it; the engine refuses a max_seq_len above it
# (engines/fast/arch.py check_window).
FAMILY_SHAPES: dict[str, dict[str, Any]] = {
    **{name: dict(model_type="qwen3", **dims, vocab_size=151936, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                  max_position_embeddings=40960) for name, dims in QWEN3.items()},
    "mistral-7b": dict(model_type="mistral", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, intermediate_size=14336, vocab_size=32000,
                       rope_theta=10_000.0, rms_norm_eps=1e-5, max_position_embeddings=32768, sliding_window=4096,
                       tie_word_embeddings=False),
}
# Every shape the benchmarks can build, with its whole config: the Qwen2 ones with Qwen2.5's shared settings.
MODEL_SHAPES: dict[str, dict[str, Any]] = {
    **{name: dict(model_type="qwen2", **dims, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                  max_position_embeddings=32768) for name, dims in QWEN2_SHAPES.items()},
    **FAMILY_SHAPES,
}

# Dense (no sparsity) bf16 tensor-core peak, TFLOP/s. NVIDIA H100 Tensor Core GPU datasheet (SXM5: "BF16 Tensor
# Core 1,979 TFLOPS", footnote: with sparsity) and NVIDIA H200 datasheet (same 1,979 with sparsity): half is dense.
PEAK_BF16_DENSE_TFLOPS = {"H100": 989.4, "H200": 989.4}


def model_config(shape: str) -> Any:
    """The HF config of a MODEL_SHAPES shape, of its family's class."""
    from transformers import AutoConfig

    if shape not in MODEL_SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(MODEL_SHAPES)}")
    dims = dict(MODEL_SHAPES[shape])
    return AutoConfig.for_model(dims.pop("model_type"), **dims, use_cache=True)


def build_model(shape: str, dtype: torch.dtype, device: str) -> torch.nn.Module:
    """A random-weight model of any MODEL_SHAPES shape (Qwen2, Qwen3 or Mistral), drawn from seed 0 on `device`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(model_config(shape))
    model.generation_config.eos_token_id = None  # fixed-length decoding: no EOS anywhere
    return model.to(dtype).eval()


# The scripts' historical name: every --shapes option takes any MODEL_SHAPES shape through it.
build_qwen2 = build_model


def matmul_params(model: torch.nn.Module) -> int:
    """Parameters that take part in matmuls per token: all unique ones, minus an untied input embedding
    (a gather). A tied embedding counts once, as the output projection."""
    n = sum(p.numel() for p in model.parameters())
    if not model.config.tie_word_embeddings:
        n -= model.get_input_embeddings().weight.numel()
    return n


def kv_bytes_per_token(model: torch.nn.Module, dtype: torch.dtype) -> int:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * torch.finfo(dtype).bits // 8


def peak_bf16_tflops(name: str) -> float | None:
    for key, value in PEAK_BF16_DENSE_TFLOPS.items():
        if key in name:
            return value
    return None


def device_info(device: str) -> dict[str, Any]:
    import transformers

    info = {"date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
            "transformers": transformers.__version__, "device": device}
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        info.update(device_name=props.name, sms=props.multi_processor_count,
                    memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda)
    return info


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def wall_time(fn: Callable[[], Any], device: str, repeats: int = 1) -> float:
    """Median wall seconds of fn() with the device synchronised before and after (for whole calls)."""
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def event_time(fn: Callable[[], Any], iters: int, warmup: int = 2) -> float:
    """Median seconds per fn() timed with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def copy_bandwidth(device: str, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / event_time(lambda: dst.copy_(src), iters=10)


def matmul_tflops(device: str, n: int = 8192) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    return 2 * n**3 / event_time(lambda: a @ b, iters=10, warmup=3) / 1e12


def out_dir(path: str | None) -> Path:
    out = Path(path or os.environ.get("OUT") or "bench_out")
    out.mkdir(parents=True, exist_ok=True)
    return out


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, default=str))


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> None:
    def fmt(v: Any) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(columns)]
    print("| " + " | ".join(c.ljust(w) for c, w in zip(columns, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in cells:
        print("| " + " | ".join(v.ljust(w) for v, w in zip(row, widths)) + " |")


def step_peak(record: dict, name: str = "gpu_peak_allocated_gib") -> float | None:
    """A step's memory peak from its metrics record: the largest of the rollout phase's (`train/memory/generate/*`,
    the rank-local step reads and resets it when generation ends) and the rest of the step's (`train/memory/*`,
    read at the update report); None when the step logged neither."""
    got = [record[k] for k in (f"train/memory/{name}", f"train/memory/generate/{name}") if k in record]
    return max(got, default=None)
