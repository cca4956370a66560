"""Forecast the loss curve from the learning-rate schedule: the LR-annealing law (Tissue et al. 2024, arXiv
2408.11029).

    L(t) = L0 + A * S1(t)^(-alpha) - C * S2(t)
    S1(t) = sum_{i<=t} eta_i                      (the forward area: how far the LR has carried the model)
    S2(t) = sum_{i<=t} m_i,  m_i = lam * m_{i-1} + (eta_{i-1} - eta_i)   (the annealing area, with momentum)

The first two terms are the stable phase's power law in the LR area; `C * S2` is the extra reduction a decay buys,
arriving with a delay (`lam`) after the LR falls. Pure functions of numpy and scipy.

Why this law and not the multi-power law (Luo et al. 2025): with the handful of noisy evals a run has at week two,
the multi-power law's seven parameters were not identified in our synthetic checks (fitted decay gains off by 10x
with the same residual), while this law is linear in three of its four parameters: for each (alpha, lam) the best
(L0, A, C) is one bounded linear least squares, so a fit is a one-dimensional search and costs milliseconds.

Conventions and what the data identify:
- LR values are multipliers of one reference peak (the run's `optimizer.lr`), so S1 is in peak-LR steps and curves
  of one recipe family share parameters. Warmup counts in S1; its rise is not an anneal (S2 counts falls only).
- A constant-LR phase identifies L0, A and alpha only. C (and lam) need a decay: the run's own (cosine decays from
  the start), a branch decay, or an earlier run. Without one the fit is `stable-phase only`: C = 0, and a forecast
  for a decaying schedule is the stable power law alone (an upper estimate, said as such).
- Noisy curves (per-step training loss) are averaged into at most 400 bins, and the linear fits are robust
  (Huber weights, iterated), so a spike or a noisy stretch moves the fit little.
- Band: the delta method. Cov = sigma^2 (J^T J)^-1 with J the Jacobian in (L0, A, alpha, C) at the fit and sigma the
  residual sd; a prediction's variance is g Cov g^T + sigma^2; the band is +-1.645 sd (90%).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import minimize_scalar
from scipy.signal import lfilter

NAMES = ("L0", "A", "alpha", "C", "lam")
Z90 = 1.645
LAMBDAS = (0.9, 0.95, 0.98, 0.99, 0.995, 0.999)
"""The delay factors tried when a decay calibrates the fit (the paper's default is 0.999 at ~10^4-10^5 steps)."""


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


def areas(lr: np.ndarray, warmup: int, lam: float) -> tuple[np.ndarray, np.ndarray]:
    """(S1, S2) at every step 0..N (index t: after step t). O(N)."""
    s1, s2 = areas_at(lr, warmup, (lam,), np.arange(len(lr) + 1))
    return s1, s2[lam]


def areas_at(
    lr: np.ndarray, warmup: int, lams: tuple[float, ...], steps: np.ndarray
) -> tuple[np.ndarray, dict[float, np.ndarray]]:
    """S1 and, for each lam, S2 after the given steps only: one pass over the LR sequence for S1, and for S2 one
    pass from the first LR drop on (none for the stable phase of a WSD run). A 10M-step run costs ~0.1 s and a few
    arrays of its length, where the full arrays for each lam would cost seconds and gigabytes."""
    lr = np.asarray(lr, float)
    steps = np.asarray(steps, int)
    s1 = _sums_at(lr, steps)
    drop = np.subtract(lr[:-1], lr[1:])  # drop[i - 1]: the fall into step i
    np.maximum(drop, 0.0, out=drop)
    drop[:warmup] = 0.0
    falls = np.flatnonzero(drop)
    out = {}
    for lam in lams:
        if not len(falls):
            out[lam] = np.zeros(len(steps))
            continue
        first = int(falls[0])  # the momentum is 0 before the first fall
        m = lfilter([1.0], [1.0, -lam], drop[first:])  # m_i = lam * m_{i-1} + drop_i, in C
        out[lam] = _sums_at(m, steps - first - 1)
    return s1, out


def _sums_at(x: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """sum(x[:t]) for each t in `steps` (0 where t <= 0)."""
    c = np.cumsum(x)
    at = np.clip(steps, 0, len(x))
    return np.where(at > 0, c[np.maximum(at - 1, 0)] if len(c) else 0.0, 0.0)


@dataclass
class Fit:
    params: np.ndarray
    """(L0, A, alpha, C, lam)."""
    cov: np.ndarray
    """Covariance of (L0, A, alpha, C)."""
    sigma: float
    """Residual sd (loss units)."""
    points: int
    calibrated: bool
    """False: no decay in the data; the forecast is stable-phase only (C = 0, no decay gain)."""
    fit_step: int
    """The last observed step the fit used."""
    notes: list[str] = field(default_factory=list)

    @property
    def mode(self) -> str:
        return "calibrated" if self.calibrated else "stable-phase only"

    def as_dict(self) -> dict:
        return {
            "params": dict(zip(NAMES, map(float, self.params))),
            "sigma": self.sigma,
            "points": self.points,
            "mode": self.mode,
            "fit_step": self.fit_step,
        }


def _bin(steps: np.ndarray, loss: np.ndarray, max_points: int) -> tuple[np.ndarray, np.ndarray]:
    """Average a long noisy curve into at most `max_points` bins of equal count (the fit's smoothing)."""
    if len(steps) <= max_points:
        return steps, loss
    edges = np.linspace(0, len(steps), max_points + 1).astype(int)
    pairs = list(zip(edges[:-1], edges[1:]))
    return (
        np.array([int(round(steps[a:b].mean())) for a, b in pairs]),
        np.array([loss[a:b].mean() for a, b in pairs]),
    )


def _nonneg_lstsq(x: np.ndarray, y: np.ndarray, free: list[int]) -> np.ndarray:
    """Least squares with the coefficients >= 0: drop a negative one and refit (3 columns: at most 3 rounds)."""
    coef = np.zeros(x.shape[1])
    while free:
        sol = np.linalg.lstsq(x[:, free], y, rcond=None)[0]
        if (sol >= 0).all():
            coef[free] = sol
            break
        free = [j for j, v in zip(free, sol) if v >= 0] if (sol >= 0).any() else []
    return coef


def _solve(x: np.ndarray, y: np.ndarray, with_c: bool) -> tuple[np.ndarray, np.ndarray]:
    """Robust non-negative linear least squares for (L0, A, C): Huber weights, iterated. Returns (coef, resid)."""
    w = np.ones(len(y))
    free = [0, 1, 2] if with_c else [0, 1]
    for _ in range(3):
        sw = np.sqrt(w)
        coef = _nonneg_lstsq(x * sw[:, None], y * sw, list(free))
        r = y - x @ coef
        s = max(1.4826 * float(np.median(np.abs(r - np.median(r)))), 1e-6)
        w = np.minimum(1.0, 1.345 * s / np.maximum(np.abs(r), 1e-12))
    return coef, y - x @ coef


def fit(curves: list[Curve], *, max_points: int = 400) -> Fit:
    """Fit the law jointly to `curves` (the run and any calibration curves), sharing every parameter."""
    data = []
    for c in curves:
        keep = c.steps >= c.fit_from
        s, v = _bin(c.steps[keep], c.loss[keep], max_points)
        if len(s):
            data.append((c, s, v))
    y = np.concatenate([v for _, _, v in data]) if data else np.array([])
    if len(y) < 4:
        raise ValueError(f"{len(y)} observations: the law needs at least 4 to fit")
    calibrated = sum(c.decay_points() for c, _, _ in data) >= 2
    lams = LAMBDAS if calibrated else (LAMBDAS[-1],)
    at = [areas_at(c.lr, c.warmup, lams, s) for c, s, _ in data]  # each curve's areas at its observed steps
    cache = {lam: [(s1, s2[lam]) for s1, s2 in at] for lam in lams}

    def design(alpha: float, lam: float) -> np.ndarray:
        rows = []
        for (_, s, _), (s1, s2) in zip(data, cache[lam]):
            rows.append(np.stack([np.ones(len(s)), np.maximum(s1, 1e-9) ** (-alpha), -s2], axis=1))
        return np.concatenate(rows)

    def sse(alpha: float, lam: float) -> float:
        _, r = _solve(design(alpha, lam), y, calibrated)
        return float(np.sum(r**2))

    best = None
    for lam in lams:
        opt = minimize_scalar(sse, args=(lam,), bounds=(0.02, 2.0), method="bounded", options={"xatol": 1e-4})
        if best is None or opt.fun < best[0]:
            best = (opt.fun, float(opt.x), lam)
    _, alpha, lam = best
    x = design(alpha, lam)
    (l0, a, cc), r = _solve(x, y, calibrated)
    dof = max(1, len(y) - (4 if calibrated else 3))
    sigma = max(float(np.sqrt(np.sum(r**2) / dof)), 1e-6)
    s1_obs = np.concatenate([np.maximum(s1, 1e-9) for s1, _ in cache[lam]])
    jac = np.stack([x[:, 0], x[:, 1], -a * x[:, 1] * np.log(s1_obs), x[:, 2]], axis=1)
    if not calibrated:
        jac = jac[:, :3]
    cov = np.linalg.pinv(jac.T @ jac) * sigma**2
    if not calibrated:
        cov = np.pad(cov, ((0, 1), (0, 1)))
    notes = [] if calibrated else ["no decay in the data: the decay gain is not calibrated (stable-phase only)"]
    last = max(int(s.max()) for _, s, _ in data)
    return Fit(np.array([l0, a, alpha, cc, lam]), cov, sigma, len(y), calibrated, last, notes)


def curve_of(f: Fit, lr: np.ndarray, steps, warmup: int = 0) -> np.ndarray:
    """The law's loss at `steps` under the LR sequence `lr`."""
    l0, a, alpha, c, lam = f.params
    steps = np.atleast_1d(np.asarray(steps, int))
    s1, s2 = areas_at(lr, warmup, (lam,), steps)
    return l0 + a * np.maximum(s1, 1e-9) ** (-alpha) - c * s2[lam]


def predict(f: Fit, lr: np.ndarray, steps, warmup: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(value, lo, hi) at `steps` under `lr`: the law and its 90% band (delta method, noise included)."""
    l0, a, alpha, c, lam = f.params
    steps = np.atleast_1d(np.asarray(steps, int))
    s1, s2 = areas_at(lr, warmup, (lam,), steps)
    s2 = s2[lam]
    p = np.maximum(s1, 1e-9) ** (-alpha)
    value = l0 + a * p - c * s2
    g = np.stack([np.ones(len(steps)), p, -a * p * np.log(np.maximum(s1, 1e-9)), -s2], axis=1)
    sd = np.sqrt(np.maximum(np.einsum("ij,jk,ik->i", g, f.cov, g) + f.sigma**2, 0.0))
    return value, value - Z90 * sd, value + Z90 * sd


Z99 = 2.576


def off_track(f: Fit, curve: Curve, last_n: int = 4) -> list[int]:
    """The steps of the last `last_n` observations past the fit when all of them lie above its 99% band (a drift
    the law fitted then did not foresee); empty when the run is on track or too few observations came after the fit.
    99% and four in a row: the residuals of a real curve around the law are correlated, so a 90% band crossed
    three times in a row is not rare on a healthy run."""
    later = curve.steps > f.fit_step
    steps, loss = curve.steps[later], curve.loss[later]
    if len(steps) < last_n:
        return []
    steps, loss = steps[-last_n:], loss[-last_n:]
    value, _, hi = predict(f, curve.lr, steps, curve.warmup)
    bound = value + (hi - value) * Z99 / Z90
    return [int(s) for s in steps] if bool(np.all(loss > bound)) else []
