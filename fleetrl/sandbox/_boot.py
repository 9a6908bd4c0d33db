"""Bootstrap of one sandboxed run; executed as `python -I _boot.py SPEC_JSON` by fleetrl.sandbox.runner.

It must not import fleetrl (the interpreter runs isolated, `-I`). Two processes:
  supervisor  joins the pids cgroup (if one was made), forks the worker, waits for it, writes its exit status
              and CPU time to `status_path`. Under `unshare --pid --fork` it is PID 1 of a fresh PID namespace,
              so when it exits the kernel kills every process the worker left behind (a fork bomb's survivors
              included). The worker is not PID 1 on purpose: the kernel drops default-action signals such as
              SIGXCPU sent to a namespace init, which would disable the CPU limit.
  worker      sets the rlimits, moves into the temp dir, installs the audit hook, then runs the user code.
"""
import json
import os
import resource
import sys

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
# A new executable would start without the audit hook, and ctypes/_posixsubprocess reach C directly.
_DENIED_EVENTS = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork_exec",
                  "ctypes.", "socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg", "os.chroot",
                  "os.setuid", "os.kill", "os.killpg")
_DENIED_IMPORTS = ("_posixsubprocess", "_ctypes", "ctypes")
_PATH_EVENTS = ("os.rename", "os.remove", "os.rmdir", "os.mkdir", "os.symlink", "os.link", "os.chmod", "os.chown",
                "os.truncate", "os.utime", "shutil.rmtree", "shutil.move", "shutil.copyfile", "os.chdir")


def _inside(path, root):
    if isinstance(path, int):
        return True  # an already-open descriptor: its opening was checked
    real = os.path.realpath(os.fsdecode(path))
    return real == root or real.startswith(root + os.sep)


def _make_hook(root, deny_fork):
    def hook(event, args):
        if event.startswith(_DENIED_EVENTS) or (deny_fork and event in ("os.fork", "os.forkpty")):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import" and args[0] in _DENIED_IMPORTS:
            raise PermissionError(f"sandbox: importing {args[0]} is not allowed")
        if event == "open":
            path, mode, flags = args
            writing = (mode is not None and any(c in mode for c in "wax+")) or (flags or 0) & _WRITE_FLAGS
            if writing and path is not None and not _inside(path, root):
                raise PermissionError(f"sandbox: writing {path!r} is not allowed outside the sandbox directory")
        elif event in _PATH_EVENTS:
            for path in args[:2]:
                if isinstance(path, (str, bytes, os.PathLike)) and not _inside(path, root):
                    raise PermissionError(f"sandbox: {event} on {path!r} is not allowed outside the sandbox "
                                          "directory")
    return hook


def _worker(spec):
    cpu = int(spec["cpu_s"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at cpu, SIGKILL one second later
    memory = spec["memory_mb"] * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    fsize = spec["max_file_bytes"]
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if spec["set_nproc"]:  # decided by the parent: inside a user namespace getuid() is 0 even for a plain user
        resource.setrlimit(resource.RLIMIT_NPROC, (spec["max_procs"], spec["max_procs"]))
    root = os.path.realpath(spec["workdir"])
    os.chdir(root)
    os.environ.clear()
    os.environ.update({"HOME": root, "TMPDIR": root, "PATH": "/usr/bin:/bin"})
    with open(spec["code_path"]) as f:
        code = compile(f.read(), "<sandbox>", "exec")
    sys.argv = ["<sandbox>"]
    sys.path = [p for p in sys.path if p]  # no cwd entry
    sys.addaudithook(_make_hook(root, spec["deny_fork"]))
    exec(code, {"__name__": "__main__", "__builtins__": __builtins__})  # noqa: S102 — running it is the point


def main():
    spec = json.loads(sys.argv[1])
    if spec["cgroup_procs"]:
        with open(spec["cgroup_procs"], "w") as f:
            f.write(str(os.getpid()))
    # Opened before the audit hook exists: the worker names its fatal exception here, so the parent can tell
    # a MemoryError or a refused operation apart from other errors even when stderr is cut.
    report = os.open(spec["status_path"] + ".exc", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    pid = os.fork()
    if pid == 0:
        try:
            _worker(spec)
        except SystemExit as exc:
            code = exc.code
            sys.stdout.flush()
            os._exit(code if isinstance(code, int) else (0 if code is None else 1))
        except BaseException as exc:  # noqa: BLE001 — report any failure of user code as its traceback
            import traceback

            os.write(report, json.dumps({"type": type(exc).__name__, "message": str(exc)[:200]}).encode())
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    _, status, usage = os.wait4(pid, 0)
    with open(spec["status_path"], "w") as f:
        json.dump({"exit_code": os.waitstatus_to_exitcode(status), "cpu_s": usage.ru_utime + usage.ru_stime}, f)


if __name__ == "__main__":
    main()
