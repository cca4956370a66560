"""Run health: a verdict judged on trends over many steps, never one point; the same rule live and offline.

Verdicts, first match wins: `stalled` (no logs, or none for a while in an unfinished run), `diverging` (the smoothed
training loss has risen well above its best, or ends non-finite), `overfitting` (validation rises while training
falls), `plateaued` (no measurable progress over the last quarter of the run), `recovered from spikes` (spikes
happened, the trend is healthy now), `healthy`. Trends use medians over windows, so a single spike moves nothing.
`HealthMonitor` asks the same `verdict` during training, of what the run has logged so far.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

import numpy as np

from ..observe import events as ev
from ..stats import diff_scatter
from .replay import lived_episodes, spike_episodes
from .runfiles import LossSeries, RunFiles, as_float, grace_starts, load_run, spike_rule, val_of, warmup_of

DIVERGE_RATIO = 0.10
"""A smoothed loss this far above its best is diverging."""
PLATEAU_RATIO = 0.002
"""Less relative improvement than this between the last two quarters is a plateau."""
OVERFIT_RATIO = 0.02
"""Validation this far above its best, while training still falls, is overfitting."""
EVAL_SIGMAS = 3.0
"""A validation rise must also exceed this many standard errors of the difference (the two evals' `val/ref_se`)."""


def replayed(run: RunFiles) -> list[dict]:
    """The live spike rule replayed with the run's own section: over what the run lived (its record: rolled-back
    and re-run steps included), or over the logged final timeline for runs written before the record."""
    cfg, graces, start = spike_rule(run.recipe), grace_starts(run.events), warmup_of(run.recipe)
    if (rec := run.record) is not None:
        return lived_episodes(rec.step, rec.judged_loss(), rec.epoch, graces, cfg, start, run.final)
    curve = run.losses
    return spike_episodes((curve.steps, curve.values), graces, cfg, start)


def _windows(values: np.ndarray, k: int) -> list[float]:
    """Medians of consecutive windows of `k` values (a partial last window left out)."""
    n = len(values) // k * k
    return np.median(values[:n].reshape(-1, k), axis=1).tolist() if n else []


def verdict(
    losses: list[tuple[int, float]],
    val: list[tuple[int, float]],
    events: list[dict],
    finished: bool,
    idle_s: float | None,
    stall_minutes: float = 30.0,
    episodes: list[dict] | None = None,
    val_se: dict[int, float] | None = None,
) -> tuple[str, list[str]]:
    """The verdict and the reasons for it (see the module docstring).

    Args:
        val_se: the standard error of each eval's `val/ref` (`val/ref_se`, from its fixed batches' spread): a rise
            of the validation loss counts only beyond `EVAL_SIGMAS` of it and of the series' own eval-to-eval
            scatter (`eval_scatter`), so a small, noisy eval set or a noisy run does not
            turn a healthy run into `overfitting`. Runs without it judge the ratio alone.
        episodes: spikes found by replaying the live rule over `losses` (`spike_replay.spike_episodes`); the live check
            passes None, since the live detector's own spikes are in `events`.
    """
    curve = LossSeries.of(losses)
    if not len(curve):
        return "stalled", ["no training metrics logged"]
    if not finished and idle_s is not None and idle_s > stall_minutes * 60:
        return "stalled", [f"no metrics for {idle_s / 60:.0f} minutes and no run_end"]
    values = curve.values
    tail = values[-max(3, len(values) // 20) :]
    if int((~np.isfinite(tail)).sum()) > len(tail) // 2:
        return "diverging", ["the latest training losses are not finite"]
    finite = values[np.isfinite(values)]
    k = max(3, len(finite) // 10)
    meds = _windows(finite, k)
    reasons: list[str] = []
    if len(meds) >= 3:
        best, last = min(meds[:-1]), meds[-1]
        if last > best * (1 + DIVERGE_RATIO) and last > meds[-2]:
            return "diverging", [f"smoothed loss {last:.4g} is {last / best - 1:.0%} above its best {best:.4g}"]
    last_step = int(curve.steps[-1])
    unrecovered = [e for e in episodes or [] if e["recovered"] is None and last_step - e["onset"] >= 10]
    if unrecovered:
        return "diverging", [f"the loss has stayed above its trend since a spike at step {unrecovered[-1]['onset']}"]
    vals = [(s, as_float(v)) for s, v in val if math.isfinite(as_float(v))]
    if len(vals) >= 3 and len(meds) >= 3:
        # levels, not single evals: the median of each eval and the two before it (the minimum of raw noisy evals
        # is biased low, and one high eval is no trend)
        v = [x for _, x in vals]
        level = [statistics.median(v[max(0, i - 2) : i + 1]) for i in range(len(v))]
        best = min(range(len(v) - 1), key=level.__getitem__)
        best_val, now = level[best], level[-1]
        se = val_se or {}
        noise = EVAL_SIGMAS * max(
            math.hypot(se.get(vals[-1][0]) or 0.0, se.get(vals[best][0]) or 0.0), math.sqrt(2) * eval_scatter(vals)
        )
        rising = now - best_val > max(best_val * OVERFIT_RATIO, noise) and v[-1] > v[-2]
        if rising and meds[-1] <= meds[-2]:
            return "overfitting", [
                f"validation {now:.4g} (median of the last 3 evals) rose {now / best_val - 1:.1%} above its best "
                f"{best_val:.4g} while training kept falling"
            ]
    if len(finite) >= 40:
        q = len(finite) // 4
        prev, last = float(np.median(finite[-2 * q : -q])), float(np.median(finite[-q:]))
        # "no measurable progress" needs medians that would measure PLATEAU_RATIO: the sd of their difference (1.2533
        # sd / sqrt(q) each, sd the per-step scatter) under it. Early in a run with a small batch they do not (a micro
        # run's first 40 steps at 1,024 tokens: 1.5% against 0.2%), and a brief early plateau is no verdict.
        resolution = math.sqrt(2) * 1.2533 * diff_scatter(finite[-2 * q :]) / math.sqrt(q)
        if (prev - last) / abs(prev) < PLATEAU_RATIO and resolution <= PLATEAU_RATIO * abs(prev):
            return "plateaued", [f"the last quarter improved {(prev - last) / abs(prev):.2%} on the one before"]
    n_spikes = max(sum(e["event"] == ev.SPIKE for e in events), len(episodes or []))
    if n_spikes:
        reasons.append(
            f"{n_spikes} spike(s), {sum(e['event'] == 'rollback' for e in events)} rollback(s); trend healthy"
        )
        return "recovered from spikes", reasons
    return "healthy", ["loss trend falling, no spikes"]


def eval_scatter(vals: list[tuple[int, float]], last: int = 10) -> float:
    """The eval-to-eval noise of a validation series: the robust sd of its last `last` successive differences (about
    their median, so a steady trend is not noise) over sqrt(2). It holds what `val/ref_se` cannot: the weights
    themselves move between evals (a high LR, a small batch), so two evals of the same batches differ by more than
    their batches' spread. 0 with fewer than 7 differences (too few to tell scatter from a bend in the curve)."""
    v = [x for _, x in vals[-(last + 1) :]]
    return diff_scatter(v) if len(v) >= 8 else 0.0


def add_downstream(scores: dict[str, dict], step: int, values: dict[str, Any]) -> None:
    """Fold a metrics row's lm-eval scores into `scores`: per score (`<task>/<metric>`) its first and latest value
    and step (the first is the untrained baseline when scored at step 0). Constant size per score, however long the
    run."""
    for k, v in values.items():
        if ev.is_downstream_key(k) and isinstance(v, int | float) and not isinstance(v, bool):
            name = k.removeprefix(ev.EVAL_PREFIX)
            scores.setdefault(name, {"first_step": step, "first": v}).update(last_step=step, last=v)


class HealthMonitor:
    """The live verdict during training, fed incrementally from the records the run logs (the `RunLog`'s reader),
    so a check costs no file I/O; seeded once from a resumed run's files. The same `verdict` as check_run.py."""

    def __init__(self, output_dir: str | Path | None = None):
        self.losses: dict[int, float] = {}
        self.val: dict[int, Any] = {}
        self.val_se: dict[int, float] = {}
        self.incidents: list[dict] = []
        self.context: dict | None = None
        """The latest `context` event's details (loss by position and its verdict)."""
        self.downstream: dict[str, dict] = {}
        """lm-eval's scores, first and latest (`add_downstream`), for the end of the run's story."""
        if output_dir is not None:
            run = load_run(output_dir)
            self.losses.update(run.losses)  # (step, loss) pairs
            self.val.update((m["step"], val_of(m)) for m in run.evals)
            self.val_se.update((m["step"], m[ev.VAL_REF_SE]) for m in run.evals if ev.VAL_REF_SE in m)
            self.incidents = [e for e in run.events if e["event"] in (ev.SPIKE, ev.ROLLBACK)]
            self.context = next((e for e in reversed(run.events) if e["event"] == ev.CONTEXT), None)
            for m in run.evals:
                add_downstream(self.downstream, m["step"], m)

    def on_metrics(self, step: int, values: dict[str, Any]) -> None:
        add_downstream(self.downstream, step, values)
        if ev.VAL_REF in values or ev.VAL_AVG in values:
            self.val[step] = val_of(values)
            if (se := values.get(ev.VAL_REF_SE)) is not None:
                self.val_se[step] = se
        elif ev.LOSS in values:
            # a step logged again after a rollback replaces the earlier value, as in load_run
            self.losses.update((s, v) for s, v in values.get("step_losses") or [(step, values["loss"])])

    def on_event(self, kind: str, step: int, details: dict[str, Any]) -> None:
        if kind in (ev.SPIKE, ev.ROLLBACK):
            self.incidents.append({"event": kind, "step": step})
        elif kind == ev.CONTEXT:
            self.context = {"step": step, **details}

    def verdict(self) -> tuple[str, list[str]]:
        losses = sorted(self.losses.items())
        return verdict(
            losses, sorted(self.val.items()), self.incidents, finished=False, idle_s=0.0, val_se=self.val_se
        )
