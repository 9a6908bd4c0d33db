"""`fleetrl train`: config -> plan -> run directory -> Trainer.fit, with Ray cleaned up afterwards."""
from __future__ import annotations

import logging
import time
from pathlib import Path

from fleetrl.config import Plan, derive_plan, dump_yaml, load_config, to_dict
from fleetrl.config.schema import RunConfig
from fleetrl.tracking.tracker import Tracker

log = logging.getLogger("fleetrl")


def output_dir(cfg: RunConfig) -> Path:
    if cfg.trainer.output_dir:
        return Path(cfg.trainer.output_dir)
    return Path("runs") / f"{cfg.trainer.name}-{time.strftime('%Y%m%d-%H%M%S')}"


def train(config_path: str | None, overrides: list[str]) -> dict[str, float]:
    plan = derive_plan(load_config(config_path, overrides))
    return run_plan(plan)


def run_plan(plan: Plan, out_dir: Path | None = None) -> dict[str, float]:
    from fleetrl.cluster.runtime import ensure_ray
    from fleetrl.trainer.supervisor import Supervisor

    cfg = plan.config
    out = out_dir or output_dir(cfg)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(dump_yaml(cfg))
    tracker = Tracker(out, cfg.tracking, to_dict(cfg), cfg.trainer.name)
    tracker.console.print(f"[bold]fleetrl[/] run directory: {out}")
    started = ensure_ray(cfg.cluster)
    try:
        return Supervisor(plan, tracker, out).run()
    finally:
        tracker.close()
        if started:
            import ray

            ray.shutdown()
