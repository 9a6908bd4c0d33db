"""Run by test_fast_families.py with TRITON_INTERPRET=1: the Triton decode of Qwen3 (q/k norm inside the attention
kernel, with and without the norms folded into the fused projections) and Mistral against the torch decode, on CPU.

Exits non-zero (an AssertionError) when a check fails."""
from __future__ import annotations

import torch

from fleetrl.engines.fast import FastRolloutEngine
from fleetrl.engines.protocol import SamplingParams
from tests.engines.test_fast import CharTokenizer, left_padded
from tests.engines.test_fast_families import ARCHS, family_model
from tests.engines.triton_sampling_check import patch_language_once_per_launch


def check_families() -> None:
    ids, mask = left_padded([3, 9, 6, 1])
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    for arch in ARCHS:
        model = family_model(arch)
        engines = [FastRolloutEngine(model, CharTokenizer(None), device="cpu", max_seq_len=64, kernels=kernels,
                                     fuse_projections=fuse)
                   for kernels, fuse in (("torch", False), ("triton", False), ("triton", True))]
        outs = [eng.generate(ids, mask, greedy) for eng in engines]
        # the last decodes with its norms folded into the fused copies (forward.py `_decode_folded`)
        assert engines[2]._fwd.weights().layers[0].ln1 is None, arch
        for out in outs[1:]:
            assert torch.equal(out.responses, outs[0].responses), arch
            assert float((out.logprobs - outs[0].logprobs).abs().max()) < 1e-5, arch


if __name__ == "__main__":
    patch_language_once_per_launch()
    check_families()
    print("ok")
