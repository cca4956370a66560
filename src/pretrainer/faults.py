"""Fault injection for tests and drills, all in one place: kill points (environment), poisoned samples, a NaN loss
and a corrupted optimizer state (recipe `debug.inject`). Nothing here fires unless asked for."""

from __future__ import annotations

import os
import signal
from typing import TYPE_CHECKING

import numpy as np

from .sections import InjectSection

if TYPE_CHECKING:  # annotations only: datatrove's preparation workers import kill_point without torch
    import torch

KILL_ENV = "PRETRAINER_KILL_AT"
_KILL_SEEN: dict[str, int] = {}


def kill_point(where: str) -> None:
    """PRETRAINER_KILL_AT=after_state SIGKILLs the process mid-save; `step:29` after step 29; `step:29#2` the second
    time step 29 completes (in a replay after a rollback)."""
    want = os.environ.get(KILL_ENV)
    if not want:
        return
    point, _, nth = want.partition("#")
    if point == where:
        _KILL_SEEN[where] = _KILL_SEEN.get(where, 0) + 1
        if _KILL_SEEN[where] >= int(nth or 1):
            os.kill(os.getpid(), signal.SIGKILL)


def poison(rows: list[np.ndarray], indices: list[int], first: int, last: int, vocab: int) -> list[np.ndarray]:
    """Rows whose sample index lies in [first, last] become random tokens (seeded by the index, so the same data
    spike again on replay)."""
    out = []
    for row, i in zip(rows, indices):
        if first <= i <= last:
            row = np.random.default_rng(i).integers(0, vocab, size=len(row)).astype(row.dtype)
        out.append(row)
    return out


class StepFaults:
    """The recipe's per-step injections; each fires once per process (a rollback's replay runs clean)."""

    def __init__(self, inject: InjectSection, log):
        self.inject, self.log = inject, log
        self.fired: set[str] = set()

    def _fire(self, kind: str, at: int | None, step: int) -> bool:
        if at is not None and step == at and kind not in self.fired:
            self.fired.add(kind)
            self.log.event("inject", step, what=kind)
            return True
        return False

    def before_step(self, step: int, optimizer: torch.optim.Optimizer) -> bool:
        """Corrupt Adam's first moment if asked for this step; returns whether this step's loss is to be NaN."""
        if self._fire("corrupt_optimizer", self.inject.corrupt_optimizer_step, step):
            for state in optimizer.state.values():
                if "exp_avg" in state:
                    state["exp_avg"].mul_(1e4)
        return self._fire("nan", self.inject.nan_step, step)

    def after_step(self, step: int, optimizer, rank: int, world: int) -> None:
        """A NaN in the last rank's own optimizer state (the innermost torch optimizer: DeepSpeed's fp32 partition
        moments), if asked for this step."""
        if rank == world - 1 and self._fire("nan_state", self.inject.nan_state_step, step):
            while getattr(optimizer, "optimizer", None) is not None:
                optimizer = optimizer.optimizer
            t = next(s["exp_avg_sq"] for s in optimizer.state.values() if "exp_avg_sq" in s)
            (t.to_local() if hasattr(t, "to_local") else t).view(-1)[0] = float("nan")
