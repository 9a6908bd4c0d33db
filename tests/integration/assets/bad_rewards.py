"""Reward functions for the integration tests: ones that misbehave, and a constant that only a served scorer gives."""
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


def served_constant(response, ground_truth, extra_info):
    """A score no local scorer gives: a run that reports it scored over HTTP."""
    return 0.75
