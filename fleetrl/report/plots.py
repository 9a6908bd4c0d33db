"""Curves for a report: one PNG per metric, each group a colour, each seed a thin line, the across-seed mean a
thick line with its 95% t band. Which metrics: first the few a person reads first (reward, validation reward,
response length, KL and entropy, step time), then the rest that RL post-training people plot, in that order, as
far as the runs logged them (the key names are fleetrl's metrics.jsonl names). A metric that repeats an earlier
one value for value (a per-data_source mean with one data source, pass@1 of a 0/1 reward) is not plotted again."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers, and no GUI backend thread in a CLI
import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator

from fleetrl.report.load import Run
from fleetrl.report.stats import band

# The plots read first, in this order: reward, validation reward, response length, KL/entropy, step time.
PRIMARY = ("train/reward_mean", "val/reward_mean", "train/response_length_mean", "train/kl", "train/entropy",
           "train/time/step")
# The rest, ordered: rewards (pass@k, per data_source), then the policy's health, then throughput and memory.
SECONDARY_PATTERNS = (
    r"val/pass@\d+", r"val/(?!reward_mean|pass@).+/mean@\d+", r"train/reward/.+/mean",
    r"train/actor/approx_kl", r"train/actor/kl_loss",
    r"train/response_clip_ratio", r"train/actor/clip_frac",
    r"train/actor/grad_norm", r"train/actor/pg_loss", r"train/critic/.+loss", r"train/critic/grad_norm",
    # memory before the per-phase timings, which are many and may meet MAX_SECONDARY first
    r"train/tokens_per_s", r"train/memory/gpu_.+", r"train/memory/.+", r"train/time/(?!step).+",
)
MAX_SECONDARY = 24


@dataclass(frozen=True)
class PlotPlan:
    primary: list[str]
    secondary: list[str]
    repeats: dict[str, str] = field(default_factory=dict)
    """metric left out -> the earlier metric whose values it repeats in every run."""


def pick_metrics(runs: list[Run]) -> PlotPlan:
    keys = set().union(*(r.metric_keys() for r in runs)) if runs else set()
    primary = [k for k in PRIMARY if k in keys]
    chosen, secondary, repeats = list(primary), [], {}
    for pattern in SECONDARY_PATTERNS:
        for k in sorted(k for k in keys if re.fullmatch(pattern, k) and k not in chosen):
            twin = next((c for c in chosen if _repeats(runs, k, c)), None)
            if twin is not None:
                repeats[k] = twin
                continue
            chosen.append(k)
            secondary.append(k)
    return PlotPlan(primary, secondary[:MAX_SECONDARY], repeats)


def _repeats(runs: list[Run], key: str, earlier: str) -> bool:
    """True when `key` has the same steps and values as `earlier` in every run, and they vary (two flat lines
    at 0, e.g. clip fraction and approx KL of a one-epoch update, are different metrics that happen to agree)."""
    series = [(r.series(key), r.series(earlier)) for r in runs]
    return all(a == b for a, b in series) and len({v for (_, vs), _ in series for v in vs}) > 1


def plot_metric(key: str, groups: dict[str, list[Run]], path: Path, small: bool = False) -> Path:
    """`small`: a smaller canvas for the secondary grid, so its text stays legible at half the width."""
    fig, ax = plt.subplots(figsize=(4.8, 3.0) if small else (6.4, 3.8), dpi=100)
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
