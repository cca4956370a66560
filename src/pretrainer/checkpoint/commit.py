"""Finishing a checkpoint that every rank wrote a part of: meta and extra files, the manifest from each rank's own
hashes, the rename. And verifying one the same way, each rank its share.

Collective over a process group (the default one, or the one an asynchronous save's threads use); with one process
it is the same code with no communication. The protocol does not change: files into the temporary directory, the
manifest last, then the rename; a directory without a manifest is never resumed from.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from ..faults import kill_point
from . import format as ck
from . import integrity


class Group:
    """rank, world and the three collectives a checkpoint needs, over `pg` (None: the default group)."""

    def __init__(self, pg=None, alone: bool = False):
        """Args:
        alone: this process only, whatever the launch (the main process's background writer under DDP)."""
        self.pg = pg
        self.on = not alone and dist.is_available() and dist.is_initialized() and dist.get_world_size(pg) > 1
        self.rank = dist.get_rank(pg) if self.on else 0
        self.world = dist.get_world_size(pg) if self.on else 1

    def barrier(self) -> None:
        if self.on:
            dist.barrier(group=self.pg)

    def gather(self, obj) -> list | None:
        """Every rank's `obj` on rank 0 (in rank order); None elsewhere."""
        if not self.on:
            return [obj]
        out = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, dst=dist.get_global_rank(self.pg, 0) if self.pg else 0, group=self.pg)
        return out

    def everyone(self, obj) -> list:
        """Every rank's `obj` on every rank."""
        if not self.on:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj, group=self.pg)
        return out


def commit(group: Group, tmp: Path, final: Path, meta: dict, extra_files: dict[str, Callable[[Path], None]]) -> int:
    """Meta and extra files (rank 0), then each rank hashes and fsyncs its share, rank 0 writes the merged manifest
    and renames. Returns the checkpoint's bytes (on rank 0; 0 elsewhere). Raises on rank 0 when a write fails; the
    other ranks return (their part is done; the caller reports rank 0's error)."""
    if group.rank == 0:
        (tmp / ck.META).write_text(json.dumps(meta, indent=1))
        for sub, write in extra_files.items():
            write(tmp / sub)
        kill_point("after_state")
    group.barrier()  # every file exists before anyone lists them
    sizes = ck.list_files(tmp)
    mine = integrity.shares(sizes, group.world)[group.rank]
    part: dict | str
    try:
        part = integrity.entries(tmp, mine)
    except OSError as e:
        part = f"rank {group.rank}: {e.strerror or e}"
    parts = group.gather(part)
    if group.rank != 0:
        return 0
    if failed := [p for p in parts if isinstance(p, str)]:
        raise OSError(failed[0])
    files = {k: v for p in parts for k, v in p.items()}
    if missing := sorted(set(sizes) - set(files)):  # never a manifest that leaves out a file it should list
        raise OSError(f"unhashed files: {missing[:3]}")
    ck.write_manifest(tmp, files)
    if final.exists():  # the same step again (a replay after rollback, a save --resume passed over): replaced
        if (why := ck.remove_dir(final)) is not None:  # unreadable or undeletable: out of the way, not in it
            aside = ck.set_aside(final)
            print(f"warning: {final} could not be removed ({why}); moved to {aside.name}", file=sys.stderr)
    tmp.rename(final)
    ck.fsync_dir(final.parent)
    return sum(v["size"] for v in files.values())


def verify_shares(group: Group, path: Path, scan: bool = False) -> list[str]:
    """Problems with a checkpoint, the same answer on every rank; each rank hashes (and, `scan`, reads back) only its
    share of the files: O(checkpoint / world) per rank."""
    mine = ck.verify(path, scan=False, share=(group.rank, group.world))
    problems = sorted({p for ps in group.everyone(mine) for p in ps})
    if scan and not problems:
        share = integrity.shares(ck.list_files(path), group.world)[group.rank]
        problems = sorted({p for ps in group.everyone(integrity.scan_files(path, set(share))) for p in ps})
    return problems
