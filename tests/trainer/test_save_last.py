"""Which steps a run checkpoints (trainer.save_every, trainer.save_last), counted at save_checkpoint, in-process on
the local backend: the last step always (save_every=0 means only "no periodic saves"), a stop signal's step once,
nothing beyond save_every's with save_last=false."""
import signal

import pytest

from fleetrl.checkpoint import manager
from fleetrl.config import load_config
from fleetrl.trainer import run as run_mod
from fleetrl.trainer.run import plan_for, run_plan
from fleetrl.trainer.signals import Interrupted, StopSignal

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
TINY = ("model.path=tiny:", "cluster.backend=local", "data.prompts_per_step=2", "rollout.n=2",
        "algorithm.micro_batch_size=4", "trainer.val_every=0", "trainer.val_before_train=false",
        "tracking.progress=false", "tracking.console=false", "tracking.tensorboard=false", "trainer.keep_last=0")


@pytest.fixture
def saves(monkeypatch) -> list[int]:
    """The step of every save_checkpoint call, in order (the real save still runs)."""
    steps: list[int] = []
    real = manager.save_checkpoint

    def counted(out_dir, step, **kw):
        steps.append(step)
        return real(out_dir, step, **kw)
    monkeypatch.setattr(manager, "save_checkpoint", counted)
    return steps


def _run(tmp_path, *overrides: str) -> None:
    out = tmp_path / "run"
    run_plan(plan_for(load_config("examples/quickstart.yaml", [*TINY, *overrides, f"trainer.output_dir={out}"])))


@pytest.mark.parametrize("overrides, saved", [
    (("trainer.total_steps=2", "trainer.save_every=0"), [2]),           # the default: the last step only
    (("trainer.total_steps=3", "trainer.save_every=2"), [2, 3]),        # the multiple, then the last
    (("trainer.total_steps=2", "trainer.save_every=2"), [2]),           # last == a multiple: saved once
    (("trainer.total_steps=2", "trainer.save_every=0", "trainer.save_last=false"), []),
])
def test_saved_steps(tmp_path, saves, overrides, saved):
    _run(tmp_path, *overrides)
    assert saves == saved
    on_disk = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*"))
    assert on_disk == [f"step_{s}" for s in saved]


class _SignalledBeforeTheFirstStep(StopSignal):
    """As if Ctrl-C came during step 1: the loop stops after it (no handler is installed)."""

    def __enter__(self) -> "_SignalledBeforeTheFirstStep":
        self.signum = signal.SIGINT
        return self


@pytest.mark.parametrize("save_every, save_last, saved, checkpoint_step", [
    (0, "true", [1], 1),    # save_every=0: the stop still checkpoints its step
    (1, "true", [1], 1),    # the loop saved step 1 already: not saved a second time
    (0, "false", [], None),  # opted out: nothing to continue from
])
def test_a_stop_signal_checkpoints_its_step_once(tmp_path, saves, monkeypatch, capsys, save_every, save_last, saved,
                                                 checkpoint_step):
    monkeypatch.setattr(run_mod, "StopSignal", _SignalledBeforeTheFirstStep)
    with pytest.raises(Interrupted) as stopped:
        _run(tmp_path, "trainer.total_steps=3", f"trainer.save_every={save_every}", f"trainer.save_last={save_last}")
    assert (stopped.value.step, stopped.value.checkpoint_step, stopped.value.exit_code) == (1, checkpoint_step, 130)
    assert saves == saved
    said = capsys.readouterr().out
    if checkpoint_step is None:
        assert "no checkpoint to continue from (trainer.save_last=false)" in said
    else:
        assert f"trainer.output_dir={tmp_path / 'run'} trainer.resume=auto" in said


def test_a_stop_with_no_checkpoint_does_not_suggest_a_resume(tmp_path, monkeypatch, capsys):
    # trainer.resume=auto would find nothing here and start again at step 0: suggesting it would lose the step.
    monkeypatch.setattr(run_mod, "StopSignal", _SignalledBeforeTheFirstStep)
    with pytest.raises(Interrupted):
        _run(tmp_path, "trainer.total_steps=3", "trainer.save_every=2", "trainer.save_last=false")
    assert manager.find_resume(tmp_path / "run", "auto") is None
    said = capsys.readouterr().out
    assert ("stopped by SIGINT at step 1; last complete checkpoint: none; no checkpoint to continue from "
            "(trainer.save_last=false); a new run needs a new trainer.output_dir") in said
    assert "trainer.resume" not in said and "continue with" not in said
