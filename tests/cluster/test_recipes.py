"""`fleetrl slurm` / `fleetrl dstack`: the generated files parse, and their node scripts do the right thing on
the head and on a worker (run with a stand-in `python` that records its arguments)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

from fleetrl.cli import ops
from fleetrl.cluster.recipes import Recipe, dstack_task, slurm_script

RECIPE = Recipe(config="examples/quickstart.yaml", nodes=4, gpus_per_node=8,
                overrides=("trainer.total_steps=3", "trainer.name=two words"), net_profile="ib")


QUICK = "examples/quickstart.yaml"


def _node_script(script: str) -> str:
    start = script.index("<<'FLEETRL_NODE_SCRIPT'\n") + len("<<'FLEETRL_NODE_SCRIPT'\n")
    return script[start:script.index("\nFLEETRL_NODE_SCRIPT\n")]


def _run_with_fake_python(tmp_path: Path, shell: str, script: str, env: dict[str, str]) -> list[str]:
    """Runs `script` with `python` replaced by a recorder; returns one line per python invocation."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    log = tmp_path / "calls.log"
    (bindir / "python").write_text(f'#!/bin/sh\nprintf "%s|" "$@" >> {log}\necho >> {log}\n')
    (bindir / "python").chmod(0o755)
    done = subprocess.run([shell, "-c", script], env={"PATH": f"{bindir}:{os.environ['PATH']}", **env},
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return log.read_text().splitlines()


def test_slurm_script_is_valid_bash_with_the_sbatch_header():
    script = slurm_script(RECIPE)
    for text in (script, _node_script(script)):
        done = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    assert script.startswith("#!/bin/bash\n#SBATCH --job-name=fleetrl-quickstart\n#SBATCH --nodes=4\n")
    assert "#SBATCH --ntasks-per-node=1\n#SBATCH --gpus-per-node=8\n" in script
    assert 'srun --nodes=4 --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c "$NODE_SCRIPT"' in script
    assert "secrets.token_hex(32)" in script and "umask 077" in script  # token written before any node starts


def test_slurm_node_script_head_trains_worker_blocks(tmp_path):
    node = _node_script(slurm_script(RECIPE))
    env = {"SLURM_JOB_ID": "77", "FLEETRL_TOKEN_FILE": "/shared/tok"}
    head = _run_with_fake_python(tmp_path, "bash", node, {**env, "SLURM_NODEID": "0"})
    up = ("-m|fleetrl.cli.main|cluster|up|--port|6379|--token-file|/shared/tok|"
          "--state-file|/tmp/fleetrl-cluster-77.json|")
    assert head == [f"{up}--net-profile|ib|--expect-nodes|4|--wait-timeout|900|",
                    "-m|fleetrl.cli.main|train|examples/quickstart.yaml|trainer.total_steps=3|trainer.name=two words|",
                    "-m|fleetrl.cli.main|cluster|down|--state-file|/tmp/fleetrl-cluster-77.json|"]
    (tmp_path / "calls.log").unlink()
    worker = _run_with_fake_python(tmp_path, "bash", node, {**env, "SLURM_NODEID": "3"})
    assert worker == [f"{up}--net-profile|ib|--block|"]


def test_slurm_container_and_cpu_only():
    script = slurm_script(Recipe(config="c.yaml", nodes=2, gpus_per_node=0, container="nvcr.io/x/y:1"))
    assert "#SBATCH --gpus-per-node" not in script
    assert "--container-image=nvcr.io/x/y:1" in script and '--container-workdir="$PWD"' in script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


def test_dstack_task_parses_and_runs_cluster_up_on_every_node(tmp_path):
    text = dstack_task(RECIPE)
    task = yaml.safe_load(text)
    assert task["type"] == "task" and task["nodes"] == 4 and task["resources"]["gpu"] == 8
    assert task["env"] == ["RAY_AUTH_TOKEN"] and "RAY_AUTH_TOKEN=" not in "\n".join(task["commands"])
    script = task["commands"][-1]
    assert subprocess.run(["sh", "-n"], input=script, text=True).returncode == 0
    head = _run_with_fake_python(tmp_path, "sh", script, {"DSTACK_NODE_RANK": "0"})
    assert head[0].endswith("cluster|up|--port|6379|--net-profile|ib|--expect-nodes|4|--wait-timeout|900|")
    assert head[1] == "-m|fleetrl.cli.main|train|examples/quickstart.yaml|trainer.total_steps=3|trainer.name=two words|"
    (tmp_path / "calls.log").unlink()
    worker = _run_with_fake_python(tmp_path, "sh", script, {"DSTACK_NODE_RANK": "2"})
    assert worker == ["-m|fleetrl.cli.main|cluster|up|--port|6379|--net-profile|ib|--block|"]


def test_dstack_image_replaces_python():
    task = yaml.safe_load(dstack_task(Recipe(config="c.yaml", nodes=2, container="img:1")))
    assert task["image"] == "img:1" and "python" not in task


def test_recipe_rejects_bad_values():
    with pytest.raises(ValueError, match="at least one node"):
        Recipe(config="c.yaml", nodes=0)
    with pytest.raises(ValueError, match="choose one of"):
        Recipe(config="c.yaml", nodes=2, net_profile="wifi")


def test_cli_prints_the_recipes():
    app = typer.Typer()
    ops.register(app)
    out = CliRunner().invoke(app, ["slurm", QUICK, "trainer.total_steps=3", "--nodes", "2", "--gpus-per-node", "4"])
    assert out.exit_code == 0 and "#SBATCH --nodes=2" in out.output
    assert f"train {QUICK} trainer.total_steps=3" in out.output
    out = CliRunner().invoke(app, ["dstack", QUICK, "--nodes", "3"])
    assert out.exit_code == 0 and yaml.safe_load(out.output)["nodes"] == 3
    out = CliRunner().invoke(app, ["slurm", QUICK, "--nodes", "0"])
    assert out.exit_code == 2 and "at least one node" in out.output


@pytest.mark.parametrize("cmd", ["slurm", "dstack"])
def test_cli_checks_the_config_before_printing(cmd):
    app = typer.Typer()
    ops.register(app)
    out = CliRunner().invoke(app, [cmd, "nothere.yaml", "--nodes", "2"])
    assert out.exit_code == 2 and out.output.startswith("error: config file 'nothere.yaml' does not exist")
    out = CliRunner().invoke(app, [cmd, QUICK, "trainer.totl=1", "--nodes", "2"])
    assert out.exit_code == 2 and out.output.startswith("error: unknown config key 'trainer.totl'")
    # a value only the plan rejects (micro batch that does not divide the step's samples)
    out = CliRunner().invoke(app, [cmd, QUICK, "algorithm.micro_batch_size=7", "--nodes", "2"])
    assert out.exit_code == 2 and out.output.startswith("error: ") and "micro_batch_size" in out.output
    out = CliRunner().invoke(app, [cmd, QUICK, "--nodes", "2", "--port", "70000"])
    assert out.exit_code == 2 and "--port" in out.output


def test_a_secret_that_lives_on_the_head_does_not_stop_the_recipe(monkeypatch):
    # The token is in the head's job environment, not on the machine that prints the script.
    monkeypatch.delenv("FLEETRL_TEST_HEAD_ONLY", raising=False)
    app = typer.Typer()
    ops.register(app)
    out = CliRunner().invoke(app, ["slurm", QUICK, "rewards.remote_token=${env:FLEETRL_TEST_HEAD_ONLY}", "--nodes", "2"])
    assert out.exit_code == 0 and "#SBATCH --nodes=2" in out.output, out.output


SPLIT_16_8 = ("cluster.pools={train: {nodes: 2, workers_per_node: 8, gpus_per_worker: 1}, "
              "gen: {nodes: 1, workers_per_node: 8, gpus_per_worker: 1}}", "cluster.roles={actor: train, rollout: gen}")


@pytest.mark.parametrize("nodes, gpus, fits", [(3, 8, True), (2, 8, False), (3, 4, False), (4, 8, True)])
def test_the_plans_gpus_must_fit_the_nodes_asked_for(nodes, gpus, fits):
    # train: 2 nodes x 8 GPUs, gen: 1 node x 8 GPUs, each pool node on its own machine: 3 nodes of 8 GPUs.
    app = typer.Typer()
    ops.register(app)
    out = CliRunner().invoke(app, ["slurm", QUICK, *SPLIT_16_8, "--nodes", str(nodes), "--gpus-per-node", str(gpus)])
    if fits:
        assert out.exit_code == 0 and f"#SBATCH --nodes={nodes}" in out.output, out.output
    else:
        assert out.exit_code == 2 and out.output.startswith("error: pool '"), out.output
        assert "raise --nodes or --gpus-per-node" in out.output


def test_pools_without_gpus_fit_a_cpu_cluster():
    from fleetrl.cluster.recipes import check_gpus_fit
    from fleetrl.config import check_plan, load_config

    plan = check_plan(load_config(QUICK, []))
    check_gpus_fit(list(plan.pools.values()), nodes=1, gpus_per_node=0)  # the quickstart asks for no GPU
