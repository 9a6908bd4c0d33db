"""TrainingEngine mixed precision: bf16 matmuls in the forward, fp32 parameters, gradients and Adam state."""
from __future__ import annotations

import pytest
import torch

from fleetrl.config.schema import OptimConfig
from fleetrl.engines.training import TrainingEngine


def _model() -> torch.nn.Linear:
    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 1.0 / 3.0]]))
    return model


def test_bf16_autocast_rounds_the_matmul_but_keeps_fp32_master_weights():
    x = torch.tensor([[1.0, 1.0]])
    seen = {}

    def loss_fn(b):
        y = model(b)
        seen["dtype"] = y.dtype
        return y.float().sum(), {"y": float(y.detach())}

    model = _model()
    engine = TrainingEngine(model, OptimConfig(lr=0.1, grad_clip=0.0), autocast_dtype=torch.bfloat16)
    m = engine.step(iter([x]), loss_fn)
    # bf16 keeps 8 significant bits: 1/3 -> 0.333984375, so y = 1 + 0.333984375 (exact in fp32 it is 1.3333334)
    assert seen["dtype"] == torch.bfloat16 and m["y"] == pytest.approx(1.3359375, abs=1e-7)
    # The step itself is fp32: Adam's first step moves each weight by lr * sign(grad) = 0.1 from its fp32 value.
    assert model.weight.dtype == torch.float32
    torch.testing.assert_close(model.weight.detach(), torch.tensor([[0.9, 1.0 / 3.0 - 0.1]]), atol=1e-6, rtol=0)
    assert all(v.dtype == torch.float32 for st in engine.optimizer.state.values() for k, v in st.items()
               if k != "step")


def test_actor_autocast_comes_from_the_config():
    from fleetrl.config import ConfigError, load_config

    assert load_config("examples/quickstart.yaml", ["actor.autocast=bfloat16"]).actor.autocast == "bfloat16"
    with pytest.raises(ConfigError, match="actor.autocast: unknown value 'int8'"):
        load_config("examples/quickstart.yaml", ["actor.autocast=int8"])
