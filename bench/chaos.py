"""Chaos soak (issue 41): one PPO run on two network-namespace hosts survives a seeded schedule of faults, and
its final weights are bit-identical to an uninterrupted run of the same seed.

    sudo python bench/chaos.py --faults 20 --seed 1 [--steps 200] [--kinds kill_worker,stop_worker,...]

Host A (a netns) holds the Ray head, the driver (`fleetrl train`), the actor and reference pool, and the reward
server (`fleetrl serve-reward` on A's loopback; the run scores through `rewards.remote_urls`). Host B (a second
netns, joined by a veth pair) holds the rollout and the critic. The run directory is a small tmpfs, so the disk
can be filled. First an uninterrupted reference run of the seed, then the chaos run: a controller tails
metrics.jsonl and, at each scheduled step (plus a random delay inside the step, so faults land in any phase),
injects one fault:

- kill_worker: SIGKILL one Ray worker process of the run (either host);
- stop_worker: SIGSTOP one (SIGCONT once the restart is logged, so that teardown can end it);
- freeze_host: SIGSTOP every process of host B; once the stall is logged the host is "rebooted" (its processes
  killed) and a replacement joins at the same address;
- cut_link: B's veth end goes down; once the stall is logged it comes back up (a replacement joins if Ray had
  declared B dead meanwhile);
- kill_driver: SIGKILL the driver's process group, then `fleetrl train ... trainer.resume=auto` again;
- reward_stop: SIGSTOP the reward server; SIGCONT once the run logs its restart (RewardServerLostError);
- disk_full: fill the run's tmpfs to ~1 MiB free; the next save fails (DiskFullError, exit 2); free it, resume;
- corrupt_ckpt: flip one byte of the newest checkpoint's actor shard, then kill a worker: the resume must skip it.

Reward faults replay rather than being absorbed: a frozen server ends the step with RewardServerLostError (a
restart from the last checkpoint), never with default scores, so the reference needs no faults of its own.

Checks: rc 0 at the end; final actor and critic weights equal to the reference's, tensor by tensor; every step
written twice in metrics.jsonl is preceded by a `resumed` event that supersedes it; nothing of the soak left running
(no process in its namespaces or naming its temp dir, no namespace, no mount). Prints a per-fault table and a
per-kind summary (time to notice, time to recover, steps redone) as markdown; writes them as JSON to --out.
Needs root (ip netns, mount). `--no-netns` is not offered: freeze_host and cut_link need a second host.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests import netns  # noqa: E402 — the repo's namespace helper (cleanup by PID and namespace)

CLI = [sys.executable, "-m", "fleetrl.cli.main"]
PORT = 6394
REWARD_PORT = 8765
KINDS = ("kill_worker", "stop_worker", "freeze_host", "cut_link", "kill_driver", "reward_stop", "disk_full",
         "corrupt_ckpt")
HOST_KINDS = ("freeze_host", "cut_link")
# Ray's node-death verdict after ~3 s instead of ~15-60 s: the supervisor waits for it after a frozen host.
FAST_HEALTH = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "1000",
               "RAY_health_check_failure_threshold": "3", "RAY_health_check_initial_delay_ms": "1000"}


@dataclass
class Fault:
    kind: str
    step: int
    delay_s: float  # after the step's metrics line appears: lands in a random phase of the next step
    # filled in as it happens (seconds after injection)
    injected_at_step: int = 0
    notice_s: float | None = None
    recover_s: float | None = None
    redone: int | None = None
    how: str = ""  # what noticed it: the event or exit code, and the phase it names


def schedule(seed: int, n: int, steps: int, kinds: tuple[str, ...]) -> list[Fault]:
    """n faults at distinct steps, one in each of n equal slots of [4, steps - 4]; kinds cycle through a shuffled
    list so every kind comes at least once when n >= len(kinds)."""
    rng = random.Random(seed)
    lo, hi = 4, steps - 4
    width = (hi - lo) / n
    bag: list[str] = []
    faults = []
    for i in range(n):
        if not bag:
            bag = list(kinds)
            rng.shuffle(bag)
        start = lo + int(i * width)
        step = rng.randint(start, max(start, lo + int((i + 1) * width) - 1))
        faults.append(Fault(bag.pop(), step, round(rng.uniform(0.0, 0.3), 3)))
    return faults


def _env(root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "SLURM_")) and k not in
           ("NODE_RANK", "MASTER_ADDR")}
    return {**env, "HOME": str(root / "home"), "PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(root / "token")}


class Soak:
    """The two hosts, their Ray nodes, the reward server and the run's tmpfs; `close()` removes all of it."""

    def __init__(self, root: Path, a: netns.Host, b: netns.Host, seed: int, steps: int, save_every: int):
        self.root, self.a, self.b, self.seed, self.steps, self.save_every = root, a, b, seed, steps, save_every
        self.env = _env(root)
        self.disk = root / "disk"
        self.reward: subprocess.Popen | None = None
        self.workers = 0

    # ---- bring-up -------------------------------------------------------------------------------------------
    def _up_args(self, name: str) -> list[str]:
        return ["--token-file", str(self.root / "token"), "--state-file", str(self.root / f"{name}.json"),
                "--temp-dir", str(self.root / f"t{name}"), "--num-cpus", "2",
                "--object-store-memory", str(80 * 2**20)]

    def start(self) -> None:
        self.disk.mkdir()
        _sh(["mount", "-t", "tmpfs", "-o", "size=48m", "frlchaos", str(self.disk)])
        head = self.a.popen(CLI + ["cluster", "up", "--head", "--node-ip-address", self.a.ip, "--port", str(PORT),
                                   "--expect-nodes", "2", "--wait-timeout", "120", *self._up_args("head")],
                            env={**self.env, **FAST_HEALTH}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not (self.root / "token").exists():
            if time.monotonic() > deadline or head.poll() is not None:
                raise RuntimeError(f"head did not start: {head.communicate()[0]}")
            time.sleep(0.1)
        self.start_worker()
        out, _ = head.communicate(timeout=150)
        if head.returncode != 0:
            raise RuntimeError(f"head: {out}")
        self.reward = self.a.popen(CLI + ["serve-reward", "--fn", "prefix_match", "--host", "127.0.0.1",
                                          "--port", str(REWARD_PORT)], env=self.env,
                                   stdout=open(self.root / "reward.log", "w"), stderr=subprocess.STDOUT)

    def start_worker(self) -> None:
        """Host B's Ray node (again, after a lost host: the replacement joins at the same address)."""
        self.workers += 1
        name = f"worker{self.workers}"
        (self.root / f"worker{self.workers - 1}.json").unlink(missing_ok=True)
        self.b.popen(CLI + ["cluster", "up", "--port", str(PORT), "--join-timeout", "60", "--block",
                            *self._up_args(name)], env={**self.env, "NODE_RANK": "1", "MASTER_ADDR": self.a.ip},
                     stdout=open(self.root / f"{name}.out", "w"), stderr=subprocess.STDOUT)

    def close(self) -> None:
        for state in self.root.glob("*.json"):
            with contextlib.suppress(Exception):
                subprocess.run(CLI + ["cluster", "down", "--state-file", str(state)], env=self.env,
                               capture_output=True, timeout=60)
        subprocess.run(["umount", "-l", str(self.disk)], capture_output=True)

    # ---- the run --------------------------------------------------------------------------------------------
    def overrides(self, out: Path) -> list[str]:
        a, b = self.a.ip, self.b.ip
        return [
            "model.path=tiny:", "data.prompts_per_step=8", "algorithm.mini_batch_prompts=8", "data.val=null",
            "trainer.val_every=0", "trainer.val_before_train=false", f"trainer.total_steps={self.steps}",
            f"trainer.seed={self.seed}", f"trainer.save_every={self.save_every}", "trainer.keep_last=3",
            "trainer.max_restarts=100", "trainer.restart_wait_s=60", "trainer.resume=auto",
            f"trainer.output_dir={out}", "tracking.progress=false",
            f"cluster.address={a}:{PORT}", "cluster.stall_s=3", "cluster.first_call_stall_s=60",
            "cluster.placement_timeout_s=30",
            "cluster.pools={main: {cpus_per_worker: 0.5, resources: {'node:%s': 0.01}}, "
            "far: {cpus_per_worker: 0.5, resources: {'node:%s': 0.01}}}" % (a, b),
            "cluster.roles={actor: main, ref: main, rollout: far, critic: far}",
            f"rewards.remote_urls=['http://127.0.0.1:{REWARD_PORT}']", "rewards.remote_timeout_s=10",
            "rewards.remote_connect_timeout_s=1", "rewards.remote_retries=0",
        ]

    def driver(self, out: Path, log: Path) -> subprocess.Popen:
        return self.a.popen(CLI + ["train", "examples/ppo_tiny.yaml", *self.overrides(out)], env=self.env,
                            stdout=open(log, "a"), stderr=subprocess.STDOUT)


class Tail:
    """metrics.jsonl as it grows, each record with the monotonic time it was first seen (polled every 50 ms)."""

    def __init__(self, path: Path):
        self.path, self.pos, self.records, self.torn = path, 0, [], 0

    def poll(self) -> list[tuple[float, dict]]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self.pos)
            data = f.read()
        new = []
        for line in data.split(b"\n")[:-1]:  # a line without its newline is still being written
            self.pos += len(line) + 1
            try:
                new.append((time.monotonic(), json.loads(line)))
            except ValueError:
                self.torn += 1  # a killed driver's last line
        self.records += [rec for _, rec in new]
        return new


def _sh(cmd: list[str]) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")
    return done.stdout


def _ns_pids(host: netns.Host) -> list[int]:
    return [int(p) for p in subprocess.run(["ip", "netns", "pids", host.name], capture_output=True,
                                           text=True).stdout.split()]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _is_train(rec: dict) -> bool:
    return "train/reward_mean" in rec


def _phase(error: str) -> str:
    for pattern in (r"phase '(\w+)'", r"_RayWorker\.(\w+)", r"Worker\.(\w+)"):
        if m := re.search(pattern, error):
            return m.group(1)
    return ""


def _how(event: str, error: str) -> str:
    """`restart: WorkerLostError`, `stall in compute_values`: one table cell."""
    kind = error.split(":", 1)[0]
    text = f"{event}: {kind}" if event == "restart" and kind.isidentifier() else event
    return f"{text} in {_phase(error)}" if _phase(error) else text


class Controller:
    """Runs the chaos run: relaunches the driver after its own faults, injects the schedule, times each fault."""

    def __init__(self, soak: Soak, out: Path, faults: list[Fault], seed: int):
        self.soak, self.out, self.faults = soak, out, faults
        self.rng = random.Random(seed + 1000)
        self.tail = Tail(out / "metrics.jsonl")
        self.log = soak.root / "chaos_driver.log"
        self.drv = soak.driver(out, self.log)
        self.launches = 1
        self.written = 0  # highest train step written so far (falls back after a resume)
        self.active: Fault | None = None
        self.t0 = 0.0
        self.floor: int | None = None  # supersedes_after of the active fault's resume
        self.high_at_resume = 0
        self.stopped: list[int] = []  # SIGSTOPped pids to continue once noticed
        self.host_lost_at = 0.0  # when host B was last killed or its replacement started

    def run(self, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        queue = list(self.faults)
        while time.monotonic() < deadline:
            for t, rec in self.tail.poll():
                self._observe(t, rec)
            rc = self.drv.poll()
            if rc is not None:
                if rc == 0 and any(r.get("event") == "finished" for r in self.tail.records[-3:]):
                    return 0
                if not self._driver_exited(rc):
                    return rc
            self._keep_host_b()
            if self.active is None and queue and self.written >= queue[0].step and self._inject(queue[0]):
                queue.pop(0)
            elif self.active is not None:
                self._expire()
                if self.active is not None and self.active.kind == "disk_full" and self.active.notice_s is None:
                    _fill(self.soak.disk / "ballast", keep=2**20)  # pruning after a save that slipped in freed room
            time.sleep(0.05)
        return 124

    # ---- observing ------------------------------------------------------------------------------------------
    def _observe(self, t: float, rec: dict) -> None:
        f = self.active
        ev = rec.get("event")
        if f is not None and ev in ("stall", "restart") and f.notice_s is None:
            self._noticed(t, _how(ev, rec.get("error", "")))
        if f is not None and ev == "resumed" and f.notice_s is not None:
            self.floor, self.high_at_resume = int(rec.get("supersedes_after") or 0), self.written
            if f.kind == "corrupt_ckpt":
                f.how += f"; resumed from {Path(rec.get('path') or 'scratch').name}"
        if _is_train(rec):
            if f is not None and self.floor is not None:
                f.recover_s, f.redone = round(t - self.t0, 2), self.high_at_resume - self.floor
                self.active, self.floor = None, None
            self.written = rec["step"]

    def _noticed(self, t: float, how: str) -> None:
        f = self.active
        f.notice_s, f.how = round(t - self.t0, 2), how
        _signal(self.stopped, signal.SIGCONT)
        self.stopped = []
        if f.kind == "freeze_host":  # the frozen host is rebooted: its processes end; _keep_host_b replaces it
            _signal(_ns_pids(self.soak.b), signal.SIGKILL)
        if f.kind == "cut_link":
            _sh(["ip", "-n", self.soak.b.name, "link", "set", self.soak.b.iface, "up"])

    def _driver_exited(self, rc: int) -> bool:
        """A driver exit the active fault explains: relaunch with resume=auto. False: the run failed."""
        f = self.active
        if f is None or f.kind not in ("kill_driver", "disk_full"):
            return False
        if f.kind == "disk_full":
            if rc != 2:
                return False
            (self.soak.disk / "ballast").unlink()
        if f.notice_s is None:
            f.notice_s, f.how = round(time.monotonic() - self.t0, 2), f"driver exit {rc}"
        self.drv = self.soak.driver(self.out, self.log)
        self.launches += 1
        return True

    def _keep_host_b(self) -> None:
        """Host B without a raylet (killed, or declared dead by Ray after a cut link) gets a replacement node."""
        f = self.active
        if f is not None and f.kind in HOST_KINDS and f.notice_s is None:
            return  # the fault is still in progress
        if time.monotonic() - self.host_lost_at < 30:
            return  # a replacement is still joining
        if any("raylet" in _cmdline(p) for p in _ns_pids(self.soak.b)):
            return
        _signal(_ns_pids(self.soak.b), signal.SIGKILL)
        self.soak.start_worker()
        self.host_lost_at = time.monotonic()

    def _expire(self) -> None:
        """A fault nothing noticed within 60 s (a reward server stopped while no step scored) is undone, unnoticed."""
        f = self.active
        if f.notice_s is not None or time.monotonic() - self.t0 < 60:
            return
        _signal(self.stopped, signal.SIGCONT)
        self.stopped = []
        if f.kind == "cut_link":
            _sh(["ip", "-n", self.soak.b.name, "link", "set", self.soak.b.iface, "up"])
        (self.soak.disk / "ballast").unlink(missing_ok=True)
        f.how, self.active = "not noticed within 60 s", None

    # ---- injecting ------------------------------------------------------------------------------------------
    def _inject(self, f: Fault) -> bool:
        """False when the fault cannot land yet (no worker process to hit)."""
        time.sleep(f.delay_s)
        workers = [p for h in (self.soak.a, self.soak.b) for p in _ns_pids(h) if "ray::_RayWorker" in _cmdline(p)]
        if not workers and f.kind in ("kill_worker", "stop_worker", "corrupt_ckpt"):
            return False
        f.injected_at_step = self.written
        self.t0 = time.monotonic()
        self.active, self.floor = f, None
        if f.kind == "kill_worker":
            _signal([self.rng.choice(workers)], signal.SIGKILL)
        elif f.kind == "stop_worker":
            self.stopped = [self.rng.choice(workers)]
            _signal(self.stopped, signal.SIGSTOP)
        elif f.kind == "freeze_host":
            self.stopped = _ns_pids(self.soak.b)
            _signal(self.stopped, signal.SIGSTOP)
        elif f.kind == "cut_link":
            _sh(["ip", "-n", self.soak.b.name, "link", "set", self.soak.b.iface, "down"])
        elif f.kind == "kill_driver":
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.drv.pid, signal.SIGKILL)
        elif f.kind == "reward_stop":
            self.stopped = [self.soak.reward.pid]
            _signal(self.stopped, signal.SIGSTOP)
        elif f.kind == "disk_full":
            _fill(self.soak.disk / "ballast", keep=2**20)
        elif f.kind == "corrupt_ckpt":
            f.how = f"corrupted {_corrupt_newest(self.out / 'checkpoints')}"
            _signal([self.rng.choice(workers)], signal.SIGKILL)
        print(f"[chaos] {f.kind} after step {self.written} (+{f.delay_s}s)", flush=True)
        return True


def _fill(path: Path, keep: int) -> None:
    """Grows `path` until its filesystem has about `keep` bytes free (the run writes meanwhile, so a size that no
    longer fits is retried with more room). Called again, it takes back what the run freed since."""
    with open(path, "ab") as f:
        if shutil.disk_usage(path.parent).free <= 2 * keep:
            return
        for _ in range(8):
            try:
                room = shutil.disk_usage(path.parent).free + os.fstat(f.fileno()).st_size
                os.posix_fallocate(f.fileno(), 0, max(1, room - keep))
                return
            except OSError:
                keep *= 2
    raise RuntimeError(f"could not fill {path.parent}")


def _corrupt_newest(root: Path) -> str:
    steps = sorted((int(p.name[5:]) for p in root.glob("step_*") if p.name[5:].isdigit()
                    and (p / "meta.json").exists()), reverse=True)
    shard = next((root / f"step_{steps[0]}" / "actor").glob("*.distcp"))
    with open(shard, "r+b") as f:
        f.seek(shard.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    return f"step_{steps[0]}"


# ---- checks -----------------------------------------------------------------------------------------------------
def unmarked_rewrites(records: list[dict]) -> list[int]:
    """Steps written again without a `resumed` event before them that supersedes the earlier record."""
    written: set[int] = set()
    bad = []
    for rec in records:
        if rec.get("event") == "resumed":
            floor = int(rec.get("supersedes_after") or 0)
            written = {s for s in written if s <= floor}
        elif _is_train(rec):
            if rec["step"] in written:
                bad.append(rec["step"])
            written.add(rec["step"])
    return bad


def weight_diff(ref: Path, got: Path) -> list[str]:
    """Tensors that differ (by name) between two checkpoints' actor and critic; [] when bit-identical."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    diffs = []
    with tempfile.TemporaryDirectory() as tmp:
        for role in ("actor", "critic"):
            sd = []
            for i, ckpt in enumerate((ref, got)):
                dcp_to_torch_save(ckpt / role, f"{tmp}/{role}{i}.pt")
                sd.append(_flat(torch.load(f"{tmp}/{role}{i}.pt", weights_only=False)))
            for name in sorted(set(sd[0]) | set(sd[1])):
                x, y = sd[0].get(name), sd[1].get(name)
                if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
                    if x != y:
                        diffs.append(f"{role}:{name}")
                elif x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
                    diffs.append(f"{role}:{name}")
    return diffs


def _flat(d, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def leftovers(root: Path, names: tuple[str, ...]) -> list[str]:
    """Anything of the soak still there: processes naming its temp dir, its namespaces, its tmpfs."""
    left = [f"pid {p}: {_cmdline(p)[:120]}" for p in (int(e) for e in os.listdir("/proc") if e.isdigit())
            if str(root) in _cmdline(p) and p != os.getpid()]
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    left += [f"namespace {n}" for n in names if n in listed.split()]
    left += [f"mount {line.split()[1]}" for line in Path("/proc/mounts").read_text().splitlines()
             if str(root) in line]
    return left


# ---- report -----------------------------------------------------------------------------------------------------
def table(faults: list[Fault]) -> str:
    rows = ["| # | fault | at step | noticed by (phase) | notice s | recover s | steps redone |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for i, f in enumerate(faults, 1):
        rows.append(f"| {i} | {f.kind} | {f.injected_at_step} (+{f.delay_s}s) | {f.how} | {_num(f.notice_s)} | "
                    f"{_num(f.recover_s)} | {_num(f.redone)} |")
    rows += ["", "| fault kind | n | notice s (median / max) | recover s (median / max) | steps redone (total) |",
             "| --- | --- | --- | --- | --- |"]
    for kind in KINDS:
        fs = [f for f in faults if f.kind == kind]
        if not fs:
            continue
        notice = [f.notice_s for f in fs if f.notice_s is not None]
        recover = [f.recover_s for f in fs if f.recover_s is not None]
        rows.append(f"| {kind} | {len(fs)} | {_med_max(notice)} | {_med_max(recover)} | "
                    f"{sum(f.redone or 0 for f in fs)} |")
    return "\n".join(rows)


def _num(x) -> str:
    return "-" if x is None else f"{x}"


def _med_max(xs: list[float]) -> str:
    if not xs:
        return "-"
    return f"{statistics.median(xs):.1f} / {max(xs):.1f}"


# ---- main -------------------------------------------------------------------------------------------------------
def soak(seed: int, n_faults: int, steps: int, save_every: int, kinds: tuple[str, ...],
         timeout_s: float, logs: Path | None = None) -> dict:
    reason = netns.skip_reason()
    if reason:
        raise SystemExit(f"chaos soak needs two network-namespace hosts: {reason}")
    faults = schedule(seed, n_faults, steps, kinds)
    root = Path(tempfile.mkdtemp(prefix="frc", dir="/tmp"))
    result: dict = {"seed": seed, "steps": steps, "faults": []}
    t_start = time.monotonic()
    names: tuple[str, ...] = ()
    try:
        with netns.netns_pair(f"c{os.getpid() % 10000}") as (a, b):
            names = (a.name, b.name)
            s = Soak(root, a, b, seed, steps, save_every)
            try:
                s.start()
                result["setup_s"] = round(time.monotonic() - t_start, 1)
                t = time.monotonic()
                ref = s.driver(s.disk / "ref", root / "ref.log")
                result["ref_rc"] = ref.wait(timeout=timeout_s)
                result["ref_s"] = round(time.monotonic() - t, 1)
                if result["ref_rc"] != 0:
                    raise RuntimeError(f"reference run failed: {(root / 'ref.log').read_text()[-3000:]}")
                # the reference's final checkpoint leaves the tmpfs, which the chaos run fills
                ref_ckpt = root / "ref_final"
                shutil.copytree(s.disk / "ref" / "checkpoints" / f"step_{steps}", ref_ckpt)
                shutil.rmtree(s.disk / "ref")
                t = time.monotonic()
                c = Controller(s, s.disk / "run", faults, seed)
                result["rc"] = c.run(timeout_s)
                result["chaos_s"] = round(time.monotonic() - t, 1)
                result["launches"] = c.launches
                result["torn_lines"] = c.tail.torn
                result["unmarked_rewrites"] = unmarked_rewrites(c.tail.records)
                final = s.disk / "run" / "checkpoints" / f"step_{steps}"
                result["weight_diffs"] = weight_diff(ref_ckpt, final) if final.exists() else ["no final checkpoint"]
                result["restarts"] = sum(1 for r in c.tail.records if r.get("event") == "restart")
                if result["rc"] != 0:
                    result["log_tail"] = (root / "chaos_driver.log").read_text()[-4000:]
            finally:
                if logs is not None:  # the drivers' and nodes' logs and the run's metrics, for a failure's story
                    logs.mkdir(parents=True, exist_ok=True)
                    for f in [*root.glob("*.log"), *root.glob("*.out"), s.disk / "run" / "metrics.jsonl"]:
                        with contextlib.suppress(OSError):
                            shutil.copy(f, logs / f.name)
                s.close()
    finally:
        result["faults"] = [asdict(f) for f in faults]
        result["wall_s"] = round(time.monotonic() - t_start, 1)
        time.sleep(1)
        result["leftovers"] = leftovers(root, names)
        shutil.rmtree(root, ignore_errors=True)
    result["passed"] = (result.get("rc") == 0 and not result.get("weight_diffs") and not result["leftovers"]
                        and not result.get("unmarked_rewrites") and all(f.recover_s is not None or "not noticed"
                                                                        in f.how for f in faults))
    result["table"] = table(faults)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--faults", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--kinds", default=",".join(KINDS), help="comma-separated subset of " + ",".join(KINDS))
    p.add_argument("--timeout", type=float, default=3000, help="seconds for each of the two runs")
    p.add_argument("--logs", type=Path, default=None, help="copy the driver, node and metrics logs here")
    p.add_argument("--out", default=None, help="JSON result (default bench/results/chaos_seed<S>.json)")
    args = p.parse_args()
    kinds = tuple(k for k in args.kinds.split(",") if k)
    if unknown := set(kinds) - set(KINDS):
        raise SystemExit(f"unknown fault kinds {sorted(unknown)}; choose from {list(KINDS)}")
    os.chdir(REPO)
    # SIGTERM, and SIGINT even where a shell started us in the background with it ignored, end the soak through
    # its cleanup (Ray nodes, namespaces, the tmpfs)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    result = soak(args.seed, args.faults, args.steps, args.save_every, kinds, args.timeout, args.logs)
    out = Path(args.out or REPO / "bench" / "results" / f"chaos_seed{args.seed}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(result["table"])
    summary = {k: result.get(k) for k in ("seed", "rc", "restarts", "launches", "weight_diffs", "unmarked_rewrites",
                                          "leftovers", "setup_s", "ref_s", "chaos_s", "wall_s", "passed")}
    print("RESULT " + json.dumps(summary), flush=True)
    sys.exit(0 if result["passed"] else 1)


if __name__ == "__main__":
    main()
