import pytest

from fleetrl.sweep.spec import RunSpec, expand, parse_grid, parse_seeds


def test_seeds_times_grid_in_seed_major_order():
    grid = parse_grid(["algorithm.advantage=grpo,rloo", "actor.optim.lr=1e-3,1e-4"])
    runs = expand([42, 7], grid)
    # 2 seeds x 2 advantages x 2 learning rates = 8 runs; every setting of seed 42 comes before any of seed 7.
    assert len(runs) == 8
    assert [r.seed for r in runs] == [42] * 4 + [7] * 4
    assert runs[0].grid == {"algorithm.advantage": "grpo", "actor.optim.lr": "1e-3"}
    assert runs[3].grid == {"algorithm.advantage": "rloo", "actor.optim.lr": "1e-4"}
    assert runs[0].name == "advantage=grpo,lr=1e-3,seed=42"
    assert len({r.name for r in runs}) == 8


def test_overrides_record_seed_and_grid_values():
    spec = RunSpec(name="x", seed=3, grid={"algorithm.advantage": "rloo"})
    assert spec.overrides() == ["algorithm.advantage=rloo", "trainer.seed=3"]


def test_no_grid_is_one_run_per_seed():
    assert [r.name for r in expand([1, 2], {})] == ["seed=1", "seed=2"]


def test_keys_with_the_same_last_part_keep_their_full_name():
    runs = expand([0], parse_grid(["actor.optim.lr=1,2", "critic.optim.lr=3"]))
    assert runs[0].name == "actor.optim.lr=1,critic.optim.lr=3,seed=0"


def test_unsafe_characters_in_values_become_underscores():
    runs = expand([0], parse_grid(["rewards.default=/x/y.py:fn"]))
    assert runs[0].name == "default=_x_y.py_fn,seed=0"


@pytest.mark.parametrize("text, match", [("42,x", "comma-separated integers"), ("", "at least one seed"),
                                         ("1,2,1", r"seed\(s\) \[1\] appear more than once")])
def test_bad_seeds(text, match):
    with pytest.raises(ValueError, match=match):
        parse_seeds(text)


@pytest.mark.parametrize("items, match", [
    (["algorithm.advantage"], "expected KEY=V1,V2"),
    (["trainer.seed=1,2"], "set by the sweep for each run"),
    (["a.b=1", "a.b=2"], "given twice"),
    (["a.b=1,1"], "non-empty and distinct"),
])
def test_bad_grid(items, match):
    with pytest.raises(ValueError, match=match):
        parse_grid(items)


def test_values_that_collide_after_sanitising_are_rejected():
    with pytest.raises(ValueError, match="same run directory name"):
        expand([0], parse_grid(["rewards.default=a:b,a/b"]))
