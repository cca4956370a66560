"""Run logging: metrics.jsonl and events.jsonl are the local source of truth; W&B and TensorBoard mirror them
through Accelerate's trackers."""

from __future__ import annotations

import json
import math
import netrc
import os
import sys
import time
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm


def wandb_has_key() -> bool:
    """A W&B key in the environment or in ~/.netrc (where `wandb login` puts it)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return any("wandb" in host for host in netrc.netrc().hosts)
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def tracker_setup(report_to: list[str], output_dir: Path) -> list[str]:
    """Trackers for `Accelerator(log_with=...)`. W&B goes offline when no key is configured (it syncs later with
    `wandb sync`), so a run never waits on a login prompt or the network."""
    if "wandb" in report_to:
        if not wandb_has_key():
            os.environ.setdefault("WANDB_MODE", "offline")
        os.environ.setdefault("WANDB_DIR", str(output_dir))
        os.environ.setdefault("WANDB_SILENT", "true")
    return list(report_to)


def _clean(v: Any) -> Any:
    # JSON has no NaN/inf; write them as strings so the line stays parseable and the fact stays visible.
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


class RunLog:
    """Appends one JSON object per line; only the main process writes."""

    def __init__(self, output_dir: Path, accelerator, enabled: bool):
        self.dir = Path(output_dir)
        self.accelerator = accelerator
        self.enabled = enabled
        self.t0 = time.time()
        self.observers: list = []
        """Objects with on_metrics(step, values) and on_event(kind, step, details), told of every record."""

    def _append(self, name: str, record: dict) -> None:
        if not self.enabled:
            return
        with open(self.dir / name, "a") as f:
            f.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")

    def metrics(self, step: int, values: dict[str, Any]) -> None:
        self._append("metrics.jsonl", {"step": step, "time": round(time.time() - self.t0, 3), **values})
        for o in self.observers:
            o.on_metrics(step, values)
        numeric = {k: v for k, v in values.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        self.accelerator.log(numeric, step=step)

    def event(self, kind: str, step: int, **details: Any) -> None:
        self._append("events.jsonl", {"event": kind, "step": step, "time": round(time.time() - self.t0, 3), **details})
        for o in self.observers:
            o.on_event(kind, step, details)


def read_jsonl(path: str | Path) -> list[dict]:
    """Records of a .jsonl file; a torn last line (a run killed mid-write) is ignored."""
    out = []
    p = Path(path)
    if not p.exists():
        return out
    for line in p.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def alert(accelerator, report_to: list[str], title: str, text: str) -> None:
    """A W&B alert when W&B is online; always a line above the progress bar (events.jsonl has the record)."""
    if not accelerator.is_main_process:
        return
    tqdm.write(f"[{title}] {text}", file=sys.stderr)
    if "wandb" in report_to and os.environ.get("WANDB_MODE") not in ("offline", "disabled"):
        try:
            accelerator.get_tracker("wandb", unwrap=True).alert(title=title, text=text)
        except Exception:  # an alert must never take the run down
            pass
