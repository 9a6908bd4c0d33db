"""GPU check of the packed forward + fused log-probs against the padded path (issue: speed on GPU).

    PYTHONPATH=. python bench/check_packed.py [--shape qwen2.5-0.5b] [--samples 32] [--out DIR ($OUT)]

1. Correctness, fp32 (TF32 off), 8 long-tailed samples: log-probs, entropy and every gradient of the packed
   forward (flex attention, fused chunked LM head) against `sequence_logprobs` on the padded layout (sdpa).
2. Speed and memory, bf16 autocast, `--samples` long-tailed samples (bench/longtail.py lengths, 126-token
   prompts): forward + backward of one micro-batch, padded (log-softmax in 512-token chunks) vs packed + fused.
Prints `key: value` lines and a `RESULT {json}` line; exits 1 when a correctness figure is out of tolerance.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.longtail import draw_lengths  # noqa: E402
from fleetrl.models.logprobs import sequence_logprobs  # noqa: E402
from fleetrl.models.packing import packed_logprobs  # noqa: E402
from fleetrl.models.shapes import random_model  # noqa: E402

PROMPT = 126


def make_batch(n: int, vocab: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    lens = draw_lengths(n, mean=300, max_len=1024, seed=seed, step=0)
    R = int(lens.max())
    rm = (torch.arange(R)[None] < lens[:, None]).long()
    pm = torch.ones(n, PROMPT, dtype=torch.long)
    pr = torch.randint(0, vocab, (n, PROMPT), generator=g)
    rs = torch.randint(0, vocab, (n, R), generator=g) * rm
    adv = torch.randn(n, 1, generator=g).expand(-1, R)
    return tuple(t.cuda() for t in (pr, pm, rs, rm, adv))


def loss_grads(model, fn, batch, **kw):  # noqa: ANN001, ANN201
    pr, pm, rs, rm, adv = batch
    model.zero_grad(set_to_none=True)
    lp, ent = fn(model, pr, pm, rs, rm, return_entropy=True, **kw)
    loss = -(lp * adv * rm).sum() / rm.sum() - 0.01 * (ent * rm).sum() / rm.sum()
    loss.backward()
    return lp.detach(), ent.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def correctness(shape: str) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    model = random_model(f"random:{shape}", torch.float32).cuda().train()
    batch = make_batch(8, model.config.vocab_size, seed=1)
    lp0, e0, g0 = loss_grads(model, sequence_logprobs, batch, chunk_size=512)
    lp1, e1, g1 = loss_grads(model, packed_logprobs, batch, attention="flex_attention", fused_chunk=1024)
    rel = max(float((g1[n] - g0[n]).norm() / g0[n].norm().clamp_min(1e-30)) for n in g0)
    return {"logp_max_abs_diff": float((lp1 - lp0).abs().max()), "entropy_max_abs_diff": float((e1 - e0).abs().max()),
            "grad_max_rel_diff": rel}


def timed(model, fn, batch, reps: int = 3, **kw) -> tuple[float, float]:  # noqa: ANN001
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss_grads(model, fn, batch, **kw)  # warm-up (flex attention compiles here)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        for _ in range(reps):
            loss_grads(model, fn, batch, **kw)
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps, torch.cuda.max_memory_allocated() / 2**30


def start(bench: str, checks: Callable[[str], dict]) -> tuple[argparse.Namespace, dict, torch.nn.Module, tuple]:
    """The common head of the GPU checks: arguments, the correctness fields `checks(shape)` returns (printed at
    once), then TF32 on and the model and long-tailed batch the timings use."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    args = ap.parse_args()
    result = {"bench": bench, "device": torch.cuda.get_device_name(0), "shape": args.shape,
              "date": time.strftime("%Y-%m-%d"), **checks(args.shape)}
    print("correctness " + json.dumps(result), flush=True)  # printed before the timing, which may run out of memory
    torch.backends.cuda.matmul.allow_tf32 = True
    model = random_model(f"random:{args.shape}", torch.float32).cuda().train()
    return args, result, model, make_batch(args.samples, model.config.vocab_size, seed=2)


def main() -> None:
    args, result, model, batch = start("check_packed", correctness)
    rm = batch[3]
    result["real_tokens"] = int(rm.sum()) + PROMPT * args.samples
    result["padded_slots"] = rm.numel() + PROMPT * args.samples
    result["padded_s"], result["padded_peak_gib"] = timed(model, sequence_logprobs, batch, chunk_size=512)
    result["packed_s"], result["packed_peak_gib"] = timed(model, packed_logprobs, batch, attention="flex_attention",
                                                          fused_chunk=4096)
    for k, v in result.items():
        print(f"{k:>24}: {v}")
    print("RESULT " + json.dumps(result))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "check_packed.json").write_text(json.dumps(result, indent=1))
    ok = result["logp_max_abs_diff"] < 1e-3 and result["grad_max_rel_diff"] < 1e-3
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
