"""Robust statistics shared by every judgement: the live spike rule, its replay, the forecast and the verdicts.

Each is a pure function of arrays, so the detector, the forecast's band and the health verdicts read a curve's noise
the same way.
"""

from __future__ import annotations

import math

import numpy as np

MAD_TO_SD = 1.4826
"""The median absolute deviation of a Gaussian times this is its sd."""


def robust_sd(residuals: np.ndarray) -> float:
    """1.4826 x the median absolute residual. Around 0, not the residuals' median: the fit has centred them (robust
    regression's usual scale), and the replay then sorts each of its millions of windows once, not twice."""
    return MAD_TO_SD * float(np.median(np.abs(residuals)))


def diff_scatter(values, order: int = 1) -> float:
    """The point-to-point noise of a series: the robust sd of its differences of `order` (about their median, so a
    steady trend is not noise) over the sd those take from unit noise (sqrt 2 for successive differences, sqrt 6 for
    second ones); 0 under `order` + 1 points. Used where a level's noise must not include the misfit of a curve drawn
    through it (the forecast band, the health verdicts). Second differences also leave out a slope that changes
    between points far apart (evals through a loss curve's fall)."""
    d = np.diff(np.asarray(values, float), order)
    unit = math.sqrt(math.comb(2 * order, order))
    return MAD_TO_SD * float(np.median(np.abs(d - np.median(d)))) / unit if len(d) else 0.0


TAIL_Q, TAIL_Z = 0.95, 1.96
"""The window's 95th percentile of |residual| and where a Gaussian puts it (1.96 sd)."""


def tail_sd(sorted_abs: np.ndarray) -> np.ndarray:
    """The sd a Gaussian would need to put the window's 95th percentile of |residual| where it lies (per row of
    |residuals| sorted along the last axis). The scale is at least this: a run whose loss has heavier tails than a
    Gaussian (a Student-t) widens its own scale, where the MAD alone would take its shoulders for spikes
    (`bench_judgement.py --noise-models`, false spikes per 100k steps with / without it: t(3) 1.6 / 5.4, t(5) 0.4 /
    2.2; on Gaussian noise the 95th percentile of 100 points rarely exceeds the MAD's sd by much, and bumps of 5 sd
    are found alike)."""
    k = int(TAIL_Q * (sorted_abs.shape[-1] - 1))
    return sorted_abs[..., k] / TAIL_Z
