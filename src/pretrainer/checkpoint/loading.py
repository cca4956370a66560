"""Loading a checkpoint into the live model and optimizer, whatever number of processes saved it.

- FSDP: DCP reshards on load (`dcp.DcpCheckpointer.load`).
- DeepSpeed, same world size: the engine's own load, through Accelerate.
- DeepSpeed, another world size (a lost node, a bigger allocation): the checkpoint is converted once into
  DeepSpeed's universal format (`deepspeed.checkpoint.ds_to_universal`, parameter by parameter, optimizer moments
  included), next to the run's checkpoints in `universal/step_N/`, and loaded with `load_universal_checkpoint`.
- Single process and DDP: Accelerate's files hold the whole state; any world size loads them.

The data cursor is global and the global batch is fixed, so only the accumulation steps per rank change.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from accelerate.utils import DistributedType

from ..errors import PretrainerError
from ..observe import events as ev
from .identity import universal_stamp

DS_TAG = "pytorch_model"  # the tag Accelerate's save_state gives DeepSpeed's checkpoint


BACKENDS = {"deepspeed": "DeepSpeed ZeRO", "fsdp": "FSDP (DCP shards)", "plain": "one process or DDP"}


def saved_backend(path: Path) -> str:
    """Which engine wrote a checkpoint, from its files: DeepSpeed's tag directory, DCP's shards, or Accelerate's."""
    if (Path(path) / DS_TAG).is_dir():
        return "deepspeed"
    return "fsdp" if (Path(path) / "dcp").is_dir() else "plain"


def running_backend(acc) -> str:
    kind = acc.distributed_type
    return {DistributedType.DEEPSPEED: "deepspeed", DistributedType.FSDP: "fsdp"}.get(kind, "plain")


def check_backend(acc, path: Path) -> None:
    """One line, on every rank alike, when the launch's engine cannot read the checkpoint's files (each engine
    keeps its own optimizer layout; only the weights cross, through an export)."""
    saved, now = saved_backend(path), running_backend(acc)
    if saved != now:
        raise PretrainerError(
            f"--resume {path}: saved by {BACKENDS[saved]}, this launch runs {BACKENDS[now]}: resume it under the "
            f"engine that saved it, or export its weights (export_checkpoint.py) and start a new run from them"
        )


def load_state(acc, model, optimizer, path: Path, meta: dict, dcp, log, universal_root: Path) -> None:
    """Args:
    universal_root: where DeepSpeed's universal conversions go (the run's `universal/`)."""
    check_backend(acc, path)
    if dcp is not None:
        dcp.load(model, optimizer, path)
        return
    saved = meta.get("world_size", acc.num_processes)
    if acc.distributed_type == DistributedType.DEEPSPEED and saved != acc.num_processes:
        universal = to_universal(acc, path, meta, log, universal_root / path.name)
        engine = acc.deepspeed_engine_wrapped.engine
        engine._config.load_universal_checkpoint = True  # read at load time by the engine and its ZeRO optimizer
        try:
            engine.load_checkpoint(str(universal), tag=DS_TAG)
        finally:
            engine._config.load_universal_checkpoint = False
        return
    acc.load_state(str(path))


def to_universal(acc, path: Path, meta: dict, log, out: Path) -> Path:
    """DeepSpeed's universal checkpoint of `path`, in `out` (converted by the main process once; reused after, only
    for the same run's same save: `done` holds its identity stamp)."""
    done, stamp = out / "done", universal_stamp(meta)
    if acc.is_main_process and not (done.exists() and done.read_text() == stamp):
        try:
            from deepspeed.checkpoint import ds_to_universal
        except ImportError as e:
            raise PretrainerError(f"--resume {path}: DeepSpeed's universal checkpoint is not available: {e}") from None
        shutil.rmtree(out, ignore_errors=True)
        src = path / DS_TAG
        args = argparse.Namespace(
            input_folder=str(src),
            output_folder=str(out / DS_TAG),
            num_extract_workers=2,
            num_merge_workers=1,
            keep_temp_folder=False,
            strict=True,
            inject_missing_state=True,
        )
        ds_to_universal.main(args)
        done.write_text(stamp)
        log.event(
            ev.UNIVERSAL_CONVERT,
            meta["step"],
            path=str(path),
            to=str(out),
            saved_world=meta["world_size"],
            world=acc.num_processes,
        )
    acc.wait_for_everyone()
    return out
