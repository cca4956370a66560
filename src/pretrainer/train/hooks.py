"""The optional work around an optimizer step, as named hooks in one list: fault injection, the noise scale's
micro-batch gradient, per-layer statistics, the optimizer probe and the z-loss's bookkeeping.

The step (step.py) calls every hook at the same points, in list order, so it reads straight down whatever the
recipe turned on:

    begin(step)
    per micro batch: forward_loss(loss) -> reported(loss) -> backward_loss(loss) -> after_backward(k, n)
    before_update(applied) -> optimizer.step() if applied -> after_update(step, applied)
    end(step)
    take(step) at a logging step: metrics and per-layer vectors

None of them reads a device value on the host inside the step: what they measure is read at logging steps (`take`).
"""

from __future__ import annotations

import torch

from ..model.losses import ZLossLM
from ..observe import events as ev
from .inject import StepFaults
from .measures.layers import LayerStats
from .measures.noise_scale import GradientNoise
from .measures.probe import OptimizerProbe


class StepHook:
    """Every method a no-op: a hook overrides what it needs."""

    def begin(self, step: int) -> None:
        pass

    def forward_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The micro batch's loss as the step will use it."""
        return loss

    def reported(self, loss: torch.Tensor) -> torch.Tensor:
        """The part of the loss that is reported as `loss` (the training objective may hold more)."""
        return loss

    def backward_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """What backward runs on."""
        return loss

    def after_backward(self, k: int, n: int) -> None:
        """After micro batch `k` of `n` went through backward."""

    def before_update(self, applied: bool) -> None:
        pass

    def after_update(self, step: int, applied: bool) -> None:
        pass

    def end(self, step: int) -> None:
        pass

    def take(self, step: int) -> tuple[dict[str, float], dict[str, list[float]] | None]:
        return {}, None


class FaultHook(StepHook):
    """`debug.inject`'s step faults: a NaN loss, a scaled gradient, corrupted optimizer moments."""

    def __init__(self, faults: StepFaults, optimizer, rank: int, world: int):
        self.faults, self.optimizer, self.rank, self.world = faults, optimizer, rank, world
        self.nan, self.scale = False, 1.0

    def begin(self, step: int) -> None:
        self.nan = self.faults.before_step(step, self.optimizer)
        self.scale = self.faults.grad_factor(step)

    def forward_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * float("nan") if self.nan else loss

    def backward_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.scale != 1.0 else loss

    def end(self, step: int) -> None:
        self.faults.after_step(step, self.optimizer, self.rank, self.world)


class NoiseHook(StepHook):
    """The noise scale's small-batch gradient: the first micro batch's, on the steps it measures."""

    def __init__(self, gns: GradientNoise, model):
        self.gns, self.model, self.now = gns, model, False

    def begin(self, step: int) -> None:
        self.now = self.gns.due(step)
        if self.now:
            self.gns.arm()

    def after_backward(self, k: int, n: int) -> None:
        if self.now and k == 0:
            self.gns.capture(self.model.parameters(), n)


class LayerHook(StepHook):
    """Per-layer gradient, update and parameter norms (and the attention-logit bound) on logging steps."""

    def __init__(self, layers: LayerStats):
        self.layers, self.now = layers, False

    def begin(self, step: int) -> None:
        self.now = self.layers.due(step)
        if self.now:
            self.layers.arm()

    def before_update(self, applied: bool) -> None:
        if self.now:
            self.layers.before()

    def after_update(self, step: int, applied: bool) -> None:
        if self.now:
            self.layers.after(applied)

    def take(self, step: int):
        taken = self.layers.take(step)
        return taken if taken is not None else ({}, None)


class ProbeHook(StepHook):
    """The applied update, measured on logging steps (Muon's proof that it orthogonalises)."""

    def __init__(self, probe: OptimizerProbe):
        self.probe, self.now = probe, False

    def begin(self, step: int) -> None:
        self.now = self.probe.due(step)

    def before_update(self, applied: bool) -> None:
        if self.now and applied:
            self.probe.before()

    def after_update(self, step: int, applied: bool) -> None:
        if self.now and applied:
            self.probe.after(step)

    def take(self, step: int):
        return self.probe.take(), None


class ZLossHook(StepHook):
    """The z-loss term: taken out of the reported loss, summed on the device for `loss/z` at logging steps."""

    def __init__(self, zloss: ZLossLM, device):
        self.zloss = zloss
        self.sum = torch.zeros((), device=device)
        self.count = 0

    def reported(self, loss: torch.Tensor) -> torch.Tensor:
        self.sum += self.zloss.last_z
        self.count += 1
        return loss - self.zloss.last_z

    def take(self, step: int):
        if not self.count:
            return {}, None
        out = {ev.LOSS_Z: float(self.sum) / self.count}
        self.sum.zero_()
        self.count = 0
        return out, None
