"""Checkpoints that resume exactly: written atomically, found again by `trainer.resume`.

Layout of OUT/checkpoints/step_N/ (written as step_N.tmp/, renamed when complete; `latest` written last):
  actor/, critic/        torch.distributed.checkpoint folders: {"model": ..., "optim": ...} by parameter name,
                         so they load into any data-parallel size (sharded or not)
  workers/POOL_rR.pt     per-worker extras: LR scheduler, RNG states (torch, numpy, python)
  controller.pt          step, weights version, sampler position, KL controller, controller RNG
  config.yaml            the run config, secrets redacted, mode 0600 (a changed config on resume is reported as a diff)
  checksums.json         size and sha256 of every file above, checked before a resume trusts the checkpoint
  meta.json              step, model/tokenizer paths, dtype, actor.lora if any (what `fleetrl export` needs);
                         written last
"""
from __future__ import annotations

import difflib
import errno
import json
import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence

import torch
import yaml
from torch.distributed.checkpoint.api import CheckpointException

from fleetrl.checkpoint.export import CheckpointError, read_meta
from fleetrl.checkpoint.integrity import CHECKSUMS, COMPLETE_MARK, file_checksums, run_dir_of, validate_checkpoint
from fleetrl.config import redacted_dict, write_config
from fleetrl.config.load import redact_secrets, to_dict
from fleetrl.config.schema import RunConfig

if TYPE_CHECKING:
    from fleetrl.cluster.group import WorkerGroup

log = logging.getLogger("fleetrl.checkpoint")
# Config keys that say how a run is driven (where it writes, how it resumes, what it saves, logs and prints, how
# long it waits), not what it trains: load_checkpoint leaves them out of its diff, since a resume changes some of
# them nearly every time (trainer.resume never -> auto) and a reported change must mean the training differs.
# A section name stands for all of its keys.
RUN_CONTROL_KEYS = frozenset({
    "trainer.resume", "trainer.output_dir", "trainer.name", "trainer.save_every", "trainer.save_last",
    "trainer.keep_last", "trainer.keep_every", "trainer.export_every", "trainer.delta_checkpoints",
    "trainer.max_restarts", "trainer.restart_wait_s", "tracking", "cluster.address", "cluster.num_cpus",
    "cluster.placement_timeout_s", "cluster.init_timeout_s", "cluster.call_timeout_s", "cluster.first_call_timeout_s",
    "cluster.call_timeouts", "cluster.stall_s", "cluster.first_call_stall_s"})
# (path, problem) of each broken checkpoint already warned about: a run looks for its resume point more than once
# (run.py's early check, then the Trainer's load; again at a stop or a recovery), and says so once.
_warned: set[tuple[Path, str]] = set()
__all__ = ["CheckpointError", "DiskFullError", "Stateful", "find_resume", "load_checkpoint", "other_model_message",
           "save_checkpoint", "validate_checkpoint"]


class Stateful(Protocol):
    """A part of the controller that saves itself (the manager never reads a trainer's fields)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def checkpoint_root(out_dir: Path) -> Path:
    return Path(out_dir) / "checkpoints"


def save_checkpoint(out_dir: Path, step: int, *, groups: Sequence["WorkerGroup"], state: Mapping[str, Stateful],
                    config: RunConfig, actor: "WorkerGroup | None" = None) -> Path:
    """Writes OUT/checkpoints/step_N atomically. `groups`: every worker group (each worker saves its share);
    `state`: the controller's parts by name; `actor`: the actor's group when delta checkpoints are on. A save that
    fails leaves no step_N.tmp; one that failed for a full disk raises DiskFullError (one line for the user)."""
    root = checkpoint_root(out_dir)
    final, tmp = root / f"step_{step}", root / f"step_{step}.tmp"
    try:
        return _save(root, final, tmp, step, groups=groups, state=state, config=config, actor=actor)
    except (Exception, CheckpointException) as e:  # DCP's wrapper is a BaseException
        free = _free_bytes(root)  # before the cleanup: what the save ran into
        # A failed save leaves no step_N.tmp behind: resume never picks one, but it would keep the disk full.
        shutil.rmtree(tmp, ignore_errors=True)
        (root / "latest.tmp").unlink(missing_ok=True)
        if not is_disk_full(e):
            raise
        raise DiskFullError(disk_full_message(root, step, free, _newest_complete(root))) from e


class DiskFullError(CheckpointError):
    """A checkpoint save ran out of space: the user frees some or writes elsewhere; never a bug to trace back."""


# How a full disk shows up beside ENOSPC: torch's zip writer (torch.save, DCP's metadata) reports a short write as
# an `inline_container.cc` enforce failure ("unexpected pos 704 vs 598"), and Ray passes a worker's error as text.
_DISK_FULL_TEXT = ("No space left", "Disk quota exceeded", "inline_container", "unexpected pos")


def is_disk_full(e: BaseException) -> bool:
    """Whether `e`, or an error it was raised from (a worker's, DCP's per-rank failures), is a full disk."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [e]
    while todo:
        err = todo.pop()
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(t in str(err) for t in _DISK_FULL_TEXT):
            return True
        todo += [err.__cause__, err.__context__]
        failures = getattr(err, "failures", None)  # CheckpointException: {rank: WrappedException(exc, trace)}
        if isinstance(failures, Mapping):
            todo += [getattr(f, "exc", None) for f in failures.values()]
    return False


def disk_full_message(root: Path, step: int, free: int | None, newest: Path | None) -> str:
    free_text = f"{free} bytes free" if free is not None else "free space unknown"
    safe = (f"the newest complete checkpoint is {newest} (safe; trainer.resume=auto continues from it)"
            if newest is not None else "there is no complete checkpoint yet (a resume starts again at step 0)")
    return (f"checkpoint directory {root}: saving step {step} failed because the disk is full ({free_text} on its "
            f"filesystem); the partial step_{step} was removed and {safe}. Free space on that disk, or point "
            f"trainer.output_dir at a larger one, or keep fewer checkpoints with a lower trainer.keep_last "
            f"(e.g. trainer.keep_last=2), then run again with trainer.resume=auto")


def _free_bytes(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _newest_complete(root: Path) -> Path | None:
    """The newest checkpoint in `root` that passes validation (no warnings: this is only for the message)."""
    for s in sorted(_steps(root), reverse=True):
        if validate_checkpoint(root / f"step_{s}") is None:
            return root / f"step_{s}"
    return None


def _save(root: Path, final: Path, tmp: Path, step: int, *, groups: Sequence["WorkerGroup"],
          state: Mapping[str, Stateful], config: RunConfig, actor: "WorkerGroup | None") -> Path:
    from fleetrl.workers.worker import Worker

    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "workers").mkdir(parents=True)
    for group in groups:
        group.call_all(Worker.save_state, str(tmp))
    torch.save({name: part.state_dict() for name, part in state.items()}, tmp / "controller.pt")
    write_config(tmp / "config.yaml", config)
    m = config.model
    meta = {"step": step, "model_path": m.path, "tokenizer_path": m.tokenizer or m.path, "dtype": m.dtype}
    if config.actor.lora is not None:  # export rebuilds the adapters around the base model to merge them
        meta["lora"] = to_dict(config.actor.lora)
    if actor is not None:
        _save_delta(actor, config, root, step, tmp, meta)
    (tmp / CHECKSUMS).write_text(json.dumps(file_checksums(tmp), indent=1))
    meta["checksums"] = CHECKSUMS
    (tmp / COMPLETE_MARK).write_text(json.dumps(meta, indent=1))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)  # atomic on one filesystem: a crash leaves step_N.tmp, never a half step_N
    _write_latest(root, final.name)
    prune(root, config.trainer.keep_last, config.trainer.keep_every)
    return final


def load_checkpoint(path: Path, *, groups: Sequence["WorkerGroup"], state: Mapping[str, Stateful],
                    config: RunConfig) -> str:
    """Loads every worker's share and the controller's parts. Returns the diff of the checkpoint's config
    against `config` ('' when equal) for the caller to report, leaving out RUN_CONTROL_KEYS."""
    from fleetrl.workers.worker import Worker

    saved = torch.load(path / "controller.pt", weights_only=False)
    for group in groups:
        try:
            group.call_all(Worker.load_state, str(path))
        # A worker's error, wrapped by Ray or not (DCP's own wrapper is a BaseException): torch names a shape it
        # cannot load.
        except (Exception, CheckpointException) as e:
            if "size mismatch" in str(e).lower():
                raise CheckpointError(other_model_message(path, config.model.path)) from e
            raise
    for name, part in state.items():
        part.load_state_dict(saved[name])
    # Both sides redacted: a secret neither leaks into the log nor shows up as a change (older checkpoints
    # stored it in clear).
    saved_config = yaml.safe_load((path / "config.yaml").read_text()) or {}
    diff = difflib.unified_diff(_trained_yaml(redact_secrets(saved_config)), _trained_yaml(redacted_dict(config)),
                                "checkpoint config", "current config", lineterm="", n=0)
    return "\n".join(list(diff)[2:])


def _trained_yaml(data: dict[str, Any]) -> list[str]:
    """The lines of `data` (a config as plain data) as YAML, without RUN_CONTROL_KEYS."""
    kept = {section: {k: v for k, v in value.items() if f"{section}.{k}" not in RUN_CONTROL_KEYS}
            if isinstance(value, dict) else value
            for section, value in data.items() if section not in RUN_CONTROL_KEYS}
    return yaml.safe_dump(kept, sort_keys=False).splitlines()


def _save_delta(actor: "WorkerGroup", config: RunConfig, root: Path, step: int, tmp: Path, meta: dict) -> None:
    """Change of the actor since the previous delta checkpoint (or the base model), changed tensors only."""
    from fleetrl.checkpoint.delta import apply_deltas, load_delta, make_delta, save_delta
    from fleetrl.models.hf import load_causal_lm
    from fleetrl.workers.worker import Worker

    m = config.model
    new = actor.call_all(Worker.model_state, "actor")[0]
    chain = delta_chain(root, step)
    base = load_causal_lm(m.path, dtype=m.dtype).state_dict()
    previous = apply_deltas(base, [load_delta(p) for p in chain]) if chain else base
    prev_step = int(chain[-1].parent.name[5:]) if chain else 0
    kind = config.trainer.delta_checkpoints
    delta = make_delta(previous, new, mode="exact" if kind == "exact" else "diff", bits=8 if kind == "int8" else None,
                       base_model=m.path, base_step=prev_step, step=step)
    save_delta(delta, tmp / "delta.safetensors")
    meta["delta"] = {"mode": kind, "base_step": prev_step, "nbytes": delta.nbytes,
                     "error": {k: v for k, v in delta.error_report(previous, new).items() if k.startswith("overall/")}}


def delta_chain(root: Path, before_step: int) -> list[Path]:
    """delta.safetensors of every complete checkpoint before `before_step`, in step order."""
    return [root / f"step_{s}" / "delta.safetensors" for s in sorted(_steps(root))
            if s < before_step and (root / f"step_{s}" / "delta.safetensors").is_file()
            and (root / f"step_{s}" / COMPLETE_MARK).is_file()]


def export_via_deltas(ckpt: str | Path, out_dir: str | Path, *, dtype: str | None = None) -> Path:
    from fleetrl.checkpoint.delta import export_from_deltas

    ckpt = Path(ckpt)
    meta = read_meta(ckpt)
    chain = delta_chain(ckpt.parent, meta["step"] + 1)
    if not chain or chain[-1].parent != ckpt:
        raise CheckpointError(f"{ckpt} has no delta.safetensors; train with trainer.delta_checkpoints=exact "
                              f"(and keep every checkpoint: trainer.keep_last=0) to export from deltas")
    return export_from_deltas(meta["model_path"], [str(p) for p in chain], out_dir,
                              tokenizer_path=meta["tokenizer_path"], dtype=dtype)


def _write_latest(root: Path, name: str) -> None:
    tmp = root / "latest.tmp"
    tmp.write_text(name + "\n")
    os.replace(tmp, root / "latest")


def prune(root: Path, keep_last: int, keep_every: int) -> None:
    steps = sorted(_steps(root))
    if keep_last <= 0:
        return
    doomed = steps[:-keep_last]
    for step in doomed:
        if keep_every and step % keep_every == 0:
            continue
        shutil.rmtree(root / f"step_{step}", ignore_errors=True)


def _steps(root: Path) -> list[int]:
    out = []
    for p in root.glob("step_*"):
        if p.is_dir() and not p.name.endswith(".tmp") and p.name[5:].isdigit():
            out.append(int(p.name[5:]))
    return out


def find_resume(out_dir: Path | None, resume: str) -> Path | None:
    """`never` -> None; a PATH -> that checkpoint (validated); `auto` -> newest complete one in `out_dir`, skipping
    broken ones (None when `out_dir` is None or holds none)."""
    if resume == "never":
        return None
    return _explicit_resume(resume) if resume != "auto" else _newest_intact(out_dir)


def _explicit_resume(resume: str) -> Path:
    path = Path(resume)
    problem = validate_checkpoint(path)
    if problem is None:
        return path
    run = run_dir_of(path)
    if run is not None:  # a run directory: `auto` resumes its newest checkpoint
        problem += f"; or resume its newest checkpoint with trainer.resume=auto trainer.output_dir={run}"
    raise CheckpointError(f"trainer.resume={resume}: {problem}")


def _newest_intact(out_dir: Path | None) -> Path | None:
    if out_dir is None:
        return None
    root = checkpoint_root(out_dir)
    problems = []
    for step in sorted(_steps(root), reverse=True):
        path = root / f"step_{step}"
        problem = validate_checkpoint(path)
        if problem is None:
            return path
        if (path, problem) not in _warned:
            _warned.add((path, problem))
            log.warning("skipping checkpoint %s: %s", path, problem)
        problems.append(f"{path.name}: {problem}")
    if problems:
        # Starting from step 0 here would silently throw the run's progress away and mix a new run into its dir.
        raise CheckpointError(f"trainer.resume=auto: none of the {len(problems)} checkpoints in {root} can be "
                              "loaded (" + "; ".join(problems) + "). To start fresh instead, pass a new "
                              "trainer.output_dir (or trainer.resume=never); to resume from one of them anyway, "
                              "repair it and pass trainer.resume=PATH")
    return None


def other_model_message(ckpt: Path, model_path: str) -> str:
    """Why a checkpoint's weights do not fit this run's model: the names of both. Said when a worker's load finds a
    shape that differs, not from the names: the same model may sit at another path on another machine (a job's
    uploaded working dir, another mount), and only the shapes tell."""
    try:
        saved = json.loads((Path(ckpt) / COMPLETE_MARK).read_text()).get("model_path")
    except (OSError, ValueError, AttributeError):
        saved = None
    trained = f"model {saved!r} (model_path in its {COMPLETE_MARK})" if isinstance(saved, str) else "another model"
    return (f"checkpoint {ckpt} was trained from {trained}, whose weights do not fit this run's model.path="
            f"{model_path!r} (a tensor's shape differs). Resume with the model it was trained from; to train "
            f"{model_path!r} instead, start a new run (trainer.resume=never and a new trainer.output_dir)")
