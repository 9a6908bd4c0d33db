"""A worker's share of a checkpoint: model + optimiser through torch.distributed.checkpoint (by parameter
name, so any data-parallel size can load it), and a small per-worker file of scheduler and RNG states.

Only trainable parameters (and buffers) are stored: frozen ones come back from model.path on every start. With
actor.lora that is the adapters and their Adam state, a few MB instead of the whole model."""
from __future__ import annotations

import random
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from fleetrl.engines.training import TrainingEngine

_OPTIONS = StateDictOptions(ignore_frozen_params=True)
# Loading leaves the frozen parameters as model.path gave them; dcp.load has already failed on any missing
# trainable tensor, so nothing strict is lost.
_LOAD_OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)


def save_trainable(path: Path, engine: TrainingEngine, rank: int) -> None:
    """Unsharded: every rank holds the same full state, so rank 0 writes it alone (no collective).
    Sharded (FSDP2): every rank writes its shards collectively."""
    if not engine.sharded and rank != 0:
        return
    model_sd, optim_sd = get_state_dict(engine.model, engine.optimizer, options=_OPTIONS)
    with _single_process_quiet():
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path), no_dist=not engine.sharded)


def load_trainable(path: Path, engine: TrainingEngine) -> None:
    model_sd, optim_sd = get_state_dict(engine.model, engine.optimizer, options=_OPTIONS)
    state = {"model": model_sd, "optim": optim_sd}
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=str(path), no_dist=not engine.sharded)
    set_state_dict(engine.model, engine.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"], options=_LOAD_OPTIONS)


def save_extras(path: Path, engines: dict[str, TrainingEngine]) -> None:
    torch.save({"schedulers": {r: e.scheduler.state_dict() for r, e in engines.items()}, "rng": rng_state()}, path)


def load_extras(path: Path, engines: dict[str, TrainingEngine]) -> None:
    """A different world size on resume has no file for new ranks: they keep their fresh seeded RNG."""
    if not path.is_file():
        return
    state = torch.load(path, weights_only=False)
    for role, engine in engines.items():
        if role in state["schedulers"]:
            engine.scheduler.load_state_dict(state["schedulers"][role])
    set_rng_state(state["rng"])


def rng_state() -> dict:
    """Every generator of this process: python, numpy, torch (and CUDA when present). The one RNG capture."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns "torch.distributed is disabled ... assuming the intent is to save in a single process" on every
    unsharded save and load, even with no_dist=True, which says exactly that: one line of noise per checkpoint
    in every run's output (torch 2.11-2.13). Only that warning, only around our own calls."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield
