"""One optimizer step through Accelerate: forward and backward over a rank's micro batches, clip, update.

Everything distributed comes from Accelerate (DDP, DeepSpeed ZeRO, FSDP). The host synchronises with the device at
most once per step, and only when the NaN guard needs the loss and gradient norm before the update.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from accelerate.utils import DistributedType

from ..model.masking import Inputs, plain_inputs
from ..observe import events as ev
from .gns import GradientNoise
from .inject import StepFaults
from .probe import OptimizerProbe


@dataclass(frozen=True)
class StepOutcome:
    """What one optimizer step did: the loop and its parts read this, nothing else of the step."""

    step: int
    """The optimizer step this was (1-based: the step count after it)."""
    loss: torch.Tensor
    """Mean loss over this rank's micro batches (on the device)."""
    grad_norm: torch.Tensor | None
    """Pre-clip global gradient norm (on the device)."""
    observed: tuple[float, float | None] | None
    """Host values of (loss averaged over ranks, grad norm) when the NaN guard is on: the step's only host sync."""
    applied: bool
    """Whether the update reached the weights (False: the NaN guard held back a non-finite step)."""


class StepRunner:
    """Forward/backward over a rank's micro batches, then one clipped optimizer step and the LR update."""

    def __init__(
        self,
        accelerator,
        model,
        optimizer,
        scheduler,
        max_grad_norm: float | None,
        log,
        guard: bool,
        inputs: Inputs = plain_inputs,
        gns: GradientNoise | None = None,
        faults: StepFaults | None = None,
        probe: OptimizerProbe | None = None,
    ):
        """Args:
        guard: read loss and grad norm on the host before the update, so a non-finite step never reaches the
            optimizer (and the spike detector gets its values).
        inputs: token rows -> model inputs (document masking, when the recipe asks for it).
        gns: the noise scale, which captures one micro batch's gradient on the steps it measures.
        faults: the recipe's injected faults (None unless `debug.inject` asks for one).
        probe: measures the applied update on logging steps (Muon's proof that it orthogonalises)."""
        self.acc, self.model, self.optimizer, self.scheduler = accelerator, model, optimizer, scheduler
        self.max_norm = math.inf if max_grad_norm is None else max_grad_norm  # inf: measure the norm, clip nothing
        self.log, self.guard, self.inputs, self.gns, self.faults = log, guard, inputs, gns, faults
        self.probe = probe

    def observe(self, loss: torch.Tensor, grad_norm: torch.Tensor | None) -> tuple[float, float | None]:
        """The step's mean loss over ranks and its gradient norm on the host: one transfer for both."""
        gn = grad_norm.float() if grad_norm is not None else torch.zeros((), device=loss.device)
        loss_v, gn_v = self.acc.reduce(torch.stack([loss, gn]), reduction="mean").tolist()
        return loss_v, (gn_v if grad_norm is not None else None)

    def __call__(self, batches: list[torch.Tensor], step: int) -> StepOutcome:
        acc, model = self.acc, self.model
        model.train()
        nan = self.faults.before_step(step, self.optimizer) if self.faults else False
        capture = self.gns is not None and self.gns.due(step)
        loss_sum = torch.zeros((), device=acc.device)
        grad_norm, observed, applied = None, None, True
        for k, mb in enumerate(batches):
            mb = mb.to(acc.device, non_blocking=True)
            with acc.accumulate(model):
                out = model(**self.inputs(mb), use_cache=False)
                loss = out.loss * float("nan") if nan else out.loss
                acc.backward(loss)
                loss_sum += loss.detach().float()
                if capture and k == 0:
                    self.gns.capture(model.parameters(), len(batches))
                if acc.sync_gradients:
                    grad_norm, observed, applied = self._update(step, loss_sum / len(batches))
        if grad_norm is None and acc.distributed_type == DistributedType.DEEPSPEED:
            # DeepSpeed clips inside its own step and reports the pre-clip norm afterwards.
            norm = model.get_global_grad_norm()
            grad_norm = torch.as_tensor(norm if norm is not None else float("nan"), device=acc.device)
        loss = loss_sum / len(batches)
        if self.faults:
            self.faults.after_step(step, self.optimizer, acc.process_index, acc.num_processes)
        if self.guard and observed is None:  # DeepSpeed: its engine has already stepped
            observed = self.observe(loss, grad_norm)
        return StepOutcome(step, loss, grad_norm, observed, applied)

    def _update(self, step: int, loss: torch.Tensor):
        """Clip, then step unless the NaN guard sees a non-finite loss or gradient; the LR follows the step."""
        grad_norm = self.acc.clip_grad_norm_(self.model.parameters(), self.max_norm)
        if grad_norm is not None and not torch.is_tensor(grad_norm):  # DeepSpeed reports a float
            grad_norm = torch.tensor(float(grad_norm), device=self.acc.device)
        observed = self.observe(loss, grad_norm) if self.guard else None
        applied = observed is None or all(math.isfinite(v) for v in observed if v is not None)
        if applied:
            probe = self.probe if self.probe is not None and self.probe.due(step) else None
            if probe is not None:
                probe.before()
            self.optimizer.step()
            if probe is not None:
                probe.after(step)
        else:
            self.log.event(ev.SKIPPED_UPDATE, step, loss=observed[0], grad_norm=observed[1])
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, observed, applied
