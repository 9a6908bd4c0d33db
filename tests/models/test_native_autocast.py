"""The native forward (models/decoder.py) under autocast with fp32 master weights: q/k/v reach the attention kernels
that autocast does not cover (the flash varlen kernel, flex) in the autocast dtype.

Why it needs saying: under bf16 autocast the projections come out in bf16, but RoPE multiplies q and k by cos/sin
in the residual stream's dtype (fp32), so q and k arrived in fp32 beside a bf16 v, and the flash varlen kernel
refused them on the GPU ("FlashAttention only support fp16 and bf16 data type") at the first update of fp32
SmolLM2 with actor.autocast=auto."""
from __future__ import annotations

import pytest
import torch
import transformers

from fleetrl.models import varlen
from fleetrl.models.decoder import NativeDecoder
from fleetrl.models.native import packed_native_logprobs
from tests.models.test_native_forward import MODELS, _shared_batch

BF16 = torch.bfloat16


def _spy(monkeypatch: pytest.MonkeyPatch, name: str) -> list[tuple[torch.dtype, ...]]:
    """Records the q/k/v dtypes each call of varlen.`name` receives."""
    seen: list[tuple[torch.dtype, ...]] = []
    real = getattr(varlen, name)

    def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: varlen.VarlenSegments) -> torch.Tensor:
        seen.append((q.dtype, k.dtype, v.dtype))
        return real(q, k, v, seg)

    monkeypatch.setattr(varlen, name, spy)
    return seen


@pytest.mark.parametrize("autocast", [False, True])
def test_varlen_segments_get_q_k_v_in_the_autocast_dtype(monkeypatch: pytest.MonkeyPatch, autocast: bool) -> None:
    # On CPU the varlen segments run through SDPA one at a time (`_reference`), which is what the GPU kernel's
    # caller hands its tensors to: the same cast reaches both.
    seen = _spy(monkeypatch, "_reference")
    model = MODELS["qwen2_tied_bias"]()
    pr, pm, rs, rm = _shared_batch()
    with torch.autocast("cpu", dtype=BF16, enabled=autocast):
        lp, _ = packed_native_logprobs(NativeDecoder(model), model, pr, pm, rs, rm, attention="varlen",
                                       share_prompts=True)
    (-(lp * rm).sum()).backward()
    want = (BF16,) * 3 if autocast else (torch.float32,) * 3  # no autocast: the model's dtype, untouched
    assert seen and set(seen) == {want}
    # fp32 master weights get fp32 gradients either way
    assert all(p.grad is not None and p.grad.dtype == torch.float32 and p.grad.isfinite().all()
               for p in model.parameters())


def test_varlen_under_autocast_matches_the_dense_mask_under_autocast() -> None:
    # The dense mask goes through SDPA, which autocast casts itself: the explicit cast gives the same function.
    model = MODELS["llama_untied"]().eval()
    decoder = NativeDecoder(model)
    pr, pm, rs, rm = _shared_batch()
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
        got, _ = packed_native_logprobs(decoder, model, pr, pm, rs, rm, attention="varlen", share_prompts=True)
        want, _ = packed_native_logprobs(decoder, model, pr, pm, rs, rm, attention="dense", share_prompts=True)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=0)


@pytest.mark.gpu
def test_one_native_update_of_an_fp32_model_under_bf16_autocast_with_the_flash_varlen_kernel(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What actor.forward=native with share_prompts runs on a GPU (packed_attention auto -> varlen) for fp32
    master weights and actor.autocast=auto: one optimiser step through the flash kernel, fp32 weights and grads."""
    from fleetrl.config.schema import OptimConfig
    from fleetrl.engines.training import TrainingEngine
    from fleetrl.models.native import NativeForward
    from fleetrl.models.packing import HostRows, PackedForward

    seen = _spy(monkeypatch, "_kernel")
    cfg = transformers.Qwen2Config(vocab_size=40, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg).cuda()  # fp32, head dim 64
    host = HostRows(*_shared_batch())
    batch = [t.cuda() for t in host]
    forward = NativeForward(NativeDecoder(model), packed=PackedForward(max_tokens=256, attention="varlen",
                                                                       share_prompts=True, max_segment=64))
    engine = TrainingEngine(model, OptimConfig(lr=1e-3, grad_clip=1.0), device="cuda", autocast_dtype=BF16)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    adv = torch.tensor([1.0, -2.0, 0.5, 3.0, -1.0], device="cuda")[:, None]

    def loss_fn(_: object) -> tuple[torch.Tensor, dict[str, float]]:
        lp, _ = forward(model, *batch, temperature=1.0, return_entropy=False, host=host)
        return -(lp.float() * adv * batch[3]).sum() / batch[3].sum(), {}

    metrics = engine.step(iter([None]), loss_fn)
    assert seen and set(seen) == {(BF16,) * 3}  # the flash kernel ran, on bf16 q/k/v
    assert metrics["skipped"] == 0.0 and 0.0 < metrics["grad_norm"] < float("inf")
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32 and p.isfinite().all(), name
    assert any(not torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())
