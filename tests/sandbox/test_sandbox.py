"""Sandbox limits, each hit on purpose with tight limits and reported with its reason (tests/envs/test_tools.py:
the `python` tool turns each into a tool error).

The fork-bomb tests run under a pids cgroup of 8 processes (or RLIMIT_NPROC as non-root) and a 2 s wall-time
kill of the whole PID namespace, so they cannot take the shared machine down.
"""
import os
import time

import pytest

from fleetrl.sandbox import SandboxLimits, run_python
from fleetrl.sandbox import runner as sandbox

TIGHT = SandboxLimits(cpu_s=1, wall_s=20, memory_mb=128, max_procs=8, max_output_bytes=256)


def boot_processes() -> list[int]:
    """PIDs running this worktree's sandbox bootstrap (other checkouts have a different path)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if sandbox._BOOT.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def test_success_stdin_and_truncation():
    assert run_python("print(input()[::-1])", TIGHT, stdin="abc\n").stdout == "cba\n"
    result = run_python("print('x' * 1000)", TIGHT)
    assert result.ok and result.truncated and result.stdout == "x" * 256


def test_infinite_loop_killed_at_cpu_limit():
    result = run_python("while True:\n    pass", TIGHT)
    assert result.reason == sandbox.REASON_CPU
    assert 0.9 <= result.cpu_s < 2.5  # SIGXCPU at 1 s of CPU, SIGKILL at 2 s at the latest
    assert result.wall_s < 15  # far below the 20 s wall limit, even on a loaded machine


def test_sleep_killed_at_wall_limit():
    result = run_python("import time\ntime.sleep(60)", SandboxLimits(cpu_s=1, wall_s=1.0, memory_mb=128, max_procs=8))
    assert result.reason == sandbox.REASON_WALL and result.exit_code is None
    assert 1.0 <= result.wall_s < 3.0


def test_memory_bomb_killed_at_memory_limit():
    result = run_python("x = bytearray(512 * 2**20)\nprint('allocated')", TIGHT)  # 512 MiB > the 128 MiB limit
    assert result.reason == sandbox.REASON_MEMORY and "allocated" not in result.stdout
    assert result.stderr.strip().splitlines()[-1].startswith("MemoryError")


def test_socket_connect_fails():
    result = run_python("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=2)", TIGHT)
    assert result.reason == sandbox.REASON_DENIED and "socket.connect" in result.stderr


@pytest.mark.skipif(not sandbox._unshare_works(), reason="needs `unshare --net --pid` (util-linux, root)")
def test_network_namespace_has_only_loopback():
    # The kernel layer on its own, below the audit hook: the namespace has no interface but lo.
    result = run_python("print(open('/proc/net/dev').read())", TIGHT)
    interfaces = [line.split(":")[0].strip() for line in result.stdout.splitlines()[2:] if ":" in line]
    assert result.ok and interfaces == ["lo"]


def test_write_outside_temp_dir_fails_and_inside_works(tmp_path):
    target = tmp_path / "escape.txt"
    result = run_python(f"open({str(target)!r}, 'w').write('x')", TIGHT)
    assert result.reason == sandbox.REASON_DENIED and not target.exists()
    renamed = run_python(f"import os\nopen('a', 'w').write('x')\nos.rename('a', {str(target)!r})", TIGHT)
    assert renamed.reason == sandbox.REASON_DENIED and not target.exists()
    inside = run_python("open('a.txt', 'w').write('hi')\nprint(open('a.txt').read())", TIGHT)
    assert inside.ok and inside.stdout == "hi\n"


def test_fork_bomb_is_contained():
    before = boot_processes()
    result = run_python("import os\nwhile True:\n    os.fork()", SandboxLimits(cpu_s=1, wall_s=2, memory_mb=128,
                                                                                  max_procs=8))
    assert result.reason == sandbox.REASON_PROCS
    assert boot_processes() == before  # nothing left behind
    assert run_python("print(1)", TIGHT).stdout == "1\n"  # and the next run works


@pytest.mark.skipif(os.getuid() != 0 and not sandbox._unshare_works(), reason="needs the cgroup or NPROC layer")
def test_fork_count_is_capped_and_sleepers_are_killed():
    # pids.max = 8 counts the supervisor and the worker, so 8 - 2 = 6 forks succeed; the children sleep
    # for a minute and must all be gone once the 2 s wall limit kills the run.
    code = ("import os, time\nn = 0\nfor _ in range(50):\n    try:\n        pid = os.fork()\n    except OSError:\n"
            "        continue\n    if pid == 0:\n        time.sleep(60)\n        os._exit(0)\n    n += 1\n"
            "print(n, flush=True)\ntime.sleep(60)")
    before = boot_processes()
    result = run_python(code, SandboxLimits(cpu_s=1, wall_s=2, memory_mb=128, max_procs=8))
    assert result.reason == sandbox.REASON_WALL
    assert result.stdout == "6\n"
    # Other tests may run sandboxes at the same time (pytest -n): theirs end within seconds, while a leaked
    # sleeper of this run would live 60 s. So wait up to 15 s for every process that is not from before to go.
    deadline = time.monotonic() + 15
    while not set(boot_processes()) <= set(before) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert set(boot_processes()) <= set(before)


def test_without_a_process_cap_fork_is_refused(monkeypatch):
    # As root without a writable pids cgroup nothing in the kernel caps processes: the hook refuses fork.
    monkeypatch.setattr(sandbox, "_make_cgroup", lambda max_procs: None)
    monkeypatch.setattr(os, "getuid", lambda: 0)
    result = run_python("import os\nos.fork()", TIGHT)
    assert result.reason == sandbox.REASON_DENIED and "no_fork" in result.layers
    assert "os.fork is not allowed" in result.stderr
