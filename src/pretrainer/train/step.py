"""One optimizer step through Accelerate: forward and backward over a rank's micro batches, clip, update.

Everything distributed comes from Accelerate (DDP, DeepSpeed ZeRO, FSDP). The host synchronises with the device at
most once per step, and only when the guard needs the loss and gradient norm before the update: to hold back a
non-finite step, and to let skip-step (skip_step.py) judge it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from accelerate.utils import DistributedType

from ..model.masking import Inputs, forward_of, plain_inputs
from ..stability.decisions import Observed, Skipped
from ..stability.skip_step import SkipStep
from .engines.deepspeed_gate import DeepSpeedGate
from .hooks import StepHook


@dataclass(frozen=True)
class StepOutcome:
    """What one optimizer step did: the loop and its parts read this, nothing else of the step."""

    step: int
    """The optimizer step this was (1-based: the step count after it)."""
    loss: torch.Tensor
    """Mean loss over this rank's micro batches (on the device)."""
    grad_norm: torch.Tensor | None
    """Pre-clip global gradient norm (on the device)."""
    observed: Observed | None
    """Host values of the loss averaged over ranks and the grad norm when the NaN guard is on: the step's only host
    sync."""
    applied: bool
    """Whether the update reached the weights (False: skip-step or the NaN guard held it back)."""
    skipped: Skipped | None = None
    """Why the update was not applied (`non_finite`, `loss`, `grad_norm`) and the limit crossed."""


class StepRunner:
    """Forward/backward over a rank's micro batches, then one clipped optimizer step and the LR update."""

    def __init__(
        self,
        accelerator,
        model,
        optimizer,
        scheduler,
        max_grad_norm: float | None,
        *,
        guard: bool,
        inputs: Inputs = plain_inputs,
        skip: SkipStep | None = None,
        hooks: list[StepHook] | None = None,
    ):
        """Args:
        guard: read loss and grad norm on the host before the update, so a non-finite step never reaches the
            optimizer (and the spike detector gets its values).
        inputs: token rows -> model inputs (document masking, when the recipe asks for it).
        skip: skip-step's rule (judges every guarded step; None: only non-finite steps are held back).
        hooks: the optional work around the step (hooks.py), called in list order."""
        self.acc, self.model, self.optimizer, self.scheduler = accelerator, model, optimizer, scheduler
        self.max_norm = math.inf if max_grad_norm is None else max_grad_norm  # inf: measure the norm, clip nothing
        self.guard, self.inputs, self.skip = guard, inputs, skip
        self.hooks = list(hooks or [])
        deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
        self.deepspeed = deepspeed
        self.gate = (
            DeepSpeedGate(model, accelerator.device) if deepspeed and guard and skip and skip.cfg.enabled else None
        )

    def observe(self, loss: torch.Tensor, grad_norm: torch.Tensor | None, *extra: torch.Tensor) -> list[float]:
        """The step's mean loss over ranks and its gradient norm on the host (and any `extra` device scalars, equal
        on every rank): one transfer for all."""
        gn = grad_norm.float() if grad_norm is not None else torch.zeros((), device=loss.device)
        values = self.acc.reduce(torch.stack([loss, gn, *(e.float() for e in extra)]), reduction="mean").tolist()
        return [values[0], values[1] if grad_norm is not None else None, *values[2:]]

    def __call__(self, batches: list[torch.Tensor], step: int) -> StepOutcome:
        acc, model, hooks = self.acc, self.model, self.hooks
        model.train()
        for h in hooks:
            h.begin(step)
        loss_sum = torch.zeros((), device=acc.device)
        grad_norm, observed, skipped = None, None, None
        for k, mb in enumerate(batches):
            mb = mb.to(acc.device, non_blocking=True)
            with acc.accumulate(model):
                inputs = self.inputs(mb)
                with forward_of(inputs):  # no per-micro-batch host sync in transformers' mask preparation
                    out = model(**inputs, use_cache=False)
                loss = out.loss
                for h in hooks:
                    loss = h.forward_loss(loss)
                reported = loss.detach().float()
                for h in hooks:
                    reported = h.reported(reported)
                loss_sum += reported
                if self.gate is not None and acc.sync_gradients:  # DeepSpeed steps inside this backward
                    self.gate.arm(acc.reduce(loss_sum / len(batches), "mean"), self.skip.limits())
                for h in hooks:
                    loss = h.backward_loss(loss)
                if self.deepspeed and acc.sync_gradients:  # before the engine steps; applied or not is read after
                    for h in hooks:
                        h.before_update(True)
                acc.backward(loss)
                for h in hooks:
                    h.after_backward(k, len(batches))
                if acc.sync_gradients and not self.deepspeed:
                    grad_norm, observed, skipped = self._update(step, loss_sum / len(batches))
                elif acc.sync_gradients:  # its engine clipped and stepped inside backward (through the gate)
                    # _after_deepspeed reads what it did; asking Accelerate for the norm here would read it twice
                    self.scheduler.step()
        loss = loss_sum / len(batches)
        for h in hooks:
            h.end(step)
        if self.deepspeed:
            grad_norm, observed, skipped = self._after_deepspeed(loss)
            for h in reversed(hooks):
                h.after_update(step, skipped is None)
        return StepOutcome(step, loss, grad_norm, observed, skipped is None, skipped)

    def _update(self, step: int, loss: torch.Tensor):
        """Clip, then step unless the guard holds the update back (non-finite, or skip-step's outlier); the LR
        follows the step either way."""
        grad_norm = torch.as_tensor(self.acc.clip_grad_norm_(self.model.parameters(), self.max_norm))
        observed, skipped = None, None
        if self.guard:
            observed = Observed(*self.observe(loss, grad_norm))
            skipped = self._judge(observed)
        applied = skipped is None
        for h in self.hooks:
            h.before_update(applied)
        if applied:
            self.optimizer.step()
        for h in reversed(self.hooks):
            h.after_update(step, applied)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, observed, skipped

    def _judge(self, observed: Observed) -> Skipped | None:
        if self.skip is not None:
            return self.skip.judge(observed.loss, observed.grad_norm)
        finite = math.isfinite(observed.loss) and (observed.grad_norm is None or math.isfinite(observed.grad_norm))
        return None if finite else Skipped("non_finite", math.nan)

    def _after_deepspeed(self, loss: torch.Tensor):
        """DeepSpeed clipped and stepped inside its engine (through the gate when skip-step is on); read back its
        pre-clip norm and, with the guard on, the step's values and the device's verdict in one transfer."""
        gate = self.gate
        if gate is not None and gate.norm is not None:
            grad_norm = gate.norm
        else:
            norm = self.model.get_global_grad_norm()
            grad_norm = torch.as_tensor(norm if norm is not None else float("nan"), device=self.acc.device)
        if not self.guard:
            return grad_norm, None, None
        if gate is None or gate.skip is None:  # no gate: DeepSpeed skips a non-finite step by itself
            values = self.observe(loss, grad_norm)
            observed = Observed(values[0], values[1])
            return grad_norm, observed, self._judge(observed)
        loss_v, norm_v, skipped = self.observe(loss, grad_norm, gate.skip)
        observed = Observed(loss_v, norm_v)
        reason = self._judge(observed)  # the host's reading of the same numbers: the reason, the history
        # what happened is the device's verdict (a limit met to the last bit may read either way on the host), or
        # DeepSpeed's own overflow path for a non-finite norm
        if skipped or (reason is not None and reason.reason == "non_finite"):
            return grad_norm, observed, reason or Skipped("limit", math.nan)
        return grad_norm, observed, None

    def take_metrics(self, step: int) -> tuple[dict[str, float], dict[str, list[float]] | None]:
        """At a logging step: every hook's metrics (one host read each) and the per-layer vectors (None when not
        measured)."""
        out: dict[str, float] = {}
        vectors = None
        for h in self.hooks:
            metrics, vec = h.take(step)
            out.update(metrics)
            vectors = vec if vec is not None else vectors
        return out, vectors
