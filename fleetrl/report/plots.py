"""Curves for a report: one PNG per metric, each group a colour, each seed a thin line, the across-seed mean a
thick line with its 95% t band. Which metrics: the ones people plot for RL post-training, in that order, as far
as the runs logged them (the key names are fleetrl's metrics.jsonl names)."""
from __future__ import annotations

import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers, and no GUI backend thread in a CLI
import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator

from fleetrl.report.load import Run
from fleetrl.report.stats import band

# Ordered: rewards first (overall, then per data_source), then the policy's health, then throughput and memory.
METRIC_PATTERNS = (
    r"val/reward_mean", r"train/reward_mean", r"val/pass@\d+",
    r"val/(?!reward_mean|pass@).+/mean@\d+", r"train/reward/.+/mean",
    r"train/kl", r"train/actor/approx_kl", r"train/actor/kl_loss", r"train/entropy",
    r"train/response_length_mean", r"train/response_clip_ratio", r"train/actor/clip_frac",
    r"train/actor/grad_norm", r"train/actor/pg_loss", r"train/critic/.+loss", r"train/critic/grad_norm",
    # memory before the per-phase timings, which are many and may meet MAX_PLOTS first
    r"train/time/step", r"train/tokens_per_s", r"train/memory/gpu_.+", r"train/memory/.+", r"train/time/(?!step).+",
)
MAX_PLOTS = 30


def pick_metrics(runs: list[Run]) -> list[str]:
    keys = set().union(*(r.metric_keys() for r in runs)) if runs else set()
    out: list[str] = []
    for pattern in METRIC_PATTERNS:
        out += sorted(k for k in keys if re.fullmatch(pattern, k) and k not in out)
    return out[:MAX_PLOTS]


def plot_metric(key: str, groups: dict[str, list[Run]], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6.4, 3.8), dpi=100)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, runs) in enumerate(groups.items()):
        color = colors[i % len(colors)]
        series = [r.series(key) for r in runs]
        series = [s for s in series if s[0]]
        for steps, values in series:
            ax.plot(steps, values, color=color, alpha=0.3, linewidth=0.9)
        steps, cis = band(series)
        if not steps:
            continue
        ax.plot(steps, [c.mean for c in cis], color=color, linewidth=2.2, label=f"{label} (n={len(series)})")
        if len(series) > 1:
            ax.fill_between(steps, [c.lo for c in cis], [c.hi for c in cis], color=color, alpha=0.18, linewidth=0)
    ax.set_title(key, fontsize=10)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def png_name(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", key) + ".png"
