"""Is a checkpoint safe to resume from? Completeness (meta.json, written last), then integrity.

Integrity: at save, checksums.json records every file's size and sha256; `validate_checkpoint` recomputes them,
so a flipped byte inside a same-size .distcp (bad disk, torn copy, a sync tool) is found before loading, and
`find_resume` falls back to an older checkpoint. sha256 rather than a faster hash: `sha256sum` can check a
file by hand, and OpenSSL's SHA extensions make it about as fast as blake2b on current CPUs. Files are hashed
in parallel threads (hashlib drops the GIL on large buffers), streaming in 4 MiB chunks.

Checkpoints from before checksums.json get the older checks: sizes against .metadata, and loading the small
pickles.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

COMPLETE_MARK = "meta.json"
CHECKSUMS = "checksums.json"
ALGO = "sha256"
_CHUNK = 4 * 2**20


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in chunks (never the whole file in memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def file_checksums(ckpt: Path) -> dict:
    """{"algo": "sha256", "files": {relative path: {"size": bytes, "sha256": hex}}} for every file under
    `ckpt` except meta.json and checksums.json themselves."""
    ckpt = Path(ckpt)
    files = sorted(p for p in ckpt.rglob("*") if p.is_file() and p.name not in (COMPLETE_MARK, CHECKSUMS))
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        digests = list(pool.map(sha256_file, files))
    return {"algo": ALGO, "files": {p.relative_to(ckpt).as_posix(): {"size": p.stat().st_size, ALGO: d}
                                    for p, d in zip(files, digests, strict=True)}}


def verify_checksums(ckpt: Path, manifest: dict) -> str | None:
    """None when every listed file has its recorded size and digest; else the first mismatch."""
    listed = manifest.get("files", {})
    if manifest.get("algo") != ALGO or not isinstance(listed, dict):
        return f"{CHECKSUMS} is not a {ALGO} manifest written by fleetrl"
    for rel, want in listed.items():  # sizes first: a missing or truncated file is found without reading
        f = ckpt / rel
        if not f.is_file():
            return f"{rel} is missing ({CHECKSUMS} lists it)"
        if f.stat().st_size != want["size"]:
            return f"{rel} has {f.stat().st_size} bytes, {want['size']} were saved (truncated or replaced)"
    rels = list(listed)
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        got = list(pool.map(lambda r: sha256_file(ckpt / r), rels))
    for rel, digest in zip(rels, got, strict=True):
        if digest != listed[rel][ALGO]:
            return f"{rel} is corrupt ({ALGO} {digest[:12]}…, {listed[rel][ALGO][:12]}… was saved)"
    return None


def validate_checkpoint(path: Path, *, only: str | None = None) -> str | None:
    """None when complete and intact; otherwise what is wrong (one line). `only` ("actor"): check just that role's
    files, which is all export reads, so a checkpoint copied without controller.pt or workers/ still exports."""
    path = Path(path)
    if not path.is_dir():
        return "does not exist" if not path.exists() else "is a file, not a checkpoint directory (step_N/)"
    if not (path / COMPLETE_MARK).is_file():
        return not_a_step_dir(path) or f"incomplete (no {COMPLETE_MARK}; the save was interrupted)"
    try:
        meta = json.loads((path / COMPLETE_MARK).read_text())
        if meta.get("checksums"):
            manifest = json.loads((path / meta["checksums"]).read_text())
            if only is not None:
                files = manifest.get("files", {})
                manifest = {**manifest, "files": {r: w for r, w in files.items() if r.startswith(f"{only}/")}}
            return verify_checksums(path, manifest)
    except (OSError, ValueError, KeyError, AttributeError) as e:
        return f"{COMPLETE_MARK} or {CHECKSUMS} unreadable ({type(e).__name__}: {e})"
    return _legacy_checks(path) if only is None else _check_distcp_sizes(path, roles=(only,))


def run_dir_of(path: Path) -> Path | None:
    """The run directory when `path` is one (it holds checkpoints/ or metrics.jsonl) or is its checkpoints/ folder:
    the usual mistake when a checkpoint (RUN/checkpoints/step_N) is asked for."""
    path = Path(path)
    if (path / "checkpoints").is_dir() or (path / "metrics.jsonl").is_file():
        return path
    if path.name == "checkpoints" and any(p.is_dir() for p in path.glob("step_*")):
        return path.parent
    return None


def not_a_step_dir(path: Path) -> str | None:
    """What to pass instead when `path` is a run directory (or its checkpoints/); None otherwise."""
    run = run_dir_of(path)
    if run is None:
        return None
    steps = sorted((int(p.name[5:]) for p in (run / "checkpoints").glob("step_*")
                    if p.is_dir() and p.name[5:].isdigit()))  # step_N.tmp is a save in progress, never a candidate
    example = str(run / "checkpoints" / f"step_{steps[-1]}") + " (the latest)" if steps else "RUN/checkpoints/step_N"
    return (f"is a run directory, not a checkpoint: pass one of its step directories, e.g. {example}"
            + ("" if steps else "; it holds no checkpoints yet"))


def _legacy_checks(path: Path) -> str | None:
    """Checkpoints without checksums.json: every file present, non-empty, as long as .metadata says."""
    try:
        torch.load(path / "controller.pt", weights_only=False)
        for role_dir in ("actor", "critic"):
            meta = path / role_dir / ".metadata"
            if (path / role_dir).exists() and not meta.is_file():
                return f"{role_dir}/ has no .metadata"
        for f in list(path.glob("*/*.distcp")) + list((path / "workers").glob("*.pt")):
            if f.stat().st_size == 0:
                return f"{f.relative_to(path)} is empty (truncated)"
        for f in (path / "workers").glob("*.pt"):
            torch.load(f, weights_only=False)
    except Exception as e:  # noqa: BLE001 — any unreadable file makes the checkpoint unusable
        return f"unreadable ({type(e).__name__}: {e})"
    return _check_distcp_sizes(path)


def _check_distcp_sizes(path: Path, roles: tuple[str, ...] = ("actor", "critic")) -> str | None:
    """A truncated .distcp file is shorter than the byte ranges its .metadata promises."""
    for role_dir in roles:
        meta_file = path / role_dir / ".metadata"
        if not meta_file.is_file():
            continue
        try:
            with open(meta_file, "rb") as f:
                meta = pickle.load(f)
        except Exception as e:  # noqa: BLE001
            return f"{role_dir}/.metadata unreadable ({e})"
        ends: dict[str, int] = {}
        for info in getattr(meta, "storage_data", {}).values():
            rel = getattr(info, "relative_path", None)
            if rel is not None:
                ends[rel] = max(ends.get(rel, 0), info.offset + info.length)
        for rel, end in ends.items():
            f = path / role_dir / rel
            if not f.is_file() or f.stat().st_size < end:
                return f"{role_dir}/{rel} is truncated ({f.stat().st_size if f.is_file() else 0} < {end} bytes)"
    return None
