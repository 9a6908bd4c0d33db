"""Run by test_fast_sampling.py with TRITON_INTERPRET=1: the Triton sampler and the fused Triton decode on CPU.

Exits non-zero (an AssertionError) when a check fails. Blocks of 64 columns make a 200-token vocab span 4
blocks, so both stages of the sampler (block by inverse CDF, token by the race within it) are exercised.
"""
from __future__ import annotations

import inspect

import torch

import fleetrl.engines.fast.triton_kernels as tk
from fleetrl.engines.fast import FastRolloutEngine
from fleetrl.engines.protocol import SamplingParams
from tests.engines.test_fast import CharTokenizer, left_padded, tiny_model

CHI2_001_DF4 = 18.47  # p = 0.001 critical value, 5 categories


def patch_language_once_per_launch() -> None:
    """Triton's interpreter (3.x, runtime/interpreter.py) patches triton.language for a kernel launch (restored
    after the grid) and again at every call of a @triton.jit function inside the kernel (tl.max, tl.sum, ...),
    for every program: an inspect.getmembers of each language module each time, ~40% of this script's time. A
    call's patch of a module the launch has already patched changes nothing (replaced members are skipped, the
    rest are set again to fresh copies of the same functions), so it is skipped; a module first reached inside
    the launch (tl.core, from triton.language.standard) is still patched, as before. The interpreted code is the
    same. Left as it is when the interpreter's layout differs."""
    from triton.runtime import interpreter as ti

    real = getattr(ti, "_patch_lang", None)
    if real is None or not hasattr(ti, "_LangPatchScope") or not hasattr(ti.tl, "core"):
        return
    patched: set[int] = set()  # the language modules patched during the running launch; empty between launches

    def langs(fn) -> set[int]:  # noqa: ANN001
        return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (ti.tl, ti.tl.core)}

    def patch_lang(fn):  # noqa: ANN001, ANN202
        if patched and langs(fn) <= patched:
            return ti._LangPatchScope()  # a call inside the launch: nothing left to patch
        launch = not patched
        scope = real(fn)
        patched.update(langs(fn))
        if launch:  # GridExecutor restores the launch's scope after the grid
            restore = scope.restore

            def restore_and_end() -> None:
                restore()
                patched.clear()

            scope.restore = restore_and_end
        return scope

    ti._patch_lang = patch_lang


def check_sampler(rows: int = 2000, temperature: float = 0.8) -> None:
    tk.SAMPLE_BLOCK_V = 64
    kn = tk.TritonKernels(torch.device("cpu"))
    logits = torch.full((200,), -40.0)
    hot = {3: 1.0, 64: -1.5, 70: 0.2, 130: -0.5, 199: 0.7}  # in blocks 0, 1, 1, 2, 3
    for t, v in hot.items():
        logits[t] = v
    batch = logits[None].repeat(rows, 1).to(torch.bfloat16)
    req = torch.arange(rows)
    temp = torch.tensor([temperature])
    tok, lp = kn.sample(batch, temp, torch.tensor([12345]), req, torch.zeros_like(req), greedy=False)
    ref = torch.log_softmax(batch.float() / temperature, -1)
    assert float((lp - ref[0, tok]).abs().max()) < 1e-6
    counts = torch.bincount(tok, minlength=200).double()
    probs = torch.softmax(batch[0].float() / temperature, 0).double()
    ids = sorted(hot)
    assert counts[ids].sum() == rows, "a -40 logit (probability ~1e-22) was drawn"
    chi2 = float(((counts[ids] - rows * probs[ids]) ** 2 / (rows * probs[ids])).sum())
    assert chi2 < CHI2_001_DF4, chi2
    # Greedy draws nothing at random and every row is the same: 64 rows (64 programs, each with its own request and
    # count) check what 2000 did, at 1/30 of the interpreter's time (~30 s).
    g = 64
    tok, lp = kn.sample(batch[:g], torch.tensor([1.0]), torch.tensor([1]), req[:g], req[:g], greedy=True)
    assert tok.shape == (g,) and bool((tok == 3).all())
    assert float((lp - torch.log_softmax(batch.float(), -1)[0, 3]).abs().max()) < 1e-6


def check_fused_decode() -> None:
    for arch in ("llama", "qwen2"):
        model = tiny_model(arch)
        ids, mask = left_padded([3, 9, 6, 1])
        greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
        engines = [FastRolloutEngine(model, CharTokenizer(None), device="cpu", max_seq_len=64, kernels=kernels,
                                     fuse_projections=fuse)
                   for kernels, fuse in (("torch", False), ("triton", False), ("triton", True))]
        outs = [eng.generate(ids, mask, greedy) for eng in engines]
        # the last decodes with its norms folded into the fused copies (forward.py `_decode_folded`)
        assert engines[2]._fwd.weights().layers[0].ln1 is None and engines[1]._fwd.weights().layers[0].ln1 is not None
        for out in outs[1:]:
            assert torch.equal(out.responses, outs[0].responses), arch
            assert float((out.logprobs - outs[0].logprobs).abs().max()) < 1e-5, arch
    check_shared_prefix_reads()


def check_shared_prefix_reads() -> None:
    """Samples of one prompt read its cache rows at the leader slot; leaders stop first (limits 1-2) and their
    slots are refilled (4 slots, 8 samples) while followers decode: the Triton decode must equal the torch one,
    which reads every slot's own rows."""
    ids, mask = left_padded([3, 9, 6])
    index = [0, 0, 0, 1, 1, 2, 2, 2]
    params = SamplingParams(max_new_tokens=6, temperature=0.0,
                            max_new_tokens_per_sample=torch.tensor([1, 6, 5, 2, 6, 1, 6, 6]))
    model = tiny_model("llama")
    # sync_every=4: after a sync that finds a stopped leader, the live slots decode 2 steps before its slot is
    # released (engine.py `_run`), so its followers read its rows then too.
    for sync_every in (1, 4):
        outs = [FastRolloutEngine(model, CharTokenizer(None), device="cpu", max_seq_len=64, kernels=kernels,
                                  max_batch=4, sync_every=sync_every).generate(ids[index], mask[index], params)
                for kernels in ("torch", "triton")]
        assert torch.equal(outs[1].responses, outs[0].responses), sync_every
        assert float((outs[1].logprobs - outs[0].logprobs).abs().max()) < 1e-5, sync_every


if __name__ == "__main__":
    patch_language_once_per_launch()
    check_sampler()
    check_fused_decode()
    print("ok")
