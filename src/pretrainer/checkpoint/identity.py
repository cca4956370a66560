"""Run identity: an id given to a run when it first starts in a directory (`run.json`), saved in every checkpoint's
meta, naming its remote copies (`checkpoint.remote/<run_id>/step_N/`), stamped on DeepSpeed's universal conversions
and on every exported model (`provenance.json`). Nothing resumes, fetches, converts or exports across identities:
a directory reused with `--overwrite`, a remote shared with an earlier run, a checkpoint copied in from elsewhere
are each recognised as another run's.

Where a run's id comes from, in order (main process; every rank gets the main process's):
1. the directory's `run.json` (the run continues);
2. the newest local checkpoint's meta (a directory copied without its `run.json`);
3. with `--resume auto`, the remote's owner of the directory's name (`checkpoint.remote/owner-<dir name>`): a
   replaced node, whose directory is empty, continues the run that last started in a directory of that name;
4. a new id (a new run; it claims its directory name on the remote).

A checkpoint of another run is resumed only by a new run directory (a branch, e.g. `--branch-decay-from`): its id
is the new run's `parent`, so repeating the branch command resumes it again. Checkpoints and exports written before
run identity carry no id and pass.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

from ..errors import PretrainerError
from . import format as ck

RUN_FILE = "run.json"
PROVENANCE = "provenance.json"


@dataclass
class Identity:
    run_id: str
    parent: str | None = None
    source: str = "new"
    """Where the id came from: `run.json`, `checkpoint`, `remote` or `new` (this launch created it)."""

    @property
    def created(self) -> bool:
        return self.source == "new"


def new_id() -> str:
    return uuid.uuid4().hex[:16]


def read_run_file(run_dir: Path) -> Identity | None:
    path = Path(run_dir) / RUN_FILE
    try:
        data = json.loads(path.read_text())
        return Identity(str(data["run_id"]), data.get("parent"), source="run.json")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PretrainerError(
            f"{path}: not a run identity file ({type(e).__name__}: {e}); restore or remove it"
        ) from None


def write_run_file(run_dir: Path, ident: Identity) -> None:
    """Atomically: a torn `run.json` would make the directory's run unknown."""
    path = Path(run_dir) / RUN_FILE
    tmp = path.with_name(f"{ck.TMP_PREFIX}{RUN_FILE}")
    tmp.write_text(json.dumps({"run_id": ident.run_id, "parent": ident.parent}) + "\n")
    os.replace(tmp, path)


def _newest_local(checkpoints: Path) -> str | None:
    """The run id of the newest local checkpoint that names one."""
    for cand in reversed(ck.list_checkpoints(checkpoints)):
        if rid := cand.meta.get("run_id"):
            return str(rid)
    return None


def establish(run_dir: Path, resume: str, remote_owner) -> Identity:
    """The run's identity (main process), written to `run.json` when it is new to the directory.

    Args:
        remote_owner: () -> the remote's owner id or None; called only for `--resume auto` with nothing local."""
    if (ident := read_run_file(run_dir)) is not None:
        return ident
    if rid := _newest_local(Path(run_dir) / "checkpoints"):
        ident = Identity(rid, source="checkpoint")
    elif resume == "auto" and (rid := remote_owner()):
        ident = Identity(rid, source="remote")
    else:
        ident = Identity(new_id())
    write_run_file(run_dir, ident)
    return ident


def foreign(meta: dict, ident: Identity) -> str | None:
    """Why a checkpoint is not this run's (None: it is, it is this run's parent, or it predates run identity)."""
    saved = meta.get("run_id")
    if saved is None or saved in (ident.run_id, ident.parent):
        return None
    return f"a checkpoint of run {saved}, not of this run ({ident.run_id})"


def check_resume(path: Path, meta: dict, ident: Identity, run_dir: Path, is_main: bool) -> None:
    """Refuse a checkpoint of another run, unless this launch starts a new run directory from it (a branch: the
    checkpoint's run becomes the new run's parent).

    Raises:
        PretrainerError: one line naming both runs."""
    if (why := foreign(meta, ident)) is None:
        return
    if not ident.created:
        raise PretrainerError(
            f"--resume {path}: {why}: {run_dir} holds its own run; resume one of its checkpoints, or branch from this "
            "one into a new --output-dir"
        )
    ident.parent = str(meta["run_id"])
    if is_main:
        write_run_file(run_dir, ident)


def universal_stamp(meta: dict) -> str:
    """What a universal conversion is of: a run's checkpoint (the time of the save tells a re-saved step apart)."""
    return json.dumps({"run_id": meta.get("run_id"), "step": meta["step"], "saved_at": meta.get("saved_at")})


def provenance(meta: dict, checkpoint: str | Path | None) -> dict:
    return {"run_id": meta.get("run_id"), "step": meta["step"], "tokens": meta.get("tokens"), "from": str(checkpoint)}


def write_provenance(out: Path, record: dict) -> None:
    (Path(out) / PROVENANCE).write_text(json.dumps(record) + "\n")


def check_export_target(out: Path, run_id: str | None) -> None:
    """An export never lands on another run's export (their files would mix).

    Raises:
        PretrainerError: `out` holds a model exported from another run."""
    try:
        held = json.loads((Path(out) / PROVENANCE).read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return
    if held is not None and run_id is not None and held != run_id:
        raise PretrainerError(
            f"{out}: holds a model exported from run {held}, and this checkpoint is of run {run_id}; choose another "
            "output directory"
        )
