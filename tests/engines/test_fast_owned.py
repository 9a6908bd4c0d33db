"""FastRolloutEngine(own_weights=True) (engines/fast/owned.py): the engine decodes from its own copy of the weights,
filled one decoder layer at a time, and must give what the default engine (the model's tensors in place) gives.

One process: the same tokens and log-probs as the default engine, fp32 and fused; bf16 decode of the fp32 model
equals the default engine's kept cast copy exactly; a LoRA actor's merge changes with its adapters; after an
optimiser step and a version bump both engines move alike; `sleep` frees the copy and the next call fills it again.
Two processes (gloo): an FSDP2-sharded model (each decoder layer and the root) under a TP=2 engine that owns its
weights equals a TP=1 engine on the plain model, the model stays sharded through the call, and each rank's copy
holds half of the projections."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fleetrl.engines.fast import FastRolloutEngine
from tests.engines.test_fast import CharTokenizer, left_padded, tiny_model
from tests.engines.test_fast_tp import _calls, _on_two_ranks, _same


def _pair(model: torch.nn.Module, **kw) -> tuple[FastRolloutEngine, FastRolloutEngine]:
    common = {"device": "cpu", "max_seq_len": 64, "max_batch": 4, "sync_every": 3, **kw}
    return (FastRolloutEngine(model, CharTokenizer(None), **common),
            FastRolloutEngine(model, CharTokenizer(None), own_weights=True, **common))


def _prompts() -> tuple[torch.Tensor, torch.Tensor]:
    ids, mask = left_padded([5, 2, 8, 8])
    return ids.repeat_interleave(2, 0), mask.repeat_interleave(2, 0)


def _compare(reference: FastRolloutEngine, engine: FastRolloutEngine, ids: torch.Tensor, mask: torch.Tensor) -> list:
    """Every call of `_calls` on both engines: the same outputs -> `engine`'s."""
    outs = []
    for params in _calls(eos=7):
        a, b = reference.generate(ids, mask, params), engine.generate(ids, mask, params)
        _same(a, b)
        outs.append(b)
    return outs


def _step(model: torch.nn.Module, ids: torch.Tensor, responses: torch.Tensor) -> None:
    """One SGD step on the model (the same on every rank that runs it)."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    logits = model(torch.cat([ids, responses], 1)).logits
    (-torch.log_softmax(logits.float(), -1)[..., 3].mean()).backward()
    opt.step()


def _lora(model: torch.nn.Module) -> None:
    from fleetrl.config.schema import LoraConfig
    from fleetrl.models.lora import apply_lora

    apply_lora(model, LoraConfig(rank=4, alpha=8.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:  # drawn from the name, not the global stream: two models get the same adapters
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(sum(map(ord, name))))


@pytest.mark.parametrize("arch,fuse,lora", [("llama", False, False), ("qwen2", True, False), ("llama", True, True)])
def test_owned_copy_decodes_as_the_models_own_tensors(arch: str, fuse: bool, lora: bool) -> None:
    model = tiny_model(arch)
    if lora:
        _lora(model)
    plain, owned = _pair(model, fuse_projections=fuse)
    ids, mask = _prompts()
    before = _compare(plain, owned, ids, mask)
    # the copy is the engine's own memory: no tensor it decodes with is one of the model's
    model_ptrs = {p.data_ptr() for p in model.parameters()}
    assert not any(t.data_ptr() in model_ptrs for t in owned._fwd.owned.weights.tensors())
    addresses = [t.data_ptr() for t in owned._fwd.owned.weights.tensors()]
    _step(model, ids, before[1].responses)
    plain.weights_version = owned.weights_version = 1  # what a colocated sync does
    for params, old in zip(_calls(eos=7), before):
        a, b = plain.generate(ids, mask, params), owned.generate(ids, mask, params)
        _same(a, b)
        assert not torch.allclose(b.logprobs, old.logprobs, atol=1e-3), "the owned copy holds the new weights"
    # refreshed in place: captured CUDA graphs read these addresses
    assert [t.data_ptr() for t in owned._fwd.owned.weights.tensors()] == addresses
    owned.sleep()
    assert owned._fwd.owned.weights is None and owned._fwd.owned.nbytes() == 0
    _same(plain.generate(ids, mask, _calls(eos=7)[0]), owned.generate(ids, mask, _calls(eos=7)[0]))


def test_owned_copy_in_bf16_equals_the_kept_cast_copy() -> None:
    """bf16 decode of an fp32 model: the owned copy is rounded once, as the kept cast copy (cast.py) is."""
    model = tiny_model("qwen2")
    kept = FastRolloutEngine(model, CharTokenizer(None), device="cpu", max_seq_len=64, max_batch=4,
                             compute_dtype=torch.bfloat16, keep_cast=True)
    owned = FastRolloutEngine(model, CharTokenizer(None), device="cpu", max_seq_len=64, max_batch=4,
                              compute_dtype=torch.bfloat16, own_weights=True)
    assert not owned.keep_cast
    ids, mask = _prompts()
    for params in _calls(eos=7)[:2]:
        a, b = kept.generate(ids, mask, params), owned.generate(ids, mask, params)
        assert torch.equal(a.responses, b.responses) and torch.equal(a.logprobs, b.logprobs)
    assert {t.dtype for t in owned._fwd.owned.weights.tensors()} == {torch.bfloat16}


def _count_gathers() -> list[int]:
    """Wraps owned.gathered to record the most FSDP2 groups held whole at once (this process only)."""
    from contextlib import contextmanager

    from fleetrl.engines.fast import owned

    inner, now, peak = owned.gathered, [0], [0]

    @contextmanager
    def counted(module):  # noqa: ANN001, ANN202
        with inner(module):
            now[0] += 1
            peak[0] = max(peak[0], now[0])
            try:
                yield
            finally:
                now[0] -= 1

    owned.gathered = counted
    return peak


def _check_sharded_model(rank: int, lora: bool) -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    plain, sharded = tiny_model("qwen2"), tiny_model("qwen2")  # seeded: the same weights on both ranks
    if lora:  # the 72B recipe's shape: adapters sharded with their layer, merged on the gathered layer, then sliced
        _lora(plain)
        _lora(sharded)
    for layer in sharded.model.layers:
        fully_shard(layer)
    fully_shard(sharded)
    peak_gathered = _count_gathers()
    common = {"device": "cpu", "max_seq_len": 64, "max_batch": 4, "sync_every": 3, "fuse_projections": True}
    one = FastRolloutEngine(plain, CharTokenizer(None), **common)
    tp = FastRolloutEngine(sharded, CharTokenizer(None), tp_group=dist.group.WORLD, own_weights=True, **common)
    ids, mask = _prompts()
    before = _compare(one, tp, ids, mask)
    assert all(isinstance(p, DTensor) for p in sharded.parameters()), "the model stays sharded"
    assert peak_gathered[0] == 1, "one FSDP2 group gathered at a time"
    # this rank's copy: half of each projection (q/k/v, gate/up fused; o, down), the embedding and norms whole
    lw, whole = tp._fwd.owned._own.layers[0], plain.model.layers[0]
    assert lw.wo.shape == (whole.self_attn.o_proj.weight.shape[0], whole.self_attn.o_proj.weight.shape[1] // 2)
    assert tp._fwd.fused._layers[0]["wgu"].shape[0] == whole.mlp.gate_proj.weight.shape[0]  # 2 I / 2
    _step(plain, ids, before[1].responses)
    _step(sharded, ids, before[1].responses)  # FSDP2's own step on the shards: the same update
    one.weights_version = tp.weights_version = 1
    for params in _calls(eos=7)[:2]:
        a, b = one.generate(ids, mask, params), tp.generate(ids, mask, params)
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True])
def test_tp2_engine_owning_its_slices_of_an_fsdp2_model_equals_tp1(lora: bool) -> None:
    _on_two_ranks(_check_sharded_model, lora)


