"""bench/longtail.py's stop rule through the real rollout component (local backend, tiny model): the drawn lengths
reach the engine as per-sample limits, and a response ending at its limit below max_new_tokens reads "stop"."""
from __future__ import annotations

from pathlib import Path

import pytest

from bench import longtail
from fleetrl.config import derive_plan, load_config, to_dict
from fleetrl.tracking.tracker import Tracker
from fleetrl.trainer.trainer import Trainer
from fleetrl.workers import rollout


@pytest.mark.parametrize("engine", ["hf", "fast"])
def test_drawn_lengths_limit_generation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: str):
    for name in ("sampling_params", "generate"):  # undone after the test: install patches the class
        monkeypatch.setattr(rollout.RolloutComponent, name, getattr(rollout.RolloutComponent, name))
    stats: list[dict] = []
    longtail.install(mean=4.0, max_len=8, seed=0, stats=stats)
    cfg = load_config("examples/quickstart.yaml", [
        "cluster.backend=local", "data.prompts_per_step=8", "rollout.n=4", "rollout.max_new_tokens=8",
        f"rollout.engine={engine}", "tracking.console=false", "tracking.progress=false",
        f"trainer.output_dir={tmp_path}"])
    t = Trainer(derive_plan(cfg), Tracker(tmp_path, cfg.tracking, to_dict(cfg), cfg.trainer.name), tmp_path)
    try:
        t.build_groups()
        t.progress.step = 2
        batch = t.generate(t.train_feed.next_batch(8))
    finally:
        t.shutdown()
        t.tracker.close()
    drawn = longtail.draw_lengths(32, mean=4.0, max_len=8, seed=0, step=2).tolist()
    got = batch["response_mask"].sum(1).tolist()
    assert len(set(drawn)) > 2 and stats[-1]["response_tokens"] == sum(got)  # lengths really vary
    for i, (n, limit, reason) in enumerate(zip(got, drawn, batch["finish_reason"])):
        # an EOS of the random policy may come first; otherwise the sample ends at its drawn length
        assert n <= limit, f"sample {i}: {n} tokens past its limit {limit}"
        if n < limit:
            assert reason == "stop"
        else:
            assert reason == ("length" if limit == 8 else "stop"), f"sample {i}: {reason} at {n}/{limit}"
    assert sum(n == limit for n, limit in zip(got, drawn)) > len(drawn) // 2  # most samples run to their limit
