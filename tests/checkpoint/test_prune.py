from fleetrl.checkpoint.manager import prune


def test_keep_last_and_keep_every(tmp_path):
    for s in range(1, 11):
        (tmp_path / f"step_{s}").mkdir()
    (tmp_path / "step_11.tmp").mkdir()
    prune(tmp_path, keep_last=3, keep_every=4)
    left = sorted(p.name for p in tmp_path.iterdir())
    # last 3 (8, 9, 10) + multiples of 4 (4, 8) + the in-progress tmp dir untouched
    assert left == ["step_10", "step_11.tmp", "step_4", "step_8", "step_9"]
