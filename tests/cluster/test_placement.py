"""An infeasible placement fails fast (well inside 30 s) with a message naming the shortfall."""
import time

import pytest

from fleetrl.cluster.build import build_groups
from fleetrl.cluster.placement import NodeResources, PlacementError, check_feasible
from fleetrl.config import derive_plan, load_config
from fleetrl.config.plan import PoolPlan


def _pool(name="main", nodes=1, per_node=1, **bundle):
    return PoolPlan(name=name, nodes=nodes, bundles_per_node=per_node, bundle=bundle or {"CPU": 1.0}, roles=("actor",),
                    cpu_threads=1)


NODES = [NodeResources("n1", "10.0.0.1", {"CPU": 8, "GPU": 8}, {"CPU": 8, "GPU": 8}),
         NodeResources("n2", "10.0.0.2", {"CPU": 8, "GPU": 4}, {"CPU": 8, "GPU": 4})]


def test_fits_up_to_the_smaller_node():
    # n2 holds 4 GPUs: 2 nodes × 4 workers fit exactly; 2 × 5 needs 10 of the 12 GPUs but no 2 nodes hold 5 each.
    assert check_feasible([_pool(nodes=2, per_node=4, CPU=0.25, GPU=1)], NODES) is None
    with pytest.raises(PlacementError, match=r"not in that per-node shape"):
        check_feasible([_pool(nodes=2, per_node=5, CPU=0.25, GPU=1)], NODES)
    assert NODES[1].available == {"CPU": 8, "GPU": 4}  # the check works on a copy of what is free


def test_too_many_gpus_in_total():
    with pytest.raises(PlacementError, match=r"GPU: needs 16, cluster has 12"):
        check_feasible([_pool(nodes=2, per_node=8, CPU=0.25, GPU=1)], NODES)


def test_per_node_shape_no_node_holds():
    # 12 GPUs exist, 2 × 6 would fit in total, but n2 has only 4
    with pytest.raises(PlacementError, match=r"not in that per-node shape"):
        check_feasible([_pool(nodes=2, per_node=6, CPU=0.25, GPU=1)], NODES)


def test_pools_compete_for_one_node():
    with pytest.raises(PlacementError, match=r"pool 'b'"):
        check_feasible([_pool("a", per_node=8, CPU=0.1, GPU=1), _pool("b", per_node=8, CPU=0.1, GPU=1)], NODES)


@pytest.mark.slow  # starts Ray
@pytest.mark.parametrize("overrides,needle", [
    (["cluster.pools.main.gpus_per_worker=1"], "GPU: needs 1, cluster has 0"),
    (["cluster.pools.main.cpus_per_worker=64"], "CPU: needs 64"),
    (["cluster.pools.main.nodes=2", "data.prompts_per_step=8"], "per-node shape"),
])
def test_real_cluster_fails_fast(ray_local, overrides, needle):
    plan = derive_plan(load_config("examples/quickstart.yaml", overrides))
    t0 = time.time()
    with pytest.raises(PlacementError, match=needle) as err:
        build_groups(plan)
    assert time.time() - t0 < 30
    assert "fleetrl cluster up" in str(err.value) and "cluster nodes" in str(err.value)


TWO_CPUS = [NodeResources("n1", "10.0.0.1", {"CPU": 2.0}, {"CPU": 2.0})]


def _problem(pools: list[PoolPlan], nodes: list[NodeResources]) -> str:
    """The one problem line of check_feasible's error (its second line)."""
    with pytest.raises(PlacementError) as err:
        check_feasible(pools, nodes)
    return str(err.value).splitlines()[1].strip()


def test_pools_that_together_ask_more_than_the_cluster_has_say_so():
    # 1.5 + 1 = 2.5 CPUs of a 2-CPU cluster: pool 'b' fits alone, but not beside 'a'; no node shape would help.
    problem = _problem([_pool("a", CPU=1.5), _pool("b", CPU=1.0)], TWO_CPUS)
    assert problem == ("pool 'b' (roles actor) asks for 1 node(s) × 1 worker(s) of {CPU: 1}; placed on 0. CPU: the "
                       "pools together need 2.5 (a 1.5, b 1), cluster has 2. Fix: lower cluster.pools.a and "
                       "cluster.pools.b (nodes / workers_per_node / gpus_per_worker / cpus_per_worker), or add nodes "
                       "with `fleetrl cluster up --address HEAD:PORT`")
    assert "per-node shape" not in problem


def test_resources_held_by_others_are_not_called_a_per_node_shape():
    # The cluster has 2 CPUs, but something else holds 1 of them: 1.5 fits the total, not what is free.
    held = [NodeResources("n1", "10.0.0.1", {"CPU": 2.0}, {"CPU": 1.0})]
    problem = _problem([_pool(CPU=1.5)], held)
    assert problem == ("pool 'main' (roles actor) asks for 1 node(s) × 1 worker(s) of {CPU: 1.5}; placed on 0. CPU: "
                       "needs 1.5, cluster has 2 but only 1 free (other runs or Ray jobs hold the rest). Fix: stop "
                       "what holds them (`ray status` shows the demands) or wait for them to finish, lower "
                       "cluster.pools.main.nodes / workers_per_node / gpus_per_worker / cpus_per_worker, or add nodes "
                       "with `fleetrl cluster up --address HEAD:PORT`")
