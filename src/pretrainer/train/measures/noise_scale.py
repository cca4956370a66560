"""The simple gradient noise scale B_simple = tr(Σ) / |G|² (McCandlish et al. 2018, appendix A).

From the squared gradient norms at two batch sizes, B_small < B_big:

    |G|²  ≈ (B_big |G_big|² - B_small |G_small|²) / (B_big - B_small)
    tr(Σ) ≈ (|G_small|² - |G_big|²) / (1 / B_small - 1 / B_big)

Both are unbiased but very noisy per step, so each is smoothed (bias-corrected EMA) before the ratio is taken, as
the paper recommends. With batch sizes in tokens, B_simple is in tokens: an estimate of the critical batch.
"""

from __future__ import annotations

import torch
from accelerate.utils import DistributedType

from ..engines.deepspeed_grads import SmallBatchNorm


def gns_terms(b_small: float, b_big: float, sq_small: float, sq_big: float) -> tuple[float, float]:
    """(|G|², tr Σ) estimates from one pair of measurements."""
    g2 = (b_big * sq_big - b_small * sq_small) / (b_big - b_small)
    trace = (sq_small - sq_big) / (1.0 / b_small - 1.0 / b_big)
    return g2, trace


class NoiseScale:
    def __init__(self, beta: float = 0.95):
        self.beta = beta
        self.g2 = self.trace = 0.0
        self.n = 0

    def update(self, b_small: float, b_big: float, sq_small: float, sq_big: float) -> float | None:
        """Add one measurement; returns the smoothed B_simple (None while |G|² is not yet positive)."""
        g2, trace = gns_terms(b_small, b_big, sq_small, sq_big)
        self.n += 1
        self.g2 = self.beta * self.g2 + (1 - self.beta) * g2
        self.trace = self.beta * self.trace + (1 - self.beta) * trace
        return self.value()

    def value(self) -> float | None:
        if self.n == 0:
            return None
        corr = 1 - self.beta**self.n  # the same bias correction for both: it cancels in the ratio
        g2, trace = self.g2 / corr, self.trace / corr
        return trace / g2 if g2 > 0 else None

    def state_dict(self) -> dict:
        return {"g2": self.g2, "trace": self.trace, "n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.g2, self.trace, self.n = state["g2"], state["trace"], state["n"]


class GradientNoise:
    """The one owner of the noise-scale measurement in a run: when to measure, the small-batch gradient captured
    inside the step, and the estimate at logging time.

    It needs one micro batch's own gradient: on one process and DDP it is in `p.grad` after the first backward;
    under DeepSpeed ZeRO it is read inside ZeRO's gradient hook before the reduce (`source`, ds_grads.py); not under
    FSDP. A step needs more than one micro batch per rank. Measured on logging steps only: the capture
    costs one norm over all gradients, the estimate one all-reduce and one host read, both off the ordinary steps."""

    def __init__(self, every_steps: int, beta: float = 0.95, source=None):
        self.every = every_steps
        self.scale = NoiseScale(beta)
        self.small_sq: torch.Tensor | None = None
        self.source = source
        """Where the first micro batch's squared norm is read when `p.grad` does not hold it (ds_grads.SmallBatchNorm)."""

    def arm(self) -> None:
        """Before the first micro batch of a measured step."""
        if self.source is not None:
            self.source.arm()

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def capture(self, parameters, micro_batches: int) -> None:
        """One micro batch's own squared gradient norm (still local, unsynced), right after its backward: Accelerate
        scaled it by 1/accumulation, so it is scaled back."""
        if self.source is not None:
            sq = self.source.take()
            self.small_sq = sq * micro_batches**2 if sq is not None else None
            return
        norms = [p.grad.detach().float().norm() for p in parameters if p.grad is not None]
        self.small_sq = (torch.stack(norms).norm() * micro_batches) ** 2

    def estimate(self, accelerator, small_tokens: int, big_tokens: int, grad_norm) -> float | None:
        """Feed the captured small batch and the step's gradient (the big batch); the smoothed B_simple in tokens, or
        None when nothing was captured since the last call."""
        small_sq, self.small_sq = self.small_sq, None
        if small_sq is None or grad_norm is None:
            return None
        small_sq = accelerator.reduce(small_sq, reduction="mean").item()
        return self.scale.update(small_tokens, big_tokens, small_sq, float(grad_norm) ** 2)

    def state_dict(self) -> dict:
        return self.scale.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.scale.load_state_dict(state)


def noise_scale_for(recipe, accelerator, model, plan) -> GradientNoise | None:
    """The run's noise-scale owner, where one micro batch's own gradient can be read: one process and DDP (`p.grad`),
    DeepSpeed ZeRO (its gradient hook, ds_grads.py); None under FSDP (sharded inside backward before anything could
    read it) and when a step is one micro batch per rank (no small batch to compare)."""
    kind = accelerator.distributed_type
    accum = max(plan.grad_accum(accelerator.num_processes, b.start_step) for b in plan.batches)
    if kind == DistributedType.FSDP or accum < 2:
        return None
    source = None
    if kind == DistributedType.DEEPSPEED:
        source = SmallBatchNorm(model.optimizer, int(accelerator.state.deepspeed_plugin.zero_stage))
    return GradientNoise(recipe.logging.every_steps, source=source)
