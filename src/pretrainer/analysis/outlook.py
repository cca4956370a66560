"""The forecast applied to runs: curves from a run directory or a CSV, alternative schedules of the same run, the
verdicts `check_run.py` prints, and the in-loop `Forecaster` part.

Stage boundaries: `val/ref` is measured at one fixed context for the whole run, so it is comparable across stages,
but a stage that changes the mixture or RoPE can still shift its level. The law is fitted over the whole run (no
per-stage shift: a shift in the decay stage could not be told apart from the decay gain), and the off-track rule
only judges evals in the stage the fit ended in, so a stage change is never reported as a drift.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..errors import PretrainerError
from ..observe import events as ev
from ..recipe.loading import load_recipe
from ..recipe.schedules import cosine_array, lr_array, wsd_array
from ..recipe.schema import Recipe
from .forecast import Curve, Fit, fit, off_track, predict
from .runfiles import RunFiles, load_run, val_of

MIN_POINTS = 4


def usable(curve: Curve) -> int:
    """Observations the fit uses (those from `curve.fit_from` on)."""
    return int(np.sum(curve.steps >= curve.fit_from))


def schedule_of(recipe: Recipe) -> np.ndarray:
    """The recipe's LR multiplier for each optimizer step 1..N (`[t-1]` is step t's)."""
    return lr_array(recipe)


def run_recipe(run_dir: str | Path) -> Recipe:
    """The recipe a run resolved (its model config was checked when the run started: not rebuilt here)."""
    return load_recipe(Path(run_dir) / "recipe.resolved.yaml", check_model=False)


def run_curve(
    run_dir: str | Path, recipe: Recipe | None = None, fit_until: int | None = None, run: RunFiles | None = None
) -> Curve:
    """A run's `val/ref` evals (step 0 left out: the law starts at the first update) under its recipe's schedule.
    `run`: the run as `runfiles.load_run` read it (read here when not given)."""
    run = run or load_run(run_dir)
    recipe = recipe or run_recipe(run_dir)
    pts = [(m["step"], val_of(m)) for m in run.evals if m["step"] > 0 and val_of(m) is not None]
    if fit_until is not None:
        pts = [p for p in pts if p[0] <= fit_until]
    steps = np.array([s for s, _ in pts], int)
    loss = np.array([float(v) for _, v in pts])
    return Curve(schedule_of(recipe), steps, loss, recipe.schedule.warmup_steps)


def train_curve(
    run_dir: str | Path, recipe: Recipe | None = None, fit_until: int | None = None, run: RunFiles | None = None
) -> Curve:
    """A run's per-step training loss (the timeline it kept) as a curve with a level of its own beside `val/ref`:
    many more points than the evals, each noisier, binned by the fit. Read it only where the training loss tracks
    held-out loss (one pass over the data; a run that repeats its data learns it and its training loss falls
    below `val/ref` in a shape of its own)."""
    run = run or load_run(run_dir)
    recipe = recipe or run_recipe(run_dir)
    steps, loss = run.losses.steps, run.losses.values
    if fit_until is not None:
        steps, loss = steps[steps <= fit_until], loss[steps <= fit_until]
    return Curve(schedule_of(recipe), steps, loss, recipe.schedule.warmup_steps, offset=True)


MAX_CURVE_STEPS = 20_000_000
"""The longest schedule a CSV may describe (its per-step LR is 160 MB at this length): a damaged step number must not
become a multi-GB array."""

COLUMNS = {"step": ("step", "_step", "train/step"), "lr": ("lr", "train/lr", "learning_rate"), "loss": ("loss",)}
"""Accepted header names (case and surrounding quotes or spaces ignored); W&B's exports name the step `Step`."""


def csv_curve(path: str | Path, peak: float | None = None) -> Curve:
    """A curve from `step,lr,loss` rows (from W&B or another framework): rows with an empty loss are the planned
    schedule still to run. LRs are divided by `peak` (default: the file's largest LR); steps are 1-based, in any row
    order (the rows are sorted by step; a step given twice is refused).

    Raises:
        PretrainerError: one line naming the file (and the row and column) for anything it cannot read as a curve.
    """
    steps, lr, loss = _csv_rows(Path(path))
    order = np.argsort(steps, kind="stable")
    steps, lr, loss = steps[order], lr[order], loss[order]
    if len(dup := steps[1:][np.diff(steps) == 0]):
        raise PretrainerError(f"{path}: step {int(dup[0])} is given twice; give each step once")
    peak = peak or float(lr.max())
    if not peak > 0:
        raise PretrainerError(f"{path}: no positive lr in column lr: the forecast reads the schedule from it")
    n = int(steps[-1])
    full = np.interp(np.arange(1, n + 1), steps, lr / peak)  # any logging cadence: the LR between rows interpolated
    seen = ~np.isnan(loss)
    rising = np.flatnonzero(np.diff(full) < 0)
    warmup = int(np.argmax(full)) if len(rising) else 0
    return Curve(full, steps[seen], loss[seen], warmup)


def _csv_rows(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(steps, lrs, losses: NaN where empty) of a curve CSV, checked cell by cell."""
    if not path.is_file():
        raise PretrainerError(f"{path}: {'a directory' if path.is_dir() else 'no such file'}, not a step,lr,loss CSV")
    try:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            if not header:
                raise PretrainerError(f"{path}: empty; a curve CSV has a header row step,lr,loss and one row per step")
            names = [h.strip().strip('"').strip().lower() for h in header]
            cols = {}
            for key, accepted in COLUMNS.items():
                cols[key] = next((i for i, h in enumerate(names) if h in accepted), None)
            if None in cols.values():
                missing = [k for k, i in cols.items() if i is None]
                raise PretrainerError(
                    f"{path}: needs the columns step,lr,loss (missing {', '.join(missing)}; found "
                    f"{', '.join(repr(h) for h in header[:8])}): rename the columns of a W&B export to these"
                )
            steps, lr, loss = [], [], []
            for row_no, row in enumerate(reader, start=2):
                if not any(c.strip() for c in row):
                    continue
                step = _cell(row, cols["step"], path, row_no, "step")
                if step is None or step != int(step) or not 1 <= step <= MAX_CURVE_STEPS:
                    raise PretrainerError(
                        f"{path}: row {row_no}, column step: {_raw(row, cols['step'])!r} is not a step number in "
                        f"1..{MAX_CURVE_STEPS:,}"
                    )
                rate = _cell(row, cols["lr"], path, row_no, "lr")
                if rate is None or rate < 0:
                    raise PretrainerError(
                        f"{path}: row {row_no}, column lr: a learning rate >= 0 is required on every row"
                    )
                value = _cell(row, cols["loss"], path, row_no, "loss")
                steps.append(int(step))
                lr.append(rate)
                loss.append(np.nan if value is None else value)
    except UnicodeDecodeError as e:
        raise PretrainerError(f"{path}: not UTF-8 text (byte {e.start}): a curve CSV is text") from None
    except (OSError, csv.Error) as e:
        raise PretrainerError(f"{path}: cannot be read as CSV: {e}") from None
    if not steps:
        raise PretrainerError(f"{path}: a header but no rows; a curve CSV has one row per step")
    return np.array(steps, np.int64), np.array(lr, float), np.array(loss, float)


def _raw(row: list[str], i: int) -> str:
    return row[i].strip() if i < len(row) else ""


def _cell(row: list[str], i: int, path: Path, row_no: int, column: str) -> float | None:
    """A finite number, or None for an empty cell."""
    text = _raw(row, i)
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise PretrainerError(f"{path}: row {row_no}, column {column}: {text[:40]!r} is not a finite number")
    return value


def calibration_curve(path: str | Path, peak: float | None) -> Curve:
    """A calibration curve: another run of the same recipe family (a branch decay, an earlier run), sharing every
    parameter of the law; from a run directory (its own recipe's schedule) or a `step,lr,loss` CSV. LRs are divided by
    the run's `peak` (None: a CSV's own largest LR), so both curves share one LR scale. Never cut in validation."""
    path = Path(path)
    if path.suffix == ".csv":
        curve = csv_curve(path, peak)
    elif not (path / "recipe.resolved.yaml").is_file():
        raise PretrainerError(
            f"--calibrate {path}: neither a step,lr,loss .csv nor a run directory (no recipe.resolved.yaml)"
        )
    else:
        curve = run_curve(path)
        if peak is not None:
            curve.lr = curve.lr * run_recipe(path).optimizer.lr / peak
    curve.same_run = False
    return curve


def alternatives(recipe: Recipe, now: int) -> dict[str, np.ndarray]:
    """LR sequences of the same run under other schedules: WSD with 10/20/30% decay (1-sqrt), 20% with each decay
    shape, a decay starting now to the end, and cosine; the same warmup, total steps and final LR ratio."""
    s, total = recipe.schedule, recipe.plan.total_steps
    w, floor = s.warmup_steps, s.min_lr_ratio

    def wsd_seq(steps: int, shape: str = "1-sqrt", start: int | None = None) -> np.ndarray:
        kw = dict(warmup_steps=w, total_steps=total, decay_steps=steps, decay_shape=shape, min_lr_ratio=floor)
        return wsd_array(np.arange(total), decay_start=start, **kw)

    out = {f"wsd {p}% 1-sqrt": wsd_seq(max(1, round(p / 100 * total))) for p in (10, 20, 30)}
    out.update({f"wsd 20% {shape}": wsd_seq(max(1, round(0.2 * total)), shape) for shape in ("linear", "cosine")})
    if w <= now < total - 1:
        out[f"decay from step {now}"] = wsd_seq(total - now, start=now)
    out["cosine"] = cosine_array(np.arange(total), warmup_steps=w, total_steps=total, min_lr_ratio=floor)
    return out


@dataclass
class Outlook:
    fit: Fit
    final: tuple[float, float, float]
    """(value, lo, hi) of the final val/ref under the run's own schedule."""
    total: int
    off_track: list[int]
    """Evals above the band fitted at `fit.fit_step` (empty: on track)."""
    fit_step_for_check: int | None


def outlook(curve: Curve, calibration: list[Curve] = (), check_last: int = 4) -> Outlook:
    """Fit on everything observed and forecast the final value; and, separately, refit on the first two thirds of
    the evals the law uses (step M) and ask whether the last `check_last` evals lie above that fit's band: a drift
    shows as evals the earlier law did not foresee, where a fit on everything would have bent to follow it."""
    f = fit([curve, *calibration])
    total = len(curve.lr)
    value, lo, hi = predict(f, curve.lr, [total], curve.warmup)
    drift, m = [], None
    used = curve.steps[curve.steps >= curve.fit_from]
    k = (2 * len(used)) // 3
    if k >= MIN_POINTS and len(used) - k >= check_last:
        m = int(used[k - 1])
        early = Curve(curve.lr, curve.steps[curve.steps <= m], curve.loss[curve.steps <= m], curve.warmup)
        drift = off_track(fit([early, *calibration]), curve, check_last)
    return Outlook(f, (float(value[0]), float(lo[0]), float(hi[0])), total, drift, m)


def law_line(f: Fit) -> str:
    """Which law, chosen how, and what the data did not identify."""
    scores = ", ".join(f"{n} {s:.2%}" for n, s in sorted(f.validation.items(), key=lambda x: x[1]))
    how = f"validated on {f.cuts} cuts: {scores}" if scores else "not validated: too few points"
    bound = f"; at a bound: {', '.join(f.at_bound)}" if f.at_bound else ""
    level = f"; this run's own level {f.level:+.2%} from the law shared with its calibration run" if f.level else ""
    return f"law: {f.law} ({how}){bound}{level}"


def verdict_lines(o: Outlook, target: float | None = None) -> list[str]:
    v, lo, hi = o.final
    mode = "" if o.fit.calibrated else " (stable-phase only: no decay gain identified, an upper estimate)"
    if o.off_track:
        lines = [
            f"off track: the last {len(o.off_track)} evals (steps {o.off_track[0]}-{o.off_track[-1]}) lie above the "
            f"band fitted at step {o.fit_step_for_check}"
        ]
    else:
        lines = [f"on track: final val/ref forecast {v:.4f} [{lo:.4f}, {hi:.4f}] at step {o.total}{mode}"]
    lines.append(law_line(o.fit))
    if target is not None:
        answer = "yes" if hi <= target else "no" if lo > target else "uncertain"
        lines.append(f"target {target:g}: {answer} (forecast {v:.4f} [{lo:.4f}, {hi:.4f}])")
    return lines


class InLoopForecast(NamedTuple):
    metrics: dict[str, float]
    """`forecast/final`, its band, `forecast/off_track`."""
    event: dict
    """The `forecast` event's details (the fitted law)."""
    drift: dict | None
    """The `off_track` event's details when a drift begins at this eval; None otherwise."""


class Forecaster:
    """The in-loop part: after each eval, fit the law on the `val/ref` points so far (plus calibration curves) and
    log `forecast/final`, `forecast/final_lo`, `forecast/final_hi`, `forecast/off_track` and a `forecast` event
    (and an `off_track` event when a drift begins). Its state (the points and whether it is off track)
    is checkpointed, so a resumed run forecasts from the same history."""

    def __init__(self, lr: np.ndarray, warmup: int, calibration: list[Curve] = ()):
        self.lr, self.warmup, self.calibration = lr, warmup, list(calibration)
        self.points: list[tuple[int, float]] = []
        self.off = False
        """Whether the last check found the run off track (an `off_track` event is logged when it begins)."""

    @classmethod
    def for_recipe(cls, recipe: Recipe) -> Forecaster | None:
        """The recipe's forecaster (None when `eval.forecast.enabled` is off or nothing is evaluated)."""
        sec = recipe.eval.forecast
        if not sec.enabled:
            return None
        calibration = [calibration_curve(p, recipe.optimizer.lr) for p in sec.calibrate]
        return cls(schedule_of(recipe), recipe.schedule.warmup_steps, calibration)

    def observe(self, step: int, value: float) -> None:
        if step > 0 and np.isfinite(value):
            self.points = [p for p in self.points if p[0] < step] + [(step, float(value))]

    def forecast(self) -> InLoopForecast | None:
        """The metrics and events of this eval's forecast, or None
        while the fit has fewer than `MIN_POINTS` points to use. The drift check is `outlook`'s, as check_run's: a
        drift the law later bends to follow is caught here, when it shows, and stays in the event log."""
        if len(self.points) < MIN_POINTS:
            return None
        steps, loss = zip(*self.points)
        curve = Curve(self.lr, np.array(steps), np.array(loss), self.warmup)
        if usable(curve) < MIN_POINTS:
            return None
        o = outlook(curve, self.calibration)
        value, lo, hi = o.final
        metrics = {ev.FORECAST_FINAL: value, ev.FORECAST_LO: lo, ev.FORECAST_HI: hi}
        metrics[ev.FORECAST_OFF_TRACK] = float(bool(o.off_track))
        began = bool(o.off_track) and not self.off
        self.off = bool(o.off_track)
        drift = {"evals": o.off_track, "fit_step": o.fit_step_for_check} if began else None
        return InLoopForecast(metrics, o.fit.as_dict(), drift)

    def state_dict(self) -> dict:
        return {"points": [list(p) for p in self.points], "off": self.off}

    def load_state_dict(self, state: dict) -> None:
        self.points = [(int(s), float(v)) for s, v in state["points"]]
        self.off = bool(state.get("off", False))


def forecast_report(run_dir: str | Path, target: float | None = None, run: RunFiles | None = None) -> dict | None:
    """The forecast part of `check_run.py`: verdict lines, the final forecast and the off-track evals (None when the
    run has fewer than `MIN_POINTS` val/ref evals or no resolved recipe). `run`: as `runfiles.load_run` read it."""
    if not (Path(run_dir) / "recipe.resolved.yaml").exists():
        return None
    curve = run_curve(run_dir, run=run)
    if usable(curve) < MIN_POINTS:
        return None
    o = outlook(curve)
    v, lo, hi = o.final
    out = {
        "lines": verdict_lines(o, target),
        "final": {"value": v, "lo": lo, "hi": hi, "step": o.total},
        "off_track": o.off_track,
        "fit": o.fit.as_dict(),
    }
    was, line = remembered_drift((run or load_run(run_dir)).events, bool(o.off_track))
    if was:
        out["was_off_track"] = was
    if line:
        out["lines"].insert(0, line)
    return out


def remembered_drift(events: list[dict], now_off: bool) -> tuple[list[dict], str | None]:
    """The drifts the loop logged (`off_track` events), and a verdict line for the latest when the check today no
    longer sees it: a law fitted on evals inside a drift follows the drifted curve."""
    was = [{"evals": e["evals"], "fit_step": e["fit_step"]} for e in events if e["event"] == ev.OFF_TRACK]
    if not was or now_off:
        return was, None
    e = was[-1]
    return was, (
        f"was off track: evals at steps {e['evals'][0]}-{e['evals'][-1]} lay above the band fitted at step "
        f"{e['fit_step']} (the law fitted since follows the drifted curve: compare its forecast with the one before)"
    )


def decay_from(recipe: Recipe, now: int, steps: int) -> np.ndarray:
    """The run's LR to step `now`, then a decay of `steps` steps from there in the recipe's shape and floor."""
    s = recipe.schedule
    before = schedule_of(recipe)[:now]
    kw = dict(warmup_steps=0, total_steps=steps, decay_steps=steps, min_lr_ratio=s.min_lr_ratio, decay_start=0)
    after = wsd_array(np.arange(steps), decay_shape=s.decay_shape, **kw)
    return np.concatenate([before, after * (before[-1] if now else 1.0)])


def merged_report(run_dir: str | Path, run: RunFiles | None = None) -> dict | None:
    """What averaging gave, beside what a decay would: the last eval's `val/ref_merged` against the live `val/ref`,
    and the forecast of a decay of the recipe's own length started at that step (fitted on the evals up to it, with
    the recipe's calibration runs; stable-phase only without them), and each calibration run's measured final value.
    None when the run logged no merged eval. `run`: as `runfiles.load_run` read it."""
    run_dir = Path(run_dir)
    run = run or load_run(run_dir)
    evals = run.evals
    if not any(ev.VAL_REF_MERGED in m for m in evals):
        return None
    recipe = run_recipe(run_dir)
    start = recipe.plan.decay_start
    rows = [m for m in evals if ev.VAL_REF_MERGED in m]
    stable = [m for m in rows if start is None or m["step"] <= start]  # the question is asked before a decay
    if not rows:
        return None
    m = (stable or rows)[-1]
    n, merged, live = m["step"], m[ev.VAL_REF_MERGED], m.get(ev.VAL_REF, float("nan"))
    out = {"step": n, "merged": merged, "live": live}
    line = f"merged weights at step {n}: val/ref {merged:.4f} (live {live:.4f}, {merged - live:+.4f})"
    calibration = [calibration_curve(p, recipe.optimizer.lr) for p in recipe.eval.forecast.calibrate]
    curve = run_curve(run_dir, recipe, fit_until=n, run=run)
    length = recipe.plan.decay_steps or max(1, round(0.2 * n))
    if usable(curve) >= MIN_POINTS:
        f = fit([curve, *calibration])
        value, lo, hi = (float(x[0]) for x in predict(f, decay_from(recipe, n, length), [n + length], curve.warmup))
        out["decay_forecast"] = {"steps": length, "value": value, "lo": lo, "hi": hi, "mode": f.mode}
        mode = "" if f.calibrated else " (stable-phase only: no decay gain without a calibration run)"
        line += f"; a {length}-step decay from step {n} is forecast at {value:.4f} [{lo:.4f}, {hi:.4f}]{mode}"
    ends = [e for e in evals if e["step"] == recipe.plan.total_steps and ev.VAL_REF in e]
    if start is not None and n == start and ends:  # the run decayed from this very step: its own measurement
        out["decay_measured"] = {"run": str(run_dir), "step": ends[-1]["step"], "value": ends[-1][ev.VAL_REF]}
        line += f"; the run's own decay reached {ends[-1][ev.VAL_REF]:.4f} at step {ends[-1]['step']}"
    for path in recipe.eval.forecast.calibrate:
        if Path(path).is_dir() and (c := run_curve(path)).steps.size:
            out.setdefault("branches", []).append({"run": str(path), "step": int(c.steps[-1]), "value": c.loss[-1]})
            line += f"; measured on {path}: {c.loss[-1]:.4f} at step {int(c.steps[-1])}"
    out["line"] = line
    return out
