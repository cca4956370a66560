"""Run logging: metrics.jsonl and events.jsonl are the local source of truth; W&B and TensorBoard mirror them
through Accelerate's trackers."""

from __future__ import annotations

import json
import math
import netrc
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Protocol

from tqdm.auto import tqdm

from . import events as ev


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


def tracked(row: dict[str, Any]) -> dict[str, float]:
    """The numeric values of a metrics row as trackers get them, with the optimizer step and tokens as axes."""
    out = {k: v for k, v in row.items() if isinstance(v, int | float) and not isinstance(v, bool)}
    out.pop("time", None)
    out["train/step"] = out.pop("step")
    if "tokens" in out:
        out["train/tokens"] = out.pop("tokens")
    return out


EVALS = "evals.jsonl"
"""The eval rows' own stream: the same objects as metrics.jsonl's eval rows, so a reader finds a long run's evals
without parsing its training rows."""


def is_eval_row(values: dict[str, Any]) -> bool:
    """A row with held-out (`val/`) or downstream (`eval/`) results."""
    return any(k.startswith(("val/", "eval/")) for k in values)


class LogReader(Protocol):
    """Reads the run's records as they are written (analysis/verdicts.py `HealthMonitor`)."""

    def on_metrics(self, step: int, values: dict[str, Any]) -> None: ...

    def on_event(self, kind: str, step: int, details: dict[str, Any]) -> None: ...


class RunLog:
    """Appends one JSON object per line (only the main process writes) and mirrors each metrics row to the
    trackers. W&B's own step is the row number of metrics.jsonl, which only grows across resumes and rollbacks (W&B
    drops a row whose step is not larger), and its charts use the `train/step` axis declared at init; TensorBoard
    has no custom axis, so its step is the optimizer step itself (a rollback's replayed steps are drawn again over the
    same x, as in W&B)."""

    def __init__(self, output_dir: Path, accelerator, enabled: bool):
        self.dir = Path(output_dir)
        self.accelerator = accelerator
        self.enabled = enabled
        self.t0 = time.time()
        self.reader: LogReader | None = None
        """The live health monitor: it reads each record as written, as check_run.py reads the files."""
        self.lock = threading.Lock()  # a background checkpoint write logs from its own thread
        self.rows = 0
        self.counts: Counter[str] = Counter()
        if enabled:  # continue the numbering and the incident counts of an earlier launch (read once)
            _seal(self.dir / "metrics.jsonl")
            _seal(self.dir / "events.jsonl")
            _seal(self.dir / EVALS)
            rows = read_jsonl(self.dir / "metrics.jsonl")
            self.rows = len(rows)
            if rows and not (self.dir / EVALS).exists():  # a run written before the stream: its evals so far
                for row in filter(is_eval_row, rows):
                    self._append(EVALS, row)
            self.counts.update(
                e["event"] for e in read_events(self.dir / "events.jsonl") if e["event"] in ev.INCIDENTS
            )

    def _append(self, name: str, record: dict) -> None:
        if not self.enabled:
            return
        with open(self.dir / name, "a") as f:
            f.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")

    def side(self, name: str, record: dict[str, Any]) -> None:
        """One record in a side file of the run directory (e.g. layers.jsonl): not a metrics row, not tracked."""
        with self.lock:
            self._append(name, record)

    def metrics(self, step: int, values: dict[str, Any]) -> None:
        """One metrics row (tracked at the next row number); an eval row goes to `evals.jsonl` too."""
        row = {"step": step, "time": round(time.time() - self.t0, 3), **values}
        with self.lock:
            self._append("metrics.jsonl", row)
            if is_eval_row(values):
                self._append(EVALS, row)
            values_tracked = tracked(row)
            for tracker in self.accelerator.trackers:  # main process only: the others hold none
                tracker.log(values_tracked, step=self.rows if tracker.name == "wandb" else step)
            self.rows += self.enabled
        if self.reader is not None:
            self.reader.on_metrics(step, values)

    def event(self, kind: ev.EventKind, step: int, **details: Any) -> None:
        """Append one event (kinds and their fields: observe/events.py); incidents are also metrics rows."""
        if not isinstance(kind, ev.EventKind):
            raise TypeError(f"event kind {kind!r}: use a kind from observe/events.py")
        kind.check(details)
        self._append("events.jsonl", {"event": kind, "step": step, "time": round(time.time() - self.t0, 3), **details})
        if self.reader is not None:
            self.reader.on_event(kind, step, details)
        if kind.incident:
            self.counts[kind] += 1
            self.metrics(step, {"incident": kind, f"incidents/{kind}": self.counts[kind], f"marker/{kind}": step})

    def backfill(self, run, held: int) -> int:
        """Log to a W&B run the rows of metrics.jsonl it does not hold (rows `held` on); returns how many."""
        rows = read_jsonl(self.dir / "metrics.jsonl")
        for i in range(held, len(rows)):
            run.log(tracked(rows[i]), step=i)
        return max(0, len(rows) - held)


def _seal(path: Path) -> None:
    """End a torn last line (a process killed mid-write), so the next record starts a line of its own."""
    if path.exists() and path.stat().st_size:
        with open(path, "rb+") as f:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")


def iter_jsonl(path: str | Path):
    """The records of a .jsonl file, streamed; a line that is not a JSON object with an integer `step` (a torn last
    line of a run killed mid-write, a damaged byte) is skipped, never an error: every jsonl the project writes has a
    step on every line and is read through here."""
    p = Path(path)
    if not p.is_file():
        return
    with open(p, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:  # JSONDecodeError, or a number too long to convert
                continue
            if isinstance(row, dict) and type(row.get("step")) is int:
                yield row


def read_jsonl(path: str | Path) -> list[dict]:
    """`iter_jsonl` as a list."""
    return list(iter_jsonl(path))


def read_events(path: str | Path) -> list[dict]:
    """The events of an events.jsonl: `read_jsonl`, keeping only the rows `events.well_formed` reads as events (a
    damaged kind or key is a damaged event, not a KeyError in a report)."""
    return [e for e in iter_jsonl(path) if ev.well_formed(e)]


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
