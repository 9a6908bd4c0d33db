"""The tool-use task must be LEARNED through the real trainer (Ray workers, the `fleetrl train` path): held-out
greedy success on `synthetic:lookup` from < 20% to > 80% within a fixed step budget, for every seed listed.

The answer (a digit in the episode's own table) appears nowhere in the prompt, so a policy that does not call the
tool is right 1 time in 10 at best; success needs the call `?`, then the looked-up digit copied from the tool's
reply (examples/tools_lookup_tiny.yaml, docs/envs.md "The learning test"). Success is pass@1 (score >= 1): the
0.1 shaping bonus for a successful call alone never reaches 1. That environment tokens have zero weight in the
loss (and in KL, entropy and advantages) is asserted through the trainer by tests/envs/test_env_training.py.
"""
import pytest

from tests.integration.helpers import train_run

# Both seeds: 166 s on the shared 2-core dev machine at load average ~6 (77 s + 70 s of training, 11 s Ray start).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SUCCESS = "val/synthetic/lookup/pass@1"


# Two seeds: a result that holds for one seed only is not a result (with plain `grpo` and a 0.01 entropy bonus,
# seed 0 passed and seed 1 stalled at 71%; docs/envs.md has the per-seed curves of the current settings).
@pytest.mark.parametrize("seed", [0, 1])
def test_lookup_tool_use_is_learned(tmp_path, ray_local, seed: int):
    records = train_run("examples/tools_lookup_tiny.yaml", tmp_path / "run", f"trainer.seed={seed}")
    curve = [r[SUCCESS] for r in records if SUCCESS in r]
    steps = [r for r in records if "train/env/tool_calls" in r]
    assert curve[0] < 0.2, f"seed {seed}: initial held-out success {curve[0]} should start below 20%"
    assert curve[-1] > 0.8, f"seed {seed}: held-out success curve {curve} did not pass 80%"
    # Learned by calling: by the end every episode makes exactly one call, then answers (2 turns).
    assert steps[-1]["train/env/tool_calls"] > 0.95 and steps[-1]["train/env/turns"] > 1.95
