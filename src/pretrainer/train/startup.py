"""Who a starting run is: a new run, the continuation of the run in its directory (or of the run a replaced node's
remote names), or a branch of another run. Decided once at start, before any checkpoint is chosen."""

from __future__ import annotations

import sys
from pathlib import Path

from accelerate.utils import broadcast_object_list

from ..checkpoint.identity import Identity, establish
from ..checkpoint.remote import claim, remote_owner
from ..errors import PretrainerError, first_line
from ..observe import events as ev


def run_identity(acc, run_dir: Path, resume: str, remote: str | None, log) -> Identity:
    """The run's identity, decided by the main process and given to every rank; the run claims its directory's name
    on the remote (a failed claim is a warning: the run's copies still go to its own directory there, only a replaced
    node would not find them without `run.json`)."""
    ident, error, before = None, None, None
    if acc.is_main_process:
        try:
            ident = establish(run_dir, resume, lambda: remote_owner(remote, run_dir) if remote else None)
        except PretrainerError as e:
            error = str(e)
        if ident is not None and remote:
            try:
                before = claim(remote, run_dir, ident.run_id)
            except Exception as e:  # noqa: BLE001 - any fsspec backend's error; the uploads will report theirs
                print(
                    f"warning: checkpoint.remote {remote}: could not claim it for run {ident.run_id}: {first_line(e)}",
                    file=sys.stderr,
                    flush=True,
                )
    if acc.num_processes > 1:
        ident, error = broadcast_object_list([ident, error])
    if error:
        raise PretrainerError(error)
    log.event(ev.RUN_IDENTITY, 0, run_id=ident.run_id, parent=ident.parent, source=ident.source, remote_was=before)
    return ident
