"""Loss-spike detection against the recent trend.

Rule: a step is *suspect* when its loss exceeds the median of the recent window by more than `threshold` robust
standard deviations (1.4826 x MAD, floored at `min_rel_scale` x median so a very flat window does not make every
wiggle an outlier). A spike is `persistence` suspect steps in a row, dated from the first (the onset). NaN/inf in the
loss or the gradient norm is a spike at once. No judgement during a grace period after warmup and after each stage
start (the loss legitimately jumps when seq_len or the mixture changes); suspect losses never enter the window, so a
spike cannot raise its own baseline.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Decision:
    kind: str
    """`ok`, `suspect` (above the threshold, not yet persistent) or `spike`."""
    onset: int | None = None
    reason: str = ""
    zscore: float = 0.0


class SpikeDetector:
    def __init__(
        self,
        window: int = 100,
        threshold: float = 6.0,
        persistence: int = 3,
        min_history: int = 20,
        min_rel_scale: float = 0.01,
        grace_steps: int = 50,
    ):
        self.window, self.threshold, self.persistence = window, threshold, persistence
        self.min_history, self.min_rel_scale, self.grace_steps = min_history, min_rel_scale, grace_steps
        self.history: deque[float] = deque(maxlen=window)
        self.grace_until = 0
        self.run: list[int] = []  # steps of the current run of suspect losses

    def start_grace(self, step: int, forget: bool = True) -> None:
        """After warmup or a stage start: judge nothing for `grace_steps`; optionally forget the old trend."""
        self.grace_until = step + self.grace_steps
        if forget:
            self.history.clear()
        self.run = []

    def update(self, step: int, loss: float, grad_norm: float | None = None) -> Decision:
        if not math.isfinite(loss) or (grad_norm is not None and not math.isfinite(grad_norm)):
            self.run = []
            what = "loss" if not math.isfinite(loss) else "grad_norm"
            return Decision("spike", step, f"non-finite {what}", math.inf)
        if step < self.grace_until or len(self.history) < self.min_history:
            self.history.append(loss)
            return Decision("ok")
        med = statistics.median(self.history)
        mad = statistics.median(abs(x - med) for x in self.history)
        scale = max(1.4826 * mad, self.min_rel_scale * abs(med), 1e-8)
        z = (loss - med) / scale
        if z <= self.threshold:
            self.run = []
            self.history.append(loss)
            return Decision("ok", zscore=z)
        self.run.append(step)
        if len(self.run) >= self.persistence:
            onset = self.run[0]
            self.run = []
            return Decision("spike", onset, f"loss {z:.1f} robust sd above the recent median {med:.4g}", z)
        return Decision("suspect", self.run[0], zscore=z)

    def state_dict(self) -> dict:
        return {"history": list(self.history), "grace_until": self.grace_until, "run": list(self.run)}

    def load_state_dict(self, state: dict) -> None:
        self.history = deque(state["history"], maxlen=self.window)
        self.grace_until = int(state["grace_until"])
        self.run = list(state["run"])


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


def outliers(values: list[float], threshold: float = 6.0) -> list[int]:
    """Positions of values far above the rest, for attributing a spike to individual samples.

    The spread is the MAD of the values at or below the median: poisoned samples sit above it, so up to half of the
    values can be bad without inflating the scale that judges them.
    """
    finite = [v for v in values if math.isfinite(v)]
    if len(finite) < 3:
        return [i for i, v in enumerate(values) if not math.isfinite(v)]
    med = statistics.median(finite)
    mad = statistics.median(med - v for v in finite if v <= med)
    scale = max(1.4826 * mad, 0.01 * abs(med), 1e-8)
    return [i for i, v in enumerate(values) if not math.isfinite(v) or (v - med) / scale > threshold]
