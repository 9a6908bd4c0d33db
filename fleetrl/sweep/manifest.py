"""The sweep manifest, `SWEEP_DIR/sweep.json`: what was asked (config, overrides, seeds, grid, resources) and
each run's state, attempts and last error. Written atomically after every state change, so `--resume` and
`fleetrl report` read a consistent file even when the sweep was killed mid-write."""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fleetrl.errors import UserError
from fleetrl.sweep.spec import RunSpec

MANIFEST = "sweep.json"
VERSION = 1
# queued -> running -> finished | failed; running -> queued again on a retry; stopped = interrupted by the user.
STATES = ("queued", "running", "finished", "failed", "stopped")


class ManifestError(UserError, ValueError):
    """sweep.json cannot be read; the message names the file, what is wrong and how to go on."""


@dataclass(kw_only=True)
class RunRecord:
    name: str
    seed: int
    grid: dict[str, str]
    state: str = "queued"
    attempts: int = 0
    failures: int = 0
    """Attempts that died or stalled (a Ctrl-C is not one): `--retries` bounds these."""
    exit_code: int | None = None
    error: str | None = None
    """Why the last attempt ended badly, and the tail of its log."""
    resources: str = ""
    ray_tmp: str | None = None
    pid: int | None = None
    """Session leader of the last attempt and its start time (psutil create_time): lets `--resume` find and end
    the runs of a sweep that was killed with SIGKILL, without ever touching a reused pid."""
    pid_created: float | None = None
    started: float | None = None
    """Unix time the last attempt started / ended (shows which runs overlapped)."""
    ended: float | None = None

    @property
    def spec(self) -> RunSpec:
        return RunSpec(name=self.name, seed=self.seed, grid=dict(self.grid))


@dataclass(kw_only=True)
class Manifest:
    config: str
    """The base config as copied into the sweep dir (so a resume does not depend on the original file)."""
    overrides: list[str]
    seeds: list[int]
    grid: dict[str, list[str]]
    runs: list[RunRecord]
    options: dict = field(default_factory=dict)
    created: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    version: int = VERSION

    def save(self, sweep_dir: Path) -> None:
        tmp = sweep_dir / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        os.replace(tmp, sweep_dir / MANIFEST)

    @classmethod
    def load(cls, sweep_dir: Path) -> Manifest:
        path = Path(sweep_dir) / MANIFEST
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist: --resume takes a directory made by `fleetrl sweep` "
                                    f"(its --out), which holds {MANIFEST}")
        raw = _read(path)
        try:
            raw["runs"] = [RunRecord(**r) for r in raw["runs"]]
            return cls(**raw)
        except (KeyError, TypeError) as e:  # a field missing or unknown, or runs not a list of objects
            raise _damaged(path, f"it does not hold a fleetrl sweep manifest ({_what(e)})") from None

    def counts(self) -> dict[str, int]:
        return {s: sum(r.state == s for r in self.runs) for s in STATES if any(r.state == s for r in self.runs)}


def _read(path: Path) -> dict:
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:  # e.g. edited by hand, or a disk that filled up
        raise _damaged(path, f"not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise _damaged(path, f"cannot be read ({e})") from None
    if not isinstance(raw, dict):
        raise _damaged(path, f"expected a JSON object, got {type(raw).__name__}")
    if raw.get("version") != VERSION:
        raise ManifestError(f"{path}: manifest version {raw.get('version')!r}, this fleetrl reads {VERSION}; "
                            f"use the fleetrl that made the sweep, or report its runs directly: fleetrl report "
                            f"{path.parent}")
    return raw


def _damaged(path: Path, what: str) -> ManifestError:
    # The file is left as it is and the runs' own directories are untouched: nothing is lost by this error.
    tmp = path.with_name(MANIFEST + ".tmp")
    restore = f"restore it from {tmp} (an interrupted save) or a backup, or " if tmp.is_file() else \
        "restore it from a backup, or "
    return ManifestError(f"{path}: {what}; {restore}start a new sweep with another --out (each run's directory "
                         f"under {path.parent} still holds its metrics and checkpoints)")


def _what(e: KeyError | TypeError) -> str:
    if isinstance(e, KeyError):
        return f"field {e.args[0]!r} is missing"
    return str(e).replace(".__init__()", ":")
