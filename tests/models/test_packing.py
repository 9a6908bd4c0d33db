"""Packed training forward (models/packing.py), fused log-probs (algo/fused_logprobs.py) and token-budget
micro-batches (workers/layout.py) against the padded, unfused reference path, on CPU in fp32."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fleetrl.algo import POLICY_LOSSES
from fleetrl.algo.fused_logprobs import fused_logprobs_entropy
from fleetrl.algo.losses import entropy_from_logits
from fleetrl.batch import Batch
from fleetrl.config.schema import OptimConfig
from fleetrl.engines.training import TrainingEngine
from fleetrl.models.hf import load_causal_lm
from fleetrl.models.logprobs import sequence_logprobs
from fleetrl.models.packing import PACK_ALIGN, pack, packed_logprobs
from fleetrl.workers.layout import token_micro_batches
from fleetrl.workers.messages import MiniBatchCounts, UpdateSpec
from fleetrl.workers.update import run_update

TINY = "tiny:hidden=32,layers=2,heads=4,intermediate=64"


# ------------------------------------------------------------------------------------------ fused log-probs
def _reference(h, w, t, temperature):
    z = (h @ w.t()).float() / temperature
    return F.log_softmax(z, -1).gather(-1, t[:, None]).squeeze(-1), entropy_from_logits(z)


@pytest.mark.parametrize("chunk", [1, 3, 64])  # 3 does not divide N=10: a short last chunk
def test_fused_logprobs_and_entropy_match_reference_values_and_grads(chunk):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(10, 8, generator=g, dtype=torch.float64).float().requires_grad_()
    w = torch.randn(50, 8, generator=g).requires_grad_()
    t = torch.randint(0, 50, (10,), generator=g)
    gl, ge = torch.randn(10, generator=g), torch.randn(10, generator=g)  # arbitrary upstream gradients
    ref_lp, ref_ent = _reference(h, w, t, 0.7)
    ref_grads = torch.autograd.grad((ref_lp * gl + ref_ent * ge).sum(), (h, w))
    lp, ent = fused_logprobs_entropy(h, w, t, temperature=0.7, chunk=chunk)
    grads = torch.autograd.grad((lp * gl + ent * ge).sum(), (h, w))
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # Inductor's C++ compile of the two chunk kernels, ~20 s on 2 cores
def test_compiled_cpu_chunk_math_equals_the_eager_ops(monkeypatch):
    from fleetrl.algo import fused_logprobs

    g = torch.Generator().manual_seed(0)
    h = torch.randn(10, 8, generator=g).requires_grad_()
    w = torch.randn(50, 8, generator=g)  # frozen, as under LoRA
    t = torch.randint(0, 50, (10,), generator=g)
    gl, ge = torch.randn(10, generator=g), torch.randn(10, generator=g)

    def run(compiled, autocast, entropy_grad=True):
        monkeypatch.setattr(fused_logprobs, "FUSE_ON_CPU", compiled)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            lp, ent = fused_logprobs_entropy(h, w, t, temperature=0.7, chunk=3)  # a short last chunk
        loss = (lp * gl).sum() + ((ent * ge).sum() if entropy_grad else 0)
        return lp, ent, torch.autograd.grad(loss, h)[0]

    ref_lp, ref_ent = _reference(h, w, t, 0.7)
    ref_grad = torch.autograd.grad((ref_lp * gl + ref_ent * ge).sum(), h)[0]
    for got, want in zip(run(True, False), (ref_lp, ref_ent, ref_grad)):  # fp32: the reference's numbers
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for entropy_grad in (True, False):  # bf16 logits: as the eager ops round them
        for got, want in zip(run(True, True, entropy_grad), run(False, True, entropy_grad)):
            torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


def test_fused_chunks_never_leave_a_one_row_remainder():
    from fleetrl.algo.fused_logprobs import _chunks

    assert _chunks(10, 3) == [(0, 3), (3, 6), (6, 8), (8, 10)]  # 3 3 3 1 -> 3 3 2 2
    assert _chunks(9, 3) == [(0, 3), (3, 6), (6, 9)]
    assert _chunks(5, 4) == [(0, 3), (3, 5)]
    assert _chunks(1, 4) == [(0, 1)]  # one row in all: nothing to join


def test_fused_logprobs_of_a_uniform_head_are_minus_log_v():
    # W = 0: every logit is 0, so p = 1/V: logp = -log 50 = -3.912, entropy = log 50, for any target.
    lp, ent = fused_logprobs_entropy(torch.randn(4, 8), torch.zeros(50, 8), torch.tensor([0, 1, 2, 49]), chunk=3)
    torch.testing.assert_close(lp, torch.full((4,), -3.912023), atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, torch.full((4,), 3.912023), atol=1e-5, rtol=0)


def test_fused_logprobs_rejects_a_bad_chunk():
    with pytest.raises(ValueError, match="chunk must be a positive"):
        fused_logprobs_entropy(torch.zeros(2, 4), torch.zeros(5, 4), torch.zeros(2, dtype=torch.long), chunk=0)


# ------------------------------------------------------------------------------------------ packing
def _batch(prompt_lens, response_lens, P=6, R=7, vocab=40, seed=0):
    """Left-padded prompts, right-padded responses with the given real lengths (ids >= 4: no special tokens)."""
    g = torch.Generator().manual_seed(seed)
    B = len(prompt_lens)
    pm = torch.zeros(B, P, dtype=torch.long)
    rm = torch.zeros(B, R, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        pm[i, P - p:], rm[i, :r] = 1, 1
    return (torch.randint(4, vocab, (B, P), generator=g) * pm, pm,
            torch.randint(4, vocab, (B, R), generator=g) * rm, rm)


def test_a_frozen_head_is_cast_once_and_again_after_an_in_place_change():
    from fleetrl.algo.fused_logprobs import cast_head

    w = torch.randn(10, 4)
    first = cast_head(w, torch.bfloat16)
    assert first.dtype == torch.bfloat16 and cast_head(w, torch.bfloat16) is first  # kept between calls
    w.add_(1.0)  # a weight sync writes in place
    again = cast_head(w, torch.bfloat16)
    assert again is not first and torch.equal(again, w.bfloat16())
    trained = torch.randn(10, 4, requires_grad=True)  # a trained head changes every step: never kept
    assert cast_head(trained, torch.bfloat16) is not cast_head(trained, torch.bfloat16)
    assert cast_head(w, torch.float32) is w


def test_rows_round_up_to_the_forwards_alignment():
    from fleetrl.models.packing import CPU_ALIGN, PackedForward

    pm, rm = torch.ones(2, 3, dtype=torch.long), torch.tensor([[1, 1, 0], [1, 1, 1]])
    # 6 prompt + 5 response tokens = 11 real: 128 slots at GPU alignment, 16 on CPU; flex rows take the budget
    assert PackedForward(max_tokens=300).token_slots(pm, rm) == (11, PACK_ALIGN)
    assert PackedForward(max_tokens=300, align=CPU_ALIGN).token_slots(pm, rm) == (11, 16)
    assert PackedForward(max_tokens=300, attention="flex_attention", align=CPU_ALIGN).token_slots(pm, rm) == (11, 384)
    # varlen rows are a dynamic size of the compiled layer: rounded to the alignment, not padded to the budget
    assert PackedForward(max_tokens=300, attention="varlen").token_slots(pm, rm) == (11, PACK_ALIGN)


def test_pack_layout_by_hand():
    # Sample 0: prompt [a b] response [c]; sample 1: prompt [d] response [e f]. Packed row: a b c d e f + 122 pads.
    pr, pm = torch.tensor([[11, 12], [0, 14]]), torch.tensor([[1, 1], [0, 1]])
    rs, rm = torch.tensor([[13, 0], [15, 16]]), torch.tensor([[1, 0], [1, 1]])
    pk = pack(pr, pm, rs, rm)
    assert pk.input_ids_1N[0, :6].tolist() == [11, 12, 13, 14, 15, 16]
    assert pk.input_ids_1N.shape[1] == PACK_ALIGN and pk.real_tokens == 6
    assert pk.position_ids_1N[0, :8].tolist() == [0, 1, 2, 0, 1, 2, 0, 1]  # the pad run restarts at 0 too
    assert pk.pred_index_M.tolist() == [1, 3, 4]  # c from b (index 1); e from d (3); f from e (4)
    assert pk.targets_M.tolist() == [13, 15, 16]


def test_a_long_pad_is_cut_into_docs_of_at_most_pack_align_tokens():
    # A row padded to a 512-token budget: 6 real tokens, then 506 pads in docs of 122 (to the first 128-token
    # boundary: flex's blocks), 128, 128 and 128 tokens. As one doc the pad would attend over all its 506 tokens
    # (quadratic) and set the varlen kernel's length bound.
    pr, pm = torch.tensor([[11, 12], [0, 14]]), torch.tensor([[1, 1], [0, 1]])
    rs, rm = torch.tensor([[13, 0], [15, 16]]), torch.tensor([[1, 0], [1, 1]])
    pk = pack(pr, pm, rs, rm, align=512)
    doc, pos = pk.doc_N.tolist(), pk.position_ids_1N[0].tolist()
    assert doc[:6] == [0, 0, 0, 1, 1, 1] and pos[:6] == [0, 1, 2, 0, 1, 2]
    pad_docs = doc[6:]
    assert [pad_docs.count(d) for d in (2, 3, 4, 5)] == [122, 128, 128, 128] and len(pad_docs) == 506
    assert pos[6:6 + 124] == list(range(122)) + [0, 1]  # positions restart with each pad doc
    assert set(pk.seg_N[6:].tolist()) == {0}


@pytest.mark.parametrize("attention", [None, "sdpa"])  # None: the tiny model's eager attention
def test_packed_equals_padded_loss_and_gradients(attention):
    model = load_causal_lm(TINY)
    # Lengths include a 1-token prompt and a 1-token response (the edge cases of the shift by one).
    pr, pm, rs, rm = _batch([6, 1, 3, 2], [7, 1, 4, 2])
    adv = torch.tensor([1.0, -2.0, 0.5, 3.0])[:, None].expand(-1, rm.shape[1])

    def loss_and_grads(fn, **kw):
        model.zero_grad()
        lp, ent = fn(model, pr, pm, rs, rm, temperature=0.9, return_entropy=True, **kw)
        loss = -(lp * adv * rm).sum() / rm.sum() - 0.1 * (ent * rm).sum() / rm.sum()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    ref_loss, ref_grads = loss_and_grads(sequence_logprobs)
    for fused in (None, 5):
        loss, grads = loss_and_grads(packed_logprobs, attention=attention, fused_chunk=fused)
        torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
        for name, g in ref_grads.items():
            torch.testing.assert_close(grads[name], g, atol=1e-5, rtol=1e-4, msg=name)


def test_packed_logprobs_are_zero_on_padding():
    model = load_causal_lm(TINY)
    pr, pm, rs, rm = _batch([2, 4], [3, 5])
    with torch.no_grad():
        lp, ent = packed_logprobs(model, pr, pm, rs, rm, return_entropy=True)
    assert (lp[rm == 0] == 0).all() and (ent[rm == 0] == 0).all()
    assert (lp[rm == 1] < 0).all() and (ent[rm == 1] > 0).all()


def test_pack_rejects_a_sample_without_prompt_tokens():
    pr, pm, rs, rm = _batch([2, 1], [1, 1])
    pm[1] = 0
    with pytest.raises(ValueError, match="at least one prompt token"):
        pack(pr, pm, rs, rm)


# ------------------------------------------------------------------------------------------ token budgets
def test_token_micro_batches_cover_every_sample_once_within_budget():
    # Real lengths (prompt + response): 3+2=5, 1+7=8, 6+7=13, 2+1=3, 4+4=8. Budget 10, greedy in order:
    # [5] (5+8 > 10), [8], [13] (alone: over budget), [3, 8]? 3+8 = 11 > 10 -> [3], [8].
    _, pm, _, rm = _batch([3, 1, 6, 2, 4], [2, 7, 7, 1, 4])
    batch = Batch({"prompt_mask": pm, "response_mask": rm, "row": torch.arange(5)})
    mbs = token_micro_batches(batch, 10)
    assert [mb["row"].tolist() for mb in mbs] == [[0], [1], [2], [3], [4]]
    mbs = token_micro_batches(batch, 16)  # 5+8=13 (+13 > 16); 13+3=16 fits exactly (+8 > 16); [8]
    assert [mb["row"].tolist() for mb in mbs] == [[0, 1], [2, 3], [4]]
    assert sorted(r for mb in mbs for r in mb["row"].tolist()) == [0, 1, 2, 3, 4]


def test_token_micro_batches_count_a_shared_prompt_once():
    # Rows 0-2 share a 3-token prompt, rows 3-4 a 2-token one; responses 2, 4, 1, 5, 3. Budget 12, shared:
    # row 0 costs 3+2=5, row 1 4 (9), row 2 1 (10); row 3 starts a new prompt: 2+5=7 > 12-10 -> new micro-batch,
    # row 4 3 (10). Unshared the same rows cost 5, 7, 4, 7, 5: [0,1] (12), [2,3] (11), [4].
    pr, pm, _, rm = _batch([3, 3, 3, 2, 2], [2, 4, 1, 5, 3])
    pr[1:3], pr[4] = pr[0], pr[3]
    batch = Batch({"prompts": pr, "prompt_mask": pm, "response_mask": rm, "row": torch.arange(5)})
    assert [mb["row"].tolist() for mb in token_micro_batches(batch, 12, share_prompts=True)] == [[0, 1, 2], [3, 4]]
    assert [mb["row"].tolist() for mb in token_micro_batches(batch, 12)] == [[0, 1], [2, 3], [4]]
    # A micro-batch that starts inside a group pays for the prompt again. Budget 8: row 0 (5); row 1 would make 9,
    # so it starts a micro-batch at its full 7; row 2 adds 1 (8); row 3 (7) and row 4 (3 shared, 10 > 8) alone.
    assert [mb["row"].tolist() for mb in token_micro_batches(batch, 8, share_prompts=True)] == [[0], [1, 2], [3], [4]]


def _update(model, batch, *, micro_batch_tokens):
    # eps=1 makes Adam's first step lr·g/(|g|+1) ≈ lr·g: smooth in the gradient, so gradients that agree to
    # 1e-7 give updates that agree (with the default eps, ~0 gradients would step by ±lr on rounding noise).
    engine = TrainingEngine(model, OptimConfig(lr=1.0, eps=1.0, grad_clip=0.0), total_optimizer_steps=10)
    counts = MiniBatchCounts(num_tokens=float(batch["response_mask"].sum()), num_seqs=float(len(batch)), norm_len=7.0)
    spec = UpdateSpec(minis=(counts,), kl_coef=0.0, old_logprobs="recomputed")

    def loss_fn(mb, c):
        args = (model, mb["prompts"], mb["prompt_mask"], mb["responses"], mb["response_mask"])
        lp, _ = (sequence_logprobs(*args) if micro_batch_tokens is None else packed_logprobs(*args, fused_chunk=4))
        loss, _ = POLICY_LOSSES.get("ppo")(lp, mb["old_logprobs"], mb["advantages"], mb["response_mask"].float(),
                                           agg="token-mean", num_tokens=c.num_tokens, num_seqs=c.num_seqs)
        return loss, {}

    run_update(engine, batch, spec, epochs=1, micro_batch_size=2, loss_fn=loss_fn, prefix="actor",
               micro_batch_tokens=micro_batch_tokens)
    return dict(model.named_parameters())


def test_token_budget_update_equals_sample_count_update():
    pr, pm, rs, rm = _batch([6, 1, 3, 2, 5, 4], [7, 1, 4, 2, 6, 3], seed=1)
    batch = Batch({"prompts": pr, "prompt_mask": pm, "responses": rs, "response_mask": rm,
                   "old_logprobs": torch.full(rm.shape, -3.0) * rm,
                   "advantages": torch.tensor([1.0, -1.0, 2.0, 0.5, -0.5, 1.5])[:, None] * rm})
    before = {n: p.detach().clone() for n, p in load_causal_lm(TINY).named_parameters()}
    by_samples = _update(load_causal_lm(TINY), batch, micro_batch_tokens=None)  # 3 micro-batches of 2
    by_tokens = _update(load_causal_lm(TINY), batch, micro_batch_tokens=12)  # lengths 13,2,7,4,11,7: 5 groups
    moved = max(float((by_samples[n].detach() - before[n]).abs().max()) for n in before)
    assert moved > 1e-3  # the step did something, so equality below is not vacuous
    for name, p in by_samples.items():
        torch.testing.assert_close(by_tokens[name], p, atol=1e-5, rtol=1e-4, msg=name)
