"""Forecast the loss curve from the learning-rate schedule: three laws (analysis/laws.py: the stable-phase power
law, the LR-annealing law of Tissue et al. 2024, the multi-power law of Luo et al. 2025), the one that predicted this
run best chosen by rolling-origin validation, and a band built from those validation errors.

Choosing by prediction, not by fit: the law with the smallest residual is the one with the most freedom, and the
question a forecast answers is about steps not yet seen. So the run's own observations are cut at several steps
(`CUTS`); each law is fitted on the points before a cut and scored on the points after it (mean absolute relative
error); the law with the lowest score over the cuts makes the forecast. With too few points for a cut, the law is the
annealing law where a decay is in the data, the power law where none is.

The band (`predict`): one observation's noise, and the law's error at the forecast's horizon. The validation errors
measure how wrong the chosen law, refitted on fewer points, was on this run at horizons it could check: their 90th
percentile per unit of log-horizon (log(t / cut)), noise taken out, scales to the forecast's horizon
(log(t / fit step)). Where the law could not be validated, the delta method (the parameters' covariance: what the law
promises if it is right) stands in. The drift check keeps a wider band (`drift_band`): the widest of those, with the
forecasts of laws that validated nearly as well (`RIVAL`).

Conventions and what the data identify:
- LR values are multipliers of one reference peak (the run's `optimizer.lr`), so the LR area is in peak-LR steps and
  curves of one recipe family share parameters. Warmup counts in the area; its rise is not an anneal.
- A constant-LR phase identifies L0, A and alpha only. A decay gain needs a decay: the run's own (cosine decays from
  the start), a branch decay, or an earlier run. Without one the forecast is `stable-phase only` (the power law: an
  upper estimate for a decaying schedule, said as such).
- Several curves: the first is the target (`val/ref`); a curve with `offset` (a training-loss curve of the same run)
  shares the law but has a level of its own; a calibration run shares everything in the fit. Long curves (per-step
  training loss) are averaged into at most `MAX_POINTS` bins; each curve is weighted by its own measured noise.
- A sibling calibration run (another seed under the same LR, with points over the steps the target observed)
  shares the law's shape, not always its level: seeds of one recipe differ by a level that persists (1-3% on the
  micro runs). Where validation says carrying the run's own level forward (its last `RECENT` points against the shared
  law) predicted its later points better, the forecast does (`level`). A branch decay from the run's own checkpoint
  shares its history, level included.
- A parameter at a bound of its search (L0 at 0, alpha at 0.02, ...) is named in `at_bound` and the notes: the data
  did not identify it, and the validation band is what the forecast then rests on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..stats import diff_scatter
from .laws import LAWS, Basis, LawFit, Series, basis, fit_law

Z90 = 1.645
Z99 = 2.576
MAX_POINTS = 100
CUTS = (0.4, 0.55, 0.7, 0.85)
"""Where the run's own points are cut for validation: fractions of its usable points."""
MIN_FIT = 4
"""Points a law is fitted on at least (of the target, or of the run's curves together)."""
PER_PARAMETER = 2
"""Points of the run per parameter of a law before a validation cut (power 3, annealing 5, multi-power 7)."""
RIVAL = 2.0
"""A law whose validation score is within this factor of the chosen one's is a rival: the band covers its forecast
too (laws that predicted the run about as well but disagree about the future are the forecast's uncertainty)."""
RECENT = 3
"""Points of the run that measure its own level against a law shared with another run (`Fit.level`)."""


@dataclass
class Curve:
    """One run's loss observations under its LR sequence (multipliers of the reference peak)."""

    lr: np.ndarray
    """LR multiplier of each optimizer step 1..N (`lr[t-1]` is step t's), the planned remainder included."""
    steps: np.ndarray
    """Steps at which the loss was observed (1-based optimizer steps)."""
    loss: np.ndarray
    warmup: int = 0
    first: int | None = None
    """The first step the fit uses; None: max(2 x warmup, 10% of the steps) (see `fit_from`)."""
    offset: bool = False
    """A level of its own (a training-loss curve beside `val/ref`)."""
    same_run: bool = True
    """Cut with the target in validation (False: a calibration run, always used whole)."""

    def __post_init__(self) -> None:
        self.lr = np.asarray(self.lr, float)
        self.steps = np.asarray(self.steps, int)
        self.loss = np.asarray(self.loss, float)
        ok = np.isfinite(self.loss) & (self.steps >= 1) & (self.steps <= len(self.lr))
        self.steps, self.loss = self.steps[ok], self.loss[ok]

    @property
    def fit_from(self) -> int:
        """The first step the fit uses: the first steps after initialisation fall faster than any law in the LR area
        (the model leaves its random init), so by default observations before max(2 x warmup, 10% of the steps) are
        left out."""
        return self.first if self.first is not None else max(2 * self.warmup, len(self.lr) // 10, 1)

    def decay_points(self) -> int:
        """Observations made after the LR had fallen below its peak (after warmup)."""
        peak = float(self.lr.max()) if len(self.lr) else 1.0
        fell = np.flatnonzero((self.lr < 0.999 * peak) & (np.arange(len(self.lr)) >= self.warmup))
        return int(np.sum(self.steps > fell[0] + 1)) if len(fell) else 0


@dataclass
class Fit:
    chosen: LawFit
    """The law that predicted best, fitted on every point."""
    sigma: float
    """The target's measured noise (residual sd, loss units)."""
    points: int
    calibrated: bool
    """False: no decay in the data; the forecast is stable-phase only (the power law, no decay gain)."""
    fit_step: int
    """The last observed step of the run the fit used."""
    validation: dict[str, float] = field(default_factory=dict)
    """Each candidate law's mean absolute relative error on the points after the cuts (none: too few points)."""
    spread: float = 0.0
    """The chosen law's 90th percentile of |relative error| / log(t / cut) in validation (0: none measured)."""
    cuts: int = 0
    notes: list[str] = field(default_factory=list)
    rivals: list[LawFit] = field(default_factory=list)
    """Laws that validated within `RIVAL` of the chosen one, fitted on every point: the drift check's band covers
    them."""
    scatter: float | None = None
    """The target's point-to-point noise (`scatter`; None: too few points): one observation's draw around the curve."""
    level: float = 0.0
    """The run's own level, carried forward: its last `RECENT` points' mean relative departure from a law shared
    with a sibling calibration run (another seed under the same LR, `sibling`), where that predicted the run's later
    points better in validation; 0: the shared law's level (no such run, or it validated worse)."""

    @property
    def law(self) -> str:
        return self.chosen.law.name

    @property
    def params(self) -> dict[str, float]:
        return self.chosen.params

    @property
    def at_bound(self) -> list[str]:
        return self.chosen.at_bound

    @property
    def mode(self) -> str:
        return "calibrated" if self.calibrated else "stable-phase only"

    def as_dict(self) -> dict:
        return {
            "law": self.law,
            "params": self.params,
            "sigma": self.sigma,
            "points": self.points,
            "mode": self.mode,
            "fit_step": self.fit_step,
            "validation": {"scores": self.validation, "cuts": self.cuts, "spread": self.spread},
            "at_bound": self.at_bound,
            "level": self.level,
        }


def _bin(steps: np.ndarray, loss: np.ndarray, max_points: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Average a long noisy curve into at most `max_points` bins of equal count: (steps, means, counts)."""
    if len(steps) <= max_points:
        return steps, loss, np.ones(len(steps))
    edges = np.linspace(0, len(steps), max_points + 1).astype(int)
    counts = np.diff(edges).astype(float)
    mid = np.add.reduceat(steps.astype(float), edges[:-1]) / counts
    return np.rint(mid).astype(int), np.add.reduceat(loss, edges[:-1]) / counts, counts


def _series(curves: list[Curve], max_points: int) -> list[tuple[Curve, Series]]:
    out = []
    for c in curves:
        keep = c.steps >= c.fit_from
        s, v, n = _bin(c.steps[keep], c.loss[keep], max_points)
        if len(s):
            out.append((c, Series(basis(c.lr, c.warmup, s), v, n, c.offset)))
    return out


def _before(s: Series, cut: int) -> Series:
    m = s.basis.steps <= cut
    return Series(s.basis.take(m), s.loss[m], s.weight[m], s.offset)


def _after(s: Series, cut: int) -> tuple[Basis, np.ndarray]:
    m = s.basis.steps > cut
    return s.basis.take(m), s.loss[m]


def validate(law: str, data: list[tuple[Curve, Series]], cuts: list[int]) -> np.ndarray:
    """Rows (relative error, log(t / cut), curve index, observed loss, relative error with the curve's own level) of
    each point of the run after each cut, the law fitted on the points before it; and of each calibration run's points
    in that fit (horizon 0: a law that cannot follow a calibration decay pays for it). The last column carries each
    curve's `recent_level` before the cut forward (`Fit.level`). A curve with a level of its own is scored only where
    it has points before the cut. A cut with fewer than `PER_PARAMETER` points of the run per parameter of the law is
    not tried: a law is not judged on data it could only interpolate."""
    out = []
    need = PER_PARAMETER * LAWS[law].size
    for cut in cuts:
        train, scored, own = [], [], 0
        for i, (c, s) in enumerate(data):
            part = _before(s, cut) if c.same_run else s
            if len(part.loss):
                train.append(part)
                off = sum(x.offset for x in train[:-1]) if s.offset else None
                scored.append((i, s, part, c.same_run, off))
                own += len(part.loss) if c.same_run else 0
        if own < need:
            continue
        f = fit_law(LAWS[law], train, rounds=1)
        for i, s, part, same, off in scored:
            b, y = _after(s, cut) if same else (s.basis, s.loss)
            if len(y):
                horizon = np.log(b.steps / cut) if same else np.zeros(len(y))
                p = f.predict(b, off)
                leveled = p * (1.0 + recent_level(f, part, off)) if same else p
                out.append(np.stack([(p - y) / y, horizon, np.full(len(y), i), y, (leveled - y) / y], axis=1))
    return np.concatenate(out) if out else np.zeros((0, 5))


def recent_level(f: LawFit, s: Series, offset: int | None = None) -> float:
    """The mean relative departure of the last `RECENT` points of `s` from the fitted law (0 without points)."""
    if not len(s.loss):
        return 0.0
    k = slice(-RECENT, None)
    p = f.predict(s.basis.take(k), offset)
    return float(np.mean((s.loss[k] - p) / p))


def sibling(curves: list[Curve]) -> bool:
    """Whether a calibration curve is a sibling of the target: another run (another seed) under the same LR up to the
    target's last observation, with `RECENT` points within the steps the target observed. Between siblings a
    persistent difference is a level of the seed. Not between runs of different schedules: there it is also the
    schedules' difference, which the shared law is there to carry (two micro cosines calibrated by a WSD run sat
    0.8% and 1.6% above the shared law half-way and ended 1.3% and 0.4% below its forecast: their level carried
    forward would have moved it the wrong way). A branch decay from the target's checkpoint starts where the
    target's points stop: it shares the target's history, level included."""
    t = curves[0].steps[curves[0].steps >= curves[0].fit_from]
    if not len(t):
        return False
    end = int(t[-1])
    return any(
        not c.same_run
        and len(c.lr) >= end
        and np.allclose(c.lr[:end], curves[0].lr[:end])
        and np.sum((c.steps >= t[0]) & (c.steps <= end)) >= RECENT
        for c in curves[1:]
    )


def spread_of(rows: np.ndarray, sd: np.ndarray) -> float:
    """The 90th percentile of the law's own error per unit of log-horizon, over the longer half of the horizons:
    each error with the point's observation noise (`sd`, per curve) taken out in quadrature, since the band adds
    that noise itself."""
    rows = rows[rows[:, 1] > 0]
    if not len(rows):
        return 0.0
    rows = rows[rows[:, 1] >= np.median(rows[:, 1])]
    e, h, which, y = rows[:, :4].T
    noise = sd[which.astype(int)] / np.abs(y)
    model = np.sqrt(np.maximum(e**2 - noise**2, 0.0))
    return float(np.quantile(model / h, 0.9))


def _cuts(data: list[tuple[Curve, Series]]) -> list[int]:
    """Validation cuts: steps at `CUTS` of the run's usable points, each with `MIN_FIT` points before it and one
    after."""
    steps = np.sort(np.concatenate([s.basis.steps for c, s in data if c.same_run]))
    if len(steps) < MIN_FIT + 1:
        return []
    ks = {min(max(int(round(f * len(steps))), MIN_FIT), len(steps) - 1) for f in CUTS}
    return sorted({int(steps[k - 1]) for k in ks if steps[k - 1] < steps[-1]})


def fit(curves: list[Curve], *, max_points: int = MAX_POINTS, laws: tuple[str, ...] | None = None) -> Fit:
    """Fit the laws to `curves` (the first is the target), choose the one that predicted the run best, fit it on
    every point. `laws`: the candidates (default: all three where a decay is in the data, the power law where
    none is)."""
    data = _series(curves, max_points)
    points = sum(len(s.loss) for _, s in data)
    if points < MIN_FIT or not data or data[0][0] is not curves[0]:
        raise ValueError(f"{points} observations: the law needs at least {MIN_FIT} to fit, the target one")
    decays = sum(c.decay_points() for c, _ in data) >= 2
    names = laws or (("annealing", "multipower", "power") if decays else ("power",))
    cuts = _cuts(data)
    errors = {name: validate(name, data, cuts) for name in names} if len(names) > 1 or cuts else {}
    scores = {n: float(np.mean(np.abs(v[:, 0]))) for n, v in errors.items() if len(v)}
    every = [s for _, s in data]
    end = basis(curves[0].lr, curves[0].warmup, [len(curves[0].lr)])
    fitted: dict[str, LawFit] = {}
    for name in sorted(scores, key=scores.get):  # the best validated law whose forecast is a loss
        fitted[name] = fit_law(LAWS[name], every)
        if credible(fitted[name], end):
            break
    ranked = [n for n in sorted(scores, key=scores.get) if n in fitted and credible(fitted[n], end)]
    if ranked:
        chosen = ranked[0]
        lf = fitted[chosen]
    else:  # too few points to validate: the first law whose shape they identify, in order of parsimony
        for chosen in [n for n in ("annealing", "power", "multipower") if n in names]:
            lf = fitted.get(chosen) or fit_law(LAWS[chosen], every)
            if lf.identified and credible(lf, end):
                break
    rivals = []
    for name, score in scores.items():
        if name != chosen and score <= RIVAL * scores[chosen]:
            f = fitted.get(name) or fit_law(LAWS[name], every)
            if credible(f, end):
                rivals.append(f)
    # each curve's observation noise, as the band counts it: the residual sd would also hold the law's misfit (with a
    # calibration run, the target's own transient against the shared law: 3-9% on the micro runs), which would
    # cancel the very errors the spread measures
    noise = np.array([scatter(s.loss) or sd for (_, s), sd in zip(data, lf.sd)])
    calibrated = lf.law.name != "power" and lf.coef[2] > 0
    if not decays:
        notes = ["no decay in the data: the decay gain is not calibrated (stable-phase only)"]
    elif not calibrated:
        notes = ["a decay is in the data but no decay gain is identified by it (stable-phase only)"]
    else:
        notes = []
    rows, level = errors.get(chosen, np.zeros((0, 5))), 0.0
    later = rows[rows[:, 1] > 0]
    if len(later) and sibling(curves):
        shared, kept = float(np.mean(np.abs(later[:, 0]))), float(np.mean(np.abs(later[:, 4])))
        if kept < shared:  # seeds differ by a level that persists: the run's own predicted its later points better
            level = recent_level(lf, data[0][1])
            rows = np.concatenate([rows[:, 4:5], rows[:, 1:]], axis=1)
            notes.append(
                f"the calibration run shares the law, this run keeps its own level ({level:+.2%} from the shared law"
                f" over its last {RECENT} points; validated {kept:.2%} against {shared:.2%} at the shared level)"
            )
    spread = spread_of(rows, noise) if chosen in scores else 0.0
    if not scores and len(names) > 1:
        notes.append(f"too few points to validate: the {chosen} law by default")
    if lf.at_bound:
        notes.append(f"at a bound (not identified by these points): {', '.join(lf.at_bound)}")
    last = max(int(s.basis.steps.max()) for c, s in data if c.same_run)
    own = curves[0].loss[curves[0].steps >= curves[0].fit_from]
    one = scatter(own)
    return Fit(lf, float(lf.sd[0]), points, calibrated, last, scores, spread, len(cuts), notes, rivals, one, level)


def scatter(loss: np.ndarray) -> float | None:
    """The noise of one observation (`stats.diff_scatter` of second differences; None under 4 points). Unlike the
    fit's residual sd it holds no misfit of the law, which the band counts apart (the validation spread); unlike
    successive differences, no change of slope between evals far apart (the micro runs' val/ref every 20 steps
    through their fall read a median 1.2x the noise that way)."""
    return diff_scatter(loss, order=2) if len(loss) >= 4 else None


def credible(lf: LawFit, end: Basis) -> bool:
    """A law whose forecast for the end of the plan is not a positive loss (a decay term larger than the loss itself)
    extrapolates outside what it means. (Below L0 is allowed: L0 is the floor of the constant-LR curve, and a decay
    gains beyond it.)"""
    return bool(lf.predict(end)[0] > 0.0)


def predict(f: Fit, lr: np.ndarray, steps, warmup: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(value, lo, hi) at `steps` under `lr`: the chosen law and its 90% band. Two independent errors, added in
    quadrature: one observation's noise (the final value is one eval, or one step's loss: the target's point-to-point
    scatter; a run's own level, `Fit.level`, adds the noise of the `RECENT` points it is the mean of) and the law's
    error at that horizon. Where the law was validated, that error is measured: its validation errors per
    log-horizon (noise taken out) scaled to the horizon. They are the errors of the law refitted on fewer points, so
    they hold its parameters' error too, and the delta method is not added to them (added, the bands held 97-100%
    of the outcomes where 90% was claimed; docs/BENCHMARKS.md). Where it was not, the delta method (what the law
    promises if it is right) stands in."""
    b, value, var = _parameter_variance(f, lr, steps, warmup)
    noise = f.scatter if f.scatter is not None else f.sigma
    noise2 = noise**2 * (1.0 + (1.0 / RECENT if f.level else 0.0))
    horizon = np.maximum(np.log(np.maximum(b.steps, 1) / max(f.fit_step, 1)), 0.0)
    if f.law in f.validation:
        law2 = (f.spread * horizon * value) ** 2
    else:
        law2 = Z90**2 * var
    half = np.sqrt(Z90**2 * noise2 + law2)
    return value, np.maximum(value - half, 0.0), value + half  # a loss is not negative


def _parameter_variance(f: Fit, lr: np.ndarray, steps, warmup: int) -> tuple[Basis, np.ndarray, np.ndarray]:
    """The law at `steps` (at the run's own level) and the variance the fitted parameters give it."""
    b = basis(lr, warmup, steps)
    g = f.chosen.gradient(b) * (1.0 + f.level)
    return b, f.chosen.predict(b) * (1.0 + f.level), np.maximum(np.einsum("ij,jk,ik->i", g, f.chosen.cov, g), 0.0)


def drift_band(f: Fit, lr: np.ndarray, steps, warmup: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(value, top of the 90% band) for the drift check: the widest of the delta method with the fit's residual sd
    (at least one eval's noise), the validation errors scaled to the horizon, and the rivals' forecasts. Wider than
    `predict`'s on purpose: a healthy curve wanders around a law by more than one eval's noise. The residual sd of a
    law through a few points of a steady fall can be far below one eval's noise (a healthy corpus run: 0.013 from 8
    evals, the point-to-point scatter 0.054), and its plateau after the fall was called a drift."""
    b, value, var = _parameter_variance(f, lr, steps, warmup)
    noise = max(f.sigma, f.scatter or 0.0)
    delta = Z90 * np.sqrt(var + noise**2)
    horizon = np.maximum(np.log(np.maximum(b.steps, 1) / max(f.fit_step, 1)), 0.0)
    hi = value + np.maximum(delta, f.spread * horizon * np.abs(value))
    for rival in f.rivals:
        hi = np.maximum(hi, rival.predict(b) * (1.0 + f.level))
    return value, hi


def off_track(f: Fit, curve: Curve, last_n: int = 4) -> list[int]:
    """The steps of the last `last_n` observations past the fit when all of them lie above its 99% band (a drift
    the law fitted then did not foresee); empty when the run is on track or too few observations came after the fit.
    99% and four in a row: the residuals of a real curve around the law are correlated, so a 90% band crossed
    three times in a row is not rare on a healthy run. A fit with a parameter at a bound judges nothing: a law whose
    floor (or shape) the points did not place cannot tell a curve that levels off earlier than it assumed from a
    drift (a healthy micro run's plateau was called off track that way)."""
    if f.at_bound:
        return []
    later = curve.steps > f.fit_step
    steps, loss = curve.steps[later], curve.loss[later]
    if len(steps) < last_n:
        return []
    steps, loss = steps[-last_n:], loss[-last_n:]
    value, hi = drift_band(f, curve.lr, steps, curve.warmup)
    bound = value + (hi - value) * Z99 / Z90
    return [int(s) for s in steps] if bool(np.all(loss > bound)) else []
