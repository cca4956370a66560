"""The recipe's fault injections (`debug.inject`), as wrappers installed only when a recipe asks for them: poisoned
samples around the stage's batches, and per-step faults (a NaN loss, a corrupted optimizer state, a NaN in the
optimizer state, scaled gradients) around the step. Nothing here is on the path of a run that injects nothing."""

from __future__ import annotations

import numpy as np
import torch

from ..data.pipeline import StageBatches
from ..observe import events as ev
from ..recipe.plan import StageSpan
from ..recipe.sections import InjectSection, StageSection
from ..runtime import innermost_optimizer


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
            self.log.event(ev.INJECT, step, what=kind)
            return True
        return False

    def before_step(self, step: int, optimizer: torch.optim.Optimizer) -> bool:
        """Corrupt Adam's first moment if asked for this step; returns whether this step's loss is to be NaN."""
        if self._fire("corrupt_optimizer", self.inject.corrupt_optimizer_step, step):
            for state in optimizer.state.values():
                if "exp_avg" in state:
                    state["exp_avg"].mul_(1e4)
        if (drift := self.inject.lr_drift) is not None and step >= drift[0]:
            # the scheduler has set this step's LR; scale it (the next scheduler step sets an unscaled one again)
            for group in optimizer.param_groups:
                group["lr"] *= 1.0 + drift[1] * (step - drift[0])
        return self._fire("nan", self.inject.nan_step, step)

    def grad_factor(self, step: int) -> float:
        """The factor this step's gradients are multiplied by (1.0 unless `grad_scale` fires now)."""
        fault = self.inject.grad_scale
        return fault.factor if fault is not None and self._fire("grad_scale", fault.step, step) else 1.0

    def after_step(self, step: int, optimizer, rank: int, world: int) -> None:
        """A NaN in the last rank's own optimizer state (the innermost torch optimizer: DeepSpeed's fp32 partition
        moments), if asked for this step."""
        if rank == world - 1 and self._fire("nan_state", self.inject.nan_state_step, step):
            optimizer = innermost_optimizer(optimizer)
            t = next(s["exp_avg_sq"] for s in optimizer.state.values() if "exp_avg_sq" in s)
            (t.to_local() if hasattr(t, "to_local") else t).view(-1)[0] = float("nan")


class PoisonedBatches(StageBatches):
    """A stage's batches with `debug.inject.poison_samples` applied: the same samples come out poisoned every time
    they are drawn (the replay after a rollback included)."""

    def __init__(self, *args, first: int, last: int, vocab_size: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.poison = (first, last, vocab_size)

    def rows_for(self, indices: list[int]) -> list[np.ndarray]:
        return poison(super().rows_for(indices), indices, *self.poison)


def wants_step_faults(inject: InjectSection) -> bool:
    fields = (
        inject.corrupt_optimizer_step,
        inject.nan_step,
        inject.nan_state_step,
        inject.lr_drift,
        inject.grad_scale,
    )
    return any(x is not None for x in fields)


def stage_batches(
    section: StageSection, span: StageSpan, sources, seed: int, vocab_size: int, inject: InjectSection
) -> StageBatches:
    """A stage's batches: with `debug.inject.poison_samples` applied when it names this stage (a drill: the same
    samples poisoned at every draw)."""
    args = (section, span, sources, seed, vocab_size)
    poison = inject.poison_samples
    if poison is not None and poison[0] == span.index:
        return PoisonedBatches(*args, first=poison[1], last=poison[2], vocab_size=vocab_size)
    return StageBatches(*args)
