"""Checkpoints you can trust.

A checkpoint is `checkpoints/step_00001000/`: the state (Accelerate's `save_state`: model, optimizer, RNG, DeepSpeed
shards included; FSDP: DCP shards in `dcp/`) plus `meta.json` (our state) plus `manifest.json` (size and xxh3-128 of
every file, each hashed by the rank that wrote it), written into a hidden temporary directory and renamed into place
after the manifest. A directory without a valid manifest is never
resumed from. All state is read from `meta.json`, never parsed out of directory names.

- `format`: manifest, verification, listing, retention (pure functions of what is on disk);
- `integrity`: which rank hashes and verifies which file, the hash, the live finite check;
- `commit`: finishing a checkpoint every rank wrote part of, and verifying one, each rank its share;
- `writer`: the CPU snapshot and the background writer (single process, DDP);
- `dcp`: FSDP2 shards through torch.distributed.checkpoint, asynchronous, resharded on load;
- `loading`: loading on any world size (DeepSpeed through its universal checkpoint);
- `remote`: the background copy at an fsspec URL, its retention, the fetch for a replaced node;
- `manager`: triggers, save, prune, protection, resume and restore;
- `export`: `final/` as `save_pretrained` files with their provenance (the Hub upload is in `publishing/`).
"""

import importlib

from .format import (
    MANIFEST,
    META,
    NOTHING,
    TMP_PREFIX,
    Candidate,
    CheckpointError,
    Protected,
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

_LAZY = {"CheckpointManager": "manager", "Restored": "manager", "BackgroundWriter": "writer", "Snapshot": "writer"}


def __getattr__(name: str):
    """The manager and the writer on first use (PEP 562): they import Accelerate and DeepSpeed, which reading a run
    directory (check_run.py, verification) does not need."""
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "MANIFEST",
    "META",
    "NOTHING",
    "TMP_PREFIX",
    "BackgroundWriter",
    "Candidate",
    "CheckpointError",
    "CheckpointManager",
    "Protected",
    "Restored",
    "Snapshot",
    "fsync_dir",
    "incomplete_dirs",
    "list_checkpoints",
    "newest_valid",
    "read_meta",
    "remove_dir",
    "to_keep",
    "tokens_crossed",
    "verify",
    "write_manifest",
]
