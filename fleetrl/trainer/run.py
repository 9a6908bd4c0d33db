"""`fleetrl train`: config -> plan -> run directory -> Trainer.fit, with Ray cleaned up afterwards."""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from rich.text import Text

from fleetrl.config import Plan, derive_plan, load_config, redacted_dict, write_config
from fleetrl.config.schema import RunConfig
from fleetrl.tracking.tracker import Tracker
from fleetrl.trainer.rundir import claim_run_dir
from fleetrl.trainer.signals import Interrupted, StopSignal

log = logging.getLogger("fleetrl")


def train(config_path: str | None, overrides: list[str]) -> dict[str, float]:
    return run_plan(plan_for(load_config(config_path, overrides)))


def plan_for(cfg: RunConfig) -> Plan:
    """The Plan of `cfg`; in epoch mode (trainer.total_steps: null) the training set is read to size the run."""
    if cfg.trainer.total_steps is not None:
        return derive_plan(cfg)
    from fleetrl.trainer.feed import count_train_prompts  # tokenizes, so imports transformers: only when needed

    return derive_plan(cfg, train_prompts=count_train_prompts(cfg))


def run_plan(plan: Plan, out_dir: Path | None = None) -> dict[str, float]:
    """Reads the data and checks rewards BEFORE creating the run directory or starting Ray (a bad file fails in
    seconds and leaves nothing behind), then claims the directory, starts Ray and runs under the supervisor."""
    # Heavy imports (torch, transformers, Ray) only after the config was validated: a bad flag fails in ~1 s.
    from fleetrl.checkpoint.manager import find_resume
    from fleetrl.cluster.runtime import ensure_ray
    from fleetrl.trainer.inputs import RunInputs  # the tokenizer, so transformers (~4 s of a bad flag's ~7 s)
    from fleetrl.trainer.supervisor import Supervisor

    cfg = plan.config
    if out_dir is not None:
        cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, output_dir=str(out_dir)))
    inputs = RunInputs.load(plan)
    try:
        out, lock = claim_run_dir(cfg)
    except BaseException:
        inputs.scorer.close()
        raise
    if cfg.trainer.resume != "never":
        find_resume(out, cfg.trainer.resume)  # a broken checkpoint fails here, before config.yaml is rewritten
    write_config(out / "config.yaml", cfg)  # secrets redacted, mode 0600
    tracker = Tracker(out, cfg.tracking, redacted_dict(cfg), cfg.trainer.name)
    tracker.console.print(Text(f"fleetrl run directory: {out}"), soft_wrap=True)
    started = ensure_ray(cfg.cluster)
    try:
        with StopSignal() as stop:
            last = Supervisor(plan, tracker, out, stop=stop, inputs=inputs).run()
        tracker.event(plan.total_steps, "finished")  # tells a complete run from one cut short (report, sweep)
        _summary(tracker, out)
        return last
    except Interrupted as e:
        tracker.console.print(Text(f"{e}; continue with: fleetrl train <config> ... trainer.output_dir={out} "
                                   f"trainer.resume=auto"), soft_wrap=True)
        raise
    finally:
        tracker.close()
        lock.close()
        if started:
            import ray

            ray.shutdown()


def _summary(tracker: Tracker, out: Path) -> None:
    vals = [(r["step"], r["val/reward_mean"]) for r in tracker.history if "val/reward_mean" in r]
    if vals:
        (s0, v0), (s1, v1) = vals[0], vals[-1]
        tracker.console.print(Text(f"validation reward: {v0:.3f} (step {s0}) -> {v1:.3f} (step {s1})"))
    tracker.console.print(Text(f"metrics: {out / 'metrics.jsonl'}   tensorboard: {out / 'tensorboard'}"), soft_wrap=True)
