"""What the sweep shows while it runs: a live rich table on a terminal, or, when stdout is a file or a pipe
(CI, nohup), one plain line per run every `plain_every_s` seconds, so logs stay readable."""
from __future__ import annotations

import time

from rich.console import Console
from rich.live import Live
from rich.table import Table

from fleetrl.sweep.health import Heartbeat
from fleetrl.sweep.manifest import RunRecord

_STYLE = {"queued": "dim", "running": "cyan", "finished": "green", "failed": "bold red", "stopped": "yellow"}


def _fmt(v: float | None, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def _eta(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(s)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def rows(runs: list[RunRecord], beats: dict[str, Heartbeat], totals: dict[str, int | None]) -> list[list[str]]:
    """[run, state, step/total, reward, val reward, s/step, ETA, resources, attempts] per run."""
    out = []
    for r in runs:
        b = beats.get(r.name)
        total = totals.get(r.name)
        step = f"{b.step if b else '-'}/{total if total is not None else '?'}"
        out.append([r.name, r.state, step, _fmt(b.reward if b else None), _fmt(b.val_reward if b else None),
                    _fmt(b.s_per_step if b else None, ".2f"), _eta(b.eta_s if b else None), r.resources or "-",
                    str(r.attempts)])
    return out


HEADER = ["run", "state", "step", "reward", "val", "s/step", "ETA", "resources", "tries"]


class StatusView:
    def __init__(self, console: Console, live: bool | None = None, plain_every_s: float = 30.0) -> None:
        self.console = console
        self.live_mode = console.is_terminal if live is None else live
        self.plain_every_s = plain_every_s
        self._live: Live | None = None
        self._last_plain = 0.0

    def __enter__(self):
        if self.live_mode:
            # Manual refresh: the sweep loop stays the only thread (signal handling and fork stay simple).
            self._live = Live(Table(), console=self.console, auto_refresh=False, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)

    def update(self, runs: list[RunRecord], beats: dict[str, Heartbeat], totals: dict[str, int | None]) -> None:
        table_rows = rows(runs, beats, totals)
        if self._live is not None:
            table = Table(*HEADER, title="fleetrl sweep", expand=False)
            for row in table_rows:
                table.add_row(*row, style=_STYLE.get(row[1], ""))
            self._live.update(table, refresh=True)
        elif time.monotonic() - self._last_plain >= self.plain_every_s:
            self._last_plain = time.monotonic()
            for row in table_rows:
                if row[1] == "running":
                    self.console.print("  ".join(f"{h}={v}" for h, v in zip(HEADER, row)), markup=False,
                                       highlight=False, soft_wrap=True)
