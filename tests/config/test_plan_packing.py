"""The packed-forward keys (algorithm.micro_batch_tokens, actor.fused_logprob_chunk, actor.packed_attention):
validated once by derive_plan, carried as Plan.micro_batch_tokens."""
from __future__ import annotations

import pytest

from fleetrl.config import derive_plan, load_config
from fleetrl.config.plan import ConfigError


def _plan(*overrides: str):
    return derive_plan(load_config(None, list(overrides)))


def test_token_budget_is_carried_by_the_plan_and_off_by_default():
    assert _plan().micro_batch_tokens is None
    assert _plan("algorithm.micro_batch_tokens=8192").micro_batch_tokens == 8192


@pytest.mark.parametrize("override, match", [
    ("algorithm.micro_batch_tokens=0", "algorithm.micro_batch_tokens=0 must be a positive token count"),
    ("actor.fused_logprob_chunk=-1", "actor.fused_logprob_chunk=-1 must be a positive token count"),
    ("actor.packed_attention=flexattention", "flex_attention"),  # did-you-mean names the close choice
])
def test_bad_packing_keys_name_the_key(override, match):
    with pytest.raises(ConfigError, match=match):
        _plan(override)


def test_packing_takes_an_fsdp2_actor():
    assert _plan("algorithm.micro_batch_tokens=4096", "actor.sharding=fsdp2").micro_batch_tokens == 4096
