"""Weights through Ray's object store as numpy arrays, not torch tensors (the async weight path, cluster/group.py).

Why: Ray pickles a torch tensor's storage in band, so a put copies every byte through the pickler and every get
copies it back out; numpy arrays go out of band, written to the store once and read back as views of it without a
copy. On this project's 2-core CPU machine a 2 GB bf16 state went in at 0.15 GB/s as tensors and 0.50 GB/s as
arrays, and came back at 0.28 GB/s against a zero-copy view (bench/store_codec.py); Qwen3-8B's 16 GB publish took
42-55 s on 4x H200 as tensors (bench/RESULTS.md, issue 38). numpy has no bfloat16, so each tensor travels as an
array of unsigned integers of its width with its torch dtype beside it, and is viewed back bit for bit.
"""
from __future__ import annotations

import warnings

import numpy as np
import torch

_CARRIER = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # same-width types numpy knows


def to_store(named: dict[str, torch.Tensor]) -> dict[str, tuple[np.ndarray, str]]:
    """{name: (the CPU tensor's bytes as a numpy array of its width, its torch dtype's name)}; shares memory."""
    out = {}
    for name, t in named.items():
        if t.device.type != "cpu":
            raise ValueError(f"to_store: {name!r} is on {t.device}; copy it to the host first (export_weights does)")
        t = t.detach().contiguous()
        out[name] = (t.view(_CARRIER[t.element_size()]).numpy(), str(t.dtype).removeprefix("torch."))
    return out


def from_store(stored: dict[str, tuple[np.ndarray, str]]) -> dict[str, torch.Tensor]:
    """The tensors `to_store` took, as views of the arrays (read-only ones from the store: the caller copies them
    into its own weights, never writes them)."""
    with warnings.catch_warnings():  # torch warns on a read-only array; these views are only read
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return {name: torch.from_numpy(arr).view(getattr(torch, dtype)) for name, (arr, dtype) in stored.items()}
