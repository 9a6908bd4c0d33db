"""The reward_model pool in `fleetrl config show` and in `fleetrl doctor`'s placement count."""
import json

from typer.testing import CliRunner

from fleetrl.cli.main import app
from fleetrl.cluster import doctor as dr
from fleetrl.cluster.doctor import NodeInfo
from fleetrl.config import derive_plan, load_config

RM_POOL = ["rewards.model={path: 'tiny:'}",
           "cluster.pools={main: {gpus_per_worker: 1, workers_per_node: 8},"
           " rm: {gpus_per_worker: 1, workers_per_node: 8}}",
           "cluster.roles={actor: main, rollout: main, reward_model: rm}"]


def test_config_show_lists_the_rm_pool():
    r = CliRunner().invoke(app, ["config", "show", "examples/quickstart.yaml", *RM_POOL])
    assert r.exit_code == 0, r.output
    plan = json.loads(r.output[r.output.index("{", r.output.index("plan")):])
    assert plan["roles"]["reward_model"] == "rm (dp=8)"
    assert plan["pools"]["rm"]["roles"] == ["reward_model"] and plan["pools"]["rm"]["bundle"]["GPU"] == 1


def _node(ip: str, gpus: int) -> NodeInfo:
    return NodeInfo(node_id=f"id-{ip}", ip=ip, resources={"CPU": 64.0, "GPU": float(gpus)})


def test_doctor_counts_the_rm_pool():
    plan = derive_plan(load_config("examples/quickstart.yaml", RM_POOL))
    # actor + rollout take one 8-GPU node, the RM pool needs a second one
    ok = dr.check_placement(plan, [_node("a", 8), _node("b", 8)])
    assert ok.ok and ok.detail == "main: 1×8 bundles, rm: 1×8 bundles"
    short = dr.check_placement(plan, [_node("a", 8)])
    assert not short.ok
    assert "pool 'rm' (roles reward_model) asks for 1 node(s) × 8 worker(s)" in short.detail
    # 8 GPUs in total: 'main' takes all 8 and the RM pool asks 8 more, so it is the total that is short, and the
    # message says so (not a per-node shape)
    assert "GPU: the pools together need 16 (main 8, rm 8), cluster has 8." in short.detail
    assert "per-node shape" not in short.detail
