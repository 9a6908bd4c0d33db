"""Actor rank 0's host copy of the weights it publishes to an async rollout pool (cluster/group.py `put_weights`).

Why: a publish copied each gathered tensor to freshly allocated pageable host memory, so every one of Qwen3-8B's
16 GB faulted in new pages and went over the link at pageable speed, every step; with the object store's in-band
pickling this was 42-55 s of a 4x H200 step (bench/RESULTS.md, issue 38). Here each tensor has a buffer of its own,
allocated at the first publish and reused after: page-locked where the weights are on a GPU (the copy then runs
at the link's speed and needs no staging of its own), plain host memory on a CPU.
"""
from __future__ import annotations

import logging
from typing import Iterable

import torch

log = logging.getLogger("fleetrl.worker")


class HostStage:
    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}
        self._pin = True  # until page-locking fails once (a container's memlock limit): then pageable buffers

    def copy(self, named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Each (name, tensor) copied into its buffer as it comes (the caller's gathered tensor may be freed at
        once: the copy is queued on the stream that made it, which orders any reuse of its memory after the copy).
        Returns the buffers by name, valid until the next `copy`."""
        out: dict[str, torch.Tensor] = {}
        devices: set[torch.device] = set()
        for name, t in named:
            buf = self._buffer(name, t)
            buf.copy_(t.detach(), non_blocking=t.is_cuda)
            if t.is_cuda:
                devices.add(t.device)
            out[name] = buf
        for device in devices:
            torch.cuda.synchronize(device)
        return out

    def _buffer(self, name: str, t: torch.Tensor) -> torch.Tensor:
        buf = self._bufs.get(name)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = self._bufs[name] = self._allocate(t)
        return buf

    def _allocate(self, t: torch.Tensor) -> torch.Tensor:
        if t.is_cuda and self._pin:
            try:
                return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            except RuntimeError as err:  # page-locking refused: slower copies, same result
                log.warning("publishing weights from pageable host memory: page-locking %d bytes failed (%s)",
                            t.numel() * t.element_size(), err)
                self._pin = False
        return torch.empty(t.shape, dtype=t.dtype)
