"""prompts.jsonl, next to metrics.jsonl: which prompts each step trained, so that "resume loses nothing" can be read
off a run directory (docs/async.md, Resume).

One line per step, `{"step": S, "prompts": [uid, ...]}`, one uid per GRPO group in the order the step trained
them; a uid is the prompt's `source_file:row` (data/records.py), the same in every run and process. The driver
writes it from the batch's `uid` field it already holds (the rank-local step: from the prompts it drew), no
tensor moves for it. A resume appends `{"event": "resumed", "supersedes_after": S}`, as metrics.jsonl does: the
records of steps after S that the file already holds belong to the run that died, and the resumed run writes those
steps again. `trained_prompts` reads the file with that rule.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Iterable, Sequence

log = logging.getLogger("fleetrl.trainer")
FILE = "prompts.jsonl"


class PromptLog:
    def __init__(self, out_dir: Path) -> None:
        self.path = Path(out_dir) / FILE
        self._warned = False

    def step(self, step: int, uids: Sequence[str]) -> None:
        self._append({"step": step, "prompts": [str(u) for u in uids]})

    def resumed(self, step: int) -> None:
        """The run continues after step `step`: later records already in the file are superseded. Nothing is
        written for a run that has no file yet."""
        if self.path.is_file():
            self._append({"event": "resumed", "supersedes_after": step})

    def _append(self, record: dict) -> None:
        """One write per record, opened for appending each time (a step's cost, microseconds). A line a kill cut
        short is ended first, so it never swallows the next record. A full disk costs the record and a warning,
        never the run (the checkpoint save that follows reports the disk)."""
        line = json.dumps(record) + "\n"
        try:
            with open(self.path, "a+b") as f:  # appends whatever was read: the write goes to the end
                end = f.seek(0, os.SEEK_END)
                if end and f.seek(end - 1) is not None and f.read(1) != b"\n":
                    line = "\n" + line
                f.write(line.encode())
        except OSError as e:
            if not self._warned:
                log.warning("%s: a step's prompt record was not written (%s)", self.path, e)
                self._warned = True


def parse(lines: Iterable[str]) -> dict[int, list[str]]:
    """step -> the prompts that step trained, as the run's final history has it: a `resumed` record drops the
    steps after its `supersedes_after`, a later record of a step replaces an earlier one. Lines that are not a
    JSON object (a line cut by a kill) are skipped."""
    steps: dict[int, list[str]] = {}
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict):
            continue
        if rec.get("event") == "resumed":
            after = int(rec["supersedes_after"])
            steps = {s: p for s, p in steps.items() if s <= after}
        elif "step" in rec and "prompts" in rec:
            steps[int(rec["step"])] = list(rec["prompts"])
    return dict(sorted(steps.items()))


def trained_prompts(run_dir: Path) -> dict[int, list[str]]:
    """`parse` of a run directory's prompts.jsonl ({} when there is none)."""
    path = Path(run_dir) / FILE
    return parse(path.read_text().splitlines()) if path.is_file() else {}
