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


@pytest.mark.parametrize("override", ["actor.sharding=fsdp2", "actor.share_prompts=true"])
def test_native_forward_limits_are_refused_with_the_fix(override):
    extra = ["actor.logprob_chunk=16"] if "share_prompts" in override else []
    with pytest.raises(ConfigError, match="actor.forward=native supports neither.*or forward=hf"):
        _plan("actor.forward=native", override, *extra)
