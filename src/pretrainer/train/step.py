"""One optimizer step through Accelerate: forward and backward over a rank's micro batches, clip, update.

Everything distributed comes from Accelerate (DDP, DeepSpeed ZeRO, FSDP). The host synchronises with the device at
most once per step, and only when the guard needs the loss and gradient norm before the update: to hold back a
non-finite step, and to let skip-step (absorb.py) judge it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from accelerate.utils import DistributedType

from ..model.losses import ZLossLM
from ..model.masking import Inputs, forward_of, plain_inputs
from ..observe import events as ev
from .absorb import SkipStep
from .ds_gate import DeepSpeedGate
from .gns import GradientNoise
from .inject import StepFaults
from .layers import LayerStats
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
    """Whether the update reached the weights (False: skip-step or the NaN guard held it back)."""
    skipped: tuple[str, float] | None = None
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
        log,
        guard: bool,
        inputs: Inputs = plain_inputs,
        gns: GradientNoise | None = None,
        faults: StepFaults | None = None,
        probe: OptimizerProbe | None = None,
        skip: SkipStep | None = None,
        layers: LayerStats | None = None,
        zloss: ZLossLM | None = None,
    ):
        """Args:
        guard: read loss and grad norm on the host before the update, so a non-finite step never reaches the
            optimizer (and the spike detector gets its values).
        inputs: token rows -> model inputs (document masking, when the recipe asks for it).
        gns: the noise scale, which captures one micro batch's gradient on the steps it measures.
        faults: the recipe's injected faults (None unless `debug.inject` asks for one).
        probe: measures the applied update on logging steps (Muon's proof that it orthogonalises).
        skip: skip-step's rule (judges every guarded step; None: only non-finite steps are held back).
        layers: the per-layer statistics, measured on logging steps.
        zloss: the model's z-loss (its term is taken out of the loss reported, and summed for `loss/z`)."""
        self.acc, self.model, self.optimizer, self.scheduler = accelerator, model, optimizer, scheduler
        self.max_norm = math.inf if max_grad_norm is None else max_grad_norm  # inf: measure the norm, clip nothing
        self.log, self.guard, self.inputs, self.gns, self.faults = log, guard, inputs, gns, faults
        self.probe, self.skip, self.layers, self.zloss = probe, skip, layers, zloss
        self._watch: LayerStats | None = None
        self._z_sum = torch.zeros((), device=accelerator.device)  # z terms since the last logging step
        self._z_count = 0
        deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
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
        acc, model = self.acc, self.model
        model.train()
        nan = self.faults.before_step(step, self.optimizer) if self.faults else False
        scale = self.faults.grad_factor(step) if self.faults else 1.0
        capture = self.gns is not None and self.gns.due(step)
        loss_sum = torch.zeros((), device=acc.device)
        grad_norm, verdict = None, None
        self._watch = self.layers if self.layers is not None and self.layers.due(step) else None
        if self._watch is not None:
            self._watch.arm()
        for k, mb in enumerate(batches):
            mb = mb.to(acc.device, non_blocking=True)
            with acc.accumulate(model):
                inputs = self.inputs(mb)
                with forward_of(inputs):  # no per-micro-batch host sync in transformers' mask preparation
                    out = model(**inputs, use_cache=False)
                loss = out.loss * float("nan") if nan else out.loss
                if self.zloss is not None:  # report the cross-entropy; the z term is logged on its own
                    self._z_sum += self.zloss.last_z
                    self._z_count += 1
                    loss_sum -= self.zloss.last_z
                loss_sum += loss.detach().float()
                if self.gate is not None and acc.sync_gradients:  # DeepSpeed steps inside this backward
                    self.gate.arm(acc.reduce(loss_sum / len(batches), "mean"), self.skip.limits())
                acc.backward(loss * scale if scale != 1.0 else loss)
                if capture and k == 0:
                    self.gns.capture(model.parameters(), len(batches))
                if acc.sync_gradients:
                    grad_norm, verdict = self._update(step, loss_sum / len(batches))
        loss = loss_sum / len(batches)
        if self.faults:
            self.faults.after_step(step, self.optimizer, acc.process_index, acc.num_processes)
        if acc.distributed_type == DistributedType.DEEPSPEED:
            grad_norm, verdict = self._after_deepspeed(loss)
        observed, skipped = verdict if verdict is not None else (None, None)
        return StepOutcome(step, loss, grad_norm, observed, skipped is None, skipped)

    def _update(self, step: int, loss: torch.Tensor):
        """Clip, then step unless the guard holds the update back (non-finite, or skip-step's outlier); the LR
        follows the step either way."""
        if self.acc.distributed_type == DistributedType.DEEPSPEED:
            # its engine clipped and stepped inside backward (through the gate); _after_deepspeed reads what it did.
            # Asking Accelerate for the norm here would read it on the host a second time.
            self.scheduler.step()
            return None, None
        grad_norm = torch.as_tensor(self.acc.clip_grad_norm_(self.model.parameters(), self.max_norm))
        verdict = None
        if self.guard:
            observed = tuple(self.observe(loss, grad_norm))
            verdict = (observed, self._judge(*observed))
        applied = verdict is None or verdict[1] is None
        if self._watch is not None:
            self._watch.before()
        if applied:
            probe = self.probe if self.probe is not None and self.probe.due(step) else None
            if probe is not None:
                probe.before()
            self.optimizer.step()
            if probe is not None:
                probe.after(step)
        if self._watch is not None:
            self._watch.after(applied)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, verdict

    def _judge(self, loss: float, grad_norm: float | None) -> tuple[str, float] | None:
        if self.skip is not None:
            return self.skip.judge(loss, grad_norm)
        finite = math.isfinite(loss) and (grad_norm is None or math.isfinite(grad_norm))
        return None if finite else ("non_finite", math.nan)

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
            return grad_norm, None
        if gate is None or gate.skip is None:  # no gate: DeepSpeed skips a non-finite step by itself
            observed = self.observe(loss, grad_norm)
            return grad_norm, (observed[:2], self._judge(*observed[:2]))
        loss_v, norm_v, skipped = self.observe(loss, grad_norm, gate.skip)
        reason = self._judge(loss_v, norm_v)  # the host's reading of the same numbers: the reason, the history
        # what happened is the device's verdict (a limit met to the last bit may read either way on the host), or
        # DeepSpeed's own overflow path for a non-finite norm
        if skipped or (reason is not None and reason[0] == "non_finite"):
            return grad_norm, ((loss_v, norm_v), reason or ("limit", math.nan))
        return grad_norm, ((loss_v, norm_v), None)

    def take_metrics(self, step: int) -> tuple[dict[str, float], dict[str, list[float]] | None]:
        """At a logging step: the probe's, the z-loss's and the layer statistics' metrics (one host read each), and
        the per-layer vectors (None when not measured)."""
        out: dict[str, float] = {}
        if self.probe is not None:
            out.update(self.probe.take())
        if self._z_count:
            out[ev.LOSS_Z] = float(self._z_sum) / self._z_count
            self._z_sum.zero_()
            self._z_count = 0
        taken = self.layers.take(step) if self.layers is not None else None
        if taken is None:
            return out, None
        out.update(taken[0])
        return out, taken[1]
