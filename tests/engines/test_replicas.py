"""Ranks build the same weights without a broadcast (engines/replicas.py, models/meta_init.py): two gloo ranks draw a
random: shape on the meta device, shard it with FSDP2 through the training engine, and each draws its own shard; the
shards make up exactly the model one process draws, the fingerprints agree, and the optimiser trains the drawn
weights. A rank that draws from another seed, or loads another model, stops the build with a message."""
from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

SHAPE = "random:qwen2.5-test"


def _rank(rank: int, init: str, out: str) -> None:
    from fleetrl.config.schema import OptimConfig
    from fleetrl.engines.replicas import WeightsDivergeError, check_same
    from fleetrl.engines.training import DistInfo, TrainingEngine
    from fleetrl.models.hf import load_causal_lm
    from fleetrl.models.meta_init import materialize
    from fleetrl.models.shapes import random_model

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    info = DistInfo(rank=rank, world_size=2)
    result: dict[str, object] = {}
    try:
        # (1) the same seed on both ranks: sharded on the meta device by the engine, then drawn shard by shard
        model = load_causal_lm(SHAPE, device="meta")
        engine = TrainingEngine(model, OptimConfig(lr=0.1), dist_info=info, sharded=True)
        check_same(materialize(model, "cpu"), None, "actor")
        result["local"] = {k: tuple(v.to_local().shape) for k, v in model.state_dict().items() if "k_proj.weight" in k}
        result["whole"] = {k: v.full_tensor() for k, v in model.state_dict().items()}
        ids = torch.tensor([[1, 2, 3, 4]])
        engine.step([ids], lambda x: (model(input_ids=x).logits.float().pow(2).mean(), {}))
        result["stepped"] = {k: v.full_tensor() for k, v in model.state_dict().items()}
        # (2) another seed on rank 1: the fingerprints of the whole draws differ
        other = random_model(SHAPE, torch.float32, seed=rank, device="meta")
        TrainingEngine(other, OptimConfig(), dist_info=info, sharded=True)
        try:
            check_same(materialize(other, "cpu"), None, "actor")
        except WeightsDivergeError as e:
            result["seed_error"] = str(e)
        # (3) loaded models (built alike, unsharded): the engine compares them instead of broadcasting
        try:
            TrainingEngine(load_causal_lm("tiny:" if rank == 0 else "tiny:seed=1"), OptimConfig(), dist_info=info)
        except WeightsDivergeError as e:
            result["load_error"] = str(e)
        TrainingEngine(load_causal_lm("tiny:"), OptimConfig(), dist_info=info)  # the same model: no error
        # (4) the 72B LoRA recipe: adapters injected on the meta device, the frozen base kept in bf16, sharded, drawn
        lora = _meta_lora()
        engine = TrainingEngine(lora, OptimConfig(lr=0.1), dist_info=info, sharded=True)
        check_same(materialize(lora, "cpu"), None, "actor")
        result["lora_whole"] = {k: v.full_tensor() for k, v in lora.state_dict().items()}
        engine.step([ids], lambda x: (lora(input_ids=x).logits.float().pow(2).mean(), {}))
        result["lora_stepped"] = {k: v.full_tensor() for k, v in lora.state_dict().items()}
    finally:
        dist.destroy_process_group()
    torch.save(result, f"{out}/{rank}.pt")


def _meta_lora() -> torch.nn.Module:
    from fleetrl.config.schema import LoraConfig
    from fleetrl.models.hf import load_causal_lm
    from fleetrl.models.lora import apply_lora, store_frozen_base

    model = load_causal_lm(SHAPE, device="meta")
    apply_lora(model, LoraConfig(rank=4, alpha=8.0))
    store_frozen_base(model, torch.bfloat16, upcast=True)
    return model


@pytest.mark.slow  # two spawned processes importing torch and transformers: ~15-30 s on 2 cores
def test_two_ranks_draw_alike_without_a_broadcast_and_a_divergence_raises(tmp_path):
    import torch.multiprocessing as mp

    from fleetrl.models.shapes import random_model

    mp.start_processes(_rank, args=(f"file://{tmp_path}/rendezvous", str(tmp_path)), nprocs=2, start_method="spawn")
    r0, r1 = (torch.load(tmp_path / f"{r}.pt") for r in (0, 1))
    one = random_model(SHAPE, torch.float32).state_dict()
    # Each rank holds half of each matrix (FSDP2 shards dim 0), and the halves make up the one-process draw exactly.
    assert r0["local"]["model.layers.0.self_attn.k_proj.weight"] == (16, 64)
    for key, want in one.items():
        assert torch.equal(r0["whole"][key], want) and torch.equal(r1["whole"][key], want), key
    # The optimiser made over the meta parameters trains the drawn ones (to_empty kept the parameter objects).
    assert not torch.equal(r0["stepped"]["model.norm.weight"], one["model.norm.weight"])
    assert all(torch.equal(r0["stepped"][k], r1["stepped"][k]) for k in one)
    for r in (r0, r1):
        assert "actor weights differ between ranks: rank 1 has model.layers.0.self_attn.k_proj.weight with sum" \
            in r["seed_error"]
        assert "every node must see the same model.path" in r["seed_error"]
        assert "model weights differ between ranks: rank 1" in r["load_error"]
    # LoRA on the meta device: both ranks hold the one-process draw (adapters B = 0, the base in bf16), and a step
    # trains the adapters alike on both while the frozen base stays as drawn.
    from fleetrl.models.meta_init import materialize

    alone = _meta_lora()
    materialize(alone, "cpu")
    want = alone.state_dict()
    up = "model.layers.0.mlp.up_proj"
    assert want[f"{up}.base_layer.weight"].dtype == torch.bfloat16 and not want[f"{up}.lora_B.default.weight"].any()
    for key, value in want.items():
        assert torch.equal(r0["lora_whole"][key], value) and torch.equal(r1["lora_whole"][key], value), key
    assert r0["lora_stepped"][f"{up}.lora_B.default.weight"].any()
    assert torch.equal(r0["lora_stepped"][f"{up}.base_layer.weight"], want[f"{up}.base_layer.weight"])
    assert all(torch.equal(r0["lora_stepped"][k], r1["lora_stepped"][k]) for k in want)
