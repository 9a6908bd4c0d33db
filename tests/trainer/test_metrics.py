from dataclasses import FrozenInstanceError

import pytest

from fleetrl.trainer.metric_names import is_machine_metric
from fleetrl.trainer.metrics import pass_at_k
from fleetrl.workers.messages import Extreme, UpdateMetrics


def test_update_metrics_sum_shares_and_keep_rank0_norms():
    same = {"actor/grad_norm": 2.0, "actor/lr": 1e-3}
    ranks = [UpdateMetrics.of({"actor/pg_loss": 0.25, "actor/clip_frac": 0.1}, same),
             UpdateMetrics.of({"actor/pg_loss": 0.5, "actor/clip_frac": 0.3}, same)]
    out = UpdateMetrics.reduce(ranks)
    # shares add (0.25 + 0.5, 0.1 + 0.3); grad norm and lr are equal on every rank and taken once
    assert out == pytest.approx({"actor/pg_loss": 0.75, "actor/clip_frac": 0.4, "actor/grad_norm": 2.0,
                                 "actor/lr": 1e-3})


def test_pass_at_k_hand_computed():
    # prompt 1 has a success among its 3 samples, prompt 2 none, prompt 3 all: 2 of 3 prompts pass
    assert pass_at_k([[0, 1, 0], [0, 0, 0.5], [1, 1, 1]]) == pytest.approx(2 / 3)


def test_memory_peaks_take_the_max_over_ranks_and_roles():
    same = {"actor/grad_norm": 2.0}
    rss, gpu = "memory/rss_peak_gib", "memory/gpu_peak_allocated_gib"
    actor = [UpdateMetrics.of({"actor/pg_loss": 0.25}, same).with_extremes({rss: Extreme(1.5, "max"),
                                                                            gpu: Extreme(10.0, "max")}),
             UpdateMetrics.of({"actor/pg_loss": 0.5}, same).with_extremes({rss: Extreme(2.5, "max"),
                                                                          gpu: Extreme(12.0, "max")})]
    critic = [UpdateMetrics.of({"critic/vf_loss": 1.0}, {"critic/grad_norm": 3.0}, {rss: Extreme(3.0, "max")}),
              UpdateMetrics.of({"critic/vf_loss": 2.0}, {"critic/grad_norm": 3.0}, {rss: Extreme(0.5, "max")})]
    # one role: max over its two ranks (2.5 and 12), the shares still add (0.25 + 0.5)
    assert UpdateMetrics.reduce(actor) == pytest.approx({"actor/pg_loss": 0.75, "actor/grad_norm": 2.0,
                                                         rss: 2.5, gpu: 12.0})
    # both roles: rss is max(1.5, 2.5, 3.0, 0.5) = 3.0, the critic's rank 0, whichever role reported last
    assert UpdateMetrics.reduce_roles([critic, actor]) == pytest.approx(
        {"critic/vf_loss": 3.0, "critic/grad_norm": 3.0, "actor/pg_loss": 0.75, "actor/grad_norm": 2.0,
         rss: 3.0, gpu: 12.0})
    assert UpdateMetrics.reduce_roles([]) == {}


def test_with_extremes_keeps_the_message_frozen():
    base = UpdateMetrics.of({"actor/pg_loss": 0.5}, {"actor/lr": 1e-3}, {"actor/ratio_max": Extreme(1.2, "max")})
    out = base.with_extremes({"memory/rss_peak_gib": Extreme(1.0, "max")})
    assert set(out.extremes) == {"actor/ratio_max", "memory/rss_peak_gib"} and set(base.extremes) == {"actor/ratio_max"}
    assert out.shares == base.shares and out.same == base.same
    with pytest.raises(FrozenInstanceError):
        out.extremes = {}  # type: ignore[misc]


@pytest.mark.parametrize("name, machine", [
    ("train/time/step", True), ("train/time/worker_call_overhead", True), ("val/time/generate", True),
    ("train/tokens_per_s", True), ("train/memory/rss_peak_gib", True), ("train/memory/gpu_peak_reserved_gib", True),
    ("train/env/tool_time_s", True), ("train/env/env_wait_s", True), ("async/actor_wait_s", True),
    ("async/rollout_idle_s", True),
    ("train/actor/pg_loss", False), ("train/reward_timeouts", False), ("train/actor/tokens_slots", False),
    ("async/staleness_mean", False), ("train/env/tool_calls", False),
])
def test_machine_metrics_are_timings_throughput_and_memory(name: str, machine: bool):
    assert is_machine_metric(name) is machine
