"""The loss-curve laws the forecast chooses between, as functions of the LR sequence (multipliers of one reference
peak; `lr[t-1]` is step t's), and their robust fit. Pure functions of numpy and scipy.

- `power`: L0 + A S1(t)^-alpha, the stable phase's power law in the LR area S1 (sum of the LR up to t). It has no
  decay term: the baseline, and the only law a run without a decay can identify.
- `annealing` (Tissue et al. 2024, arXiv 2408.11029): power - C S2(t), S2 the annealing area (falls of the LR
  accumulated with a momentum lam, a grid of values). One shape of decay gain for every schedule.
- `multipower` (Luo et al. 2025, arXiv 2503.12811): power - B sum_k (eta_{k-1} - eta_k) G(eta_k^-gamma S_k(t)),
  G(x) = 1 - (C x + 1)^-beta, S_k(t) the LR area from step k to t: each fall of the LR pays off as it is followed by
  more area, at a rate set by the LR it fell to. It follows a cosine's long decay where the annealing law, fitted
  early, under- or over-shoots; with few points its decay parameters may not be identified (reported as bounds hit).

Every law is linear in (L0, A, decay gain) and in a level offset per extra curve (a training-loss curve beside
`val/ref`), so each fit is a variable projection: a bounded search over the nonlinear parameters (alpha; lam from a
grid; C, beta, gamma) whose residual solves the linear ones by least squares with L0, A and the gain kept >= 0.
Several starts; Huber weights from the residuals, iterated; each curve weighted by its own measured noise.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import least_squares

from ..stats import MAD_TO_SD

LAMBDAS = (0.9, 0.95, 0.98, 0.99, 0.995, 0.999)
"""The annealing law's delay factors (the paper's default is 0.999 at ~10^4-10^5 steps)."""
MPL_BINS = 48
"""Groups of LR falls the multi-power law's sum runs over (each split further at every step it is evaluated at):
its cost per evaluation is points x groups, not points x steps; a million-step cosine costs the same as a short one."""
MAX_EVALS = 25
"""Residual evaluations per parameter in one search: a shape the points do not identify (a flat valley) is
stopped there and reported by its bounds, not searched for seconds."""
ETA_FLOOR = 1e-3
"""eta_k^-gamma with an LR that decays to 0: the last fall is taken at 0.1% of the peak."""


def sums_at(x: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """sum(x[:t]) for each t in `steps` (0 where t <= 0)."""
    return _at(np.cumsum(x), steps)


def _at(c: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """`sums_at` from the cumulative sum `c`."""
    at = np.clip(steps, 0, len(c))
    return np.where(at > 0, c[np.maximum(at - 1, 0)] if len(c) else 0.0, 0.0)


def momentum(x: np.ndarray, lam: float) -> np.ndarray:
    """m_i = lam * m_{i-1} + x_i from m_-1 = 0 (scipy's `lfilter([1], [1, -lam], x)`, whose import costs check_run
    0.4 s), as array operations: within a block where lam^-k stays under 1e250, m is a cumulative sum of x_j lam^-j
    scaled back by lam^i, the block's start carried in; each term keeps its relative precision."""
    n = len(x)
    block = max(1, int(250 / -math.log10(lam)))
    p = lam ** np.arange(min(block, n), dtype=float)
    out = np.empty(n)
    carry = 0.0
    for a in range(0, n, block):
        k = min(block, n - a)
        c = np.cumsum(x[a : a + k] / p[:k])
        c += lam * carry
        c *= p[:k]
        out[a : a + k] = c
        carry = float(c[-1])
    return out


def falls(lr: np.ndarray, warmup: int) -> np.ndarray:
    """drop[j]: the fall of the LR into step j + 2 (>= 0; rises and the warmup count as none)."""
    drop = np.subtract(lr[:-1], lr[1:])
    np.maximum(drop, 0.0, out=drop)
    drop[:warmup] = 0.0
    return drop


def annealing_areas(drop: np.ndarray, where: np.ndarray, lams: tuple[float, ...], steps: np.ndarray) -> dict:
    """For each lam, the annealing area S2 after the given steps only, from the LR's falls (`drop`, nonzero at
    `where`): one pass from the first fall on (none for the stable phase of a WSD run). A 10M-step run costs ~0.1 s
    and a few arrays of its length, where the full arrays for each lam would cost seconds and gigabytes."""
    out = {}
    for lam in lams:
        if not len(where):
            out[lam] = np.zeros(len(steps))
            continue
        first = int(where[0])  # the momentum is 0 before the first fall
        out[lam] = sums_at(momentum(drop[first:], lam), steps - first - 1)
    return out


@dataclass
class Basis:
    """What a law needs of one LR sequence at given steps, computed once per curve (the fit's searches reuse it)."""

    steps: np.ndarray
    s1: np.ndarray
    s2: dict[float, np.ndarray]
    """The annealing area at `steps` for each lam of `LAMBDAS`."""
    groups: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
    """The multi-power law's groups of falls: (last step, LR fallen to, LR area before it, total fall), each group's
    steps all <= or all > every step in `steps`."""

    def take(self, index) -> Basis:
        """The basis at some of its steps (a mask or a slice): the groups stay, as each still bounds every step."""
        return Basis(self.steps[index], self.s1[index], {k: v[index] for k, v in self.s2.items()}, self.groups)


_LAST: list = []
"""The last sequence's passes, with a weak reference to it: the forecast asks for several bases of one run's LR
(fit, validation, the drift check, the band); at 10M steps each pass costs ~0.1 s."""


def _passes(lr: np.ndarray, warmup: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(cumulative LR, its falls, where it falls) of `lr`, reused while the same array, unchanged, is asked again."""
    # nothing here changes an LR array in place; a sample of its values guards against it all the same
    key = (warmup, len(lr), float(lr[:: max(1, len(lr) // 4096)].sum()))
    if _LAST and _LAST[0]() is lr and _LAST[1] == key:
        return _LAST[2]
    drop = falls(lr, warmup)
    out = (np.cumsum(lr), drop, np.flatnonzero(drop))
    _LAST[:] = [weakref.ref(lr), key, out]
    return out


def basis(lr: np.ndarray, warmup: int, steps) -> Basis:
    """Areas at `steps` and the grouped falls: O(len(lr)) once, then nothing per step in the searches."""
    lr = np.asarray(lr, float)
    steps = np.atleast_1d(np.asarray(steps, int))
    cum, drop, j = _passes(lr, warmup)
    s1, s2 = _at(cum, steps), annealing_areas(drop, j, LAMBDAS, steps)
    if not len(j):
        empty = np.zeros(0)
        return Basis(steps, s1, s2, (empty, empty, empty, empty))
    d = drop[j]
    k = j + 2  # the step the LR fell into
    share = np.cumsum(d) / d.sum()
    cuts = np.searchsorted(share, np.linspace(0, 1, MPL_BINS + 1)[1:-1])  # groups of equal total fall
    cuts = np.union1d(cuts, np.searchsorted(k, steps, side="right"))  # and split where an evaluated step lies
    gid = np.searchsorted(cuts, np.arange(len(k)), side="right")
    n = int(gid.max()) + 1
    total = np.bincount(gid, d, n)
    keep = total > 0
    before = cum[k - 2]  # the area up to step k - 1

    def mean(v: np.ndarray) -> np.ndarray:
        return (np.bincount(gid, d * v, n) / np.where(keep, total, 1.0))[keep]

    last = np.zeros(n, int)
    np.maximum.at(last, gid, k)
    return Basis(steps, s1, s2, (last[keep], mean(lr[k - 1]), mean(before), total[keep]))


class Law:
    """A law: its nonlinear parameters (bounds, starts), its variants (a grid searched outside the fit) and, for
    given values, the columns whose non-negative coefficients are A and the decay gain."""

    name = ""
    names: tuple[str, ...] = ()
    lower: tuple[float, ...] = ()
    upper: tuple[float, ...] = ()
    starts: tuple[tuple[float, ...], ...] = ()
    variants: tuple = (None,)
    linear = ("L0", "A")

    @property
    def size(self) -> int:
        """Parameters fitted: the nonlinear ones, one for a grid of variants, the linear ones."""
        return len(self.names) + (len(self.variants) > 1) + len(self.linear)

    def columns(self, b: Basis, theta: np.ndarray, variant) -> np.ndarray:
        raise NotImplementedError

    def params(self, theta: np.ndarray, variant) -> dict[str, float]:
        return dict(zip(self.names, map(float, theta)))


def _power(b: Basis, alpha: float) -> np.ndarray:
    return np.maximum(b.s1, 1e-9) ** (-alpha)


class Power(Law):
    name, names, lower, upper, starts = "power", ("alpha",), (0.02,), (2.0,), ((0.1,), (0.5,))

    def columns(self, b, theta, variant):
        return _power(b, theta[0])[:, None]


class Annealing(Law):
    name, names, lower, upper, starts = "annealing", ("alpha",), (0.02,), (2.0,), ((0.1,), (0.5,))
    variants = LAMBDAS
    linear = ("L0", "A", "C")

    def columns(self, b, theta, lam):
        return np.stack([_power(b, theta[0]), -b.s2[lam]], axis=1)

    def params(self, theta, lam):
        return {"alpha": float(theta[0]), "lam": float(lam)}


class MultiPower(Law):
    name = "multipower"
    names = ("alpha", "log10_C", "beta", "gamma")
    lower, upper = (0.02, -3.0, 0.05, 0.0), (2.0, 3.0, 3.0, 1.5)
    starts = ((0.3, 0.0, 0.6, 0.5), (0.1, 1.0, 1.0, 0.3), (0.6, -1.0, 0.4, 0.8))
    linear = ("L0", "A", "B")

    def columns(self, b, theta, variant):
        return np.stack([_power(b, theta[0]), -self.gain(b, theta)], axis=1)

    @staticmethod
    def gain(b: Basis, theta: np.ndarray) -> np.ndarray:
        """sum over the falls before each step of fall x G(eta^-gamma x the area since): points x groups."""
        last, eta, before, total = b.groups
        if not len(last):
            return np.zeros(len(b.steps))
        _, log_c, beta, gamma = theta
        x = np.maximum(b.s1[:, None] - before[None, :], 0.0)
        rate = 10.0**log_c * np.maximum(eta, ETA_FLOOR) ** (-gamma)
        g = -np.expm1(-beta * np.log1p(rate[None, :] * x))  # 1 - (1 + C eta^-gamma x)^-beta
        g *= last[None, :] <= b.steps[:, None]
        return g @ total


LAWS = {law.name: law for law in (Power(), Annealing(), MultiPower())}


@dataclass
class Series:
    """One curve's binned observations as a fit sees them."""

    basis: Basis
    loss: np.ndarray
    weight: np.ndarray
    """Relative weight of each point (a bin of n steps: n)."""
    offset: bool
    """A level of its own (a training-loss curve beside `val/ref`)."""


@dataclass
class LawFit:
    law: Law
    theta: np.ndarray
    variant: object
    coef: np.ndarray
    """L0, the law's linear coefficients, then one offset per curve with a level of its own."""
    sd: np.ndarray
    """Each curve's residual sd (its measured noise, loss units)."""
    cov: np.ndarray
    """Covariance of (theta, coef) (the delta method)."""
    at_bound: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, law: str, theta, coef, variant=None) -> LawFit:
        """A law with given parameters and no fit behind it (curves drawn from it in tests and benchmarks)."""
        return cls(LAWS[law], np.asarray(theta, float), variant, np.asarray(coef, float), np.ones(1), np.zeros((0, 0)))

    @property
    def identified(self) -> bool:
        """No shape parameter at a bound of its search, and a decay gain where the law has one: L0 at 0 (the floor
        not yet seen) is allowed, since every law then shares it."""
        return not [n for n in self.at_bound if n != "L0"]

    @property
    def params(self) -> dict[str, float]:
        out = self.law.params(self.theta, self.variant)
        out.update(zip(self.law.linear, map(float, self.coef)))
        return out

    def predict(self, b: Basis, offset: int | None = None) -> np.ndarray:
        """The law at `b`'s steps, at the level of the target (or of the curve with that offset index)."""
        return _design(self, b, self.theta, offset) @ self.coef

    def gradient(self, b: Basis, offset: int | None = None) -> np.ndarray:
        """d prediction / d (theta, coef), for the delta method: theta by central differences."""
        cols = [_design(self, b, self.theta, offset)]
        step = 1e-4 * (np.asarray(self.law.upper) - np.asarray(self.law.lower))
        grads = []
        for i, h in enumerate(step):
            up, down = self.theta.copy(), self.theta.copy()
            up[i], down[i] = up[i] + h, down[i] - h
            grads.append((_design(self, b, up, offset) - _design(self, b, down, offset)) @ self.coef / (2 * h))
        return np.concatenate([np.stack(grads, axis=1), cols[0]], axis=1)


def _design(f: LawFit, b: Basis, theta: np.ndarray, offset: int | None) -> np.ndarray:
    cols = f.law.columns(b, theta, f.variant)
    extra = len(f.coef) - 1 - cols.shape[1]
    levels = np.zeros((len(b.steps), extra))
    if offset is not None:
        levels[:, offset] = 1.0
    return np.concatenate([np.ones((len(b.steps), 1)), cols, levels], axis=1)


def _rows(law: Law, series: list[Series], theta: np.ndarray, variant) -> np.ndarray:
    """The design matrix over every curve: 1 (L0), the law's columns, a level indicator per offset curve."""
    n_off = sum(s.offset for s in series)
    out, k = [], 0
    for s in series:
        cols = law.columns(s.basis, theta, variant)
        levels = np.zeros((len(s.loss), n_off))
        if s.offset:
            levels[:, k] = 1.0
            k += 1
        out.append(np.concatenate([np.ones((len(s.loss), 1)), cols, levels], axis=1))
    return np.concatenate(out)


def _bounded_lstsq(x: np.ndarray, y: np.ndarray, nonneg: int) -> np.ndarray:
    """Least squares with the first `nonneg` coefficients >= 0: a negative one is fixed at 0 and the rest refitted."""
    free = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while free:
        sol = np.linalg.lstsq(x[:, free], y, rcond=None)[0]
        bad = [(v, j) for v, j in zip(sol, free) if j < nonneg and v < 0]
        if not bad:
            coef[free] = sol
            break
        free.remove(min(bad)[1])
    return coef


def fit_law(law: Law, series: list[Series], *, rounds: int = 2) -> LawFit:
    """The law fitted to the curves jointly: every start and variant searched with the curves' weights, then
    `rounds` reweightings from the best (each curve's measured noise, Huber weights on its points) and a final
    search from there."""
    y = np.concatenate([s.loss for s in series])
    which = np.concatenate([np.full(len(s.loss), i) for i, s in enumerate(series)])
    base = np.sqrt(np.concatenate([s.weight for s in series]))
    nonneg = len(law.linear)  # L0, A and the gain are >= 0; the offsets are free
    lo, hi = np.asarray(law.lower, float), np.asarray(law.upper, float)

    def solve(theta, variant, w):
        x = _rows(law, series, theta, variant)
        coef = _bounded_lstsq(x * w[:, None], y * w, nonneg)
        return coef, y - x @ coef

    def search(theta0, variant, w):
        res = least_squares(
            lambda th: solve(th, variant, w)[1] * w,
            theta0,
            bounds=(lo, hi),
            x_scale=hi - lo,
            ftol=1e-6,
            xtol=1e-6,
            max_nfev=MAX_EVALS * (len(theta0) + 1),
        )
        return res.cost, res.x

    w = base.copy()
    best = min(
        ((*search(np.asarray(t, float), v, w), v) for v in law.variants for t in law.starts), key=lambda r: r[0]
    )
    _, theta, variant = best
    for _ in range(rounds):
        _, r = solve(theta, variant, w)
        sd = _curve_sd(r, which, len(series))
        z = np.abs(r) / sd[which]
        w = base / sd[which] * np.sqrt(np.minimum(1.0, 1.345 / np.maximum(z, 1e-12)))
        _, theta = search(theta, variant, w)
        if len(law.variants) > 1:  # the grid again under the new weights
            _, theta, variant = min(((*search(theta, v, w), v) for v in law.variants), key=lambda r: r[0])
    coef, r = solve(theta, variant, w)
    sd = _curve_sd(r, which, len(series))
    f = LawFit(law, theta, variant, coef, sd, np.zeros((0, 0)))
    f.at_bound = [n for n, v, a, b in zip(law.names, theta, lo, hi) if min(v - a, b - v) < 1e-3 * (b - a)]
    f.at_bound += [n for n, v in zip(law.linear, coef) if v <= 0.0]
    # the delta method on the weighted problem (weights 1/sd: the scale is already in them). A shape parameter held
    # at a bound is fixed there (its flat direction would make the band infinite); the linear ones stay free, so a
    # floor held at 0 still widens the band by what the points leave open
    jac = np.concatenate([f.gradient(s.basis, _offset_index(series, i)) for i, s in enumerate(series)]) * w[:, None]
    free = np.array([n not in f.at_bound for n in law.names] + [True] * len(coef))
    dof = max(1, len(y) - int(free.sum()))
    scale = float(np.sum((r * w) ** 2) / dof)
    f.cov = np.zeros((len(free), len(free)))
    f.cov[np.ix_(free, free)] = np.linalg.pinv(jac[:, free].T @ jac[:, free]) * scale
    return f


def _offset_index(series: list[Series], i: int) -> int | None:
    return sum(s.offset for s in series[:i]) if series[i].offset else None


def _curve_sd(r: np.ndarray, which: np.ndarray, n: int) -> np.ndarray:
    """Each curve's robust residual sd (MAD), shrunk towards the pooled one by 4 points' worth: a curve of two
    points has no noise estimate of its own."""
    pooled = max(MAD_TO_SD * float(np.median(np.abs(r))), 1e-6)
    out = np.empty(n)
    for i in range(n):
        ri = r[which == i]
        own = MAD_TO_SD * float(np.median(np.abs(ri))) if len(ri) else pooled
        out[i] = max(np.sqrt((len(ri) * own**2 + 4 * pooled**2) / (len(ri) + 4)), 1e-6)
    return out
