"""Small files shared between processes: JSON that must never be seen half-written (manifests, the skip ledger),
written beside and renamed; and exclusive locks that say who holds them."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout


def atomic_write_json(path: str | Path, obj: Any, durable: bool = False) -> None:
    """Write `obj` as JSON to a temporary file beside `path`, then rename it into place (atomic on POSIX).

    Args:
        durable: fsync the file before the rename (a manifest that marks a checkpoint complete must survive a power
            cut; a ledger rewritten every rollback need not)."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    tmp.rename(path)


def read_json(path: str | Path) -> Any | None:
    """The JSON in `path`, or None when there is no such file."""
    p = Path(path)
    return json.loads(p.read_text()) if p.exists() else None


class OwnedLock:
    """An exclusive `filelock.FileLock` (flock on POSIX: the OS releases it when the process dies, however it dies,
    so it is never stale) with its holder's pid written beside it (`<lock>.pid`), for the message a second process
    gets. The pid is not in the lock file itself: filelock truncates that file when it opens it to try."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.lock = FileLock(str(self.path))
        self.pid_file = self.path.with_name(f"{self.path.name}.pid")

    def try_acquire(self) -> bool:
        """Take the lock if it is free; False (at once) if another process holds it."""
        try:
            self.lock.acquire(timeout=0)
        except Timeout:
            return False
        self._mark()
        return True

    def acquire(self) -> None:
        """Wait for the lock, however long it takes."""
        self.lock.acquire()
        self._mark()

    def _mark(self) -> None:
        self.pid_file.write_text(f"{os.getpid()}\n")

    def holder(self) -> str:
        """The pid of the process that holds (or last held) the lock, or `?`."""
        try:
            return self.pid_file.read_text().strip() or "?"
        except OSError:
            return "?"

    def release(self) -> None:
        if self.lock.is_locked:
            self.lock.release(force=True)
