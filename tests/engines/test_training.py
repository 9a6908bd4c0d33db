import math
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from fleetrl.config.schema import OptimConfig
from fleetrl.engines.training import DistInfo, TrainingEngine, make_scheduler


def _engine(**optim):
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, -1.0]]))
    return model, TrainingEngine(model, OptimConfig(**{"lr": 0.1, **optim}))


def test_warmup_then_linear_decay_hand_computed():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = make_scheduler(opt, OptimConfig(lr=1.0, schedule="linear", warmup_steps=2, min_lr_ratio=0.0), 6)
    lrs = []
    for _ in range(6):
        lrs.append(round(sched.get_last_lr()[0], 6))
        opt.step()
        sched.step()
    # warm-up (step+1)/2: 0.5, 1.0; then linear over the 4 remaining steps: 1 - k/4 for k = 0..3
    assert lrs == [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]


def test_step_matches_hand_computed_adam():
    model, engine = _engine(grad_clip=0.0)
    x = torch.tensor([[1.0, 2.0]])
    m = engine.step(iter([x]), lambda b: ((model(b) ** 2).sum(), {"loss": 1.0}))
    # y = 1*1 + (-1)*2 = -1; dL/dw = 2*y*x = [-2, -4]; Adam's first step moves each weight by lr*sign(g) = 0.1
    torch.testing.assert_close(model.weight.detach(), torch.tensor([[1.1, -0.9]]), atol=1e-5, rtol=0)
    assert m["grad_norm"] == pytest.approx(math.sqrt(4 + 16)) and m["skipped"] == 0.0 and m["loss"] == 1.0


def test_nonfinite_gradient_skips_the_update():
    model, engine = _engine()
    before = model.weight.detach().clone()
    m = engine.step(iter([torch.ones(1, 2)]), lambda b: (model(b).sum() * float("nan"), {}))
    assert m["skipped"] == 1.0
    assert torch.equal(model.weight.detach(), before)


def test_offload_and_onload_keep_training_identical():
    x = torch.tensor([[1.0, 2.0]])

    def run(offload: bool):
        model, engine = _engine()
        for _ in range(3):
            if offload:
                engine.offload_optimizer()
                engine.onload_optimizer()
            engine.step(iter([x]), lambda b: (((model(b) - 3) ** 2).sum(), {}))
        return model.weight.detach()

    assert torch.equal(run(False), run(True))


class _Stack(torch.nn.Module):
    """Two layers under `.layers`, so that FSDP2 shards each (engines/training.py `_decoder_layers`)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _ranks_check(rank: int, init: str, out: str) -> None:
    """One of two gloo ranks: (1) its own seed draws its own weights (as a worker's rank-seeded generator draws
    LoRA's A), then the engine is built; (2) an FSDP2 step where rank 0 has two micro-batches and rank 1 one (a
    token budget does that), and the same step in one process over all three. Saves what the rank holds."""
    # A deadline: without the repeat, rank 0's second micro-batch would wait forever for rank 1's gathers.
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    try:
        torch.manual_seed(100 + rank)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
        model[1].weight.requires_grad_(False)  # frozen: loaded, never drawn, so left as each rank has it
        drawn = {k: v.clone() for k, v in model.state_dict().items()}
        TrainingEngine(model, OptimConfig(lr=0.1), dist_info=DistInfo(rank=rank, world_size=2))
        data = torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(5))
        torch.manual_seed(7)  # one model on both ranks, as if loaded
        stack, whole = _Stack(), _Stack()
        whole.load_state_dict(stack.state_dict())
        for m, dist_info, sharded, mbs in ((stack, DistInfo(rank=rank, world_size=2), True, [[0, 1], [2]][rank]),
                                          (whole, DistInfo(), False, [0, 1, 2])):
            engine = TrainingEngine(m, OptimConfig(lr=0.1), dist_info=dist_info, sharded=sharded)
            # Each micro-batch's loss is normalised by the global count (12 rows), as algo.losses does.
            engine.step(iter(data[mbs]), lambda x, m=m: (m(x).pow(2).sum() / 12, {"rows": float(len(x))}))
        got = {k: v.full_tensor() for k, v in stack.state_dict().items()}
        torch.save({"drawn": drawn, "held": model.state_dict(), "sharded": got, "whole": whole.state_dict()},
                   f"{out}/{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two spawned processes importing torch: ~5-10 s
def test_ranks_start_alike_and_fsdp2_runs_uneven_micro_batch_counts(tmp_path):
    import torch.multiprocessing as mp

    init = f"file://{tmp_path}/rendezvous"
    mp.start_processes(_ranks_check, args=(init, str(tmp_path)), nprocs=2, start_method="spawn")
    r0, r1 = (torch.load(tmp_path / f"{r}.pt") for r in (0, 1))
    # Every rank starts from rank 0's trainable weights. The bug this guards: LoRA's A matrices differed per rank,
    # so DP=2 averaged the gradients of two models.
    for key in ("0.weight", "0.bias", "1.bias"):
        assert not torch.equal(r0["drawn"][key], r1["drawn"][key])  # the ranks drew different weights
        assert torch.equal(r1["held"][key], r0["drawn"][key]) and torch.equal(r0["held"][key], r0["drawn"][key])
    assert torch.equal(r1["held"]["1.weight"], r1["drawn"]["1.weight"])
    # FSDP2 with 2 micro-batches on one rank and 1 on the other: no hang (rank 1 repeats its last with no
    # gradient), and the update equals one process stepping over all three.
    for r in (r0, r1):
        for key, want in r["whole"].items():
            torch.testing.assert_close(r["sharded"][key], want, atol=1e-6, rtol=1e-5)
