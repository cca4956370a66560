"""Skip-step under DeepSpeed ZeRO: its engine steps inside `backward`, before the host could decide, so the verdict is
taken on the device, inside the engine's step, through the one door DeepSpeed has for not stepping: an invalid
gradient norm. DeepSpeed then runs its overflow path (gradients dropped, fp32 weights and moments untouched, the step
counted as skipped), the same on every rank because every rank sees the same global norm, the same reduced loss and
the same limits.

The gate wraps the ZeRO optimizer's global-norm function (`scaled_global_norm` for ZeRO-1/2, `_get_norm_groups` for
ZeRO-3; DeepSpeed 0.19). It adds no host synchronisation: the limits are written into a device tensor with `fill_`
and DeepSpeed's own validity check reads the gated norm. An engine without either function is refused at start.
"""

from __future__ import annotations

import math

import torch

from ...errors import RecipeError


class DeepSpeedGate:
    def __init__(self, engine, device: torch.device):
        self.opt = opt = engine.optimizer
        self.limits = torch.full((2,), math.inf, device=device)  # (loss, grad norm)
        self.loss = torch.zeros((), device=device)
        self.armed = False
        self.norm: torch.Tensor | None = None
        """The pre-clip global gradient norm DeepSpeed computed (before gating), for the logs and the history."""
        self.skip: torch.Tensor | None = None
        """The device verdict of the last armed step."""
        if engine.zero_optimization_stage() == 3 and hasattr(opt, "_get_norm_groups"):
            inner = opt._get_norm_groups
            opt._get_norm_groups = lambda: self._gate_groups(inner())
        elif hasattr(opt, "scaled_global_norm"):
            inner_norm = opt.scaled_global_norm
            opt.scaled_global_norm = lambda norm_type=2: self._gate(inner_norm(norm_type))
        else:
            raise RecipeError(
                f"stability.skip_step: this DeepSpeed optimizer ({type(opt).__name__}) has no global-norm function "
                "the skip can act through (a ZeRO-1/2/3 optimizer is needed); set stability.skip_step.enabled: false"
            )

    def arm(self, loss: torch.Tensor, limits: tuple[float, float] | None) -> None:
        """Before the step's last backward: this step's loss (mean over ranks, on the device) and the host's limits."""
        lim = limits or (math.inf, math.inf)
        self.limits[0].fill_(lim[0])
        self.limits[1].fill_(lim[1])
        self.loss, self.armed = loss, True

    def _gate(self, norm: torch.Tensor) -> torch.Tensor:
        if not self.armed:
            return norm
        self.armed = False
        norm = torch.as_tensor(norm, device=self.limits.device, dtype=torch.float32)
        self.norm = norm
        self.skip = (self.loss > self.limits[0]) | (norm > self.limits[1])
        return torch.where(self.skip, torch.full_like(norm, math.inf), norm)

    def _gate_groups(self, groups: list) -> list:
        if not self.armed or not groups:
            return groups
        stacked = torch.stack([torch.as_tensor(g, device=self.limits.device, dtype=torch.float32) for g in groups])
        # DeepSpeed marks a non-finite group norm as -1; keep that (its own overflow) and gate the rest
        total = torch.where((stacked < 0).any(), torch.full_like(stacked[0], math.nan), stacked.norm())
        gated = self._gate(total)
        return [torch.where(self.skip, gated, g) for g in stacked.unbind()]
