"""The live spike rule replayed over a whole logged curve, fast enough for a million steps.

`check_run.py` judges spikes as training did, by feeding the logged per-step losses through the same
`SpikeDetector`. Step by step that costs one robust trend fit per step (~80 us): over a 1M-step run, minutes. Two
facts make it cheap without changing a decision:

- While the detector's window holds exactly the last `window` losses of the curve (no suspect pending, none dropped,
  no skipped episode inside it), its trend fit is a pure function of the step's position. Those fits are computed in
  batches for raw sliding windows by the rule's own kernel (`spikes.trend_fits`, whose rows do not depend on the
  rows beside them: a window fitted in a batch is fitted as the live detector fits it alone).
- Almost every step is `ok` (z at most threshold / 2) and only joins the window. A stretch of such steps is found with
  one comparison over the batch and appended at once; only suspects, stage starts and spike episodes go through the
  detector one step at a time, and there the detector fits exactly as live.

`spike_episodes(..., batched=False)` feeds every step through the detector itself: the same driver without the
batches, which the tests and `bench_check_run.py` hold the batched replay to.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from threadpoolctl import threadpool_limits

from ..recipe.sections import SpikesSection
from ..stability.spikes import Fits, SpikeDetector, trend_fits

CHUNK = 32768
"""Most windows fitted per batch: ~26 MB per array at the default window of 100."""
MIN_CHUNK = 1024
"""Windows fitted by the first batch; each batch that runs out doubles the next, up to `CHUNK`."""


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
        self.stream_l = np.concatenate([hist_l, det.losses[at:end]])
        view_s = np.lib.stride_tricks.sliding_window_view(self.stream, w)[: end - at]
        view_l = np.lib.stride_tricks.sliding_window_view(self.stream_l, w)[: end - at]
        fits = _fit_rows(view_s, view_l, det.steps[at:end], det.persistence, w)
        self.coef, self.sd = fits.coef, fits.scale
        z = judged(det, det.losses[at:end], self.coef[:, 0], self.sd)
        self.raw = ~(z <= det.threshold / 2) | ~np.isfinite(det.losses[at:end])
        """Rows whose step, judged by its own row, needs the detector: a suspect, or a non-finite loss."""
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
        it would join the window), and the next step, judged against the same window (the suspect is pending, the
        window unchanged; fitted here as the detector fits it there) under the bar. Both then join the window in
        order, as if never suspect: the rows after them hold. At Gaussian noise ~4% of steps are suspects, nearly all
        of them lone; without this each would go through the detector one step at a time (~100 us)."""
        w, bar, top = det.window, det.threshold / 2, det.threshold
        lead = self.raw & (z > bar) & (z <= top)
        lead[-1] = False  # its next step lies beyond the table
        r = np.flatnonzero(lead)
        nxt = self.at + r + 1
        if len(r):
            rows_s = np.lib.stride_tricks.sliding_window_view(self.stream, w)[r]
            rows_l = np.lib.stride_tricks.sliding_window_view(self.stream_l, w)[r]
            f = _fit_rows(rows_s, rows_l, det.steps[nxt], det.persistence, w)
            z1 = judged(det, det.losses[nxt], f.coef[:, 0], f.scale)
            r = r[np.isfinite(z1) & (z1 <= bar)]
        taken, prev = [], -2
        for k in r.tolist():  # a lone suspect's next step is judged by its row: it cannot lead a pair of its own
            if k != prev + 1:
                taken.append(k)
                prev = k
        return np.asarray(taken, dtype=np.int64)

    def row(self, history) -> int | None:
        """The row whose window is exactly `history` (None: the window changed since the build)."""
        w, last = len(history), history[-1][0]
        k = int(np.searchsorted(self.stream, last))
        if k >= len(self.stream) or self.stream[k] != last or k < w - 1 or self.stream[k - w + 1] != history[0][0]:
            return None
        r = k - w + 1
        return r if r < len(self.sd) else None


def judged(det: SpikeDetector, losses: np.ndarray, pred: np.ndarray, sd: np.ndarray) -> np.ndarray:
    """The z-scores the detector gives `losses` against trends predicting `pred` with scales `sd` (its
    `SpikeDetector.zscore`, per element)."""
    return (losses - pred) / np.maximum(np.maximum(sd, det.min_rel_scale * np.abs(pred)), 1e-8)


FIT_ROWS = 2048
"""Windows per `trend_fits` call: its ~20 element-wise passes then run on arrays that stay in cache (1.6 MB at the
default window of 100); measured 30% faster than 16384 rows per call."""


def _fit_rows(view_s: np.ndarray, view_l: np.ndarray, at: np.ndarray, persistence: int, window: int) -> Fits:
    """`trend_fits` over many rows, in cache-sized pieces, the pieces shared by the cores (`_threads`)."""
    bounds = list(zip(range(0, len(at), FIT_ROWS), range(FIT_ROWS, len(at) + FIT_ROWS, FIT_ROWS)))

    def fit(piece: tuple[int, int]):
        a, b = piece
        return trend_fits(view_s[a:b], view_l[a:b], at[a:b], persistence, window)

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
    """The live detector, its trend fits looked up in a batch-fitted `_Table` wherever the window is the table's
    (`batched`; otherwise every step is the detector's own)."""

    def __init__(self, steps: np.ndarray, losses: np.ndarray, cfg: SpikesSection, batched: bool = True):
        super().__init__(cfg.window, cfg.threshold, cfg.persistence, cfg.min_history, grace_steps=cfg.grace_steps)
        self.steps, self.losses, self.batched = steps, losses, batched
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
        """The table's row where it judges this very step (nothing pending): the fit the detector would make."""
        if (hit := self.lookup()) is not None and step == (t := hit[0]).stream[hit[1] + self.window]:
            p, s = float(t.coef[hit[1], 0]), float(t.sd[hit[1]])
            scale = max(s, self.min_rel_scale * abs(p), 1e-8)
            return (loss - p) / scale, p, scale
        return super().zscore(step, loss)

    def skip_ok(self, i: int, limit: int) -> int:
        """With nothing pending, take every step up to `limit` the live detector would accept without a question
        (grace, a short history, or z under the suspect bar); return the first position that needs the detector."""
        while self.batched and i < limit and not self.run and np.isfinite(self.losses[i]):
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
    losses,
    grace_at: list[int] | tuple = (),
    cfg: SpikesSection | None = None,
    start: int | None = None,
    batched: bool = True,
) -> list[dict]:
    """Replay the live rule over a per-step loss curve, with the run's own `spikes` section (`cfg`; None: the
    defaults): each spike's onset, the step it was detected, and the step the loss came back under its pre-spike
    trend (None: it never did).

    Args:
        losses: (step, loss) pairs with rising steps, or a (steps, losses) pair of arrays.
        grace_at: steps where a grace period starts and the trend is forgotten, as in training (each stage start).
        start: the grace period the detector starts with (the live loop: the end of warmup); None: the first step.
        batched: False: every step through the detector itself, its episodes included (the definition the batched
            replay is held to; ~80 us a step).
    """
    with threadpool_limits(limits=1, user_api="blas"):  # the fits run a thread per core (`_threads`)
        return _episodes(*_arrays(losses), grace_at, cfg, start, batched)


def _episodes(steps: np.ndarray, values: np.ndarray, grace_at, cfg: SpikesSection | None, start, batched: bool):
    n = len(steps)
    det, episodes = _Replay(steps, values, cfg or SpikesSection(), batched), []
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
        if d.reason == "recovered":  # unbatched: the detector followed the episode itself
            episodes[-1]["recovered"] = step
        if d.kind != "spike":
            continue
        episodes.append({"onset": d.onset, "detected": step, "recovered": None, "bound": det.episode})
        if not batched:
            continue
        det.episode = None  # the episode is followed here, in one search
        # until the loss is back under the bound, the detector sees nothing (grace starts passed meanwhile apply)
        # (a non-finite step ends it as a spike of its own, judged by the detector)
        bound = episodes[-1]["bound"]
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


__all__ = ["lived_episodes", "spike_episodes", "timeline"]
