"""The report as ONE self-contained HTML file: plots inlined as base64 PNGs, tables, the configs' differences and
the log tails of failed runs. No scripts, no external assets: it opens from a mail attachment or an artifact."""
from __future__ import annotations

import base64
import html
import time
from pathlib import Path

from fleetrl.report.load import Run

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#222;max-width:1400px}
h1{font-size:22px;margin-bottom:4px} h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:13px;margin:8px 0} td,th{border:1px solid #ccc;padding:4px 8px;text-align:left}
th{background:#f3f3f3} .num{text-align:right;font-variant-numeric:tabular-nums}
.plots{display:grid;grid-template-columns:repeat(auto-fill,minmax(540px,1fr));gap:10px}
.plots img{width:100%;border:1px solid #eee}
.plots.small{grid-template-columns:repeat(auto-fill,minmax(300px,1fr));gap:6px}
h3{font-size:14px;margin-top:22px;color:#555} .warn{background:#fff6d6;padding:6px 10px;margin:4px 0;font-size:13px}
.bad{background:#ffe3e3} pre{background:#f6f6f6;padding:8px;font-size:12px;overflow-x:auto;max-height:320px}
.muted{color:#777;font-size:13px}
"""


def _e(x: object) -> str:
    return html.escape(str(x))


def _table(header: list[str], rows: list[list[str]], num_cols: tuple[int, ...] = ()) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td class='num'>{c}</td>" if i in num_cols else f"<td>{c}</td>"
                                    for i, c in enumerate(r)) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _img(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return f"<img alt='{_e(path.stem)}' src='data:image/png;base64,{data}'>"


def _ci(iv) -> str:
    if iv.n == 0:
        return "-"
    if iv.n == 1:
        return f"{iv.mean:.3f} <span class='muted'>(1 seed, no CI)</span>"
    return f"{iv.mean:.3f} ± {iv.half_width:.3f} <span class='muted'>[{iv.lo:.3f}, {iv.hi:.3f}]</span>"


def _summary_section(rows, score_key: str, comparison) -> str:
    # "seeds" is how many replicates the interval rests on; which seeds they are comes last, for reference.
    table = _table(["group", "seeds", f"final {score_key}", f"best {score_key}", "seed values"],
                   [[_e(r.group), str(len(r.seeds)), _ci(r.final), _ci(r.best),
                     f"<span class='muted'>{_e(', '.join(map(str, r.seeds)))}</span>"] for r in rows], (1,))
    out = (f"<h2>Final and best {_e(score_key)} per group</h2><p class='muted'>mean ± half-width of the 95% "
           f"t-interval across seeds [lower, upper]</p>{table}")
    if comparison:
        a, b, final, best = comparison
        out += (f"<h2>{_e(a)} − {_e(b)}</h2>" + _table(
            ["", "difference", "95% CI (Welch)", "dof"],
            [[label, f"{iv.mean:+.4f}", f"[{iv.lo:+.4f}, {iv.hi:+.4f}]", f"{iv.dof:.1f}"]
             for label, iv in (("final", final), ("best", best))], (1, 2, 3)))
    return out


def _config_section(groups: dict[str, list[Run]], differing: list[str]) -> str:
    if not differing:
        return "<h2>Config differences</h2><p class='muted'>all runs share one config (apart from seeds)</p>"
    rows = [[_e(k)] + [_e(members[0].config.get(k, "—")) for members in groups.values()] for k in differing]
    return "<h2>Config differences</h2>" + _table(["key", *groups], rows)


def _runs_section(runs: list[Run]) -> str:
    rows = []
    for r in runs:
        _, rewards = r.series("train/reward_mean")
        restarts = sum(e.get("event") in ("restart", "resumed") for e in r.events)
        rows.append([_e(r.name), _e(r.group or "— (no config.yaml)"), _e(r.seed), str(max(r.steps, default="-")),
                     f"{rewards[-1]:.3f}" if rewards else "-", str(restarts), _e(r.sweep_state or "-")])
    out = "<h2>Runs</h2>" + _table(["run", "group", "seed", "last step", "last train reward", "restarts",
                                    "sweep state"], rows, (3, 4, 5))
    for r in runs:
        if r.sweep_state == "failed" and r.sweep_error:
            out += f"<h2 class='bad'>failed: {_e(r.name)}</h2><pre>{_e(r.sweep_error)}</pre>"
    return out


def _curves_section(primary: list[Path], secondary: list[Path], repeats: dict[str, str]) -> str:
    out = ("<h2>Curves</h2><p class='muted'>thin lines: seeds; thick line: mean; band: 95% t-interval across "
           "seeds</p><div class='plots'>" + "".join(_img(p) for p in primary) + "</div>")
    if secondary or repeats:
        out += "<h3>More metrics</h3>"
    if repeats:
        same = "; ".join(f"{_e(k)} = {_e(v)}" for k, v in repeats.items())
        out += f"<p class='muted'>not plotted (the same values as another plot in every run): {same}</p>"
    if secondary:
        out += "<div class='plots small'>" + "".join(_img(p) for p in secondary) + "</div>"
    return out


def write_html(path: Path, *, runs: list[Run], groups: dict[str, list[Run]], rows, score_key: str,
               differing: list[str], plots: tuple[list[Path], list[Path]], repeats: dict[str, str],
               warnings: list[str], comparison, summary: str) -> Path:
    """`plots`: (primary, secondary) PNGs in page order; `repeats`: metrics left out -> the plot they repeat."""
    sources = sorted({str(r.path.parent) for r in runs})
    head = (f"<!doctype html><html><head><meta charset='utf-8'><title>fleetrl report</title><style>{_CSS}"
            f"</style></head><body><h1>fleetrl report</h1><p class='muted'>{len(runs)} run(s) in {len(groups)} "
            f"group(s) from {_e(', '.join(sources))} — {_e(time.strftime('%Y-%m-%d %H:%M'))}</p>")
    parts = [head]
    parts += [f"<div class='warn'>{_e(w)}</div>" for w in warnings]
    parts.append(_summary_section(rows, score_key, comparison))
    parts.append(_curves_section(*plots, repeats))
    parts.append(_config_section(groups, differing))
    parts.append(_runs_section(runs))
    parts.append(f"<h2>Summary (text)</h2><pre>{_e(summary)}</pre></body></html>")
    path.write_text("".join(parts))
    return path
