"""The run directory: one run at a time (an exclusive lock), and an old run cleared only once the new one has passed
every check (`--overwrite` never destroys a run for a recipe that then fails)."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from ..checkpoint import read_meta
from ..checkpoint.identity import read_run_file
from ..errors import PretrainerError
from ..files import OwnedLock

LOCK = ".lock"
OLD_RUN = (
    "run.json",
    "metrics.jsonl",
    "events.jsonl",
    "wandb_id",
    "skip_ledger.json",
    "recipe.resolved.yaml",
    "layers.jsonl",
)
OLD_RUN_DIRS = ("checkpoints", "final", "merged", "universal", "wandb")
"""What `--overwrite` removes: nothing of the old run that a later command could read as the new run's (its exported
models, DeepSpeed's universal conversions of its checkpoints, which a resume would otherwise reuse, and its W&B
offline files, which `wandb sync OUTPUT_DIR/wandb/offline-run-*` would upload beside the new run's)."""


def _inside(path: Path, directory: Path) -> bool:
    return Path(directory).resolve() in Path(path).resolve().parents


def holds_run(path: Path) -> str | None:
    """What in `path` shows it holds a run (None: nothing)."""
    for name in ("metrics.jsonl", "run.json", "checkpoints"):
        if (Path(path) / name).exists():
            return name
    return None


def check_new_run_target(out: Path, checkpoint: Path, overwrite: bool, branch: bool = True) -> None:
    """A run started from a checkpoint outside its own `checkpoints/` (a branch; or `--resume PATH` of a copy
    elsewhere) never writes into the directory of the run the checkpoint belongs to, above it or inside it (it would
    replace that run's checkpoints, `final/` and recipe), and never over another run unless `--overwrite` says so. A
    plain resume (not `branch`) may continue the run `out` holds from a copy of one of its own checkpoints (a remote
    one, say), or start it again from its parent's (as `checkpoint.identity.check_resume` allows).

    Raises:
        PretrainerError: one line, before anything is written.
    """
    source = Path(checkpoint).resolve()
    parent = source.parent.parent if source.parent.name == "checkpoints" else source.parent
    target = Path(out).resolve()
    its_files = [parent / name for name in OLD_RUN_DIRS]
    if target == source or target in source.parents or any(target == d or _inside(target, d) for d in its_files):
        raise PretrainerError(
            f"--output-dir {out}: it holds (or lies in) the run that {checkpoint} belongs to; a branch writes a new "
            "run, which would replace that run's checkpoints, final/ and recipe: choose a new --output-dir"
        )
    if (held := holds_run(target)) and not overwrite:
        if not branch:
            try:
                mine, theirs = read_run_file(target), read_meta(checkpoint).get("run_id")
            except PretrainerError:
                return  # the resume's own checks name what is wrong with either
            if mine is None or theirs is None or theirs in (mine.run_id, mine.parent):
                return  # its own checkpoint, or its parent's (a branch started again from where it started)
            raise PretrainerError(
                f"--resume {checkpoint}: a checkpoint of run {theirs}, not of this run ({mine.run_id}): {out} holds its "
                "own run; resume one of its checkpoints, or branch from this one into a new --output-dir"
            )
        raise PretrainerError(
            f"--output-dir {out}: already holds a run ({held}); choose a new --output-dir, continue that run with "
            "--resume auto, or pass --overwrite to replace it"
        )


class RunDir:
    """Holds the run directory's lock (main process) for the life of the process; the OS releases it when the
    process ends, however it ends, so a lock is never stale."""

    def __init__(
        self,
        output_dir: Path,
        resume: str,
        overwrite: bool,
        is_main: bool | None = None,
        old_dirs: tuple = (),
        branch: bool = False,
    ):
        """Args:
        old_dirs: more directories of the old run that `--overwrite` removes (the TensorBoard directory).
        branch: `resume` is a checkpoint this launch starts a new run from (a branch decay, a batch branch), even
            when it lies in `output_dir`."""
        self.old_dirs = OLD_RUN_DIRS + tuple(old_dirs)
        self.path = Path(output_dir)
        self.is_main = int(os.environ.get("RANK", "0")) == 0 if is_main is None else is_main
        if resume not in ("auto", "none") and (branch or not _inside(Path(resume), self.path / "checkpoints")):
            check_new_run_target(self.path, Path(resume), overwrite, branch)  # before anything is written
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock = self._take_lock() if self.is_main else None
        holds_run = (self.path / "metrics.jsonl").exists()
        if holds_run and resume == "none" and not overwrite:
            raise PretrainerError(
                f"{self.path}: already holds a run (metrics.jsonl); continue it with --resume auto, choose "
                f"another --output-dir, or pass --overwrite to start over"
            )
        self.stale = holds_run and resume == "none"

    def _take_lock(self) -> OwnedLock:
        lock = OwnedLock(self.path / LOCK)
        if not lock.try_acquire():
            raise PretrainerError(
                f"{self.path}: in use by another run (pid {lock.holder()}); wait for it to end or choose another "
                "--output-dir"
            )
        return lock

    @contextlib.contextmanager
    def released_after(self, always: bool = True):
        """Give the lock back when the block ends (`always`) or only when it fails."""
        try:
            yield
        except BaseException:
            self.release()
            raise
        if always:
            self.release()

    def release(self) -> None:
        """Give the lock back now (the process may go on, e.g. a test or a notebook running another run)."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def clear_old_run(self) -> None:
        """With `--overwrite`, after the new run's recipe, data, tokenizer and model are known good: remove the old
        run's logs, ledger, checkpoints, conversions and exported models (main process)."""
        if not (self.stale and self.is_main):
            return
        for name in OLD_RUN:
            (self.path / name).unlink(missing_ok=True)
        for name in self.old_dirs:
            if not name or "/" in name or name in (".", ".."):  # a project name is a plain name or nothing of ours
                continue
            shutil.rmtree(self.path / name, ignore_errors=True)
        self.stale = False
