"""The run directory: one run at a time (an exclusive lock), and an old run cleared only once the new one has passed
every check (`--overwrite` never destroys a run for a recipe that then fails)."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

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


class RunDir:
    """Holds the run directory's lock (main process) for the life of the process; the OS releases it when the
    process ends, however it ends, so a lock is never stale."""

    def __init__(
        self, output_dir: Path, resume: str, overwrite: bool, is_main: bool | None = None, old_dirs: tuple = ()
    ):
        """Args:
        old_dirs: more directories of the old run that `--overwrite` removes (the TensorBoard directory)."""
        self.old_dirs = OLD_RUN_DIRS + tuple(old_dirs)
        self.path = Path(output_dir)
        self.is_main = int(os.environ.get("RANK", "0")) == 0 if is_main is None else is_main
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
