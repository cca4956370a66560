"""Checkpoints you can trust.

A checkpoint is `checkpoints/step_00001000/`: Accelerate's `save_state` (model, optimizer, RNG; DeepSpeed/FSDP
shards included) plus `meta.json` (our state) plus `manifest.json` (size and sha256 of every file), written into a
hidden temporary directory and renamed into place after the manifest. A directory without a valid manifest is never
resumed from. All state is read from `meta.json`, never parsed out of directory names.

- `format`: manifest, verification, listing, retention (pure functions of what is on disk);
- `writer`: the CPU snapshot and the background writer;
- `manager`: triggers, save, prune, protection, resume and restore.
"""

from .format import (
    MANIFEST,
    META,
    TMP_PREFIX,
    Candidate,
    CheckpointError,
    fsync_dir,
    incomplete_dirs,
    list_checkpoints,
    newest_valid,
    read_meta,
    remove_dir,
    to_keep,
    tokens_crossed,
    verify,
    write_manifest,
)
from .manager import CheckpointManager, Restored
from .writer import BackgroundWriter, Snapshot

__all__ = [
    "MANIFEST", "META", "TMP_PREFIX", "BackgroundWriter", "Candidate", "CheckpointError", "CheckpointManager",
    "Restored", "Snapshot", "fsync_dir", "incomplete_dirs", "list_checkpoints", "newest_valid", "read_meta",
    "remove_dir", "to_keep", "tokens_crossed", "verify", "write_manifest",
]  # fmt: skip
