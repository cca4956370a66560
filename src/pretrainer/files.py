"""Small JSON files that must never be seen half-written (manifests, the skip ledger): written beside, then renamed."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


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
