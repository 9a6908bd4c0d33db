import signal
import sys
import time

import psutil
import pytest

from fleetrl.sweep.process import RunProcess, end_orphan, log_tail, stop_all

# A leader that ignores SIGTERM with two children; the second child leaves the run's session (setsid), the
# way a daemon-style helper can, so only the remembered tree finds it.
_TREE = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
subprocess.Popen([sys.executable, "-c", "import os, time; time.sleep(1.0); os.setsid(); time.sleep(300)"])
print("started", flush=True)
time.sleep(300)
"""


@pytest.mark.slow  # waits out the SIGTERM grace of a process tree
def test_stop_all_ends_a_tree_that_ignores_sigterm_and_escapes_its_session(tmp_path):
    run = RunProcess.start([sys.executable, "-c", _TREE], env={"PATH": "/usr/bin:/bin"}, log_path=tmp_path / "log")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and len(run.known) < 2:
        run.snapshot()
        time.sleep(0.1)
    time.sleep(1.5)  # the second child has left the session by now
    run.snapshot()
    members = [psutil.Process(p) for p in run.known] + [psutil.Process(run.pid)]
    assert len(members) == 3
    t0 = time.monotonic()
    left = stop_all([run], grace_s=1.0)
    took = time.monotonic() - t0
    assert left == []
    assert not [p for p in members if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    # SIGTERM is ignored by the leader, so the end comes from SIGKILL right after the 1 s grace.
    assert 1.0 <= took < 10.0
    assert run.poll() == -signal.SIGKILL


def test_log_tail_returns_the_last_lines(tmp_path):
    log = tmp_path / "train.log"
    log.write_text("".join(f"line {i}\n" for i in range(100)))
    assert log_tail(log, lines=3) == "line 97\nline 98\nline 99"
    assert log_tail(tmp_path / "missing.log").startswith("(no log:")


def test_end_orphan_ends_a_leftover_run_and_ignores_a_reused_pid(tmp_path):
    run = RunProcess.start([sys.executable, "-c", "import time; time.sleep(300)"], env={}, log_path=tmp_path / "l")
    created = psutil.Process(run.pid).create_time()
    assert end_orphan(run.pid, created + 5.0, grace_s=1.0) is False  # another process's start time: untouched
    assert run.poll() is None
    assert end_orphan(run.pid, created, grace_s=1.0) is True
    run.reap()
    assert run.poll() == -signal.SIGTERM
    assert end_orphan(run.pid, created, grace_s=1.0) is False  # gone: nothing to end


def test_hurry_cuts_the_grace_short(tmp_path):
    ignore_term = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('re' + 'ady', flush=True); time.sleep(300)"
    run = RunProcess.start([sys.executable, "-c", ignore_term], env={}, log_path=tmp_path / "l")
    while "ready" not in (tmp_path / "l").read_text():  # the log also holds the command, hence 're' + 'ady'
        time.sleep(0.05)
    t0 = time.monotonic()
    assert stop_all([run], grace_s=60.0, hurry=lambda: True) == []  # a second Ctrl-C: SIGKILL at once
    assert time.monotonic() - t0 < 10.0 and run.poll() == -signal.SIGKILL
