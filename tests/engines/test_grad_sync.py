"""Gradient sync (engines/grad_sync.py, and FSDP2's in engines/training.py): two gloo ranks on halves of the data
end with the same gradients and weights as one rank on all of it, with only the last micro-batch's backward
communicating. Each case's loss is normalised by the global row count, as algo.losses does, so the exact gradient
is the ranks' SUM."""
from __future__ import annotations

import copy
from contextlib import contextmanager
from datetime import timedelta
from typing import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fleetrl.config.schema import OptimConfig
from fleetrl.engines.grad_sync import GradSync
from fleetrl.engines.training import DistInfo, TrainingEngine

# eps=1: Adam's first step is lr·g/(|g|+1), so the weights move with the gradient's size, not only its sign.
OPTIM = OptimConfig(lr=0.1, eps=1.0, grad_clip=0.0)


class _Stack(nn.Module):
    """Two layers under `.layers` (FSDP2 shards each), and `extra`, used only by a micro-batch that asks for it."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.extra = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x + self.extra(x) if use_extra else x


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _step(engine: TrainingEngine, mbs: list, loss: Callable, split: Callable | None = None) -> dict:
    """One engine step; the gradients the optimiser is given, the weights after it, and the metrics."""
    grads: dict[str, torch.Tensor] = {}

    def seen(*_: object) -> None:
        grads.update({n: _full(p.grad) for n, p in engine.model.named_parameters() if p.grad is not None})

    handle = engine.optimizer.register_step_pre_hook(seen)
    metrics = engine.step(mbs, loss, split=split)
    handle.remove()
    return {"grads": grads, "params": {n: _full(p) for n, p in engine.model.named_parameters()}, "metrics": metrics}


def _squares(model: nn.Module, rows: int) -> Callable:
    def loss(mb: tuple[torch.Tensor, bool]) -> tuple[torch.Tensor, dict[str, float]]:
        x, use_extra = mb
        return model(x, use_extra).pow(2).sum() / rows, {"rows": float(len(x))}
    return loss


def _plain_dp(rank: int) -> dict:
    """Unequal micro-batch counts (rank 0 three, rank 1 one) and several buckets."""
    data = torch.randn(5, 8, generator=torch.Generator().manual_seed(5))
    torch.manual_seed(7)
    model, whole = _Stack(), _Stack()
    whole.load_state_dict(model.state_dict())
    engine = TrainingEngine(model, OPTIM, dist_info=DistInfo(rank=rank, world_size=2))
    # 300-byte buckets: each weight (256 B) and bias (32 B) pair is its own, so buckets launch one by one and in order
    engine._grad_sync = GradSync([p for p in model.parameters() if p.requires_grad], bucket_bytes=300)
    assert len(engine._grad_sync.buckets) == 3
    mbs = [[(data[[0]], False), (data[[1]], False), (data[[2]], False)], [(data[3:], False)]]
    got = _step(engine, mbs[rank], _squares(model, 5))
    want = _step(TrainingEngine(whole, OPTIM), mbs[0] + mbs[1], _squares(whole, 5))
    return {"got": got, "want": want}


def _unused(rank: int) -> dict:
    """`extra` is used on rank 0 only, and only in its first micro-batch (not the one whose backward syncs)."""
    data = torch.randn(3, 8, generator=torch.Generator().manual_seed(6))
    torch.manual_seed(8)
    model, whole = _Stack(), _Stack()
    whole.load_state_dict(model.state_dict())
    engine = TrainingEngine(model, OPTIM, dist_info=DistInfo(rank=rank, world_size=2))
    mbs = [[(data[[0]], True), (data[[1]], False)], [(data[[2]], False)]]
    got = _step(engine, mbs[rank], _squares(model, 3))
    want = _step(TrainingEngine(whole, OPTIM), mbs[0] + mbs[1], _squares(whole, 3))
    return {"got": got, "want": want}


def _fsdp2(rank: int) -> dict:
    """FSDP2 with 3 rows on rank 0 (cut into 3 micro-batches) and 4 on rank 1 (in 1): rank 1 re-cuts its rows into
    3 with `split`, so no pass is a zero-loss repeat; every backward reduce-scatters (gradients stay sharded)."""
    data = torch.randn(7, 8, generator=torch.Generator().manual_seed(9))
    torch.manual_seed(10)
    model, whole = _Stack(), _Stack()
    whole.load_state_dict(model.state_dict())
    engine = TrainingEngine(model, OPTIM, dist_info=DistInfo(rank=rank, world_size=2), sharded=True)
    rows = [data[:3], data[3:]][rank]
    mbs = [[(x, False) for x in rows.split(1)], [(rows, False)]][rank]
    calls: list[int] = []
    squares = _squares(model, 7)

    def counted(mb: tuple[torch.Tensor, bool]) -> tuple[torch.Tensor, dict[str, float]]:
        calls.append(len(mb[0]))
        return squares(mb)

    with _counting_reduce_scatters() as reduce_scatters:
        got = _step(engine, mbs, counted, split=lambda n: [(x, False) for x in rows.tensor_split(n)])
    want = _step(TrainingEngine(whole, OPTIM), [(data, False)], _squares(whole, 7))
    return {"got": got, "want": want, "calls": calls, "reduce_scatters": reduce_scatters[0]}


@contextmanager
def _counting_reduce_scatters() -> Iterator[list[int]]:
    name = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
    real, count = getattr(dist, name), [0]

    def counted(*args: object, **kwargs: object) -> object:
        count[0] += 1
        return real(*args, **kwargs)

    setattr(dist, name, counted)
    try:
        yield count
    finally:
        setattr(dist, name, real)


def _lora(rank: int) -> dict:
    """peft adapters on a tiny Qwen2, base frozen: only the adapters have gradients, and they sum over ranks."""
    import transformers

    from fleetrl.config.schema import LoraConfig
    from fleetrl.models.lora import apply_lora

    cfg = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(11)
    model = transformers.Qwen2ForCausalLM(cfg)
    apply_lora(model, LoraConfig(rank=4, alpha=8.0))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # B starts at 0, which would leave A without a gradient
            nn.init.normal_(p, std=0.1)
    whole = copy.deepcopy(model)
    ids = torch.randint(1, 64, (4, 6), generator=torch.Generator().manual_seed(12))

    def nll(m: nn.Module) -> Callable:
        def loss(x: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
            logits = m(input_ids=x).logits[:, :-1].float()
            return nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="sum") / 20, {}
        return loss

    engine = TrainingEngine(model, OPTIM, dist_info=DistInfo(rank=rank, world_size=2))
    mbs = [[ids[[0]], ids[[1]]], [ids[2:]]]
    got = _step(engine, mbs[rank], nll(model))
    want = _step(TrainingEngine(whole, OPTIM), mbs[0] + mbs[1], nll(whole))
    return {"got": got, "want": want}


CASES = {"plain_dp": _plain_dp, "unused": _unused, "fsdp2": _fsdp2, "lora": _lora}


def _rank(rank: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2, timeout=timedelta(seconds=120))
    try:
        torch.save({name: case(rank) for name, case in CASES.items()}, f"{out}/{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("grad_sync")
    mp.start_processes(_rank, args=(f"file://{out}/rendezvous", str(out)), nprocs=2, start_method="spawn")
    return tuple(torch.load(out / f"{r}.pt") for r in (0, 1))


def _check_world2_equals_world1(two_ranks: tuple[dict, dict], case: str) -> None:
    for rank, results in enumerate(two_ranks):
        got, want = results[case]["got"], results[case]["want"]
        assert set(want["grads"]) <= set(got["grads"]), f"rank {rank}: a gradient is missing"
        for name in set(got["grads"]) - set(want["grads"]):  # used by no rank: zeros (one rank leaves it None)
            assert not got["grads"][name].any(), f"rank {rank}: {name} has a gradient no micro-batch gave it"
        for kind in ("grads", "params"):
            for name, value in want[kind].items():
                torch.testing.assert_close(got[kind][name], value, atol=1e-6, rtol=1e-5,
                                           msg=lambda m, n=name, k=kind, r=rank: f"rank {r} {k} {n}: {m}")
        torch.testing.assert_close(got["metrics"]["grad_norm"], want["metrics"]["grad_norm"], atol=1e-6, rtol=1e-5)
        assert got["metrics"]["allreduce_s"] > 0 and "allreduce_s" not in want["metrics"]
    first, second = (r[case]["got"] for r in two_ranks)
    for name, grad in first["grads"].items():  # the ranks hold the very same sum
        assert torch.equal(second["grads"][name], grad), name
    assert first["metrics"]["allreduce_s"] == second["metrics"]["allreduce_s"], "the slowest rank's, on both"


@pytest.mark.slow  # two spawned processes importing torch and transformers: ~10-20 s
def test_data_parallel_with_unequal_micro_batch_counts_equals_one_rank(two_ranks):
    _check_world2_equals_world1(two_ranks, "plain_dp")
    r0, r1 = (r["plain_dp"]["got"]["metrics"]["rows"] for r in two_ranks)
    assert (r0, r1) == (3.0, 2.0)


@pytest.mark.slow
def test_a_parameter_used_by_one_rank_in_an_early_micro_batch_only_is_summed_on_both(two_ranks):
    _check_world2_equals_world1(two_ranks, "unused")
    for results in two_ranks:
        assert results["unused"]["got"]["grads"]["extra.weight"].abs().sum() > 0


@pytest.mark.slow
def test_lora_adapters_alone_are_synced_and_equal_one_rank(two_ranks):
    _check_world2_equals_world1(two_ranks, "lora")
    grads = two_ranks[0]["lora"]["got"]["grads"]
    assert grads and all("lora_" in name for name in grads)


@pytest.mark.slow
def test_fsdp2_ranks_recut_rows_to_equal_counts_and_keep_gradients_sharded(two_ranks):
    _check_world2_equals_world1(two_ranks, "fsdp2")
    r0, r1 = (r["fsdp2"] for r in two_ranks)
    # no zero-loss pass: three forwards on each rank, each on real rows, every row once
    assert r0["calls"] == [1, 1, 1] and r1["calls"] == [2, 1, 1]
    # one reduce-scatter per layer (two FSDP2 groups; the root holds no parameter of its own) per micro-batch: the
    # gradients never stay unsharded (a 7B actor deferring them to the last micro-batch ran out of memory)
    assert r0["reduce_scatters"] == r1["reduce_scatters"] == 2 * 3


@contextmanager
def _one_rank_group() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("extra_in", ["last", "earlier"])
def test_buckets_launch_in_order_from_inside_the_last_backward(extra_in):
    torch.manual_seed(0)
    model, plain = _Stack(), _Stack()
    plain.load_state_dict(model.state_dict())
    x = torch.randn(2, 8)
    flags = (False, True) if extra_in == "last" else (True, False)  # which micro-batch reaches `extra`
    with _one_rank_group():
        sync = GradSync(list(model.parameters()), bucket_bytes=300)
        # reverse parameter order (backward's), a new bucket when the next parameter would pass 300 B:
        # [extra.bias, extra.weight], [layers.1.bias, layers.1.weight], [layers.0.bias, layers.0.weight]
        assert [[tuple(p.shape) for p in b.params] for b in sync.buckets] == [[(8,), (8, 8)]] * 3
        launched: list[int] = []
        model.layers[1].weight.register_post_accumulate_grad_hook(lambda _: launched.append(sync._next))
        model(x, flags[0]).sum().backward()  # an earlier micro-batch: no collective
        assert sync._next == 0
        with sync.launching():
            model(x, flags[1]).sum().backward()
        if extra_in == "last":
            # `extra`'s bucket went out before backward reached layers.1, and all three before `finish`
            assert launched[-1] == 1 and sync._next == 3
        else:
            # `extra` is not reached by the last backward, so its bucket (the first) is complete only at its end,
            # and the later ones wait for it: collectives go out in the same order on every rank
            assert sync._next == 0
        sync.finish()
    for flag in flags:
        plain(x, flag).sum().backward()
    for (name, p), want in zip(model.named_parameters(), plain.parameters()):  # one rank: the sum is the gradient
        torch.testing.assert_close(p.grad, want.grad, atol=0, rtol=0, msg=name)


def test_single_rank_step_builds_no_sync():
    engine = TrainingEngine(_Stack(), OPTIM)
    assert engine._grad_sync is None and engine.allreduce_s is None
