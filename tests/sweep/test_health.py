import json

from fleetrl.sweep.health import Heartbeat


def _write(path, *records, tail=""):
    with open(path, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
        f.write(tail)


def test_reads_only_new_complete_lines(tmp_path):
    m = tmp_path / "metrics.jsonl"
    beat = Heartbeat(m, total_steps=10)
    assert beat.poll() is False  # no file yet
    _write(m, {"step": 0, "val/reward_mean": 0.25},
           {"step": 1, "train/reward_mean": 0.5, "train/time/step": 2.0}, tail='{"step": 2, "train/rew')
    assert beat.poll() is True
    assert (beat.step, beat.reward, beat.val_reward) == (1, 0.5, 0.25)
    assert beat.poll() is False  # the torn line has no newline yet: not a heartbeat
    with open(m, "a") as f:
        f.write('ard_mean": 0.75, "train/time/step": 4.0}\n')
    assert beat.poll() is True and beat.step == 2 and beat.reward == 0.75
    # s/step = mean(2.0, 4.0) = 3.0; ETA = (10 - 2) * 3.0 = 24 s
    assert beat.s_per_step == 3.0 and beat.eta_s == 24.0


def test_events_and_garbage_do_not_move_the_step(tmp_path):
    m = tmp_path / "metrics.jsonl"
    _write(m, {"step": 4, "train/reward_mean": 0.1}, {"step": 2, "event": "resumed"}, tail="not json\n")
    beat = Heartbeat(m, total_steps=None)
    assert beat.poll() is True
    assert beat.step == 4 and beat.eta_s is None


def test_s_per_step_switches_to_wall_clock_once_steps_are_seen_over_time(tmp_path):
    m = tmp_path / "metrics.jsonl"
    now = [100.0]
    beat = Heartbeat(m, total_steps=20, clock=lambda: now[0])
    _write(m, {"step": 1, "train/time/step": 0.5})
    beat.poll()
    assert beat.s_per_step == 0.5  # one observation: the trainer's own step time
    now[0] = 112.0  # 12 s later the run is at step 5 (validation and a checkpoint happened in between)
    _write(m, {"step": 5, "train/time/step": 0.5})
    beat.poll()
    # (112 - 100) s / (5 - 1) steps = 3 s/step; ETA = (20 - 5) * 3 = 45 s
    assert beat.s_per_step == 3.0 and beat.eta_s == 45.0
    now[0] = 130.0
    assert beat.silent_for() == 18.0
