"""GPU check of our own training forward (actor.forward=native, models/decoder.py) against HF's modelling code.

    PYTHONPATH=. python bench/check_native.py [--shape qwen2.5-0.5b] [--samples 32] [--out DIR ($OUT)]

1. Correctness, fp32 (TF32 off), 8 long-tailed samples (bench/longtail.py lengths, 126-token prompts): log-probs,
   entropy and every gradient of the native forward, eager and with each layer compiled (inductor, fullgraph),
   padded (causal SDPA on compacted rows) and packed (flex BlockMask, fused LM head), against HF's own padded
   `sequence_logprobs` (sdpa, 4-D mask); every padded forward takes its log-softmax in 512-token chunks.
2. Speed and memory, bf16 autocast, `--samples` samples: forward + backward of one micro-batch, HF padded vs
   native compiled padded, HF packed (flex) vs native compiled packed.
Prints a `RESULT {json}` line; exits 1 when a correctness figure is out of tolerance (1e-3, as check_packed).
"""
from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.check_packed import PROMPT, loss_grads, make_batch, start, timed  # noqa: E402
from fleetrl.models.decoder import NativeDecoder  # noqa: E402
from fleetrl.models.logprobs import sequence_logprobs  # noqa: E402
from fleetrl.models.native import packed_native_logprobs, padded_native_logprobs  # noqa: E402
from fleetrl.models.packing import packed_logprobs  # noqa: E402
from fleetrl.models.shapes import random_model  # noqa: E402

BUDGET = 16384  # packed row length (flex pads every row to the token budget, as PackedForward does)


def variants(model: torch.nn.Module) -> dict:
    eager, compiled = NativeDecoder(model), NativeDecoder(model, compile_backend="inductor")
    return {
        "native_padded_eager": partial(padded_native_logprobs, eager, chunk_size=512),
        "native_padded_compiled": partial(padded_native_logprobs, compiled, chunk_size=512),
        "native_packed_compiled": partial(packed_native_logprobs, compiled, flex=True, fused_chunk=4096, align=BUDGET),
    }


def correctness(shape: str) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    model = random_model(f"random:{shape}", torch.float32).cuda().train()
    batch = make_batch(8, model.config.vocab_size, seed=1)
    lp0, e0, g0 = loss_grads(model, sequence_logprobs, batch, chunk_size=512)
    out = {}
    for name, fn in variants(model).items():
        lp, e, g = loss_grads(model, fn, batch)
        out[name] = {"logp_max_abs_diff": float((lp - lp0).abs().max()),
                     "entropy_max_abs_diff": float((e - e0).abs().max()),
                     "grad_max_rel_diff": max(float((g[n] - g0[n]).norm() / g0[n].norm().clamp_min(1e-30)) for n in g0)}
    return out


def main() -> None:
    args, result, model, batch = start("check_native", lambda shape: {"correctness": correctness(shape)})
    result["real_tokens"] = int(batch[3].sum()) + PROMPT * args.samples
    timings = {"hf_padded": partial(sequence_logprobs, chunk_size=512),
               "hf_packed_flex": partial(packed_logprobs, attention="flex_attention", fused_chunk=4096, align=BUDGET)}
    v = variants(model)
    timings.update(native_padded_compiled=v["native_padded_compiled"], native_packed_compiled=v["native_packed_compiled"])
    for name, fn in timings.items():
        try:
            result[f"{name}_s"], result[f"{name}_peak_gib"] = timed(model, fn, batch)
        except torch.OutOfMemoryError as err:
            result[f"{name}_s"] = f"OOM: {str(err)[:80]}"
        torch.cuda.empty_cache()
    print("RESULT " + json.dumps(result))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "check_native.json").write_text(json.dumps(result, indent=1))
    ok = all(c["logp_max_abs_diff"] < 1e-3 and c["grad_max_rel_diff"] < 1e-3 for c in result["correctness"].values())
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
