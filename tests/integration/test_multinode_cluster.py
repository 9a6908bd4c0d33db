"""Three raylets (ray.cluster_utils.Cluster): policy on node A, critic + reference on node B, a separate
rollout pool on node C, pinned by custom resources. Three PPO steps; the test asserts where each actor ran
and that the rollout pool received every weight version."""
import pytest

from fleetrl.config import derive_plan, load_config
from fleetrl.tracking.tracker import Tracker
from fleetrl.trainer.trainer import Trainer
from fleetrl.workers.worker import Worker

pytestmark = pytest.mark.slow

POOLS = [
    "cluster.pools={policy: {cpus_per_worker: 0.5, resources: {node_a: 0.1}},"
    " side: {cpus_per_worker: 0.25, resources: {node_b: 0.1}},"
    " gen: {cpus_per_worker: 0.25, resources: {node_c: 0.1}}}",
    "cluster.roles={actor: policy, critic: side, ref: side, rollout: gen}",
]


@pytest.fixture(scope="module")
def three_nodes():
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"node_a": 1}})
    nodes = {"node_a": cluster.head_node}
    nodes["node_b"] = cluster.add_node(num_cpus=1, resources={"node_b": 1})
    nodes["node_c"] = cluster.add_node(num_cpus=1, resources={"node_c": 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    yield {name: n.node_id for name, n in nodes.items()}
    ray.shutdown()
    cluster.shutdown()


def test_roles_land_on_their_nodes(tmp_path, three_nodes):
    cfg = load_config("examples/ppo_tiny.yaml", [*POOLS, "trainer.total_steps=3", "trainer.val_every=0",
                                                 "data.val=null", "data.prompts_per_step=8",
                                                 "algorithm.mini_batch_prompts=8",
                                                 "tracking.console=false", "tracking.progress=false"])
    plan = derive_plan(cfg)
    trainer = Trainer(plan, Tracker(tmp_path, cfg.tracking, {}, "mn"), tmp_path)
    try:
        metrics = trainer.fit()
        where = {role: trainer.group(role).node_infos()[0]["node_id"] for role in ("actor", "critic", "ref", "rollout")}
        versions = trainer.group("rollout").call_all(Worker.weights_version)
    finally:
        trainer.shutdown()
    assert where == {"actor": three_nodes["node_a"], "critic": three_nodes["node_b"],
                     "ref": three_nodes["node_b"], "rollout": three_nodes["node_c"]}
    assert trainer.step == 3 and versions == [3]
    assert "train/critic/vf_loss" in metrics and "train/kl" in metrics
