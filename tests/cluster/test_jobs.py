"""`fleetrl submit` / `jobs ...` against a real Ray head on 127.0.0.1 (started with `fleetrl cluster up`,
stopped by PID with `fleetrl cluster down`); one head for the module."""
from __future__ import annotations

import asyncio
import contextlib
import io
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import requests
import typer
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `tests.netns` whatever the pytest rootdir
from fleetrl.cli import ops  # noqa: E402
from fleetrl.cluster import jobs  # noqa: E402
from fleetrl.cluster.auth import find_token  # noqa: E402
from fleetrl.cluster.up import read_state  # noqa: E402
from tests.netns import live_group_members  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "fleetrl.cli.main"]
# Every test on the `head` fixture starts a real Ray head through the CLI (~15 s on a busy 2-core box).
SLOW = pytest.mark.slow
TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}


def _free_ports(n: int) -> list[int]:
    """n distinct free ports: all n sockets are held until each has one, so the kernel cannot hand the same
    port out twice (closed one at a time, it may)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


@pytest.fixture(scope="module")
def head():
    root = Path(tempfile.mkdtemp(prefix="frlj", dir="/tmp"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(HOME=str(root / "home"), PYTHONPATH=str(REPO), RAY_USAGE_STATS_ENABLED="0")
    port, dash, agent, client = _free_ports(4)
    state = root / "head.json"
    up = subprocess.run(CLI + ["cluster", "up", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port),
                               "--dashboard-port", str(dash), "--token-file", str(root / "token"),
                               "--state-file", str(state), "--temp-dir", str(root / "t"), "--num-cpus", "2",
                               "--object-store-memory", str(80 * 2**20), "--wait-timeout", "60",
                               "--env", "FLEETRL_TEST_API_KEY=hidden-value",
                               # Other Ray clusters on this machine (other tests) may hold the default ports.
                               f"--ray-arg=--dashboard-agent-listen-port={agent}",
                               f"--ray-arg=--ray-client-server-port={client}"],
                        env=env, capture_output=True, text=True, timeout=180)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        token = find_token({}, root / "token")
        url = f"http://127.0.0.1:{dash}"
        deadline = time.monotonic() + 60  # the job API comes up a moment after the GCS
        while True:
            try:
                if requests.get(f"{url}/api/version", headers={"Authorization": f"Bearer {token.value}"},
                                timeout=2).ok:
                    break
            except requests.RequestException:
                pass
            assert time.monotonic() < deadline, "dashboard did not come up"
            time.sleep(0.5)
        workdir = root / "wd"
        workdir.mkdir()
        yield {"url": url, "token": token, "root": root, "workdir": workdir, "state": state}
    finally:
        recorded = read_state(state)
        subprocess.run(CLI + ["cluster", "down", "--state-file", str(state)], env=env, capture_output=True,
                       timeout=60)
        left = live_group_members(recorded.pid) if recorded else []
        shutil.rmtree(root, ignore_errors=True)
        assert left == []  # everything `cluster up` started is gone


def _cli(*args: str):
    app = typer.Typer()
    ops.register(app)
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "300"})


def _wait(head, job_id: str, states: set[str], timeout: float = 60) -> jobs.JobInfo:
    deadline = time.monotonic() + timeout
    while True:
        info = jobs.job_status(head["url"], job_id, head["token"])
        if info.status in states:
            return info
        assert time.monotonic() < deadline, f"job {job_id} still {info.status}"
        time.sleep(0.5)


def test_train_entrypoint_is_fleetrl_train_with_quoted_overrides():
    assert jobs.train_entrypoint("examples/q.yaml", ["trainer.total_steps=3", "trainer.name=a b"]) == \
        "python -m fleetrl.cli.main train examples/q.yaml trainer.total_steps=3 'trainer.name=a b'"
    with pytest.raises(ValueError, match="not key=value"):
        jobs.train_entrypoint("q.yaml", ["oops"])


def _spec_dir(tmp_path, config_text=None):
    if config_text is not None:
        (tmp_path / "c.yaml").write_text(config_text)
    return tmp_path


def test_submitted_driver_joins_the_cluster_unless_an_address_is_named(tmp_path):
    wd = _spec_dir(tmp_path, "trainer: {total_steps: 2, output_dir: /r}\n")
    assert jobs.submission_spec("c.yaml", ["trainer.seed=1"], working_dir=wd).entrypoint == \
        "python -m fleetrl.cli.main train c.yaml trainer.seed=1 cluster.address=auto"
    # the user's own choice wins: an override, or an address in the config file
    assert jobs.submission_spec("c.yaml", ["cluster.address=10.0.0.1:6379"], working_dir=wd).entrypoint.endswith(
        "train c.yaml cluster.address=10.0.0.1:6379")
    (wd / "d.yaml").write_text("cluster: {address: 10.0.0.2:6379}\ntrainer: {output_dir: /r}\n")
    assert jobs.submission_spec("d.yaml", working_dir=wd).entrypoint.endswith("train d.yaml")
    # a config the submitter cannot read still joins the cluster (`fleetrl train` there reports the file)
    assert "nope.yaml cluster.address=auto" in jobs.submission_spec("nope.yaml", working_dir=wd).entrypoint


def _head_argv(entrypoint: str, home: str) -> list[str]:
    """The words the job's shell passes to `python -m fleetrl.cli.main`, with the head's HOME (printf stands in)."""
    shown = entrypoint.replace("python -m fleetrl.cli.main", "printf '%s\\n'", 1)
    return subprocess.run(["sh", "-c", shown], env={"HOME": home, "PATH": os.environ["PATH"]}, check=True,
                          capture_output=True, text=True).stdout.splitlines()


def test_submitted_run_without_output_dir_writes_under_the_heads_home_not_the_package(tmp_path, monkeypatch):
    # Ray unpacks the upload into a package dir and runs the job there: a relative runs/... would live (and be
    # cleaned up) with it. 1767225600.25 is 2026-01-01 00:00:00.250 UTC.
    monkeypatch.setattr(time, "time", lambda: 1767225600.25)
    wd = _spec_dir(tmp_path, "trainer: {total_steps: 2, name: my grpo}\n")
    spec = jobs.submission_spec("c.yaml", ["trainer.seed=1"], working_dir=wd)
    outs = [a.partition("=")[2] for a in _head_argv(spec.entrypoint, "/home/alice")
            if a.startswith("trainer.output_dir=")]
    assert outs == ["/home/alice/fleetrl-runs/my-grpo-20260101-000000-250"]
    assert Path(outs[0]).is_absolute() and not Path(outs[0]).is_relative_to(wd)
    assert spec.output_dir == "$HOME/fleetrl-runs/my-grpo-20260101-000000-250"  # what `submit` prints
    # an override's name wins over the file's
    spec = jobs.submission_spec("c.yaml", ["trainer.name=b"], working_dir=wd)
    assert spec.output_dir == "$HOME/fleetrl-runs/b-20260101-000000-250"
    # the user's own output_dir (override or config file) is left alone
    spec = jobs.submission_spec("c.yaml", ["trainer.output_dir=/mnt/shared/r"], working_dir=wd)
    assert spec.output_dir is None and spec.entrypoint.endswith("train c.yaml trainer.output_dir=/mnt/shared/r "
                                                                "cluster.address=auto")
    (wd / "d.yaml").write_text("trainer: {output_dir: /mnt/shared/d}\n")
    assert jobs.submission_spec("d.yaml", working_dir=wd).output_dir is None


def test_upload_leaves_secret_files_and_outputs_behind(tmp_path):
    from ray._private.runtime_env.packaging import create_package

    wd = tmp_path / "wd"
    keep = ["c.yaml", "pkg/mod.py", "model/tokenizer.json", "model/special_tokens_map.json",
            "model/tokenizer_config.json", "notes/tokens.md"]
    drop = [".env", ".env.local", "prod.env", "token", "auth_token", "hf.token", "token.txt", "reward_token.json",
            "my-token.txt", "secrets.yaml", "client_secret.json", "id.pem", "tls.key", ".git/config",
            "runs/r1/metrics.jsonl", ".whl/fleetrl-0.1.whl", "pkg/sub/.env"]
    for rel in keep + drop:
        (wd / rel).parent.mkdir(parents=True, exist_ok=True)
        (wd / rel).write_text("x")
    spec = jobs.submission_spec("c.yaml", working_dir=wd, env_vars={"A": "1"})
    zip_path = tmp_path / "pkg.zip"
    create_package(str(wd), zip_path, include_gitignore=True, excludes=spec.runtime_env["excludes"])
    import zipfile
    uploaded = {n for n in zipfile.ZipFile(zip_path).namelist() if not n.endswith("/")}
    assert uploaded == set(keep)


def test_env_values_stay_out_of_argv_and_metadata(monkeypatch, tmp_path):
    monkeypatch.setenv("FLEETRL_REWARD_TOKEN", "s3cret")
    env = jobs.env_from_args(["FLEETRL_REWARD_TOKEN", "NCCL_DEBUG=INFO"])
    assert env == {"FLEETRL_REWARD_TOKEN": "s3cret", "NCCL_DEBUG": "INFO"}
    assert jobs.secret_env_names(env) == ["FLEETRL_REWARD_TOKEN"]
    spec = jobs.submission_spec("c.yaml", working_dir=tmp_path, env_vars=env)
    assert spec.metadata == {"fleetrl_env_names": "FLEETRL_REWARD_TOKEN,NCCL_DEBUG"}
    assert "s3cret" not in spec.entrypoint + str(spec.metadata)
    monkeypatch.delenv("FLEETRL_REWARD_TOKEN")
    with pytest.raises(ValueError, match="FLEETRL_REWARD_TOKEN is not set in this shell"):
        jobs.env_from_args(["FLEETRL_REWARD_TOKEN"])


def test_secret_override_is_refused_but_a_reference_passes():
    with pytest.raises(ValueError, match=r"rewards.remote_token=\.\.\. would be kept in clear.*\$\{env:NAME\}"):
        jobs.train_entrypoint("c.yaml", ["rewards.remote_token=s3cret"])
    assert "${env:FLEETRL_REWARD_TOKEN}" in jobs.train_entrypoint(
        "c.yaml", ["rewards.remote_token=${env:FLEETRL_REWARD_TOKEN}"])


@SLOW
def test_submit_runs_fleetrl_train_on_the_cluster(head):
    token_file = str(head["root"] / "token")
    # A config that passes the local check (submit checks the plan) but names a data file that is not uploaded.
    shutil.copy(REPO / "examples" / "quickstart.yaml", head["workdir"] / "run.yaml")
    result = _cli("submit", "run.yaml", "trainer.total_steps=1", "data.train=missing.jsonl", "--address", head["url"],
                  "--working-dir", str(head["workdir"]), "--env", f"PYTHONPATH={REPO}", "--token-file", token_file)
    assert result.exit_code == 0, result.output
    job_id = result.output.strip().splitlines()[-1]
    info = _wait(head, job_id, TERMINAL, timeout=180)  # `fleetrl train` imports torch first: slow on a busy box
    assert info.entrypoint.startswith("python -m fleetrl.cli.main train run.yaml trainer.total_steps=1 "
                                      "data.train=missing.jsonl cluster.address=auto "
                                      'trainer.output_dir="$HOME"/fleetrl-runs/quickstart-')
    # `fleetrl train` itself ran on the cluster and rejected the data file it was given.
    assert "missing.jsonl" in jobs.job_logs(head["url"], job_id, head["token"])
    listed = _cli("jobs", "list", "--address", head["url"], "--token-file", token_file)
    assert job_id in listed.output


@SLOW
def test_state_file_is_private_and_redacts_secret_env(head):
    assert head["state"].stat().st_mode & 0o777 == 0o600
    assert read_state(head["state"]).env["FLEETRL_TEST_API_KEY"] == "***"
    assert "hidden-value" not in head["state"].read_text()


@SLOW
def test_logs_follow_streams_until_the_job_ends(head):
    # The job's driver joins the token-protected cluster with no setup: it inherits the raylet's auth env.
    entrypoint = "python -c 'import ray; ray.init(); print(\"hello-from-job\", len(ray.nodes()))'"
    job_id = jobs.submit_entrypoint(head["url"], entrypoint, working_dir=head["workdir"], token=head["token"])
    result = _cli("jobs", "logs", job_id, "-f", "--address", head["url"], "--token-file",
                  str(head["root"] / "token"))
    assert result.exit_code == 0, result.output
    assert "hello-from-job 1" in result.output
    assert _wait(head, job_id, TERMINAL).status == "SUCCEEDED"


@SLOW
def test_stop_ends_a_running_job(head):
    job_id = jobs.submit_entrypoint(head["url"], "python -u -c 'import time; print(\"up\"); time.sleep(300)'",
                                    working_dir=head["workdir"], token=head["token"])
    _wait(head, job_id, {"RUNNING"})
    result = _cli("jobs", "stop", job_id, "--address", head["url"], "--token-file", str(head["root"] / "token"))
    assert result.exit_code == 0, result.output
    assert _wait(head, job_id, TERMINAL, timeout=30).status == "STOPPED"
    status = _cli("jobs", "status", job_id, "--address", head["url"], "--token-file", str(head["root"] / "token"))
    assert "STOPPED" in status.output


@SLOW
def test_job_api_rejects_a_client_without_the_token(head):
    from ray.exceptions import AuthenticationError

    # Ray's client falls back to ~/.ray/auth_token, which any earlier `ray.init` on this machine may have
    # generated for its own cluster: then the token is present but wrong. Either way the head must refuse.
    with pytest.raises(AuthenticationError, match="(Missing|Invalid) authentication token"):
        jobs.list_jobs(head["url"], token=None)


def test_address_must_be_the_dashboard_url():
    with pytest.raises(ValueError, match="http://HEAD_IP:8265"):
        jobs.list_jobs("10.0.0.1:6379")


def test_a_head_that_accepts_and_never_answers_times_out_with_its_address(monkeypatch):
    # A listening socket nobody accepts from: the kernel completes the connection and the request waits for an
    # answer that never comes, as with a frozen dashboard. Ray's client alone would wait forever.
    monkeypatch.setattr(jobs, "ANSWER_TIMEOUT_S", 0.5)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=rf"{url} did not answer GET /api/version within .*cluster status"):
            jobs.list_jobs(url)
        assert time.monotonic() - t0 < 10


def _stalling_stream(first: list[str]):
    async def gen():
        for chunk in first:
            yield chunk
        await asyncio.sleep(3600)  # a websocket that went silent: no chunk, no close
        yield "never"
    return gen()


def test_follow_ends_when_the_job_ended_behind_a_silent_stream(capsys):
    states = iter(["RUNNING", "SUCCEEDED"])
    asked, chunks, out = [], [], io.StringIO()

    def status():
        asked.append(1)
        return next(states)

    asyncio.run(jobs.follow_logs(_stalling_stream(["a\n", "b\n"]), status, chunks, out, idle_s=0.05))
    assert chunks == ["a\n", "b\n"] and out.getvalue() == "a\nb\n"
    assert len(asked) == 2  # still running after the first silence, ended after the second
    assert "ended (SUCCEEDED) while its log stream was silent" in capsys.readouterr().err


def test_follow_raises_when_the_head_does_not_answer_either():
    def status():
        raise TimeoutError("the Ray job API at http://h:8265 did not answer")

    with pytest.raises(TimeoutError, match="http://h:8265 did not answer"):
        asyncio.run(jobs.follow_logs(_stalling_stream([]), status, [], io.StringIO(), idle_s=0.05))


def test_follow_returns_at_the_end_of_the_stream():
    async def gen():
        yield "x"

    chunks: list[str] = []
    asyncio.run(jobs.follow_logs(gen(), lambda: pytest.fail("no silence, no status call"), chunks, io.StringIO()))
    assert chunks == ["x"]


def test_submit_checks_the_config_before_contacting_the_cluster(tmp_path):
    # The address answers nothing: a config mistake must be reported without reaching for it.
    shutil.copy(REPO / "examples" / "quickstart.yaml", tmp_path / "run.yaml")
    r = _cli("submit", "run.yaml", "trainer.totl=1", "--working-dir", str(tmp_path), "--address", "http://127.0.0.1:9")
    assert r.exit_code == 2 and r.output.startswith("error: unknown config key 'trainer.totl'"), r.output
    r = _cli("submit", "nothere.yaml", "--working-dir", str(tmp_path), "--address", "http://127.0.0.1:9")
    assert r.exit_code == 2 and "does not exist" in r.output, r.output


def test_submit_says_where_the_run_writes_before_the_job_id(monkeypatch):
    # The job id stays the last line (scripts read it); the run directory is named on stderr before it.
    sent = []
    monkeypatch.setattr(time, "time", lambda: 1767225600.25)
    monkeypatch.setattr(jobs, "submit_spec", lambda address, spec, token=None: sent.append(spec) or "raysubmit_1")
    r = _cli("submit", "examples/quickstart.yaml", "--address", "http://127.0.0.1:9")
    assert r.exit_code == 0, r.output
    lines = r.output.strip().splitlines()
    assert lines[-1] == "raysubmit_1"
    assert lines[-2].startswith("run directory on the head: $HOME/fleetrl-runs/quickstart-20260101-000000-250 ")
    assert sent[0].output_dir == "$HOME/fleetrl-runs/quickstart-20260101-000000-250"
