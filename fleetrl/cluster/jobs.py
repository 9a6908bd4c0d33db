"""`fleetrl submit` and `fleetrl jobs ...`: runs on a cluster through Ray's job API (the dashboard port).

A submitted run ships the working directory (code and configs; large outputs and secret files excluded) and
runs `python -m fleetrl.cli.main train CONFIG overrides... cluster.address=auto` on the head, so the cluster needs
fleetrl's dependencies but not this checkout installed. `cluster.address=auto` (unless the config or an override
names an address) makes the job's driver join the cluster it was submitted to: without it, `fleetrl train`
starts a second, private Ray on the head, whose runtime env setup fails.

Secrets: Ray keeps a job's entrypoint and runtime env (so `--env` values) in its job record, readable through
the job API for as long as the cluster lives. Secret-named overrides are therefore refused; the job record
metadata lists only the names of `--env` variables, and the docs steer secrets into the environment of
`fleetrl cluster up` or a file (`${file:PATH}`), which no job record holds.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence, TextIO

import yaml

from fleetrl.cluster import auth
from fleetrl.config.load import is_secret_key

# Never upload these: outputs and caches grow past Ray's working_dir size limit and are not code.
OUTPUT_EXCLUDES = (".git", "runs", "checkpoints", "outputs", "wandb", "mlruns", ".venv", "__pycache__", ".whl",
                   "*.pt", "*.safetensors", "*.bin", "*.ckpt", "*.whl")
# Nor these: credentials people keep beside their code. Not `*token*`: that would also drop a local model's
# tokenizer.json and special_tokens_map.json.
SECRET_EXCLUDES = (".env", ".env.*", "*.env", "*token", "*.token", "*token.txt", "*token.json", "*_token.*",
                   "*-token.*", "*secret*", "*.pem", "*.key", ".netrc", ".ray")
DEFAULT_EXCLUDES = OUTPUT_EXCLUDES + SECRET_EXCLUDES
AGENT_WAIT_S = 60.0
# Ray's job client sends its HTTP requests without a timeout, so a head that accepts the connection and never answers
# (a frozen dashboard) would hold a CLI call forever. Connect, then answer; a submit uploads the working dir first.
CONNECT_TIMEOUT_S = 10.0
ANSWER_TIMEOUT_S = 60.0
UPLOAD_TIMEOUT_S = 600.0
# `jobs logs --follow`: after this long without a log line, ask the head (bounded) whether the job still runs.
FOLLOW_IDLE_S = 30.0
TERMINAL = frozenset({"STOPPED", "SUCCEEDED", "FAILED"})
# A submitted run without trainer.output_dir writes under the head's home (expanded there by the job's shell), like
# `fleetrl train`'s runs/ but outside Ray's working_dir package, which Ray may delete.
HOME_PREFIX = "$HOME/"
RUNS_DIR = "fleetrl-runs"


@dataclass(frozen=True, kw_only=True, slots=True)
class JobInfo:
    job_id: str
    status: str
    entrypoint: str
    message: str


@dataclass(frozen=True, kw_only=True, slots=True)
class SubmissionSpec:
    """Everything sent to the job API for one submission (built without a cluster, so it can be checked)."""

    entrypoint: str
    runtime_env: dict[str, Any]
    metadata: dict[str, str] = field(default_factory=dict)
    """Ray keeps this in the job record: names only, never values."""
    output_dir: str | None = None
    """The run directory `submit` chose on the head ($HOME/fleetrl-runs/...), None when the config or an override
    sets trainer.output_dir."""


def train_entrypoint(config: str, overrides: Sequence[str] = (), output_dir: str | None = None) -> str:
    """The shell command a submitted run executes: `python -m fleetrl.cli.main train CONFIG k=v ...`.
    `output_dir` (default_output_dir's `$HOME/...`) is appended with $HOME left for the head's shell to expand."""
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} is not key=value (e.g. trainer.total_steps=100)")
        key = item.partition("=")[0].strip()
        if is_secret_key(key.rsplit(".", 1)[-1]) and not item.partition("=")[2].startswith("${"):
            raise ValueError(f"override {key}=... would be kept in clear in the cluster's job record; pass "
                             f"{key}='${{env:NAME}}' with --env NAME (or ${{file:PATH}} on the cluster) instead")
    command = shlex.join(["python", "-m", "fleetrl.cli.main", "train", config, *overrides])
    if output_dir is None:
        return command
    rest = output_dir.removeprefix(HOME_PREFIX)
    if rest == output_dir:
        raise ValueError(f"output_dir {output_dir!r} must start with {HOME_PREFIX}")
    # Only $HOME stays unquoted: the job's shell expands it to the head's home, not the submitter's.
    return f'{command} trainer.output_dir="$HOME"/{shlex.quote(rest)}'


def default_output_dir(config_path: Path, overrides: Sequence[str], now: float | None = None) -> str | None:
    """Where a submitted run writes when neither an override nor the config file sets trainer.output_dir:
    `$HOME/fleetrl-runs/NAME-YYYYmmdd-HHMMSS-mmm` (UTC) on the head. Without it the run's relative `runs/...` would land
    inside Ray's unpacked working_dir package, which Ray deletes when it cleans up its runtime resources."""
    keys = {o.partition("=")[0].strip(): o.partition("=")[2] for o in overrides}
    trainer = _raw_section(config_path, "trainer")
    if "trainer.output_dir" in keys or trainer.get("output_dir") is not None:
        return None
    name = keys.get("trainer.name") or str(trainer.get("name") or "run")
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.") or "run"  # one path component, any shell
    now = time.time() if now is None else now
    # UTC: the submitter's and the head's time zones may differ; the name must read the same on both.
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now)) + f"-{int(now * 1000) % 1000:03d}"
    return f"{HOME_PREFIX}{RUNS_DIR}/{name}-{stamp}"


def _raw_section(config_path: Path, section: str) -> dict[str, Any]:
    """One section of the config file as plain YAML ({} when unreadable: `fleetrl train` on the head reports it)."""
    try:
        raw = yaml.safe_load(Path(config_path).read_text()) or {}
        value = raw.get(section) if isinstance(raw, dict) else None
    except (OSError, yaml.YAMLError):
        return {}
    return value if isinstance(value, dict) else {}


def with_cluster_address(config_path: Path, overrides: Sequence[str]) -> list[str]:
    """`overrides` plus `cluster.address=auto` unless an override or the config file already names an address:
    a submitted driver must join the cluster that runs it."""
    if any(o.partition("=")[0].strip() == "cluster.address" for o in overrides):
        return list(overrides)
    try:
        raw = yaml.safe_load(Path(config_path).read_text()) or {}
        address = (raw.get("cluster") or {}).get("address") if isinstance(raw, dict) else None
    except (OSError, yaml.YAMLError, AttributeError):
        address = None  # `fleetrl train` on the cluster reports an unreadable config; auto is right either way
    return list(overrides) if address is not None else [*overrides, "cluster.address=auto"]


def submission_spec(config: str, overrides: Sequence[str] = (), *, working_dir: Path = Path("."),
                    env_vars: Mapping[str, str] | None = None) -> SubmissionSpec:
    """The job a `fleetrl submit` sends: train entrypoint joining this cluster and writing to a run directory
    outside the uploaded package (default_output_dir), upload without secrets."""
    output_dir = default_output_dir(Path(working_dir) / config, overrides)
    overrides = with_cluster_address(Path(working_dir) / config, overrides)
    return SubmissionSpec(entrypoint=train_entrypoint(config, overrides, output_dir),
                          runtime_env=runtime_env(working_dir, env_vars),
                          metadata={"fleetrl_env_names": ",".join(sorted(env_vars or {}))}, output_dir=output_dir)


def env_from_args(items: Sequence[str], environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """`--env K=V` -> {K: V}; `--env K` takes K's value from this shell, so a secret never sits in argv."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not key:
            raise ValueError(f"--env {item!r} is not KEY=VALUE or KEY (e.g. --env NCCL_DEBUG=INFO)")
        if not sep:
            if key not in environ:
                raise ValueError(f"--env {key}: {key} is not set in this shell; export it or pass --env {key}=VALUE")
            value = environ[key]
        out[key] = value
    return out


def secret_env_names(env_vars: Mapping[str, str]) -> list[str]:
    """Names of `--env` variables that look like credentials (their values land in Ray's job record)."""
    return sorted(k for k in env_vars if is_secret_key(k))


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
    return submit_spec(address, submission_spec(config, overrides, working_dir=working_dir, env_vars=env_vars),
                        token, submission_id)


def submit_entrypoint(address: str, entrypoint: str, *, working_dir: Path = Path("."),
                      env_vars: Mapping[str, str] | None = None, token: auth.ClusterToken | None = None,
                      submission_id: str | None = None) -> str:
    """Submits any shell command with the same runtime env as a training run."""
    return submit_spec(address, SubmissionSpec(entrypoint=entrypoint, runtime_env=runtime_env(working_dir, env_vars)),
                        token, submission_id)


def submit_spec(address: str, spec: SubmissionSpec, token: auth.ClusterToken | None = None,
                submission_id: str | None = None) -> str:
    """Submits a spec (submission_spec's, so `fleetrl submit` can show its output_dir); returns the job id."""
    client = _client(address, token)
    deadline = time.monotonic() + AGENT_WAIT_S
    while True:
        try:
            return client.submit_job(entrypoint=spec.entrypoint, runtime_env=spec.runtime_env,
                                     metadata=spec.metadata or None, submission_id=submission_id)
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
    chunks: list[str] = []
    asyncio.run(follow_logs(client.tail_job_logs(job_id), lambda: job_status(address, job_id, token).status,
                            chunks, out or sys.stdout))
    return "".join(chunks)


async def follow_logs(stream: Any, status: Any, chunks: list[str], out: TextIO, idle_s: float = FOLLOW_IDLE_S) -> None:
    """Writes the log `stream`'s chunks to `out` (and `chunks`) until it ends. Ray's log websocket has no read
    timeout or heartbeat, so a head that froze or a network that dropped it silently would stall it for good:
    after `idle_s` without a chunk, `status()` (a bounded job-API call; it raises if the head does not answer)
    says whether the job still runs. A job that ended while its stream was silent ends the follow with a note."""
    it = aiter(stream)
    while True:
        step = asyncio.ensure_future(anext(it))
        while not (await asyncio.wait({step}, timeout=idle_s))[0]:
            state = await asyncio.to_thread(status)
            if state in TERMINAL:
                step.cancel()
                print(f"the job ended ({state}) while its log stream was silent for {idle_s:.0f}s; `fleetrl jobs "
                      f"logs ID --address ...` prints its whole log", file=sys.stderr)
                return
        try:
            chunk = step.result()
        except StopAsyncIteration:
            return
        chunks.append(chunk)
        out.write(chunk)
        out.flush()


def stop_job(address: str, job_id: str, token: auth.ClusterToken | None = None) -> bool:
    """Asks the job to stop (SIGTERM to its driver, then SIGKILL); False if it had already ended."""
    return _client(address, token).stop_job(job_id)


def _client(address: str, token: auth.ClusterToken | None) -> Any:
    if "://" not in address:
        raise ValueError(f"--address {address!r} is not the dashboard URL; pass http://HEAD_IP:8265 (the job API "
                         f"listens on the dashboard port, not the GCS port)")
    # Ray lets RAY_ADDRESS / RAY_API_SERVER_ADDRESS override an explicit address; here the flag wins.
    with _without_env("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        try:
            return _bounded_client_class()(address, headers=auth.http_headers(token))
        except ConnectionError as e:
            raise ConnectionError(f"cannot reach the Ray job API at {address}: {e}. Is the head up (`fleetrl "
                                  f"cluster status` on it)? The dashboard binds 127.0.0.1 by default: use an SSH "
                                  f"tunnel (ssh -L 8265:127.0.0.1:8265 HEAD) or start it with --dashboard-host.") from e


def _bounded_client_class() -> type:
    """Ray's JobSubmissionClient whose every request has a deadline (CONNECT_TIMEOUT_S, then ANSWER_TIMEOUT_S, or
    UPLOAD_TIMEOUT_S for the working-dir upload), and whose timeout says which head did not answer."""
    import requests
    from ray.job_submission import JobSubmissionClient

    class BoundedJobClient(JobSubmissionClient):
        def _do_request(self, method: str, endpoint: str, **kwargs: Any) -> Any:
            answer_s = UPLOAD_TIMEOUT_S if method == "PUT" else ANSWER_TIMEOUT_S
            kwargs.setdefault("timeout", (CONNECT_TIMEOUT_S, answer_s))
            try:
                return super()._do_request(method, endpoint, **kwargs)
            except requests.ConnectTimeout:  # also a ConnectionError: "cannot reach ... use an SSH tunnel" fits
                raise
            except requests.Timeout as e:
                raise TimeoutError(f"the Ray job API at {self._address} did not answer {method} {endpoint} within "
                                   f"{kwargs['timeout']}s (connect, answer). Is the head frozen or overloaded? "
                                   f"Check it with `fleetrl cluster status` on the head.") from e

    return BoundedJobClient


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
