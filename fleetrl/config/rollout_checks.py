"""The Plan's checks and choices about the rollout engine (called by `config/plan.py:derive_plan`): a model family
the fast paths run, a tensor-parallel split the model and the pool allow, a KV-cache share of a GPU, and whether the
fast engine owns its weight slices. Each refusal is one ConfigError naming the key and the fix."""
from __future__ import annotations

from fleetrl.config.checks import divisors
from fleetrl.config.load import ConfigError
from fleetrl.config.schema import RunConfig


def check_memory_fraction(cfg: RunConfig, rollout_on_gpu: bool) -> None:
    """rollout.gpu_memory_fraction sizes the fast engine's KV cache from its GPU's memory (workers/rollout.py
    `cache_budget`); another engine or a CPU pool has nothing it could bound."""
    f, r = cfg.rollout.gpu_memory_fraction, cfg.rollout
    if f is None:
        return
    if r.engine != "fast":
        hint = ("rollout.vllm.gpu_memory_utilization" if r.engine == "vllm" else
                "nothing: it holds no KV cache of a set size")
        raise ConfigError(f"rollout.gpu_memory_fraction={f} bounds the fast engine's KV cache; "
                          f"rollout.engine={r.engine} takes {hint}. Remove it or set rollout.engine=fast")
    if not rollout_on_gpu:
        raise ConfigError(f"rollout.gpu_memory_fraction={f} is a share of a GPU's memory, and the rollout pool "
                          f"({cfg.cluster.roles.get('rollout', 'main')}) has no GPUs: remove it, or give the pool "
                          "gpus_per_worker")


def owns_weights(cfg: RunConfig, colocated: bool) -> bool:
    """rollout.own_weights: auto is on where the engine would otherwise gather a sharded actor whole for a TP rank
    that reads 1/k of it (engines/fast/owned.py); the fast engine's alone."""
    own, r = cfg.rollout.own_weights, cfg.rollout
    if own is True and r.engine != "fast":
        raise ConfigError(f"rollout.own_weights=true is the fast engine's; rollout.engine={r.engine} holds its weights "
                          "its own way: set rollout.own_weights=auto (or false), or rollout.engine=fast")
    if own == "auto":
        return r.engine == "fast" and colocated and cfg.actor.sharding == "fsdp2" and r.tensor_parallel > 1
    return bool(own)


def check_family(cfg: RunConfig, folder: dict | None) -> None:
    """A local checkpoint folder's model_type against the families the fast engine and the native forward run
    (config/families.py), before any worker starts; other models are checked where they load."""
    from fleetrl.config.families import family_problem

    model_type = None if folder is None else folder.get("model_type")
    problem = family_problem(model_type if isinstance(model_type, str) else None, engine=cfg.rollout.engine,
                             forward=cfg.actor.forward)
    if problem is not None:
        raise ConfigError(f"model.path={cfg.model.path}: {problem}")


def check_tensor_parallel(cfg: RunConfig, rollout_world: int, folder: dict | None) -> None:
    """rollout.tensor_parallel: the fast engine's, dividing the rollout workers into engines of k ranks
    (workers/tp_group.py) and the model's heads, KV heads and MLP width into k shards (where the config layer can
    read the shape: a local folder's config.json; any other model's is checked by the engine when it builds)."""
    from fleetrl.config.tensor_parallel import config_shape, tp_shape_problem

    k = cfg.rollout.tensor_parallel
    if k == 1:
        return
    if cfg.rollout.engine != "fast":
        raise ConfigError(f"rollout.tensor_parallel={k} is the fast engine's; rollout.engine={cfg.rollout.engine} "
                          "runs one device per engine: set rollout.engine=fast or rollout.tensor_parallel=1")
    if rollout_world % k:
        raise ConfigError(f"rollout.tensor_parallel={k} does not divide the {rollout_world} rollout workers (one "
                          f"engine per {k} of them); use a divisor of {rollout_world} ({divisors(rollout_world)}) or "
                          "change the rollout pool's nodes/workers_per_node")
    # The k ranks of an engine must make every generate call together, with the same inputs: the synchronous
    # step calls every rank at once; the async pipeline feeds each rollout worker on its own, and a multi-turn
    # episode runs its environment per rank, so neither keeps the engine's ranks in step yet.
    for unsupported, key in ((cfg.trainer.mode == "async", "trainer.mode=async"),
                             (cfg.rollout.env is not None, "rollout.env (multi-turn episodes)")):
        if unsupported:
            raise ConfigError(f"rollout.tensor_parallel={k} runs in synchronous single-turn steps; {key} feeds each "
                              "rollout worker on its own: set rollout.tensor_parallel=1 (one engine per GPU), or "
                              "use the synchronous mode")
    shape = config_shape(folder)
    problem = None if shape is None else tp_shape_problem(k, *shape)
    if problem is not None:
        raise ConfigError(f"rollout.tensor_parallel={k} cannot split model.path={cfg.model.path}: {problem}")
