"""One optimizer step through Accelerate, and the objects it needs: the accelerator, the optimizer's parameter groups,
the DeepSpeed settings the recipe owns.

Everything distributed comes from Accelerate (DDP, DeepSpeed ZeRO, FSDP). The host synchronises with the device at
most once per step, and only when the NaN guard needs the loss and gradient norm before the update.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, InitProcessGroupKwargs

from .errors import PretrainerError
from .faults import StepFaults
from .masking import Inputs, plain_inputs
from .plan import RunPlan
from .sections import Recipe
from .tracking import tracker_setup


def fp8_capable() -> bool:
    """An NVIDIA GPU with fp8 tensor cores (compute capability 8.9+: Ada, Hopper, Blackwell)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def fp8_kwargs() -> list:
    """fp8 through Accelerate: torchao's float8 training where installed, else Accelerate's default backend
    (TransformerEngine or MS-AMP), which names what is missing."""
    if not fp8_capable():
        where = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA GPU"
        raise PretrainerError(
            f"precision.mixed: fp8 needs an NVIDIA GPU with fp8 tensor cores (compute capability 8.9+: Ada, Hopper, "
            f"Blackwell); this machine has {where}. Use bf16 here"
        )
    try:
        import torchao  # noqa: F401
    except ImportError:
        return []
    from accelerate.utils import AORecipeKwargs

    return [AORecipeKwargs()]


def make_accelerator(recipe: Recipe, output_dir, grad_accum: int) -> Accelerator:
    kwargs = fp8_kwargs() if recipe.precision.mixed == "fp8" else []
    if not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Without this every CPU rank would believe it is rank 0 of 1 (the default backend is nccl).
        kwargs.append(InitProcessGroupKwargs(backend="gloo"))
    try:
        acc = Accelerator(
            mixed_precision=recipe.precision.mixed,
            gradient_accumulation_steps=grad_accum,
            log_with=tracker_setup(recipe.logging.report_to, output_dir) or None,
            project_dir=str(output_dir),
            kwargs_handlers=kwargs,
        )
    except (ValueError, ImportError) as e:
        raise PretrainerError(f"precision.mixed: {recipe.precision.mixed!r} is not usable here: {e}") from None
    if (
        os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
        and acc.distributed_type != DistributedType.FSDP
    ):
        # Accelerate turns FSDP on only for accelerator launches (GPU, XPU, NPU, HPU...); on CPU processes it would
        # train plain DDP, with a full model and optimizer on every rank. Never fall back silently.
        raise PretrainerError(
            f"the launch asks for FSDP (ACCELERATE_USE_FSDP=true) but Accelerate enables it only on accelerators; "
            f"here it is {acc.distributed_type.value}, which would train as plain data parallel with full copies. "
            "On CPU processes use a DeepSpeed config (accelerate_configs/zero3.yaml); FSDP needs GPUs"
        )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if acc.num_processes != world:  # a CPU launch without a process group: every rank would think it is alone
        raise PretrainerError(f"expected {world} processes from WORLD_SIZE, Accelerate sees {acc.num_processes}")
    return acc


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only: norms' gains and biases keep their scale."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def configure_deepspeed(accelerator: Accelerator, plan: RunPlan, grad_accum: int) -> None:
    """The recipe, not the launcher config, decides micro batch, accumulation and clipping."""
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return
    ds = accelerator.state.deepspeed_plugin.deepspeed_config
    micro = plan.spans[0].micro_batch_size
    ds["train_micro_batch_size_per_gpu"] = micro
    ds["gradient_accumulation_steps"] = grad_accum
    ds["train_batch_size"] = micro * grad_accum * accelerator.num_processes
    ds["gradient_clipping"] = 0.0 if plan.max_grad_norm is None else plan.max_grad_norm  # DeepSpeed's "off" is 0


@dataclass
class StepResult:
    loss: torch.Tensor
    """Mean loss over this rank's micro batches (on the device)."""
    grad_norm: torch.Tensor | None
    """Pre-clip global gradient norm (on the device)."""
    observed: tuple[float, float | None] | None
    """Host values of (loss averaged over ranks, grad norm) when the NaN guard is on: the step's only host sync."""


class StepRunner:
    """Forward/backward over a rank's micro batches, then one clipped optimizer step and the LR update."""

    def __init__(self, accelerator, model, optimizer, scheduler, max_grad_norm: float | None, faults: StepFaults,
                 log, guard: bool, inputs: Inputs = plain_inputs):  # fmt: skip
        """Args:
        inputs: token rows -> model inputs (document masking, when the recipe asks for it).
        guard: read loss and grad norm on the host before the update, so a non-finite step never reaches the
            optimizer (and the spike detector gets its values)."""
        self.acc, self.model, self.optimizer, self.scheduler = accelerator, model, optimizer, scheduler
        self.max_norm = math.inf if max_grad_norm is None else max_grad_norm  # inf: measure the norm, clip nothing
        self.faults, self.log, self.guard, self.inputs = faults, log, guard, inputs
        self.gns_small_sq: torch.Tensor | None = None
        """One micro batch's own squared gradient norm, for the noise scale (set when asked for)."""

    def noise_scale(self, gns, span, grad_norm: torch.Tensor | None) -> float | None:
        """Feed the noise scale with the last measured micro batch (the small batch) and the step's gradient (the
        big one); returns the smoothed B_simple in tokens, or None when nothing was measured."""
        small_sq, self.gns_small_sq = self.gns_small_sq, None
        if small_sq is None or grad_norm is None:
            return None
        small_sq = self.acc.reduce(small_sq, reduction="mean").item()
        return gns.update(span.micro_batch_size * span.seq_len, span.tokens_per_step, small_sq, float(grad_norm) ** 2)

    def observe(self, loss: torch.Tensor, grad_norm: torch.Tensor | None) -> tuple[float, float | None]:
        """The step's mean loss over ranks and its gradient norm on the host: one transfer for both."""
        gn = grad_norm.float() if grad_norm is not None else torch.zeros((), device=loss.device)
        loss_v, gn_v = self.acc.reduce(torch.stack([loss, gn]), reduction="mean").tolist()
        return loss_v, (gn_v if grad_norm is not None else None)

    def __call__(self, batches: list[torch.Tensor], step: int, measure_gns: bool = False) -> StepResult:
        acc, model = self.acc, self.model
        model.train()
        nan = self.faults.before_step(step, self.optimizer)
        loss_sum = torch.zeros((), device=acc.device)
        grad_norm, observed = None, None
        for k, mb in enumerate(batches):
            mb = mb.to(acc.device, non_blocking=True)
            with acc.accumulate(model):
                out = model(**self.inputs(mb), use_cache=False)
                loss = out.loss * float("nan") if nan else out.loss
                acc.backward(loss)
                loss_sum += loss.detach().float()
                if measure_gns and k == 0:
                    # One micro batch's own gradient (still local, unsynced): Accelerate scaled it by 1/accumulation.
                    norms = [p.grad.detach().float().norm() for p in model.parameters() if p.grad is not None]
                    self.gns_small_sq = (torch.stack(norms).norm() * len(batches)) ** 2
                if acc.sync_gradients:
                    grad_norm, observed = self._update(step, loss_sum / len(batches))
        if grad_norm is None and acc.distributed_type == DistributedType.DEEPSPEED:
            # DeepSpeed clips inside its own step and reports the pre-clip norm afterwards.
            norm = model.get_global_grad_norm()
            grad_norm = torch.as_tensor(norm if norm is not None else float("nan"), device=acc.device)
        loss = loss_sum / len(batches)
        self.faults.after_step(step, self.optimizer, acc.process_index, acc.num_processes)
        if self.guard and observed is None:  # DeepSpeed: its engine has already stepped
            observed = self.observe(loss, grad_norm)
        return StepResult(loss, grad_norm, observed)

    def _update(self, step: int, loss: torch.Tensor):
        """Clip, then step unless the NaN guard sees a non-finite loss or gradient; the LR follows the step."""
        grad_norm = self.acc.clip_grad_norm_(self.model.parameters(), self.max_norm)
        if grad_norm is not None and not torch.is_tensor(grad_norm):  # DeepSpeed reports a float
            grad_norm = torch.tensor(float(grad_norm), device=self.acc.device)
        observed = self.observe(loss, grad_norm) if self.guard else None
        if observed is None or all(math.isfinite(v) for v in observed if v is not None):
            self.optimizer.step()
        else:
            self.log.event("skipped_update", step, loss=observed[0], grad_norm=observed[1])
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, observed
