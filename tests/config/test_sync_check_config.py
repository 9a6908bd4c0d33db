"""rollout.sync_check (engines/sync_check.py): its values are checked once, each bad one a single `error:` line."""
import pytest
from typer.testing import CliRunner

from fleetrl.cli.main import app
from fleetrl.config import load_config
from fleetrl.config.load import ConfigError
from fleetrl.config.plan import derive_plan

BASE = ["model.path=tiny:"]


def _plan(*overrides: str):
    return derive_plan(load_config("examples/quickstart.yaml", [*BASE, *overrides]))


@pytest.mark.parametrize("override, message", [
    ("rollout.sync_check.tokens=-1", "rollout.sync_check.tokens must be >= 0 (0 = off), got -1"),
    ("rollout.sync_check.sequences=0", "rollout.sync_check.sequences must be >= 1, got 0"),
    ("rollout.sync_check.threshold=-0.1", "rollout.sync_check.threshold must be >= 0 (a log-prob gap; .inf = never)"),
    ("rollout.sync_check.threshold=nan", "rollout.sync_check.threshold must be >= 0"),
    ("rollout.sync_check.on_mismatch=restrat", "did you mean 'restart'?"),
    ("rollout.sync_check.mode=relative", "rollout.sync_check.mode: unknown value 'relative'"),
])
def test_bad_values_are_one_error_line(override, message):
    with pytest.raises(ConfigError, match=None) as e:
        _plan(override)
    assert message in str(e.value) and "\n" not in str(e.value)
    r = CliRunner().invoke(app, ["config", "show", "examples/quickstart.yaml", *BASE, override])
    assert r.exit_code == 2 and r.output.startswith("error: ") and message in r.output, r.output


def test_on_by_default_off_with_zero_tokens_or_in_async_mode():
    # the default judges each step's own samples (source=step); the probe runs only when asked for
    assert _plan().step_sync_check and not _plan().sync_check
    probe = "rollout.sync_check.source=probe"
    assert _plan(probe).sync_check and not _plan(probe).step_sync_check
    assert _plan(probe, "rollout.sync_check.threshold=inf").sync_check
    for source in ("step", "probe"):
        p = _plan(f"rollout.sync_check.source={source}", "rollout.sync_check.tokens=0")
        assert not p.sync_check and not p.step_sync_check
    split = ["cluster.pools={train: {cpus_per_worker: 0.5}, gen: {cpus_per_worker: 0.5}}",
             "cluster.roles={actor: train, rollout: gen}"]
    assert _plan(*split, probe).sync_check and not _plan(*split, probe, "trainer.mode=async").sync_check
    assert _plan(*split).step_sync_check and not _plan(*split, "trainer.mode=async").step_sync_check
