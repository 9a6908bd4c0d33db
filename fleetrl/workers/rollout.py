"""Rollout component: a rollout engine over the actor's own model (colocated) or its own copy (separate pool)."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from fleetrl.batch import Batch
from fleetrl.engines.protocol import RolloutEngine, SamplingParams
from fleetrl.models.hf import load_tokenizer
from fleetrl.workers.context import WorkerContext


@contextmanager
def unsharded(model: torch.nn.Module) -> Iterator[None]:
    """FSDP2-sharded actor: gather every parameter group once for the whole generate call (otherwise each
    decode step would all-gather, and ranks that finish at different steps would deadlock), reshard after."""
    from torch.distributed.fsdp import FSDPModule

    groups = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in groups:
        m.set_reshard_after_forward(False)  # keep the gathered weights across decode steps
        m.unshard()
    try:
        yield
    finally:
        for m in groups:
            m.reshard()
            m.set_reshard_after_forward(True)


def make_engine(name: str, model: torch.nn.Module, tokenizer, device: torch.device, seed: int) -> RolloutEngine:
    if name == "fast":
        from fleetrl.engines.fast import FastRolloutEngine

        return FastRolloutEngine(model, tokenizer, device=device, seed=seed)
    from fleetrl.engines.hf import HFRolloutEngine

    return HFRolloutEngine(model, tokenizer, device=device, seed=seed)


class RolloutComponent:
    def __init__(self, ctx: WorkerContext, model: torch.nn.Module) -> None:
        self.ctx = ctx
        m = ctx.cfg.model
        self.tokenizer = load_tokenizer(m.tokenizer or m.path, trust_remote_code=m.trust_remote_code)
        self.model = model
        self.engine = make_engine(ctx.cfg.rollout.engine, model, self.tokenizer, ctx.device(),
                                  ctx.cfg.trainer.seed + ctx.rank)

    def engine_model(self) -> torch.nn.Module:
        return self.model

    def generate(self, batch: Batch) -> Batch:
        """batch: prompts/prompt_mask (already repeated n times) + meta: temperature, seed, max_new_tokens."""
        r = self.ctx.cfg.rollout
        meta = batch.meta
        if "min_weights_version" in meta and self.engine.weights_version < meta["min_weights_version"]:
            raise RuntimeError(f"rollout worker {self.ctx.rank} holds weights version {self.engine.weights_version} "
                               f"but the step needs {meta['min_weights_version']}: weight sync did not arrive")
        params = SamplingParams(
            max_new_tokens=r.max_new_tokens, temperature=meta.get("temperature", r.temperature),
            top_p=meta.get("top_p", r.top_p), top_k=meta.get("top_k", r.top_k), stop_token_ids=r.stop_token_ids,
            stop_strings=r.stop, seed=None if meta.get("seed") is None else meta["seed"] * 1009 + self.ctx.rank)
        with unsharded(self.model):
            out = self.engine.generate(batch["prompts"], batch["prompt_mask"], params)
        return Batch({"responses": out.responses.cpu(), "response_mask": out.response_mask.long().cpu(),
                      "rollout_logprobs": out.logprobs.float().cpu()},
                     {"finish_reason": list(out.finish_reasons)})

    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        self.engine.load_weights(state, version)
