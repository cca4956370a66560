"""The run directory: refuse to mix two runs in one, and start over only when asked."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from .errors import PretrainerError


def prepare_run_dir(output_dir: Path, resume: str, overwrite: bool) -> None:
    """A directory that already holds a run is continued (`--resume`) or, with `--overwrite`, cleared of its
    metrics, events and checkpoints (by the main process only)."""
    if not (output_dir / "metrics.jsonl").exists() or resume != "none":
        return
    if not overwrite:
        raise PretrainerError(
            f"{output_dir}: already holds a run (metrics.jsonl); continue it with --resume auto, choose "
            f"another --output-dir, or pass --overwrite to start over"
        )
    if int(os.environ.get("RANK", "0")) == 0:
        for name in ("metrics.jsonl", "events.jsonl", "wandb_id"):  # a new W&B run too
            (output_dir / name).unlink(missing_ok=True)
        shutil.rmtree(output_dir / "checkpoints", ignore_errors=True)
