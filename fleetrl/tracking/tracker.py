"""Where metrics go: metrics.jsonl (always), TensorBoard, a rich console line + progress bar, W&B, MLflow.

A backend that is configured but unavailable (package missing, no API key) prints one info line and the run
continues: losing a dashboard must never lose a run.
"""
from __future__ import annotations

import errno
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.text import Text

from fleetrl.config.schema import TrackingConfig

log = logging.getLogger("fleetrl.tracking")
# The console line shows these, in this order, when present.
CONSOLE_KEYS = ("train/reward_mean", "val/reward_mean", "train/response_length_mean", "train/kl",
                "train/entropy", "train/actor/grad_norm", "train/time/step")


class Tracker:
    def __init__(self, out_dir: Path, cfg: TrackingConfig, run_config: dict[str, Any], name: str) -> None:
        self.out_dir = out_dir
        self.cfg = cfg
        self.console = Console(stderr=False, highlight=False)
        self.jsonl = open(out_dir / "metrics.jsonl", "ab", buffering=0)
        self._unwritten = b""  # records a full disk refused, written first once there is room again
        self.tb = self._tensorboard() if cfg.tensorboard else None
        self.wandb = self._wandb(run_config, name) if cfg.wandb_project else None
        self.mlflow = self._mlflow(run_config, name) if cfg.mlflow_uri else None
        self.progress: Progress | None = None
        self._task = None
        self.history: list[dict[str, Any]] = []

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
        record = {"step": step, **clean}
        self.history.append(record)
        self._append(json.dumps(record, allow_nan=True) + "\n")
        if self.tb:
            for k, v in clean.items():
                if math.isfinite(v):
                    self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wandb:
            self.wandb.log(clean, step=step)
        if self.mlflow:
            self.mlflow.log_metrics({k.replace("@", "_at_"): v for k, v in clean.items() if math.isfinite(v)},
                                    step=step)
        if self.cfg.console:
            self._print(step, clean)
        if self.progress is not None and self._task is not None and any(k.startswith("train/") for k in clean):
            self.progress.update(self._task, completed=step)

    def event(self, step: int, kind: str, **info: Any) -> None:
        """Run events (restart, skipped update, resume) go to metrics.jsonl with an `event` key."""
        record = {"step": step, "event": kind, **info}
        self._append(json.dumps(record, default=str) + "\n")
        self.say(f"step {step}: {kind} {info}", label=("event", "yellow"))

    def _append(self, line: str) -> None:
        """Appends one record to metrics.jsonl. A full disk must not end the run here: the checkpoint save that
        follows reports it (DiskFullError, one line, exit 2) and says the newest safe checkpoint. So the bytes it
        refuses wait, in order, and go first into the next write that finds room (a part-written record is
        finished then, never torn by a later one)."""
        backlog = bool(self._unwritten)
        self._unwritten += line.encode()
        try:
            while self._unwritten:
                self._unwritten = self._unwritten[self.jsonl.write(self._unwritten):]
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            if not backlog:  # the first refusal since the disk had room
                log.warning("metrics.jsonl: the disk is full (%s); records wait in memory until there is room", e)

    def say(self, text: str, label: tuple[str, str] | None = None) -> None:
        """Prints `text` literally: error text (Gloo's `[/path/pair.cc:553] ...`, paths, user strings) must
        never be parsed as rich markup, or printing the message of a failure raises a MarkupError of its own."""
        line = Text.assemble(label, " ", text) if label else Text(text)
        self.console.print(line, soft_wrap=True, highlight=False)

    def start_progress(self, total: int, done: int) -> None:
        if not self.cfg.progress or self.progress is not None:
            return
        self.progress = Progress(TextColumn("[bold]steps"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                                 TimeElapsedColumn(), TimeRemainingColumn(), console=self.console, transient=True)
        self._task = self.progress.add_task("train", total=total, completed=done)
        self.progress.start()

    def finish(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None

    def close(self) -> None:
        self.finish()
        if self._unwritten:
            self._append("")
        if self._unwritten:
            log.warning("metrics.jsonl: %d bytes of records were not written: the disk is still full",
                        len(self._unwritten))
        self.jsonl.close()
        if self.tb:
            self.tb.close()
        if self.wandb:
            self.wandb.finish()
        if self.mlflow:
            self.mlflow.end_run()

    def _print(self, step: int, m: dict[str, float]) -> None:
        parts = [f"{k.removeprefix('train/').removeprefix('actor/')}={m[k]:.4g}" for k in CONSOLE_KEYS if k in m]
        if not any(k.startswith("train/") for k in m):
            parts = [f"{k}={v:.4g}" for k, v in m.items() if "/" in k and k.count("/") == 1]
        self.say(" ".join(parts), label=(f"step {step:>4}", "bold cyan"))

    def _tensorboard(self):
        try:
            from torch.utils.tensorboard import SummaryWriter

            return SummaryWriter(log_dir=str(self.out_dir / "tensorboard"))
        except Exception as e:  # tensorboard missing or broken
            log.info("TensorBoard disabled: %s", e)
            return None

    def _wandb(self, run_config: dict, name: str):
        try:
            import wandb
        except ImportError:
            self.console.print("[dim]info: tracking.wandb_project is set but wandb is not installed; skipping W&B[/]")
            return None
        if not os.environ.get("WANDB_API_KEY") and os.environ.get("WANDB_MODE") != "offline":
            self.console.print("[dim]info: WANDB_API_KEY is not set; skipping W&B (set WANDB_MODE=offline to log "
                               "locally)[/]")
            return None
        return wandb.init(project=self.cfg.wandb_project, name=name, config=run_config, dir=str(self.out_dir))

    def _mlflow(self, run_config: dict, name: str):
        try:
            import mlflow
        except ImportError:
            self.console.print("[dim]info: tracking.mlflow_uri is set but mlflow is not installed; skipping MLflow[/]")
            return None
        mlflow.set_tracking_uri(self.cfg.mlflow_uri)
        mlflow.start_run(run_name=name)
        mlflow.log_params({k: str(v)[:250] for k, v in _flatten(run_config).items()})
        return mlflow


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out
