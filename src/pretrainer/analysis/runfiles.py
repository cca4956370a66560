"""A run directory read once, as one typed object: the training rows as columns, the eval rows, the per-step losses
of the final timeline, the per-step record as lived, the events and the resolved recipe.

Eval rows come from `evals.jsonl`, their own stream (the same objects as metrics.jsonl's eval rows), so a 10M-step
run's evals are read without parsing its training rows; the per-step losses and the training columns come from the
record (`records/`). A run written before either existed is read from metrics.jsonl line by line.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from ..errors import first_line
from ..observe import events as ev
from ..observe.steprecord import Record, read_record
from ..observe.tracking import EVALS, is_eval_row, iter_jsonl, read_events
from ..recipe.sections import SpikesSection
from .replay import timeline


class LossSeries:
    """A per-step loss curve as two arrays (a long run has millions of steps: no Python tuple per step)."""

    def __init__(self, steps: np.ndarray, values: np.ndarray):
        self.steps, self.values = np.asarray(steps, np.int64), np.asarray(values, float)

    @classmethod
    def of(cls, pairs) -> LossSeries:
        if isinstance(pairs, LossSeries):
            return pairs
        pairs = list(pairs)
        return cls(np.array([s for s, _ in pairs], np.int64), np.array([as_float(v) for _, v in pairs], float))

    def __len__(self) -> int:
        return len(self.steps)

    def __iter__(self):
        return zip(self.steps.tolist(), self.values.tolist())


TRAIN_COLUMNS = ("step", "stage", "loss", "tokens", "tokens_per_s", "lr", "grad_norm", "gns")
"""What the report and the plot read of the training rows (`gns`: the row's `gns/b_simple`)."""


def _columns(rows: list[dict]) -> dict[str, np.ndarray]:
    """Training rows (dicts from metrics.jsonl) as the report's columns."""
    key = {"gns": "gns/b_simple"}
    numeric = [c for c in TRAIN_COLUMNS if c not in ("step", "stage", "tokens")]
    out = {c: np.array([as_float(m.get(key.get(c, c))) for m in rows], float) for c in numeric}
    out["step"] = np.array([m["step"] for m in rows], np.int64)
    out["stage"] = np.array([m.get("stage") for m in rows], object)
    out["tokens"] = np.array([m.get("tokens") or 0 for m in rows], np.int64)
    return out


def _record_columns(rec: Record, final: np.ndarray, stages: list[str]) -> dict[str, np.ndarray]:
    """The same columns from the record's logged rows on the final timeline: a row is there when its epoch is the
    epoch that step has on it (a step is run once per epoch)."""
    rows, whole = rec.rows, len(final) == len(rec)
    on_step, on_epoch = (rec.step, rec.epoch) if whole else (rec.step[final], rec.epoch[final])
    at = np.searchsorted(on_step, rows["step"])
    ok = at < len(on_step)
    ok[ok] &= on_step[at[ok]] == rows["step"][ok]
    ok[ok] &= on_epoch[at[ok]] == rows["epoch"][ok]
    rows = {k: v[ok] for k, v in rows.items()}
    order = np.argsort(rows["step"], kind="stable")
    rows = {k: v[order] for k, v in rows.items()}
    names = np.array(stages or ["?"], object)
    return {
        "step": rows["step"].astype(np.int64),
        "stage": names[np.clip(rows["stage"].astype(np.int64), 0, len(names) - 1)],
        "loss": rows["row_loss"],
        "tokens": rows["tokens"].astype(np.int64),
        "tokens_per_s": rows["tokens_per_s"],
        "lr": rows["lr"],
        "grad_norm": rows["grad_norm"].astype(float),
        "gns": rows["gns"],
    }


@dataclass(frozen=True)
class RunFiles:
    """What `load_run` read of a run directory. A step logged again after a rollback or resume replaces the earlier
    one in `losses` and `train`; `record` keeps every step as lived."""

    dir: Path
    train: dict[str, np.ndarray] | None
    """The training rows as columns (`TRAIN_COLUMNS`), one per logged step of the final timeline."""
    evals: list[dict]
    """The eval rows, by step."""
    losses: LossSeries | None
    """Every step's loss on the final timeline (the logged rows' in runs without a record)."""
    record: Record | None
    """The per-step record as lived (None for runs written before it existed)."""
    final: np.ndarray | None
    """The record's rows on the final timeline (`replay.timeline`)."""
    events: list[dict]
    recipe: dict[str, Any] | None
    """The resolved recipe, as plain data (None where the run has none)."""
    last_write: float | None
    """metrics.jsonl's modification time (a live run that stopped writing is stalled)."""
    damaged: tuple[str, ...] = ()
    """Files of the run read only in part or not at all (name: why), for the report to name."""

    def without_steps(self) -> RunFiles:
        """The same run without its per-step data (a 10M-step run's ~300 MB): what the forecast and the averaging
        report read, once the report has what it needs of the steps."""
        return replace(self, train=None, losses=None, record=None, final=None)


def load_run(output_dir: str | Path) -> RunFiles:
    """Metrics, evals, events and the per-step record of a run (live or finished), each file read once."""
    d = Path(output_dir)
    events = read_events(d / "events.jsonl")
    recipe, damaged = resolved_recipe(d)
    mtime = (d / "metrics.jsonl").stat().st_mtime if (d / "metrics.jsonl").exists() else None
    rec = read_record(d, damaged)
    final = None
    if rec is not None:
        evals = {m["step"]: m for m in eval_rows(d)}
        final = timeline(rec.step)
        whole = len(final) == len(rec)  # nothing re-run: no copies
        losses = LossSeries(
            rec.step if whole else rec.step[final], (rec.loss if whole else rec.loss[final]).astype(float)
        )
        stages = [st.get("name") for st in (recipe or {}).get("stages") or []]
        train = _record_columns(rec, final, stages)
    else:
        train_rows: dict[int, dict] = {}
        evals, per_step = {}, {}
        for line, m in _rows(d / "metrics.jsonl"):
            if '"val/' in line and any(k.startswith("val/") for k in m):  # the text test first: 1M rows
                evals[m["step"]] = m
            elif "loss" in m:
                train_rows[m["step"]] = m
                for s, v in m.get("step_losses", []):
                    per_step[s] = v
        ordered = [train_rows[s] for s in sorted(train_rows)]
        losses = LossSeries.of(sorted(per_step.items()) or [(m["step"], m["loss"]) for m in ordered])
        train = _columns(ordered)
    evals_by_step = [evals[s] for s in sorted(evals)]
    return RunFiles(d, train, evals_by_step, losses, rec, final, events, recipe, mtime, tuple(damaged))


def resolved_recipe(run_dir: Path) -> tuple[dict[str, Any] | None, list[str]]:
    """The run's resolved recipe as plain data (None when it has none, or when it is damaged: not YAML, not UTF-8,
    or its sections not mappings), and what is wrong with it."""
    path = Path(run_dir) / "recipe.resolved.yaml"
    if not path.is_file():
        return None, []
    try:
        recipe = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, yaml.YAMLError) as e:
        return None, [f"{path.name}: {first_line(e, 120)}"]
    shape_ok = isinstance(recipe, dict) and all(isinstance(v, dict) for k, v in recipe.items() if k != "stages")
    stages = recipe.get("stages") if isinstance(recipe, dict) else None
    if not shape_ok or not (
        stages is None or (isinstance(stages, list) and all(isinstance(st, dict) for st in stages))
    ):
        return None, [f"{path.name}: not a recipe (its sections are not mappings)"]
    return recipe, []


def eval_rows(run_dir: Path):
    """The run's eval rows: `evals.jsonl`, or for a run written before it, metrics.jsonl's lines that hold a `val/`
    or `eval/` key (parsed only where the text has one)."""
    if (run_dir / EVALS).exists():
        yield from iter_jsonl(run_dir / EVALS)
        return
    for line in _lines(run_dir / "metrics.jsonl"):
        # the text test before the JSON decoder: 1M rows, a few hundred of them evals
        if ('"val/' in line or '"eval/' in line) and (m := _decoded(line)) is not None and is_eval_row(m):
            yield m


def _lines(path: Path):
    """The lines of a metrics file, streamed (a long run's file is ~100 MB)."""
    if not path.exists():
        return
    with open(path, encoding="utf-8", errors="replace") as f:
        yield from f


def _decoded(line: str) -> dict | None:
    """A metrics line as its record; None for a torn or damaged line (not an object with an integer step)."""
    try:
        m = json.loads(line)
    except ValueError:
        return None
    return m if isinstance(m, dict) and type(m.get("step")) is int else None


def _rows(path: Path):
    """(line, record) of a metrics file; a torn or damaged line is skipped."""
    for line in _lines(path):
        if (m := _decoded(line)) is not None:
            yield line, m


def spike_rule(recipe: dict[str, Any] | None) -> SpikesSection:
    """The run's own `spikes` section (from its resolved recipe), as the live loop used it (the defaults for a run
    without a resolved recipe, or one written before a field existed)."""
    section = ((recipe or {}).get("spikes")) or {}
    try:
        return SpikesSection.model_validate(section)
    except ValueError:  # a recipe from another version: its known fields, the defaults for the rest
        known = {k: v for k, v in section.items() if k in SpikesSection.model_fields}
        try:
            return SpikesSection.model_validate(known)
        except ValueError:
            return SpikesSection()


def grace_starts(events: list[dict]) -> list[int]:
    """Where the live spike rule restarted its grace period and forgot its trend: each stage start and each batch
    change after step 0."""
    kinds = (ev.STAGE_START, ev.BATCH_CHANGE)
    return sorted({e["step"] for e in events if e["event"] in kinds and e["step"] > 0})


def warmup_of(recipe: dict[str, Any] | None) -> int:
    """The grace the live rule started with: judging begins `grace_steps` after warmup."""
    return int((((recipe or {}).get("schedule") or {}).get("warmup_steps")) or 0)


def val_of(m: dict) -> Any:
    """An eval line's comparable validation loss: `val/ref` (one fixed context and batches for the whole run), or
    `val/avg` in runs from before it existed."""
    return m.get(ev.VAL_REF, m.get(ev.VAL_AVG))


def as_float(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan
