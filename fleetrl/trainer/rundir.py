"""The run directory: unique by default, never shared by two live runs, never silently mixed with another run.

- Default `runs/<name>-<YYYYmmdd-HHMMSS-mmm>-s<seed>-<random>`: seeded runs launched together get distinct
  directories (created atomically with mkdir, so a collision is retried, never shared).
- An explicit trainer.output_dir that already holds a run is refused unless trainer.resume says to continue it;
  `auto` with no checkpoint to continue from is refused too when it would append a second, unmarked run to the
  directory's metrics.jsonl.
- A lock (flock on RUN/.lock) refuses a second live run in the same directory.
- A start that fails before the run wrote a metric or a checkpoint removes the directory it created (and an
  existing directory it only added files to does not count as holding a run), so the same command can be rerun.
"""
from __future__ import annotations

import difflib
import fcntl
import json
import os
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from fleetrl.config import dump_yaml
from fleetrl.config.load import redact_yaml_text
from fleetrl.config.schema import RunConfig
from fleetrl.errors import UserError


class RunDirError(UserError):
    """The run directory cannot be used as asked; the message says why and what to set instead."""


@dataclass
class RunDir:
    path: Path
    lock: IO
    created: bool
    """This process made the directory, so it may remove it again."""

    def release(self, *, failed: bool) -> None:
        """Unlocks. After a failed start removes the directory when this process created it and it holds only
        what the start wrote (no metric, checkpoint, stall dump or tracker log): an empty leftover would otherwise
        refuse the rerun ("already holds a run") or, under runs/, pile up. Removed before the lock is let go, so
        no other run can claim it in between."""
        if failed and self.created and _only_start_up_files(self.path):
            shutil.rmtree(self.path, ignore_errors=True)
        self.lock.close()


def claim_run_dir(cfg: RunConfig, start: Path | None = None) -> RunDir:
    """Creates (or re-opens, when resuming) the run directory and locks it. `start`: the checkpoint the run
    resumes from (find_resume's answer), None for a run from step 0."""
    explicit = Path(cfg.trainer.output_dir) if cfg.trainer.output_dir else None
    created = explicit is None or not explicit.exists()
    out = explicit or _fresh(cfg)
    try:
        out.mkdir(parents=True, exist_ok=True)
        lock = open(out / ".lock", "a+")
    except OSError as e:
        raise RunDirError(f"cannot create the run directory {out}: {e.strerror}; set trainer.output_dir to a "
                          f"writable path") from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        raise RunDirError(f"another fleetrl run (pid {lock.read().strip() or '?'}) is writing to {out}; give this "
                          f"run its own trainer.output_dir (or leave it unset for a unique one)") from None
    lock.seek(0), lock.truncate(), lock.write(str(os.getpid())), lock.flush()
    try:
        check_reuse(out, cfg, start)  # again under the lock: what another run wrote before it is counted too
    except RunDirError:
        lock.close()
        raise
    return RunDir(out, lock, created)


def check_reuse(out: Path, cfg: RunConfig, start: Path | None) -> None:
    """Refuses to mix this run into `out` when it holds another: with trainer.resume=never, and with `auto` that
    found no checkpoint (`start` None) where metrics.jsonl already has records. The one exception is a
    metrics.jsonl whose last record is a `restart` event: `fleetrl sweep` writes one before it retries a run from
    scratch, so readers know the steps that follow supersede the earlier ones."""
    if cfg.trainer.resume == "never" and _holds_a_run(out):
        raise RunDirError(f"{out} already holds a run (metrics.jsonl / checkpoints); continue it with "
                          f"trainer.resume=auto, or choose another trainer.output_dir.{_config_diff(out, cfg)}")
    last = _last_record(out / "metrics.jsonl")
    if cfg.trainer.resume == "auto" and start is None and last is not None and last.get("event") != "restart":
        raise RunDirError(f"trainer.resume=auto: {out} holds a run (metrics.jsonl up to step {last.get('step', '?')}) "
                          f"but no complete checkpoint to continue it from, and starting again at step 0 would append "
                          f"a second run to its metrics.jsonl; to start a new run, pass a new trainer.output_dir "
                          f"(or delete {out} first)")


def _fresh(cfg: RunConfig) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S") + f"-{int(time.time() * 1000) % 1000:03d}"
    for _ in range(8):
        path = Path("runs") / f"{cfg.trainer.name}-{stamp}-s{cfg.trainer.seed}-{secrets.token_hex(2)}"
        try:
            path.mkdir(parents=True, exist_ok=False)
            return path
        except FileExistsError:
            continue
    raise RunDirError("could not create a unique run directory under runs/; set trainer.output_dir")


# What a run writes before its first step: the lock, the resolved config, an empty metrics log, TensorBoard's
# first event file. Anything else (stalls/ with the stacks a StallError points to, wandb/, checkpoints) is kept.
START_UP_FILES = frozenset({".lock", "config.yaml", "metrics.jsonl", "tensorboard"})


def _only_start_up_files(out: Path) -> bool:
    try:
        names = {p.name for p in out.iterdir()}
    except OSError:
        return False
    return names <= START_UP_FILES and not _holds_a_run(out)


def _holds_a_run(out: Path) -> bool:
    # An empty metrics.jsonl is what a start that failed before its first record leaves: nothing to lose.
    metrics = out / "metrics.jsonl"
    return (metrics.is_file() and metrics.stat().st_size > 0) or any((out / "checkpoints").glob("step_*"))


def _last_record(metrics: Path) -> dict | None:
    """The last complete JSON record of a metrics.jsonl (None when there is none); reads only its tail."""
    try:
        with open(metrics, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:  # a torn last line (a killed process), or the cut first line of the tail
            continue
        if isinstance(record, dict):
            return record
    return None


def _config_diff(out: Path, cfg: RunConfig) -> str:
    saved = out / "config.yaml"
    if not saved.is_file():
        return ""
    # an older run's file may hold a secret in clear: redact it before it reaches a message
    diff = list(difflib.unified_diff(redact_yaml_text(saved.read_text()).splitlines(), dump_yaml(cfg).splitlines(), "that run",
                                     "this run", lineterm="", n=0))[2:]
    changes = [d for d in diff if not d.startswith("@@")]
    return (" Its config differs in: " + "; ".join(changes[:12])) if changes else " Its config is the same."
