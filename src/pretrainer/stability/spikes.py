"""Loss-spike detection against the local trend, in units of the noise around that trend.

Rule: over the last `window` healthy steps, fit the trend robustly (a quadratic in the step, refit once without the
points more than 3 robust sd off it), predict the current step, and measure the noise as the robust sd of the
residuals (1.4826 x their median absolute value, or the inliers' sd, or the 95th percentile of |residual| over 1.96:
the largest; the last keeps heavy tails from reading as spikes), widened for the means the rule judges by the
residuals' autocorrelation and by the trend's prediction error beyond a full window's (`widening`), floored at
`min_rel_scale` x the predicted loss. A step's z-score is its residual over that scale. A step is *suspect* when z > threshold / 2; a spike is
`persistence` suspect steps in a row whose mean z exceeds `threshold`, dated from the first (the onset). NaN/inf in
the loss or the gradient norm is a spike at once.

Why a trend: while the loss is falling, the spread of raw levels in a window measures the descent, not the noise;
residuals from the fitted trend measure the noise alone, so the same threshold holds on a steep early curve, a
plateau and after a stage change. No judgement during a grace period after warmup and after each stage start (the
level shifts when seq_len, RoPE or the mixture change), and the trend is then fitted from the steps after it only:
the first steps of a run or a stage are a transient the quadratic cannot follow, and their misfit would widen the
noise scale for a whole window (a x1000 gradient's 0.6-nat rise went unjudged that way).
Suspect losses enter the window only once the run of suspects ends without a spike, so a spike cannot raise its own
baseline and ordinary noise is not censored.

After a spike the detector judges nothing until the loss is back under its pre-spike trend plus threshold / 2 sd
(an *episode*; a non-finite spike ends at the next finite step, and a non-finite step is always a spike of its own,
episode or not), then starts a grace period without forgetting the
trend. One excursion is one spike. A rollback restores the detector from the checkpoint, which ends the episode; a
spike the loop does not roll back for (absorbed by skip-step, or recurred on an exact replay) runs its course.
`check_run.py`'s replay (spike_replay.py) follows the same rule over the recorded steps.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..recipe.sections import SpikesSection
from ..stats import MAD_TO_SD, robust_sd, tail_sd


@dataclass(frozen=True)
class Verdict:
    kind: str
    """`ok`, `suspect` (above the bar, not yet a spike) or `spike`."""
    onset: int | None = None
    reason: str = ""
    zscore: float = 0.0
    expected: float | None = None
    """The trend's prediction for the step (None where no trend was fitted)."""
    noise: float | None = None
    """The noise sd around the trend."""


def inflation(rho, persistence: int):
    """sqrt of the variance inflation of a mean of `persistence` residuals with lag-1 autocorrelation `rho` (AR(1)):
    1 + 2 sum_k (1 - k/p) rho^k. The rule judges the mean z of `persistence` steps in a row; correlated noise makes
    such means wider than independent noise does, so the scale is widened by this factor and the threshold keeps the
    false-alarm rate it has on independent noise."""
    var = 1.0
    for k in range(1, persistence):
        var = var + 2.0 * (1.0 - k / persistence) * rho**k
    return np.sqrt(var)


def edge_leverage(sums, u=0.0):
    """The prediction variance of a quadratic least-squares trend at u, in units of the noise variance: x' G^-1 x with
    x = (1, u, u^2) and G the fit's Gram matrix, given by its power sums (s0 .. s4, sum of u^k over the fitted points;
    the last axis, so rows of windows work alike; or five floats), in closed form. About 9 / n just past the end of n
    points."""
    s0, s1, s2, s3, s4 = sums.T if isinstance(sums, np.ndarray) else sums
    c00, c01, c02 = s2 * s4 - s3 * s3, s2 * s3 - s1 * s4, s1 * s3 - s2 * s2
    c11, c12, c22 = s0 * s4 - s2 * s2, s1 * s2 - s0 * s3, s0 * s2 - s1 * s1
    det = s0 * c00 + s1 * c01 + s2 * c02
    return (c00 + u * (2 * c01 + u * (2 * c02 + c11 + u * (2 * c12 + u * c22)))) / det


def power_sums(u: np.ndarray) -> np.ndarray:
    """Sums of u^0 .. u^4 along the last axis (`edge_leverage`'s input)."""
    u2 = u * u
    return np.stack(
        [np.full(u.shape[:-1], float(u.shape[-1])), u.sum(-1), u2.sum(-1), (u2 * u).sum(-1), (u2 * u2).sum(-1)], -1
    )


@functools.lru_cache(maxsize=16)
def full_sums(window: int) -> np.ndarray:
    """The power sums of a full window, `window` consecutive steps at u = (i - window) / window: the next step is at
    u = 0, `k` steps after it at k / window."""
    return power_sums((np.arange(window, dtype=float) - window) / window)


@functools.lru_cache(maxsize=256)
def full_leverage(window: int, ahead: int = 0) -> float:
    """`edge_leverage` of a full window, the prediction `ahead` steps after the next one (a step judged while
    suspects are pending)."""
    return float(edge_leverage(full_sums(window), ahead / window))


def widening(rho, excess, persistence: int):
    """The factor from the per-step noise sd to the scale a step's z is measured in: the noise's own part for means
    of `persistence` steps in a row (`inflation`), and the trend's prediction error beyond that of a full window
    judging the same step (`excess`, in leverage: `excess_from_sums`). That error is the same for all the steps of a
    mean and does not average out (`persistence` x the leverage); the threshold is calibrated on full windows
    (bench_spikes.py, the noise models, the judgement corpus), which carry their own already, so a shorter or gappier
    history widens the scale by what it adds: without that, a trend fitted on the few dozen steps after a stage or a
    run starts, extrapolated, reads its own error as spikes (the leverage is ~9 / n after n steps: x1.3 at 30
    steps)."""
    return np.sqrt(inflation(rho, persistence) ** 2 + persistence * excess)


def excess_from_sums(sums: np.ndarray, ahead, window: int):
    """The leverage of quadratic trends (their power sums, per row) at the step they judge, `ahead` of their next
    step, less that of a full `window` of consecutive steps judging as far ahead: the part a short or gappy history
    adds (0 for a full window). From the window's steps, not the refit's inliers (the few points a refit leaves out
    move it ~1%, and the replay needs no Gram matrix of each fit)."""
    return np.maximum(edge_leverage(sums) - edge_leverage(full_sums(window), ahead / window), 0.0)


def lag1(resid: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """The residuals' lag-1 autocorrelation over the kept points (per row for 2-D), clipped to [0, 0.9]: a negative
    estimate would narrow the scale on noise, and 0.9 bounds the widening."""
    r = resid * keep
    return lag1_of(r, np.sum(r * r, axis=-1))


def lag1_of(kept: np.ndarray, power: np.ndarray) -> np.ndarray:
    """`lag1` from the kept residuals (zero where left out) and their sum of squares (the batched fit has both)."""
    num = np.einsum("...i,...i->...", kept[..., :-1], kept[..., 1:])
    return np.clip(num / np.where(power > 0, power, 1.0), 0.0, 0.9)


def _sorted_median(s: np.ndarray) -> np.ndarray:
    """The median of each row of rows sorted in place (np.median's two-point partition is 4x slower on rows of
    ~100)."""
    n = s.shape[1]
    return s[:, n // 2] if n % 2 else 0.5 * (s[:, n // 2 - 1] + s[:, n // 2])


def _rowdot(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.einsum("ij,ij->i", a, b)


def _solve(u: np.ndarray, y: np.ndarray, w: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
    """Least-squares quadratic per row (weights 0/1, None: all 1) from power sums: u, y (B, W) -> coefficients (B, 3),
    and for a 2-D u the power sums (B, 5). A 1-D u (W,) is every row's (consecutive steps): unweighted, one 3x3
    system serves all rows; weighted, each row's power sums. Row by row in `einsum`'s own loops, never a BLAS matrix
    product, whose blocking (and so its last bits) changes with the number of rows: a row's fit is the same alone
    (the live detector) as among thousands (the replay)."""
    if u.ndim == 1:
        if w is None:
            a = np.vander(u, 3, increasing=True)
            return np.einsum("ij,kj->ik", y, np.linalg.solve(a.T @ a, a.T)), None
        v = np.vander(u, 5, increasing=True)
        sums = np.einsum("ij,jk->ik", w, v)  # (B, 5): sum of w u^k
        gram = sums[:, [[0, 1, 2], [1, 2, 3], [2, 3, 4]]]
        rhs = np.einsum("ij,jk->ik", w * y, v[:, :3])
        return np.linalg.solve(gram, rhs[..., None])[..., 0], None
    wu = u if w is None else w * u
    wu2 = wu * u
    s0 = np.full(len(u), float(u.shape[1])) if w is None else w.sum(axis=1)
    s1, s2, s3, s4 = wu.sum(axis=1), wu2.sum(axis=1), _rowdot(wu2, u), _rowdot(wu2, u * u)
    gram = np.stack([np.stack(x, axis=-1) for x in ((s0, s1, s2), (s1, s2, s3), (s2, s3, s4))], axis=-2)
    wy = y if w is None else w * y
    rhs = np.stack([wy.sum(axis=1), _rowdot(wu, y), _rowdot(wu2, y)], axis=-1)
    return np.linalg.solve(gram, rhs[..., None])[..., 0], np.stack([s0, s1, s2, s3, s4], axis=-1)


class Fits(NamedTuple):
    """`trend_fits`'s rows."""

    coef: np.ndarray
    """The quadratic's coefficients (B, 3) in u = (step - at) / span: the prediction at `at` is coefficient 0."""
    span: np.ndarray
    scale: np.ndarray
    """The scale a loss at `at` is judged in (B,): the noise sd widened (`widening`)."""
    noise: np.ndarray
    """The noise sd around the trend (B,), before widening."""


def trend_fits(
    steps: np.ndarray, losses: np.ndarray, at: np.ndarray, persistence: int = 3, window: int | None = None
) -> Fits:
    """The spike rule's trend, for B windows at once: steps and losses (B, W) with W >= 8, at (B,) -> `Fits`. The one
    numeric kernel of the rule: the live detector calls it with one row (`trend_fit`), the replay with thousands
    (analysis/replay.py), and a row's numbers do not depend on the rows beside it, so the replay decides as the live
    detector does by construction.

    A quadratic in u = (step - at) / span fitted by least squares, then refitted without the points more than 3
    robust sd off (curvature of an early power-law descent is in the trend, not the noise). The noise sd is the
    largest of the residuals' robust sd (`stats.robust_sd`), the inliers' sd (more efficient on a few dozen points,
    and it sees heavy shoulders; corrected for the fitted parameters and the 3-sd truncation, 0.986) and the tail sd
    (`stats.tail_sd`); the scale widens it for means of `persistence` steps by the residuals' autocorrelation and by
    the prediction's error beyond that of a full `window` (None: W) of consecutive steps (`widening`)."""
    losses = np.ascontiguousarray(losses, dtype=float)  # windows come as strided views
    at = np.asarray(at, float)
    deg, n = 2, steps.shape[1]
    window = window or n
    if (steps[:, 0] == at - n).all() and (steps[:, -1] == at - 1).all():  # consecutive, judging the next step
        span = np.full(len(at), float(n))
        u = (np.arange(n, dtype=float) - n) * (1.0 / n)
    else:
        steps = np.ascontiguousarray(steps, dtype=float)
        span = np.maximum(1.0, at - steps.min(axis=1))
        u = (steps - at[:, None]) * (1.0 / span)[:, None]

    def fit(u, y, w: np.ndarray | None) -> tuple[np.ndarray, ...]:
        """(coefficients, residuals, MAD sd, tail sd, the power sums of a 2-D u) per row."""
        coef, sums = _solve(u, y, w)
        resid = y - (coef[:, :1] + u * (coef[:, 1:2] + u * coef[:, 2:]))
        dev = np.abs(resid)  # `stats.robust_sd`: around 0
        dev.sort(axis=1)  # in place: `dev` is this call's own
        return coef, resid, MAD_TO_SD * _sorted_median(dev), tail_sd(dev), sums

    coef, resid, sd, tail, sums = fit(u, losses, None)
    keep = np.abs(resid) <= (3 * sd)[:, None]
    if not sd.all():
        keep[sd <= 0] = True
    count = keep.sum(axis=1)
    again = (count > deg + 2) & (count < n)
    if again.any():
        ua = u[again] if u.ndim == 2 else u
        c2, r2, s2, t2, _ = fit(ua, losses[again], keep[again].astype(float))
        coef[again], resid[again], sd[again], tail[again] = c2, r2, s2, t2
        keep[again] = np.abs(r2) <= 3 * s2[:, None]
        n_in = keep.sum(axis=1)
    else:
        n_in = count
    ok = n_in > deg + 2
    kept = resid * keep
    power = _rowdot(kept, kept)  # the inliers' sum of squares: their sd and the autocorrelation's denominator
    inlier_sd = np.sqrt(power / np.maximum(n_in - deg - 1, 1)) / 0.986
    sd = np.maximum(np.where(ok, np.maximum(sd, inlier_sd), sd), tail)
    if u.ndim == 1:  # consecutive steps: a full window adds nothing, a short one what its leverage exceeds it by
        excess = np.full(len(at), max(full_leverage(n) - full_leverage(window), 0.0))
    else:
        excess = excess_from_sums(sums, at - steps[:, -1] - 1, window)
    return Fits(coef, span, sd * widening(lag1_of(kept, power), excess, persistence), sd)


def trend_fit(
    steps: np.ndarray, losses: np.ndarray, at: float, persistence: int = 3, window: int | None = None
) -> tuple[float, float]:
    """(the trend's prediction at step `at`, the scale a loss there is judged in): `trend_fits` on one window of 8 or
    more steps; below 8 (a `min_history` under 8), a line, its scale against the full window's quadratic."""
    if len(steps) >= 8:
        f = trend_fits(np.asarray(steps, float)[None], np.asarray(losses, float)[None], [at], persistence, window)
        return float(f.coef[0, 0]), float(f.scale[0])
    span = max(1.0, float(at - steps.min()))
    u = (steps - at) / span  # centred on the prediction point: the prediction is the intercept
    a = np.vander(u, 2, increasing=True)
    coef = np.linalg.lstsq(a, losses, rcond=None)[0]
    resid = losses - a @ coef
    sd = robust_sd(resid)
    keep = np.abs(resid) <= 3 * sd if sd > 0 else np.ones(len(u), bool)
    if keep.sum() > 3 and not keep.all():
        coef = np.linalg.lstsq(a[keep], losses[keep], rcond=None)[0]
        resid = losses - a @ coef
        sd = robust_sd(resid)
        keep = np.abs(resid) <= 3 * sd
    n_in = int(keep.sum())
    if n_in > 3:
        sd = max(sd, float(np.sqrt(np.sum(resid[keep] ** 2) / (n_in - 2))) / 0.986)
    sd = max(sd, tail_sd(np.sort(np.abs(resid))))
    excess = max(float(np.linalg.inv(a.T @ a)[0, 0]) - full_leverage(window or len(steps)), 0.0)
    return float(coef[0]), sd * float(widening(lag1(resid, keep), excess, persistence))


class SpikeDetector:
    """The spike rule. Its defaults are the recipe's (`SpikesSection`, a test keeps them equal); the live loop and
    `check_run.py`'s replay build it from the run's own `spikes` section (`for_section`)."""

    @classmethod
    def for_section(cls, cfg: SpikesSection) -> SpikeDetector:
        return cls(cfg.window, cfg.threshold, cfg.persistence, cfg.min_history, grace_steps=cfg.grace_steps)

    def __init__(
        self,
        window: int = 100,
        threshold: float = 3.5,
        persistence: int = 3,
        min_history: int = 20,
        min_rel_scale: float = 1e-3,
        grace_steps: int = 20,
    ):
        self.window, self.threshold, self.persistence = window, threshold, persistence
        self.min_history, self.min_rel_scale, self.grace_steps = min_history, min_rel_scale, grace_steps
        self.cap = threshold + 1
        self.history: deque[tuple[int, float]] = deque(maxlen=window)
        self.grace_until = 0
        self.run: list[tuple[int, float, float]] = []  # (step, loss, z) of the current run of suspect steps
        self.episode: float | None = None
        """After a spike: the bound the loss must come back under before judging resumes (inf: any finite loss)."""

    def start_grace(self, step: int, forget: bool = True) -> None:
        """After warmup or a stage start: judge nothing for `grace_steps`; optionally forget the old trend."""
        self.grace_until = step + self.grace_steps
        if forget:
            self.history.clear()
        self.run = []

    def zscore(self, step: int, loss: float) -> tuple[float, float, float]:
        """(z, predicted loss, noise sd) of `loss` at `step` against the window's trend."""
        steps = np.fromiter((s for s, _ in self.history), float, len(self.history))
        losses = np.fromiter((v for _, v in self.history), float, len(self.history))
        pred, sd = trend_fit(steps, losses, step, self.persistence, self.window)
        scale = max(sd, self.min_rel_scale * abs(pred), 1e-8)
        return (loss - pred) / scale, pred, scale

    def onset(self) -> int | None:
        """The first step of the open run of suspect steps (a spike in the making), or None."""
        return self.run[0][0] if self.run else None

    def _accept(self, step: int, loss: float) -> None:
        for s, v, z in self.run:  # the suspects were noise after all (a gross one-step outlier stays out)
            if z <= self.threshold:
                self.history.append((s, v))
        self.run = []
        self.history.append((step, loss))

    def update(self, step: int, loss: float, grad_norm: float | None = None) -> Verdict:
        finite = math.isfinite(loss) and (grad_norm is None or math.isfinite(grad_norm))
        if self.episode is not None and finite:  # a non-finite step is a spike of its own, always
            if loss <= self.episode:
                self.episode = None
                self.start_grace(step, forget=False)
                return Verdict("ok", reason="recovered")
            return Verdict("ok", reason="in a spike episode")
        if not finite:
            self.run, self.episode = [], math.inf
            what = "loss" if not math.isfinite(loss) else "grad_norm"
            return Verdict("spike", step, f"non-finite {what}", math.inf)
        if step < self.grace_until or len(self.history) < self.min_history:
            if step >= self.grace_until or self.history:  # a forgetting grace (the trend emptied) learns nothing
                self._accept(step, loss)
            return Verdict("ok")
        z, pred, scale = self.zscore(step, loss)
        if z <= self.threshold / 2:
            self._accept(step, loss)
            return Verdict("ok", zscore=z)
        self.run.append((step, loss, z))
        if len(self.run) < self.persistence:
            return Verdict("suspect", self.run[0][0], zscore=z)
        # each step counts at most threshold + 1: one gross outlier among mild ones is noise, not a spike
        mean_z = statistics.fmean(min(x[2], self.cap) for x in self.run)
        if mean_z > self.threshold:
            onset, self.run = self.run[0][0], []
            self.episode = pred + self.threshold / 2 * scale
            reason = f"loss {mean_z:.1f} noise sd above its trend ({pred:.4g} +- {scale:.2g})"
            return Verdict("spike", onset, reason, mean_z, pred, scale)
        s, v, _ = self.run.pop(0)  # a long, mild rise is no spike: the oldest suspect joins the trend
        self.history.append((s, v))
        return Verdict("suspect", self.run[0][0], zscore=z)

    def state_dict(self) -> dict:
        return {
            "history": [list(x) for x in self.history],
            "grace_until": self.grace_until,
            "run": [list(x) for x in self.run],
            "episode": None if self.episode is None else repr(self.episode),  # a string: inf survives any JSON
        }

    def load_state_dict(self, state: dict) -> None:
        hist = state["history"]
        if hist and not isinstance(hist[0], list | tuple):  # an older checkpoint kept levels without steps
            hist = [[i - len(hist), v] for i, v in enumerate(hist)]
        self.history = deque(((int(s), float(v)) for s, v in hist), maxlen=self.window)
        self.grace_until = int(state["grace_until"])
        self.run = [tuple(x) for x in state["run"] if isinstance(x, list | tuple)]
        self.episode = None if state.get("episode") is None else float(state["episode"])


def sample_ranges(indices: list[int], margin: int) -> list[tuple[int, int]]:
    """Sorted sample indices -> inclusive (first, last) ranges, each widened by `margin` and merged."""
    out: list[list[int]] = []
    for i in sorted(indices):
        a, b = max(0, i - margin), i + margin
        if out and a <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]
