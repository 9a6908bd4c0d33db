"""Run a config to completion in-process and read its metrics back."""
from __future__ import annotations

import json
from pathlib import Path

from fleetrl.config import load_config
from fleetrl.trainer.run import plan_for, run_plan


def train_run(config: str | None, out: Path, *overrides: str) -> list[dict]:
    plan = plan_for(load_config(config, [*overrides, "tracking.progress=false", "tracking.console=false",
                                            f"trainer.output_dir={out}"]))
    run_plan(plan, out)
    return read_metrics(out)


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def val_curve(records: list[dict]) -> list[float]:
    return [r["val/reward_mean"] for r in records if "val/reward_mean" in r]
