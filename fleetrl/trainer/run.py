"""`fleetrl train`: config -> plan -> run directory -> Trainer.fit, with Ray cleaned up afterwards."""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from rich.text import Text

from fleetrl.config import Plan, derive_plan, load_config, redacted_dict, write_config
from fleetrl.config.schema import RunConfig
from fleetrl.envs.check import check_env_config
from fleetrl.tracking.tracker import Tracker
from fleetrl.trainer.rundir import check_reuse, claim_run_dir
from fleetrl.trainer.signals import Interrupted, StopSignal

if TYPE_CHECKING:
    from fleetrl.trainer.inputs import RunInputs

log = logging.getLogger("fleetrl")


def train(config_path: str | None, overrides: list[str]) -> dict[str, float]:
    return run_plan(plan_for(load_config(config_path, overrides)))


def check_models(cfg: RunConfig) -> None:
    """Every model and tokenizer name the run loads, checked under its config key (ModelPathError names it):
    nothing is loaded, a hub id not cached and not downloadable fails in seconds instead of after retries."""
    from fleetrl.models.hf import check_model_name

    m, rm = cfg.model, cfg.rewards.model
    names = {"model.path": m.path, "model.tokenizer": m.tokenizer}
    if rm is not None:
        names |= {"rewards.model.path": rm.path, "rewards.model.tokenizer": rm.tokenizer}
    for key, name in names.items():
        if name:
            check_model_name(name, key)


def plan_for(cfg: RunConfig) -> Plan:
    """The Plan of `cfg`, its environment checked; in epoch mode (trainer.total_steps: null) the training set is
    read to size the run."""
    if cfg.trainer.total_steps is not None:
        plan = derive_plan(cfg)
    else:
        from fleetrl.trainer.feed import count_train_prompts  # tokenizes, so imports transformers: only when needed

        plan = derive_plan(cfg, train_prompts=count_train_prompts(cfg))
    check_env_config(cfg.rollout.env)
    return plan


def run_plan(plan: Plan, out_dir: Path | None = None) -> dict[str, float]:
    """Checks the models, finds the checkpoint to resume (and whether the directory may take this run), reads the
    data and checks rewards BEFORE creating the run directory or starting Ray (a bad file fails in seconds and
    leaves nothing behind), then claims the directory, starts Ray and runs under the supervisor. A start that fails
    before any metric or checkpoint removes the directory it created."""
    # Heavy imports (torch, transformers, Ray) only after the config was validated: a bad flag fails in ~1 s.
    from fleetrl.trainer.inputs import RunInputs  # the tokenizer, so transformers (~4 s of a bad flag's ~7 s)

    cfg = plan.config
    if out_dir is not None:
        cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, output_dir=str(out_dir)))
    check_models(cfg)
    # A broken checkpoint, or a directory this run must not be mixed into, fails here in about a second, before the
    # data is read: no directory yet, no Ray (the Trainer loads the checkpoint; claim_run_dir checks again, locked).
    start = _resume_point(cfg)
    if cfg.trainer.output_dir and Path(cfg.trainer.output_dir).is_dir():
        check_reuse(Path(cfg.trainer.output_dir), cfg, start)
    inputs = RunInputs.load(plan)
    try:
        run_dir = claim_run_dir(cfg, start)
    except BaseException:
        inputs.scorer.close()
        raise
    failed = True
    try:
        last = _run_in(plan, cfg, run_dir.path, inputs, start)
        failed = False
        return last
    finally:
        run_dir.release(failed=failed)


def _resume_point(cfg: RunConfig) -> Path | None:
    from fleetrl.checkpoint.manager import find_resume

    t = cfg.trainer
    return find_resume(Path(t.output_dir) if t.output_dir else None, t.resume)


def _run_in(plan: Plan, cfg: RunConfig, out: Path, inputs: RunInputs, start: Path | None) -> dict[str, float]:
    from fleetrl.cluster.runtime import ensure_ray
    from fleetrl.trainer.supervisor import Supervisor

    if start is None:  # a resumed run's config.yaml is replaced once its checkpoint has loaded (Trainer.maybe_resume)
        write_config(out / "config.yaml", cfg)  # secrets redacted, mode 0600
    tracker = Tracker(out, cfg.tracking, redacted_dict(cfg), cfg.trainer.name)
    tracker.console.print(Text(f"fleetrl run directory: {out}"), soft_wrap=True)
    notice = _nothing_to_resume(cfg, out, start)
    if notice:
        tracker.say(notice, label=("notice", "yellow"))
    started = False
    try:
        started = ensure_ray(cfg.cluster)
        with StopSignal() as stop:
            last = Supervisor(plan, tracker, out, stop=stop, inputs=inputs).run()
        tracker.event(plan.total_steps, "finished")  # tells a complete run from one cut short (report, sweep)
        _summary(tracker, out)
        return last
    except Interrupted as e:
        how = (f"continue with: fleetrl train <config> ... trainer.output_dir={out} trainer.resume=auto"
               if e.checkpoint_step is not None else "no checkpoint to continue from (trainer.save_last=false); "
               "a new run needs a new trainer.output_dir")
        tracker.console.print(Text(f"{e}; {how}"), soft_wrap=True)
        raise
    finally:
        tracker.close()
        if started:
            import ray

            ray.shutdown()


def _nothing_to_resume(cfg: RunConfig, out: Path, start: Path | None) -> str | None:
    """One line when trainer.resume=auto found no checkpoint: without it `auto` looks like it worked. (A directory
    whose metrics.jsonl has records got here only after a restart event: check_reuse refuses it otherwise.)"""
    if cfg.trainer.resume != "auto" or start is not None:
        return None
    if not cfg.trainer.output_dir:  # a fresh timestamped directory never holds a checkpoint
        return (f"trainer.resume=auto found nothing to resume: trainer.output_dir is unset, so this run got the new "
                f"directory {out}; to resume a run, set trainer.output_dir to its directory (e.g. "
                f"trainer.output_dir={out} trainer.resume=auto)")
    metrics = out / "metrics.jsonl"
    again = metrics.is_file() and metrics.stat().st_size > 0
    return (f"trainer.resume=auto found no checkpoint in {out}: "
            + ("starting again at step 0 after the restart event in its metrics.jsonl" if again
               else "starting a new run at step 0"))


def _summary(tracker: Tracker, out: Path) -> None:
    vals = [(r["step"], r["val/reward_mean"]) for r in tracker.history if "val/reward_mean" in r]
    if vals:
        (s0, v0), (s1, v1) = vals[0], vals[-1]
        tracker.console.print(Text(f"validation reward: {v0:.3f} (step {s0}) -> {v1:.3f} (step {s1})"))
    tracker.console.print(Text(f"metrics: {out / 'metrics.jsonl'}   tensorboard: {out / 'tensorboard'}"), soft_wrap=True)
