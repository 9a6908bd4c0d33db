"""End-to-end sweeps of the quickstart on this machine's CPU cores: 3 seeds x 2 estimators to a report (and its
screenshot in headless Chromium), Ctrl-C with nothing left behind and an exact resume, and a crashing run."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from fleetrl.trainer.metric_names import is_machine_metric

ROOT = Path(__file__).resolve().parents[2]
TINY = ["trainer.total_steps=5", "trainer.val_every=3", "trainer.save_every=2"]
CHROMIUM = "/usr/bin/chromium"

pytestmark = pytest.mark.slow


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "OMP_NUM_THREADS": "1"}


def _cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fleetrl.cli.main", *args], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=timeout, check=False)


def _last_learning_record(run_dir: Path) -> dict:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    last = [x for x in lines if "event" not in x][-1]
    return {k: v for k, v in last.items() if not is_machine_metric(k)}  # timings, memory: not the learning


@pytest.fixture(scope="module")
def six_runs(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """3 seeds x {grpo, rloo}, two at a time, one core each, workers in the driver (no Ray: this test is about
    the sweep, and a local Ray per run would triple its time on 2 cores)."""
    out = tmp_path_factory.mktemp("sweep") / "six"
    r = _cli("sweep", "examples/quickstart.yaml", "--seeds", "42,1337,7", "--grid", "algorithm.advantage=grpo,rloo",
             "--max-parallel", "2", "--cpus-per-run", "1", "--out", str(out), "--plain", *TINY, "cluster.backend=local")
    return out, r


def test_six_runs_finish_and_the_report_shows_plots(six_runs, tmp_path):
    out, r = six_runs
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    manifest = json.loads((out / "sweep.json").read_text())
    assert [x["state"] for x in manifest["runs"]] == ["finished"] * 6
    assert manifest["options"]["resources"] == {"gpus_per_run": 0, "cpus_per_run": 1, "max_parallel": 2}
    cfg = (out / "advantage=rloo,seed=1337" / "config.yaml").read_text()
    assert "seed: 1337" in cfg and "advantage: rloo" in cfg  # the run's own config records seed and grid value

    rep = _cli("report", str(out), "--compare", "advantage=rloo", "--compare", "advantage=grpo", timeout=120)
    assert rep.returncode == 0, rep.stdout + rep.stderr
    assert "advantage=rloo - advantage=grpo: final" in rep.stdout
    report = out / "report"
    pngs = {p.name for p in report.glob("*.png")}
    assert {"val_reward_mean.png", "train_reward_mean.png", "train_entropy.png", "train_actor_grad_norm.png",
            "train_response_length_mean.png", "train_tokens_per_s.png", "train_time_generate.png"} <= pngs
    html = (report / "report.html").read_text()
    assert html.count("data:image/png;base64,") == len(pngs) and "(n=3)" in html
    _screenshot_shows_plots(report / "report.html", tmp_path)


def _screenshot_shows_plots(html: Path, tmp: Path) -> None:
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} not installed (apt-get install -y chromium) — the screenshot check needs it")
    from PIL import Image

    shot = tmp / "shot.png"
    subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={tmp / 'chromium'}", f"--screenshot={shot}", "--window-size=1200,1600",
                    html.as_uri()], capture_output=True, timeout=120, check=True)
    img = Image.open(shot).convert("RGB")
    assert img.size == (1200, 1600)
    # The curves sit below the tables (y > 500). Lines and CI bands are blue/orange; text, borders and the
    # pale table/warning backgrounds are grey or nearly so (max - min channel <= 25). A page whose images did
    # not render has ~0 coloured pixels there; the report of a 4-run sweep had 3.8 %.
    px = img.crop((0, 500, 1200, 1600)).tobytes()
    colored = sum(1 for i in range(0, len(px), 3) if max(px[i:i + 3]) - min(px[i:i + 3]) > 25)
    assert colored / (1200 * 1100) > 0.01, f"only {colored} coloured pixels in the plot area: plots not rendered?"


def _tree(pid: int) -> list[psutil.Process]:
    procs = psutil.Process(pid).children(recursive=True)
    sessions = {os.getsid(p.pid) for p in procs} - {os.getsid(0)}
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) in sessions and p not in procs:
                procs.append(p)
        except (psutil.Error, ProcessLookupError):
            pass
    return procs


def _alive(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid} {p.name()}")
        except psutil.Error:
            pass
    return out


def test_ctrl_c_leaves_no_process_and_resume_matches_an_uninterrupted_run(six_runs, tmp_path):
    """With a real local Ray per run: SIGINT once the run is past its step-2 checkpoint, every process of the
    tree (driver, GCS, raylet, workers) gone within 30 s; --resume ends with the same metrics as the run of
    the uninterrupted sweep above (CPU, same seed and estimator)."""
    out = tmp_path / "sw"
    cmd = [sys.executable, "-m", "fleetrl.cli.main", "sweep", "examples/quickstart.yaml", "--seeds", "42", "--grid",
           "algorithm.advantage=grpo", "--cpus-per-run", "1", "--out", str(out), "--plain", *TINY]
    sweep = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = out / "advantage=grpo,seed=42" / "metrics.jsonl"
    deadline, seen = time.monotonic() + 180, []
    while time.monotonic() < deadline and sweep.poll() is None:
        steps = [json.loads(x).get("step", -1) for x in (metrics.read_text().splitlines() if metrics.exists() else [])
                 if x.endswith("}")]
        seen = _tree(sweep.pid) if steps and max(steps) >= 3 else seen
        if seen and max(steps) < 5:
            break
        time.sleep(0.2)
    assert sweep.poll() is None and seen, "the run never reached step 3 while running: " + (sweep.stdout.read()
                                                                                          if sweep.poll() else "")
    assert {"raylet", "gcs_server"} & {p.name() for p in seen}, "expected the run's own Ray in the tree"
    t0 = time.monotonic()
    sweep.send_signal(signal.SIGINT)
    sweep.wait(timeout=30)
    while _alive(seen) and time.monotonic() - t0 < 30:
        time.sleep(0.2)
    assert not _alive(seen), f"still alive {time.monotonic() - t0:.1f} s after Ctrl-C: {_alive(seen)}"
    assert sweep.returncode == 130
    assert json.loads((out / "sweep.json").read_text())["runs"][0]["state"] == "stopped"

    r = _cli("sweep", "--resume", str(out), "--plain")
    assert r.returncode == 0, r.stdout[-3000:]
    assert '"event": "resumed"' in metrics.read_text()
    resumed = _last_learning_record(out / "advantage=grpo,seed=42")
    straight = _last_learning_record(six_runs[0] / "advantage=grpo,seed=42")
    assert resumed["step"] == 5 and resumed == straight


def test_a_crashing_run_is_reported_with_its_log_tail_and_the_others_finish(tmp_path):
    out = tmp_path / "crash"
    r = _cli("sweep", "examples/quickstart.yaml", "--seeds", "42", "--grid",
             "rewards.default=exact_match,/nonexistent.py:fn", "--max-parallel", "2", "--cpus-per-run", "1",
             "--retries", "1", "--out", str(out), "--plain", *TINY, "cluster.backend=local")
    assert r.returncode == 1, r.stdout[-3000:]
    runs = {x["name"]: x for x in json.loads((out / "sweep.json").read_text())["runs"]}
    bad, good = runs["default=_nonexistent.py_fn,seed=42"], runs["default=exact_match,seed=42"]
    assert good["state"] == "finished"
    assert bad["state"] == "failed" and bad["attempts"] == bad["failures"] == 2  # the first try and one retry
    assert bad["error"].startswith("exited with code 2")
    assert "file /nonexistent.py does not exist" in bad["error"]  # the log tail, in the manifest...
    assert "file /nonexistent.py does not exist" in r.stdout      # ...and on the console
    rep = _cli("report", str(out), timeout=120)
    assert rep.returncode == 0, rep.stdout + rep.stderr
    assert "failed: default=_nonexistent.py_fn,seed=42" in (out / "report" / "report.html").read_text()
    shutil.rmtree(out, ignore_errors=True)


def test_a_stalled_run_is_ended_and_reported(tmp_path):
    """A reward function that never returns (timeout far away) freezes the run before its first metrics line;
    the sweep calls it stalled after --stall-s, ends its whole tree and reports it."""
    hang = tmp_path / "hang.py"
    hang.write_text("import time\n\ndef fn(response, ground_truth, extra_info=None):\n    time.sleep(3600)\n")
    out = tmp_path / "stall"
    t0 = time.monotonic()
    r = _cli("sweep", "examples/quickstart.yaml", "--seeds", "42", "--cpus-per-run", "1", "--stall-s", "10",
             "--grace-s", "2", "--out", str(out), "--plain", *TINY, "cluster.backend=local",
             f"rewards.sources.synthetic/copy={hang}:fn", "rewards.timeout_s=3600")
    took = time.monotonic() - t0
    run = json.loads((out / "sweep.json").read_text())["runs"][0]
    assert r.returncode == 1 and run["state"] == "failed", r.stdout[-3000:]
    assert run["error"].startswith("stalled: no new line in metrics.jsonl for 1")  # 10..19 s
    assert "stalled" in r.stdout and took < 90
