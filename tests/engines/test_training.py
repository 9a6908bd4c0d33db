import math

import pytest
import torch

from fleetrl.config.schema import OptimConfig
from fleetrl.engines.training import TrainingEngine, make_scheduler


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
