"""actor.forward (hf | native): a typed choice, and native's limits refused at config time with the fix."""
from __future__ import annotations

import pytest

from fleetrl.config import derive_plan, load_config
from fleetrl.config.plan import ConfigError
from fleetrl.errors import UserError


def _plan(*overrides: str):
    return derive_plan(load_config(None, list(overrides)))


def test_forward_defaults_to_hf_and_accepts_native():
    assert _plan().config.actor.forward == "hf"
    assert _plan("actor.forward=native", "actor.compile=true").config.actor.forward == "native"


def test_an_unknown_forward_is_refused():
    with pytest.raises(UserError, match=r"actor.forward: unknown value 'fast' \(choose from: hf, native\)"):
        _plan("actor.forward=fast")


def test_native_forward_takes_an_fsdp2_actor_packed_or_padded():
    # Sharded runs go through the FSDP2 hooks (engines/sharding.py); tests/integration/test_dp.py checks the numbers.
    for extra in ([], ["algorithm.micro_batch_tokens=4096", "actor.share_prompts=true"]):
        plan = _plan("actor.forward=native", "actor.sharding=fsdp2", *extra)
        assert plan.config.actor.sharding == "fsdp2" and plan.config.actor.forward == "native"


def test_native_shared_prompts_need_packed_micro_batches():
    with pytest.raises(ConfigError, match="actor.share_prompts with actor.forward=native needs packed micro-batches: "
                                          "set algorithm.micro_batch_tokens"):
        _plan("actor.forward=native", "actor.share_prompts=true")
    plan = _plan("actor.forward=native", "actor.share_prompts=true", "algorithm.micro_batch_tokens=4096")
    assert plan.config.actor.share_prompts and plan.micro_batch_tokens == 4096
