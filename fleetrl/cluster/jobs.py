"""`fleetrl submit` and `fleetrl jobs ...`: runs on a cluster through Ray's job API (the dashboard port).

A submitted run ships the working directory (code and configs; large outputs excluded) and runs
`python -m fleetrl.cli.main train CONFIG overrides...` on the head, so the cluster needs fleetrl's
dependencies but not this checkout installed.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence, TextIO

from fleetrl.cluster import auth

# Never upload these: outputs and caches grow past Ray's working_dir size limit and are not code.
DEFAULT_EXCLUDES = (".git", "runs", "checkpoints", "outputs", "wandb", "mlruns", ".venv", "__pycache__",
                    "*.pt", "*.safetensors", "*.bin", "*.ckpt")
AGENT_WAIT_S = 60.0


@dataclass(frozen=True, kw_only=True, slots=True)
class JobInfo:
    job_id: str
    status: str
    entrypoint: str
    message: str


def train_entrypoint(config: str, overrides: Sequence[str] = ()) -> str:
    """The shell command a submitted run executes: `python -m fleetrl.cli.main train CONFIG k=v ...`."""
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} is not key=value (e.g. trainer.total_steps=100)")
    return shlex.join(["python", "-m", "fleetrl.cli.main", "train", config, *overrides])


def runtime_env(working_dir: Path, env_vars: Mapping[str, str] | None = None,
                excludes: Sequence[str] = DEFAULT_EXCLUDES) -> dict[str, Any]:
    if not Path(working_dir).is_dir():
        raise ValueError(f"working dir {working_dir} does not exist; pass --working-dir DIR (the checkout with "
                         f"your configs)")
    env: dict[str, Any] = {"working_dir": str(working_dir), "excludes": list(excludes)}
    if env_vars:
        env["env_vars"] = dict(env_vars)
    return env


def submit(address: str, config: str, overrides: Sequence[str] = (), *, working_dir: Path = Path("."),
           env_vars: Mapping[str, str] | None = None, token: auth.ClusterToken | None = None,
           submission_id: str | None = None) -> str:
    """Submits a training run; returns the job id."""
    return submit_entrypoint(address, train_entrypoint(config, overrides), working_dir=working_dir,
                             env_vars=env_vars, token=token, submission_id=submission_id)


def submit_entrypoint(address: str, entrypoint: str, *, working_dir: Path = Path("."),
                      env_vars: Mapping[str, str] | None = None, token: auth.ClusterToken | None = None,
                      submission_id: str | None = None) -> str:
    """Submits any shell command with the same runtime env as a training run."""
    env = runtime_env(working_dir, env_vars)
    client = _client(address, token)
    deadline = time.monotonic() + AGENT_WAIT_S
    while True:
        try:
            return client.submit_job(entrypoint=entrypoint, runtime_env=env, submission_id=submission_id)
        except RuntimeError as e:
            # Right after `cluster up` the job API answers before the node's job agent has registered.
            if "No available agent" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def list_jobs(address: str, token: auth.ClusterToken | None = None) -> list[JobInfo]:
    return [_info(d) for d in _client(address, token).list_jobs()]


def job_status(address: str, job_id: str, token: auth.ClusterToken | None = None) -> JobInfo:
    return _info(_client(address, token).get_job_info(job_id))


def job_logs(address: str, job_id: str, token: auth.ClusterToken | None = None, *, follow: bool = False,
             out: TextIO | None = None) -> str:
    """The job's logs so far; with follow, streams them to `out` until the job ends and returns them all."""
    client = _client(address, token)
    if not follow:
        return client.get_job_logs(job_id)
    out = out or sys.stdout
    chunks: list[str] = []

    async def _tail() -> None:
        async for chunk in client.tail_job_logs(job_id):
            chunks.append(chunk)
            out.write(chunk)
            out.flush()

    asyncio.run(_tail())
    return "".join(chunks)


def stop_job(address: str, job_id: str, token: auth.ClusterToken | None = None) -> bool:
    """Asks the job to stop (SIGTERM to its driver, then SIGKILL); False if it had already ended."""
    return _client(address, token).stop_job(job_id)


def _client(address: str, token: auth.ClusterToken | None) -> Any:
    from ray.job_submission import JobSubmissionClient

    if "://" not in address:
        raise ValueError(f"--address {address!r} is not the dashboard URL; pass http://HEAD_IP:8265 (the job API "
                         f"listens on the dashboard port, not the GCS port)")
    # Ray lets RAY_ADDRESS / RAY_API_SERVER_ADDRESS override an explicit address; here the flag wins.
    with _without_env("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        try:
            return JobSubmissionClient(address, headers=auth.http_headers(token))
        except ConnectionError as e:
            raise ConnectionError(f"cannot reach the Ray job API at {address}: {e}. Is the head up (`fleetrl "
                                  f"cluster status` on it)? The dashboard binds 127.0.0.1 by default: use an SSH "
                                  f"tunnel (ssh -L 8265:127.0.0.1:8265 HEAD) or start it with --dashboard-host.") from e


def _info(details: Any) -> JobInfo:
    status = getattr(details.status, "value", str(details.status))
    return JobInfo(job_id=details.submission_id or details.job_id or "", status=str(status),
                   entrypoint=details.entrypoint, message=details.message or "")


@contextlib.contextmanager
def _without_env(*names: str) -> Iterator[None]:
    saved = {n: os.environ.pop(n) for n in names if n in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)
