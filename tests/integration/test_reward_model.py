"""The reward_model role on three raylets (ray.cluster_utils): the policy trains on node A, its rollout engine
runs on node C, and a tiny scalar-head RM trained inside the test scores every rollout from its own
two-worker pool on node B. The rule scorer is weighted 0 (RM-only), so the policy can only learn from the RM;
held-out success (validation scores with the rule, the ground truth) must still climb from < 20% to > 80%."""
import pytest

from fleetrl.trainer.trainer import Trainer
from tests.integration.helpers import train_run, val_curve
from tests.integration.rm_task import train_copy_rm

pytestmark = pytest.mark.slow


def placed(rm_path: str) -> list[str]:
    return [
        "cluster.pools={policy: {cpus_per_worker: 1, resources: {node_a: 0.1}},"
        " rm: {workers_per_node: 2, cpus_per_worker: 0.5, resources: {node_b: 0.1}},"
        " gen: {cpus_per_worker: 1, resources: {node_c: 0.1}}}",
        "cluster.roles={actor: policy, rollout: gen, reward_model: rm}",
        f"rewards.model={{path: '{rm_path}', max_length: 64, micro_batch_size: 64, normalize: true}}",
        "rewards.combine={default: {rule: 0, model: 1}}",
        # One-token answers: the RM was trained on those. With longer ones this tiny RM (which must find where
        # the answer starts) is exploitable, and the policy learns to raise RM scores without answering right.
        "rollout.max_new_tokens=1",
        # In a group whose answers are all wrong the RM scores differ only by its noise (-8.0 vs -8.3);
        # dividing by the group's std would blow that noise up to unit advantages (docs/reward_models.md).
        "algorithm.norm_adv_by_std=false",
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
    ray.init(address=cluster.address, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    yield {name: n.node_id for name, n in nodes.items()}
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="module")
def copy_rm(tmp_path_factory):
    path, accuracy, top1 = train_copy_rm(tmp_path_factory.mktemp("rm"))
    assert accuracy > 0.95, f"the test's reward model reached only {accuracy:.2f} held-out accuracy"
    assert top1 > 0.95, f"the test's reward model ranks the right answer first on only {top1:.2f} of held-out prompts"
    return str(path)


@pytest.fixture(scope="module")
def rm_run(tmp_path_factory, three_nodes, copy_rm):
    """One RM-only training run (120 steps) read by both tests: its metrics records, and what its trainer saw at the
    end of fit() while its groups were still up (the plan it ran, the nodes of the reward_model workers, the last
    step's metrics). A separate 1-step run for the placement would start the four workers (~20 s of CPU on the 2-core
    VM) only to show what this run's workers show."""
    seen: dict = {}
    fit = Trainer.fit

    def fit_and_record(self):
        metrics = fit(self)
        seen.update(plan=self.plan, metrics=metrics,
                    where={i["node_id"] for i in self.group("reward_model").node_infos()})
        return metrics

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Trainer, "fit", fit_and_record)
        records = train_run("examples/quickstart.yaml", tmp_path_factory.mktemp("rm_run") / "run", *placed(copy_rm),
                            "trainer.total_steps=120", "trainer.val_every=30", "actor.optim.lr=0.0005")
    return seen, records


def test_rm_pool_lands_on_its_node(three_nodes, rm_run):
    seen, _ = rm_run
    plan = seen["plan"]
    assert plan.roles["reward_model"] == "rm" and plan.world["reward_model"] == 2
    assert seen["where"] == {three_nodes["node_b"]}
    assert {"train/rm_score_mean", "train/rm_score_std", "train/rule_score_mean"} <= set(seen["metrics"])


def test_policy_learns_from_rm_scores_alone(rm_run):
    _, records = rm_run
    curve = val_curve(records)
    assert curve[0] < 0.2, f"initial held-out success {curve[0]} should start below 20%"
    assert curve[-1] > 0.8, f"held-out success curve {curve} did not pass 80% training on RM scores alone"
    train = [r for r in records if "train/rm_score_mean" in r]
    # RM-only: the trained-on reward is the normalised RM logit, not the 0/1 rule score, and the raw RM score
    # rises with the rule score it was trained to predict.
    assert train[-1]["train/rm_score_mean"] > train[0]["train/rm_score_mean"] + 5
    assert train[0]["train/rule_score_mean"] < 0.2 and train[-1]["train/rule_score_mean"] > 0.6  # sampled at T=1
