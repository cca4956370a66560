"""The checkpoint format: manifest, verification, listing, retention, all as functions of what is on disk.

A checkpoint is `checkpoints/step_00001000/`: the state (Accelerate's `save_state`: model, optimizer, RNG, DeepSpeed
shards included; FSDP: DCP shards in `dcp/`) plus `meta.json` (our state) plus `manifest.json` (size and xxh3-128 of
every file, each hashed by the rank that wrote it), written into a hidden temporary directory and renamed into place
after the manifest. A directory without a valid manifest is never resumed
from. All state is read from `meta.json`, never parsed out of directory names.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import PretrainerError
from ..files import atomic_write_json
from . import integrity

MANIFEST = "manifest.json"
META = "meta.json"
TMP_PREFIX = ".tmp-"
ASIDE_PREFIX = ".passed-over-"
"""A checkpoint directory that could neither be read nor removed, renamed out of the way of a new save."""


class CheckpointError(PretrainerError):
    """A checkpoint could not be written (disk full, permissions): earlier checkpoints are intact."""

    exit_code = 74  # EX_IOERR


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_files(directory: Path) -> dict[str, int]:
    """Every file under a checkpoint directory (the manifest excepted), relative path -> size."""
    return {
        str(p.relative_to(directory)): p.stat().st_size
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }


def write_manifest(directory: Path, files: dict[str, dict] | None = None) -> dict:
    """Write the manifest last, durably. `files`: the ranks' merged entries (each rank hashed and fsynced its own
    share); None: hash and fsync every file here (a single writer)."""
    if files is None:
        files = integrity.entries(directory, list(list_files(directory)))
    manifest = {"files": dict(sorted(files.items())), "hash": integrity.HASH, "created": time.time()}
    atomic_write_json(directory / MANIFEST, manifest, durable=True)
    return manifest


WEIGHTS = (
    "model*.safetensors",
    "pytorch_model*/*model_states.pt",
    "pytorch_model_fsdp*/**/*",
    "model*.bin",
    "dcp/.metadata",
)
"""What a loader needs at least one of: Accelerate's weights, DeepSpeed's or FSDP's shards, our DCP checkpoint."""


def _json(path: Path, what: str) -> tuple[dict | None, str | None]:
    """A JSON object from a file, or why not (missing, unreadable, not UTF-8, not JSON, not an object)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None, f"no {what}"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return None, f"{what}: unreadable ({type(e).__name__})"
    return (data, None) if isinstance(data, dict) else (None, f"{what}: not a JSON object")


def meta_problem(meta: dict) -> str | None:
    for key in ("step", "tokens", "stage_index", "cursor"):
        if not isinstance(meta.get(key), int) or isinstance(meta.get(key), bool) or meta[key] < 0:
            return f"meta.json: `{key}` missing or not a non-negative integer"
    if not isinstance(meta.get("skips", []), list) or not isinstance(meta.get("recipe", {}), dict):
        return "meta.json: `skips` or `recipe` has the wrong type"
    return None


def verify(
    directory: str | Path, hashes: bool = True, scan: bool = False, share: tuple[int, int] | None = None
) -> list[str]:
    """Problems with a checkpoint; empty means it can be resumed from. Never raises.

    The manifest must list every file in the directory (a file it does not know was not there when it was written)
    and at least one weights file; each listed file must exist with its size (and its hash); meta.json must not
    record a non-finite state at the save.

    Args:
        hashes: hash the files (off: sizes only, the cheap check retention uses).
        scan: the deep check: also read weights and optimizer state from the files for NaN/Inf (`check_run.py`,
            `--verify deep`); the hot path relies on the live check recorded in meta.json instead.
        share: (rank, world): check only this rank's files (the manager merges the ranks' answers).
    """
    d = Path(directory)
    manifest, why = _json(d / MANIFEST, "manifest (the save never finished)")
    if why:
        return [why]
    meta, why = _json(d / META, "meta.json")
    if why or (why := meta_problem(meta)):
        return [why]
    if meta.get("state_finite") is False:
        return ["meta.json: weights or optimizer state held NaN/Inf when this checkpoint was saved"]
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(isinstance(v, dict) and "size" in v for v in files.values()):
        return ["manifest: `files` is not a map of file -> {size, hash}"]
    try:
        on_disk = {str(p.relative_to(d)) for p in d.rglob("*") if p.is_file() and p.name != MANIFEST}
        weights = any(fnmatch.fnmatch(rel, pat) for rel in files for pat in WEIGHTS)
    except OSError as e:
        return [f"unreadable: {e.strerror or e}"]
    problems = [f"{rel}: not in the manifest" for rel in sorted(on_disk - set(files))][:3]
    if not weights:
        problems.append("manifest: lists no model weights")
    rels = sorted(files)
    if share is not None:
        rels = integrity.shares({r: files[r]["size"] for r in rels}, share[1])[share[0]]
    problems += integrity.check(d, files, rels, deep=hashes)
    if scan and not problems:
        problems += integrity.scan_files(d)
    return problems


def read_meta(directory: str | Path) -> dict:
    meta, why = _json(Path(directory) / META, "meta.json")
    if why or (why := meta_problem(meta)):
        raise PretrainerError(f"{directory}: {why}")
    return meta


@dataclass
class Candidate:
    path: Path
    meta: dict


def scan(root: Path) -> tuple[list[Candidate], list[tuple[Path, str]]]:
    """Finished checkpoints (a manifest and a valid meta.json), oldest first by the step in their meta.json, and the
    directories with a manifest whose meta.json is missing or broken, with the reason."""
    out, broken = [], []
    try:
        dirs = [d for d in Path(root).iterdir() if d.is_dir() and not d.name.startswith((TMP_PREFIX, ASIDE_PREFIX))]
    except OSError:  # no root yet, or unreadable
        return out, broken
    for d in dirs:
        try:
            if not (d / MANIFEST).exists():
                continue
        except OSError as e:
            broken.append((d, f"unreadable: {e.strerror or e}"))
            continue
        meta, why = _json(d / META, "meta.json")
        why = why or meta_problem(meta)
        if why:
            broken.append((d, why))
        else:
            out.append(Candidate(d, meta))
    return sorted(out, key=lambda c: (c.meta["step"], c.meta.get("saved_at", 0))), sorted(broken)


def list_checkpoints(root: Path) -> list[Candidate]:
    return scan(root)[0]


def newest_valid(
    root: Path, max_step: int | None = None, finite_losses: bool = False, check: Callable[[Path], list[str]] = verify
) -> tuple[Candidate | None, list[tuple[Path, str]]]:
    """The newest checkpoint that verifies, and those skipped for failing verification (or for a broken meta.json),
    with the reason.

    Args:
        max_step: consider only checkpoints saved at or before this step (a rollback target predates its spike).
        finite_losses: consider only checkpoints whose recorded recent losses were all finite.
        check: path -> problems (the manager's splits the work across ranks).
    """
    cands, skipped = scan(root)
    for c in reversed(cands):
        if max_step is not None and c.meta["step"] > max_step:
            continue
        if finite_losses and not c.meta.get("loss_stats", {}).get("finite", True):
            continue
        problems = check(c.path)
        if not problems:
            return c, skipped
        skipped.append((c.path, "; ".join(problems[:3])))
    return None, skipped


def tokens_crossed(every_tokens: int | None, tokens_before: int, tokens_now: int) -> bool:
    """True when a step took the token count across a multiple of `every_tokens` (the token save trigger)."""
    return bool(every_tokens) and tokens_now // every_tokens > tokens_before // every_tokens


def incomplete_dirs(root: Path) -> list[Path]:
    """Saves that died before their manifest: never resumed from, safe to remove."""
    try:
        return [
            d
            for d in Path(root).iterdir()
            if d.is_dir()
            and not d.name.startswith(ASIDE_PREFIX)
            and (d.name.startswith(TMP_PREFIX) or not (d / MANIFEST).exists())
        ]
    except OSError:
        return []


@dataclass(frozen=True)
class Protected:
    """What retention must keep besides the newest `keep_last` and the milestones: the checkpoints an open spike
    episode may roll back to."""

    names: frozenset[str] = frozenset()
    """Checkpoints by name (an open episode's rollback target)."""
    before: int | None = None
    """Also the newest checkpoint saved at or before this step (an open suspicion's candidate target: a spike
    confirmed later rolls back to the newest good checkpoint from before its onset)."""


NOTHING = Protected()


def to_keep(cands: list[Candidate], keep_last: int, keep_every_tokens: int | None, protected: Protected) -> set[Path]:
    """Retention, as a pure function: the newest `keep_last`, milestones, protected ones."""
    keep = {c.path for c in cands[-keep_last:]}
    if keep_every_tokens:
        seen: set[int] = set()
        for c in cands:  # the first checkpoint at or past each multiple of keep_every_tokens
            k = c.meta["tokens"] // keep_every_tokens
            if k > 0 and k not in seen:
                seen.add(k)
                keep.add(c.path)
    keep |= {c.path for c in cands if c.path.name in protected.names}
    if protected.before is not None and (older := [c for c in cands if c.meta["step"] <= protected.before]):
        keep.add(older[-1].path)
    return keep


def set_aside(path: Path) -> Path:
    """Rename a checkpoint directory that cannot be removed out of the way (`.passed-over-<name>-<time>`, beside it):
    listing, resuming and pruning ignore it; its name says what it was. Returns the new path."""
    aside = path.with_name(f"{ASIDE_PREFIX}{path.name}-{int(time.time())}")
    path.rename(aside)
    return aside


def remove_dir(path: Path) -> str | None:
    """Delete a directory; return the error instead of raising (a failed delete must not kill a run)."""
    try:
        shutil.rmtree(path)
        return None
    except OSError as e:
        return f"{type(e).__name__}: {e}"
