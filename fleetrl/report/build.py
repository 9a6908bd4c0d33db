"""`fleetrl report`: runs -> groups -> (curves, a final/best table with CIs, an optional comparison) -> PNGs
and one self-contained HTML page."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from fleetrl.report.html import write_html
from fleetrl.report.load import Run, assign_groups, find_runs, run_warnings, same_metrics
from fleetrl.report.plots import PlotPlan, pick_metrics, plot_metric, png_name
from fleetrl.report.stats import Interval, mean_ci, welch_diff


@dataclass
class GroupRow:
    group: str
    seeds: list
    final: Interval
    best: Interval
    finals: list[float] = field(default_factory=list)
    bests: list[float] = field(default_factory=list)


@dataclass
class ReportResult:
    html: Path
    pngs: list[Path]
    """The plots in page order: `plots.primary` first, then `plots.secondary`."""
    plots: PlotPlan
    rows: list[GroupRow]
    score_key: str
    warnings: list[str]
    comparison: tuple[str, str, Interval, Interval] | None
    text_summary: str


def build_report(dirs: list[Path], out: Path, compare: tuple[str, str] | None = None) -> ReportResult:
    warnings: list[str] = []
    runs = find_runs(dirs, warnings)
    differing = assign_groups(runs)
    warnings += run_warnings(runs)
    groups, dup_warnings = replicate_groups(runs)
    warnings += dup_warnings
    score_key = "val/reward_mean" if any("val/reward_mean" in r.metric_keys() for r in runs) else "train/reward_mean"
    rows = [summarise(label, members, score_key) for label, members in groups.items()]
    comparison = _compare(rows, compare) if compare else None
    out.mkdir(parents=True, exist_ok=True)
    plan = pick_metrics(runs)
    primary = [plot_metric(k, groups, out / png_name(k)) for k in plan.primary]
    secondary = [plot_metric(k, groups, out / png_name(k), small=True) for k in plan.secondary]
    text = summary_text(rows, score_key, comparison)
    html = write_html(out / "report.html", runs=runs, groups=groups, rows=rows, score_key=score_key,
                      differing=differing, plots=(primary, secondary), repeats=plan.repeats, warnings=warnings,
                      comparison=comparison, summary=text)
    return ReportResult(html, primary + secondary, plan, rows, score_key, warnings, comparison, text)


def replicate_groups(runs: list[Run]) -> tuple[dict[str, list[Run]], list[str]]:
    """group label -> runs with distinct seeds. A seed that appears twice in a group (a rerun, or the same
    sweep passed twice) is counted once; the warning says whether its metrics were reproduced exactly."""
    groups: dict[str, list[Run]] = {}
    warnings = []
    for r in runs:
        if not r.group:  # no config.yaml: run_warnings says so; its setting is unknown
            continue
        members = groups.setdefault(r.group, [])
        twin = next((m for m in members if m.seed == r.seed), None)
        if twin is None:
            members.append(r)
            continue
        diff = same_metrics(twin, r)
        if diff is None:
            warnings.append(f"{twin.path} and {r.path}: same seed {r.seed} and config, identical metrics "
                            f"(reproduced); counted once")
        else:
            warnings.append(f"{twin.path} and {r.path}: same seed {r.seed} and config but DIFFERENT metrics "
                            f"({diff}); the run is not reproducible — only the first is counted")
    return groups, warnings


def summarise(label: str, members: list[Run], key: str) -> GroupRow:
    finals, bests = [], []
    for r in members:
        _, values = r.series(key)
        if values:
            finals.append(values[-1])
            bests.append(max(values))
    return GroupRow(label, [r.seed for r in members], mean_ci(finals), mean_ci(bests), finals, bests)


def _compare(rows: list[GroupRow], pair: tuple[str, str]) -> tuple[str, str, Interval, Interval]:
    by = {r.group: r for r in rows}
    missing = [g for g in pair if g not in by]
    if missing:
        raise ValueError(f"--compare {pair[0]} --compare {pair[1]}: no group named {', '.join(missing)}; groups are: "
                         f"{', '.join(by)}")
    a, b = by[pair[0]], by[pair[1]]
    return pair[0], pair[1], welch_diff(a.finals, b.finals), welch_diff(a.bests, b.bests)


def summary_text(rows: list[GroupRow], key: str, comparison) -> str:
    width = max([len(r.group) for r in rows] + [5])
    lines = [f"{'group':<{width}}  seeds  final {key} (mean ± 95% CI)      best {key}"]
    for r in rows:
        lines.append(f"{r.group:<{width}}  {len(r.seeds):>5}  {r.final.fmt():<32}  {r.best.fmt()}")
    if comparison:
        a, b, final, best = comparison
        lines.append(f"{a} - {b}: final {final.mean:+.3f} [{final.lo:+.3f}, {final.hi:+.3f}], best "
                     f"{best.mean:+.3f} [{best.lo:+.3f}, {best.hi:+.3f}] (95% CI, Welch, dof {final.dof:.1f})")
    return "\n".join(lines)
