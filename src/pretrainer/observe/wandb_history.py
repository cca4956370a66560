"""One W&B run per training run, whose history equals metrics.jsonl.

- The run id lives in the run directory (`wandb_id`); every launch of the run (resume, rollback) continues it with
  `resume="allow"`, online and offline (offline fragments share the id, so `wandb sync` joins them).
- The W&B step is the row number of metrics.jsonl, which only grows (replayed steps after a rollback are new rows),
  so W&B never drops a row for a smaller step; the optimizer step and tokens are declared as x-axes.
- A killed process loses what W&B had not written; on resume the rows W&B lacks are logged again from
  metrics.jsonl before training continues. Offline, what W&B has is read back from its own run files (a leveldb
  log of `wandb_internal_pb2.Record`s).
"""

from __future__ import annotations

import json
import os
import secrets
import string
import struct
from collections.abc import Iterator
from pathlib import Path

from . import events as ev

ID_FILE = "wandb_id"
X_AXES = ("train/step", "train/tokens")
_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def run_id(output_dir: Path) -> str:
    """The run's W&B id, created on the first launch (main process only)."""
    path = Path(output_dir) / ID_FILE
    if path.exists():
        return path.read_text().strip()
    rid = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))  # W&B's id alphabet
    path.write_text(rid + "\n")
    return rid


def records(path: Path) -> Iterator[bytes]:
    """The raw records of a W&B run file (leveldb log format); a torn tail (a killed writer) ends the scan."""
    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        return
    pos, parts = 7, b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # block trailer
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:  # zero padding to the end of the block
            pos += left
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        if len(chunk) < length:
            return
        pos += 7 + length
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            parts = chunk
        elif kind == _MIDDLE:
            parts += chunk
        elif kind == _LAST:
            yield parts + chunk


def history(run_files: list[Path]) -> dict[int, dict]:
    """W&B history rows by `_step`, read from offline run files with wandb's own protobuf schema."""
    from wandb.proto import wandb_internal_pb2 as pb

    rows: dict[int, dict] = {}
    for f in run_files:
        for raw in records(f):
            rec = pb.Record()
            try:
                rec.ParseFromString(raw)
            except Exception:  # a damaged record: what came before it still counts
                break
            if rec.WhichOneof("record_type") == "history":
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                rows[int(row.get("_step", rec.history.step.num))] = row
    return rows


def offline_files(output_dir: Path, rid: str) -> list[Path]:
    return sorted(Path(output_dir).glob(f"wandb/offline-run-*-{rid}/run-{rid}.wandb"))


def rows_held(run, output_dir: Path, rid: str) -> int:
    """How many rows of metrics.jsonl W&B already has: the resumed run's step online, its files offline."""
    steps = history(offline_files(output_dir, rid))
    return max(int(getattr(run, "step", 0) or 0), max(steps) + 1 if steps else 0)


JOB_TYPES = ("train", "branch", "critical-batch")


def launch_tag(accelerator) -> str:
    """How the run is launched, as a tag: `single`, `ddp-x8`, `deepspeed-zero3-x16`, `fsdp-x64`."""
    kind = str(accelerator.distributed_type).split(".")[-1].lower()
    if kind == "deepspeed":
        kind = f"deepspeed-zero{accelerator.state.deepspeed_plugin.zero_stage}"
    elif kind.startswith("multi_"):
        kind = "ddp"
    return "single" if accelerator.num_processes == 1 and kind == "no" else f"{kind}-x{accelerator.num_processes}"


def run_identity(recipe, output_dir: Path, job_type: str, launch: str) -> dict:
    """How a run is found among its siblings, the same in both trackers: grouped by its recipe's `run.name` (a
    branch decay or a batch branch joins its parent's group), named by its run directory, a job type, and tags for
    its stages and its launch."""
    if job_type not in JOB_TYPES:
        raise ValueError(f"job_type {job_type!r}: one of {JOB_TYPES}")
    tags = [f"stage:{s.name}" for s in recipe.stages] + [f"launch:{launch}"]
    return {"group": recipe.run.name, "name": Path(output_dir).name, "job_type": job_type, "tags": tags}


def init_trackers(accelerator, recipe, output_dir: Path, log, config: dict, job_type: str = "train") -> None:
    """Start the recipe's trackers; W&B continues the run directory's one run and gets back what it lacks.
    TensorBoard gets the identity as hyperparameters (`run/group`, `run/job_type`, `run/tags`: its HParams tab
    filters by them)."""
    wandb = "wandb" in recipe.logging.report_to
    rid = run_id(output_dir) if wandb and accelerator.is_main_process else None
    who = run_identity(recipe, output_dir, job_type, launch_tag(accelerator))
    init = {"wandb": {**who, "dir": str(output_dir), "id": rid, "resume": "allow"}}
    config = {**config, "run/group": who["group"], "run/job_type": job_type, "run/tags": ",".join(who["tags"])}
    accelerator.init_trackers(recipe.logging.project, config=config, init_kwargs=init)
    if wandb and (n := attach(accelerator, log, output_dir, rid)):
        log.event(ev.TRACKER_BACKFILL, 0, rows=n)


def attach(accelerator, log, output_dir: Path, rid: str) -> int:
    """On the main process, once the trackers are up: declare the axes and backfill what the W&B run lacks.
    Returns the number of rows logged again."""
    if not accelerator.is_main_process or os.environ.get("WANDB_MODE") == "disabled":
        return 0
    run = accelerator.get_tracker("wandb", unwrap=True)
    declare_axes(run)
    return log.backfill(run, rows_held(run, output_dir, rid))


def declare_axes(run) -> None:
    """Optimizer step and tokens as x-axes; every metric plotted against the optimizer step by default. The
    `marker/<kind>` values are steps, not quantities: hidden from the automatic panels (the incident counts,
    `incidents/<kind>`, are the chart; scripts/wandb_workspace.py lays it out)."""
    for axis in X_AXES:
        run.define_metric(axis)
    run.define_metric("*", step_metric="train/step")
    run.define_metric("marker/*", step_metric="train/step", hidden=True)
