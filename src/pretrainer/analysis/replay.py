"""The live spike rule replayed over a whole logged curve, fast enough for a million steps.

`check_run.py` judges spikes as training did, by feeding the logged per-step losses through the same
`SpikeDetector`. Step by step that costs one robust trend fit per step (~80 us): over a 1M-step run, minutes. Two
facts make it cheap without changing a decision:

- While the detector's window holds exactly the last `window` losses of the curve (no suspect pending, none dropped,
  no skipped episode inside it), its trend fit is a pure function of the step's position. Those fits are computed in
  batches for raw sliding windows (`batched_trend_fit`: the same quadratic, refit and scale as `spikes.trend_fit`, as
  array operations over thousands of windows at once).
- Almost every step is `ok` (z at most threshold / 2) and only joins the window. A stretch of such steps is found with
  one comparison over the batch and appended at once; only suspects, stage starts and spike episodes go through the
  detector one step at a time, and there the detector refits exactly as live wherever its window is not the raw one.

A batched fit differs from the live `lstsq` in the last bits; where a z-score lies within `TIE` of a threshold the
step is refitted with the live code, so the replay decides as the live detector does.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np
from threadpoolctl import threadpool_limits

from ..recipe.sections import SpikesSection
from ..stability.spikes import (
    SpikeDetector,
    excess_from_sums,
    excess_leverage,
    inflation,
    lag1_of,
)
from ..stats import MAD_TO_SD, tail_sd

CHUNK = 32768
"""Most windows fitted per batch: ~26 MB per array at the default window of 100."""
MIN_CHUNK = 1024
"""Windows fitted by the first batch; each batch that runs out doubles the next, up to `CHUNK`."""
TIE = 1e-6
"""z-scores this close to a threshold are refitted with the live code."""


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
    system serves all rows, one matrix product; weighted, the power sums of all rows are one matrix product too."""
    if u.ndim == 1:
        if w is None:
            a = np.vander(u, 3, increasing=True)
            return y @ np.linalg.solve(a.T @ a, a.T).T, None
        v = np.vander(u, 5, increasing=True)
        sums = w @ v  # (B, 5): sum of w u^k
        gram = sums[:, [[0, 1, 2], [1, 2, 3], [2, 3, 4]]]
        rhs = (w * y) @ v[:, :3]
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
    """`batched_trend_fit`'s rows."""

    coef: np.ndarray
    """The quadratic's coefficients (B, 3) in u = (step - at) / span: the prediction at `at` is coefficient 0; at
    another step t it is the quadratic at u = (t - at) / span (the same line, refitted there, agrees up to
    rounding)."""
    span: np.ndarray
    scale: np.ndarray
    """The scale at `at` (B,): `spikes.trend_fit`'s second value."""
    noise: np.ndarray
    """The noise sd around the trend (B,), before `spikes.widening`."""
    var: np.ndarray
    """The noise's own variance factor for means of `persistence` steps (B,)."""


def batched_trend_fit(steps: np.ndarray, losses: np.ndarray, at: np.ndarray, persistence: int = 3) -> Fits:
    """`spikes.trend_fit` for B windows at once: steps and losses (B, W) with W >= 8 (a full window), at (B,) ->
    `Fits`."""
    losses = np.ascontiguousarray(losses)  # windows come as strided views
    deg, n = 2, steps.shape[1]
    if (steps[:, 0] == at - n).all() and (steps[:, -1] == at - 1).all():  # every step logged: one u for all rows
        span = np.full(len(at), float(n))
        u = (np.arange(n, dtype=float) - n) * (1.0 / n)
    else:
        steps = np.ascontiguousarray(steps)
        span = np.maximum(1.0, at - steps.min(axis=1))
        u = (steps - at[:, None]) * (1.0 / span)[:, None]

    vander = np.vander(u, 3, increasing=True).T if u.ndim == 1 else None

    def fit(u, y, w: np.ndarray) -> tuple[np.ndarray, ...]:
        """(coefficients, residuals, MAD sd, tail sd, the power sums of a 2-D u) per row."""
        coef, sums = _solve(u, y, w)
        if vander is not None:  # one matrix product for every row's quadratic
            resid = coef @ vander
            np.subtract(y, resid, out=resid)
        else:
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
    var = inflation(lag1_of(kept, power), persistence) ** 2
    if u.ndim == 1:  # every step logged: a full window, no excess leverage (`spikes.excess_leverage`)
        return Fits(coef, span, sd * np.sqrt(var), sd, var)
    excess = excess_from_sums(sums, at - steps[:, -1] - 1, n)
    return Fits(coef, span, sd * np.sqrt(var + persistence * excess), sd, var)


class _Table:
    """Trend fits of every window of the stream the detector would see if it accepted every step from position
    `at` on: the window at build time, then the curve. Row r is the window of the stream's items r .. r+W-1, which
    judges curve position at + r; it stays right for as long as nothing is left out of the window after the build
    (a dropped outlier, a spike's skipped steps, a forgetting grace start)."""

    def __init__(self, det: _Replay, at: int, size: int):
        w, end = det.window, min(len(det.steps), at + size)
        self.at, self.end = at, end
        hist_s = np.fromiter((s for s, _ in det.history), float, w)
        hist_l = np.fromiter((v for _, v in det.history), float, w)
        self.stream = np.concatenate([hist_s, det.steps[at:end]])
        stream_l = np.concatenate([hist_l, det.losses[at:end]])
        view_s = np.lib.stride_tricks.sliding_window_view(self.stream, w)[: end - at]
        view_l = np.lib.stride_tricks.sliding_window_view(stream_l, w)[: end - at]
        self.fits = _fit_rows(view_s, view_l, det.steps[at:end], det.persistence)
        self.coef, self.span, self.sd = self.fits.coef, self.fits.span, self.fits.scale
        pred = self.coef[:, 0]
        scale = np.maximum(np.maximum(self.sd, det.min_rel_scale * np.abs(pred)), 1e-8)
        z = (det.losses[at:end] - pred) / scale
        self.raw = ~(z < det.threshold / 2 - TIE) | ~np.isfinite(det.losses[at:end])
        """Rows whose step, judged by its own row, needs the detector: a suspect (or within TIE of a bar), or a
        non-finite loss."""
        lone = self._lone_suspects(det, z)
        self.follows = np.zeros(len(z), bool)
        """Rows judged by the row before (a lone suspect's next step): right only when that suspect was taken here."""
        self.follows[lone + 1] = True
        stops = self.raw.copy()
        stops[lone], stops[lone + 1] = False, False
        self.stops = np.flatnonzero(stops)
        """Rows whose step needs the detector."""

    def _lone_suspects(self, det: _Replay, z: np.ndarray) -> np.ndarray:
        """Suspects the live detector takes back at the next step: z between the suspect bar and the threshold (so
        it would join the window), and the next step, judged by the same row's trend (the suspect is pending, the
        window unchanged) under the bar. Both then join the window in order, as if never suspect: the rows after
        them hold. At Gaussian noise ~4% of steps are suspects, nearly all of them lone; without this each would go
        through the detector one step at a time (~100 us)."""
        w, bar, top = det.window, det.threshold / 2, det.threshold
        lead = self.raw & (z > bar + TIE) & (z <= top - TIE)
        lead[-1] = False  # its next step lies beyond the table
        r = np.flatnonzero(lead)
        nxt = self.at + r + 1
        u = (det.steps[nxt] - self.stream[r + w]) / self.span[r]
        c = self.coef[r]
        p = c[:, 0] + u * (c[:, 1] + u * c[:, 2])
        s = self.scale_at(r, nxt, det)
        z1 = (det.losses[nxt] - p) / np.maximum(np.maximum(s, det.min_rel_scale * np.abs(p)), 1e-8)
        r = r[np.isfinite(z1) & (z1 < bar - TIE)]
        taken, prev = [], -2
        for k in r.tolist():  # a lone suspect's next step is judged by its row: it cannot lead a pair of its own
            if k != prev + 1:
                taken.append(k)
                prev = k
        return np.asarray(taken, dtype=np.int64)

    def scale_at(self, rows: np.ndarray, pos: np.ndarray, det: _Replay) -> np.ndarray:
        """The scale rows' trends give the steps at curve positions `pos` (after a pending suspect). A window of
        consecutive steps is a full one: its own (`spikes.excess_leverage`); one with a gap (a suspect left out)
        adds what its steps' leverage exceeds a full window's by, judging as far ahead."""
        w, f = det.window, self.fits
        gap = np.flatnonzero(self.stream[rows + w - 1] - self.stream[rows] != w - 1)
        if not len(gap):
            return f.noise[rows] * np.sqrt(f.var[rows])
        excess = np.zeros(len(rows))
        steps = np.lib.stride_tricks.sliding_window_view(self.stream, w)[rows[gap]]
        excess[gap] = excess_leverage(steps, det.steps[pos[gap]], w)
        return f.noise[rows] * np.sqrt(f.var[rows] + det.persistence * excess)

    def scale_of(self, row: int, step: int, det: _Replay) -> float:
        """`scale_at` for one row and a step, in floats (asked row by row, where numpy costs ~10 us a call)."""
        w, f = det.window, self.fits
        excess = 0.0
        if self.stream[row + w - 1] - self.stream[row] != w - 1:  # a window with gaps
            excess = float(excess_leverage(self.stream[row : row + w], float(step), w))
        return float(f.noise[row]) * math.sqrt(float(f.var[row]) + det.persistence * excess)

    def row(self, history) -> int | None:
        """The row whose window is exactly `history` (None: the window changed since the build)."""
        w, last = len(history), history[-1][0]
        k = int(np.searchsorted(self.stream, last))
        if k >= len(self.stream) or self.stream[k] != last or k < w - 1 or self.stream[k - w + 1] != history[0][0]:
            return None
        r = k - w + 1
        return r if r < len(self.sd) else None


FIT_ROWS = 2048
"""Windows per `batched_trend_fit` call: its ~20 element-wise passes then run on arrays that stay in cache (1.6 MB
at the default window of 100); measured 30% faster than 16384 rows per call."""


def _fit_rows(view_s: np.ndarray, view_l: np.ndarray, at: np.ndarray, persistence: int):
    """`batched_trend_fit` over many rows, in cache-sized pieces, the pieces shared by the cores (`_threads`)."""
    bounds = list(zip(range(0, len(at), FIT_ROWS), range(FIT_ROWS, len(at) + FIT_ROWS, FIT_ROWS)))

    def fit(piece: tuple[int, int]):
        a, b = piece
        return batched_trend_fit(view_s[a:b], view_l[a:b], at[a:b], persistence)

    pool = _threads() if len(bounds) > 1 else None
    out = list(pool.map(fit, bounds)) if pool is not None else [fit(p) for p in bounds]
    return Fits(*(np.concatenate(x) for x in zip(*out)))


_POOL: list = []


def _threads():
    """A thread per core for the fits (None on one core). Numpy releases the GIL inside each kernel: with BLAS held
    to one thread (`spike_episodes` does), two threads fit 1.8x faster than one on two cores; with BLAS's own
    threads also running, slower than one (measured, 400k windows)."""
    if not _POOL:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        _POOL.append(ThreadPoolExecutor(min(cores, 8), "spike-replay") if cores > 1 else None)
    return _POOL[0]


class _Replay(SpikeDetector):
    """The live detector, its trend fits looked up in a batch-fitted `_Table` wherever the window is the table's."""

    def __init__(self, steps: np.ndarray, losses: np.ndarray, cfg: SpikesSection):
        super().__init__(cfg.window, cfg.threshold, cfg.persistence, cfg.min_history, grace_steps=cfg.grace_steps)
        self.steps, self.losses = steps, losses
        self.table: _Table | None = None
        self.patch: _Table | None = None
        """Windows with a step left out since `table` was built: `window` rows, then `table` holds again."""
        self.size = MIN_CHUNK

    def lookup(self) -> tuple[_Table, int] | None:
        if len(self.history) < self.window:
            return None
        for t in (self.table, self.patch):
            if t is not None and (r := t.row(self.history)) is not None:
                return t, r
        return None

    def zscore(self, step: int, loss: float) -> tuple[float, float, float]:
        if (hit := self.lookup()) is not None:
            t, r = hit
            u = (step - t.stream[r + self.window]) / t.span[r]  # 0 unless suspects are pending
            c0, c1, c2 = t.coef[r]
            p = float(c0 + u * (c1 + u * c2)) if u else float(c0)
            s = t.scale_of(r, step, self) if u else float(t.sd[r])
            scale = max(s, self.min_rel_scale * abs(p), 1e-8)
            z = (loss - p) / scale
            if min(abs(z - self.threshold / 2), abs(z - self.threshold)) > TIE:
                return z, p, scale
        return super().zscore(step, loss)

    def skip_ok(self, i: int, limit: int) -> int:
        """With nothing pending, take every step up to `limit` the live detector would accept without a question
        (grace, a short history, or z under the suspect bar); return the first position that needs the detector."""
        while i < limit and not self.run and np.isfinite(self.losses[i]):
            if self.steps[i] < self.grace_until:  # grace: accepted unjudged
                n = int(np.searchsorted(self.steps[i:limit], self.grace_until))
            elif len(self.history) < self.min_history:
                n = min(limit - i, self.min_history - len(self.history))
            elif len(self.history) < self.window:
                break  # a window still filling after a stage start: a few dozen steps, fitted live
            else:
                hit = self.lookup()
                if hit is None or hit[0].at + hit[1] != i:
                    if self.table is not None and i + self.window < self.table.end:
                        # a step left the window (a dropped outlier, a skipped spike): the table's rows hold again
                        # once it has slid out, `window` steps on; until then, a short table of its own
                        self.patch = _Table(self, i, self.window)
                        hit = (self.patch, 0)
                    else:  # ran out: a longer table
                        self.size = min(2 * self.size, CHUNK) if self.table is not None else self.size
                        self.table = _Table(self, i, self.size)
                        hit = (self.table, 0)
                t, r = hit
                if t.follows[r] and t.raw[r]:
                    break  # the suspect before it was not taken by this table (grace): judged by its own row, live
                k = int(np.searchsorted(t.stops, r))
                stop = t.at + (int(t.stops[k]) if k < len(t.stops) else len(t.sd))
                n = min(stop, limit) - i
            nonfinite = np.flatnonzero(~np.isfinite(self.losses[i : i + n]))
            n = int(nonfinite[0]) if len(nonfinite) else n
            if n == 0:
                break
            if self.steps[i] < self.grace_until and not self.history:  # a forgetting grace learns nothing
                i += n
                continue
            take = slice(i + max(0, n - self.window), i + n)
            self.history.extend(zip(self.steps[take].tolist(), self.losses[take].tolist()))
            i += n
        return i


def _arrays(losses) -> tuple[np.ndarray, np.ndarray]:
    """Arrays as given (integer steps, float32 losses: the replay widens them a table at a time, exactly), or the
    pairs' values as float64."""
    if isinstance(losses, tuple) and len(losses) == 2 and isinstance(losses[0], np.ndarray):
        return losses
    steps = np.fromiter((s for s, _ in losses), float, len(losses))
    return steps, np.fromiter((v for _, v in losses), float, len(losses))


def spike_episodes(
    losses, grace_at: list[int] | tuple = (), cfg: SpikesSection | None = None, start: int | None = None
) -> list[dict]:
    """Replay the live rule over a per-step loss curve, with the run's own `spikes` section (`cfg`; None: the
    defaults): each spike's onset, the step it was detected, and the step the loss came back under its pre-spike
    trend (None: it never did).

    Args:
        losses: (step, loss) pairs with rising steps, or a (steps, losses) pair of arrays.
        grace_at: steps where a grace period starts and the trend is forgotten, as in training (each stage start).
        start: the grace period the detector starts with (the live loop: the end of warmup); None: the first step.
    """
    with threadpool_limits(limits=1, user_api="blas"):  # the fits run a thread per core (`_threads`)
        return _episodes(*_arrays(losses), grace_at, cfg, start)


def _episodes(steps: np.ndarray, values: np.ndarray, grace_at, cfg: SpikesSection | None, start: int | None):
    n = len(steps)
    det, episodes = _Replay(steps, values, cfg or SpikesSection()), []
    graces = sorted(grace_at)
    if n:
        det.start_grace(int(steps[0]) if start is None else start)
    i = 0
    while i < n:
        limit = n if not graces else min(n, int(np.searchsorted(steps, graces[0])))
        i = det.skip_ok(i, limit)
        if i >= n:
            break
        step, loss = int(steps[i]), float(values[i])
        while graces and step >= graces[0]:
            det.start_grace(graces.pop(0))
        d = det.update(step, loss)
        i += 1
        if d.kind != "spike":
            continue
        bound, det.episode = det.episode, None  # the episode is followed here, in one search
        episodes.append({"onset": d.onset, "detected": step, "recovered": None, "bound": bound})
        # until the loss is back under the bound, the detector sees nothing (grace starts passed meanwhile apply)
        # (a non-finite step ends it as a spike of its own, judged by the detector)
        back = np.flatnonzero(~np.isfinite(values[i:]) | (values[i:] <= np.float64(bound)))  # float32 widened
        if not len(back):
            break
        i += int(back[0])
        if not np.isfinite(values[i]):
            continue
        episodes[-1]["recovered"] = int(steps[i])
        while graces and steps[i] >= graces[0]:
            det.start_grace(graces.pop(0))
        det.start_grace(int(steps[i]), forget=False)
        i += 1
    return episodes


def spike_episodes_stepwise(
    losses, grace_at: list[int] | tuple = (), cfg: SpikesSection | None = None, start: int | None = None
) -> list[dict]:
    """The same replay one step at a time through the live detector itself (its episodes included): the reference
    the fast replay is tested against, and the definition it must match."""
    steps, values = _arrays(losses)
    det, episodes = SpikeDetector.for_section(cfg or SpikesSection()), []
    graces = sorted(grace_at)
    if len(steps):
        det.start_grace(int(steps[0]) if start is None else start)
    for step, loss in zip(steps.astype(int).tolist(), values.tolist()):
        while graces and step >= graces[0]:
            det.start_grace(graces.pop(0))
        d = det.update(step, loss)
        if d.kind == "spike":
            episodes.append({"onset": d.onset, "detected": step, "recovered": None, "bound": det.episode})
        elif d.reason == "recovered":
            episodes[-1]["recovered"] = step
    return episodes


def timeline(steps: np.ndarray, upto: int | None = None) -> np.ndarray:
    """Indices of a lived record's timeline as of row `upto` (None: the end): for each step, its last record so far
    (a step re-run after a rollback or a resume replaces the earlier one), in step order."""
    steps = steps if upto is None else steps[: upto + 1]
    n = len(steps)
    if n < 2 or bool(np.all(steps[1:] > steps[:-1])):  # nothing re-run: the record is its own timeline
        return np.arange(n)
    order = np.lexsort((np.arange(n), steps))  # by step, then by write order
    last = np.ones(n, bool)
    last[:-1] = steps[order][1:] != steps[order][:-1]
    return order[last]


def lived_episodes(
    steps: np.ndarray,
    losses: np.ndarray,
    epochs: np.ndarray,
    grace_at: list[int] | tuple = (),
    cfg: SpikesSection | None = None,
    start: int | None = None,
    final: np.ndarray | None = None,
) -> list[dict]:
    """The live rule replayed over what the run lived, in the order it lived it (`steprecord.Record`): the final
    timeline, plus every stretch a rollback or a resume later replaced, each judged from the detector state the live
    loop had there (that of the timeline as it stood then). Each episode gains `epoch`; ordered as lived.

    A stretch's state is the timeline's as of its block, so each replaced stretch costs one replay of the timeline
    up to it: O(steps x (1 + replaced stretches)) (rollbacks and crashes, a handful in a healthy run)."""
    n = len(steps)
    if not n:
        return []
    starts = np.concatenate([[0], np.flatnonzero(np.diff(epochs)) + 1])  # blocks: rows of one epoch, as written
    ends = np.concatenate([starts[1:], [n]]) - 1
    found: list[tuple[int, dict]] = []
    final = timeline(steps) if final is None else final  # (`final`: the timeline, when the caller has it)

    def replay(rows: np.ndarray) -> list[tuple[int, dict]]:
        whole = len(rows) == n and rows[-1] == n - 1  # the whole record in order: no copies
        on = steps if whole else steps[rows]  # rising
        eps = spike_episodes((on, losses if whole else losses[rows]), grace_at, cfg, start)
        where = rows[np.searchsorted(on, [e["detected"] for e in eps])] if eps else []
        return [(int(r), {**e, "epoch": int(epochs[r])}) for r, e in zip(where, eps)]

    found += replay(final)
    in_final = np.zeros(n, bool)
    in_final[final] = True
    for a, b in zip(starts.tolist(), ends.tolist()):
        if in_final[a : b + 1].all():
            continue
        gone = {int(r) for r in np.flatnonzero(~in_final[a : b + 1]) + a}
        found += [(r, e) for r, e in replay(timeline(steps, b)) if r in gone]
    return [e for _, e in sorted(found, key=lambda x: x[0])]


__all__ = ["Fits", "batched_trend_fit", "lived_episodes", "spike_episodes", "spike_episodes_stepwise", "timeline"]
