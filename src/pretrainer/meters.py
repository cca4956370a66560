"""What the loop measures between logging steps: per-step losses kept on the device (one host transfer per logging
step), throughput, and the recent-loss statistics a checkpoint records."""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from typing import Any

import torch


class StepWindow:
    """Per-step losses kept on the device between logging steps (no host sync), flushed with one transfer."""

    def __init__(self):
        self.steps: list[int] = []
        self.losses: list[torch.Tensor] = []
        self.tokens = 0
        self.t0 = time.perf_counter()

    def add(self, step: int, loss: torch.Tensor, tokens: int) -> None:
        self.steps.append(step)
        self.losses.append(loss)
        self.tokens += tokens

    def flush(self, accelerator) -> tuple[list[int], list[float]]:
        """The window's steps and their losses averaged over ranks; empties the window."""
        values = accelerator.reduce(torch.stack(self.losses), reduction="mean").tolist()
        steps = self.steps
        self.steps, self.losses = [], []
        return steps, values

    def tokens_per_s(self) -> float:
        """Tokens per second since the clock was last read or reset; restarts the clock."""
        dt = time.perf_counter() - self.t0
        rate = self.tokens / dt if dt > 0 else float("nan")
        self.reset_clock()
        return rate

    def reset_clock(self) -> None:
        self.tokens, self.t0 = 0, time.perf_counter()


class LossStats:
    """The last `size` logged training losses; a checkpoint records their summary, and a rollback never goes back
    to a checkpoint whose recent losses were not finite."""

    def __init__(self, size: int = 256):
        self.recent: deque[float] = deque(maxlen=size)

    def extend(self, losses: list[float]) -> None:
        self.recent.extend(losses)

    def state_dict(self) -> dict[str, Any]:
        losses = list(self.recent)
        finite = [x for x in losses if math.isfinite(x)]
        return {
            "n": len(losses),
            "finite": len(finite) == len(losses),
            "median": statistics.median(finite) if finite else None,
            "last": losses[-1] if losses else None,
            "min": min(finite) if finite else None,
            "max": max(finite) if finite else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Only the summary is saved: the losses after a restore are the new timeline's.
        self.recent.clear()
