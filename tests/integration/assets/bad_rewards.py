"""Reward functions that misbehave, for the bad-input tests."""
import time


def raises(response, ground_truth, extra_info):
    raise RuntimeError("scorer bug")


def hangs_on_three(response, ground_truth, extra_info):
    if ground_truth == "3":
        time.sleep(60)
    return 1.0 if response.strip().startswith(ground_truth) else 0.0


def sleeps_forever(response, ground_truth, extra_info):
    time.sleep(10_000)
    return 0.0
