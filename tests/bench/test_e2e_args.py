"""bench/e2e.py refuses a profiled step inside its timed window before it starts a run (a profiled step's
overhead would have counted in the figures; it happened once, bench/RESULTS.md ninth round)."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_profiled_step_inside_the_timed_window_is_refused_with_the_fix(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "e2e.py"), "--steps", "8", "--warmup", "3",
                          "--profile-step", "6", "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2
    assert "--profile-step 6 falls in the timed steps (--warmup 3)" in out.stderr
    assert "profile a warm-up step (1..3)" in out.stderr
    assert not (tmp_path / "out").exists()  # refused before anything was made


def test_a_steps_memory_peak_is_the_larger_of_its_two_phases():
    from bench.common import step_peak

    assert step_peak({"train/memory/gpu_peak_allocated_gib": 20.0, "train/memory/generate/gpu_peak_allocated_gib": 75.5}) == 75.5
    assert step_peak({"train/memory/gpu_peak_allocated_gib": 20.0}) == 20.0
    assert step_peak({"train/memory/generate/rss_peak_gib": 2.0}, "rss_peak_gib") == 2.0
    assert step_peak({"train/reward_mean": 0.5}) is None


def test_each_phase_peak_is_its_largest_over_steps():
    from bench.e2e import peak_by_phase

    steps = [{"train/memory/gpu_peak_allocated_gib": 59.9, "train/memory/generate/gpu_peak_allocated_gib": 84.0},
             {"train/memory/gpu_peak_allocated_gib": 60.3, "train/memory/generate/gpu_peak_allocated_gib": 83.5},
             {"train/reward_mean": 0.5}]
    assert peak_by_phase(steps) == {"generate": 84.0, "update": 60.3}
    assert peak_by_phase([{"train/memory/gpu_peak_allocated_gib": 3.0}]) == {"update": 3.0}
