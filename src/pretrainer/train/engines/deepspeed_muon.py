"""Muon under DeepSpeed ZeRO: DeepSpeed's own Muon, given our split, our LR rule and our clipping order.

ZeRO hands the optimizer flat fp32 partitions, on which no Muon step can orthogonalise a matrix. DeepSpeed's
`MuonWithAuxAdam` works inside ZeRO instead: ZeRO-1/2, when they flatten a rank's gradient partition
(`get_flat_partition`), run the momentum and Newton-Schulz on each whole matrix that touches the partition (the
matrices that straddle two ranks are reduced whole to both); ZeRO-3 gathers each Muon matrix's gradient once per
step and orthogonalises round-robin over ranks (`_apply_muon_to_accumulated_grads`; it needs `reduce_scatter:
false`). Either way the partition then holds the update and the optimizer only applies it.

We build that optimizer ourselves rather than through the DeepSpeed config (`"optimizer": {"type": "Muon"}`):
- **the split is ours** (train/optim.py `split_for_muon`: hidden matrices to Muon, embeddings, the head, norms and
  biases to AdamW), marked with `use_muon` on each parameter; DeepSpeed's config path would re-tag by name ("embed",
  "lm_head") inside `deepspeed.initialize`.
- **torch's LR rule**: DeepSpeed scales a matrix's update by sqrt(max(1, A/B)) (torch's `adjust_lr: original`);
  `match_rms_adamw` is that times 0.2 sqrt(max(A, B)) / sqrt(max(1, A/B)) per shape, so the matrices go into one
  group per factor, with the LR times the factor and the weight decay divided by it (torch decays by the unadjusted
  LR: `1 - lr * wd`). The schedule scales each group's own LR, as it does on one process.
- **the auxiliary AdamW is torch's**, as on one process.

And two orders DeepSpeed gets wrong for us (its issue 8439), put right by wrapping three methods of the ZeRO
optimizer (ZeRO-1/2's names below; ZeRO-3: its Muon call, `_get_norm_groups`, `unscale_and_clip_grads`), as the
skip-step gate (ds_gate.py) wraps its norm:
- **the norm is the gradient's**: DeepSpeed orthogonalises while flattening, before it computes the global norm, so
  its norm (and its clipping) would be of the update for the Muon matrices. Here the Muon groups are flattened raw
  first, DeepSpeed's norm is taken over raw gradients (the number logged and fed to the spike rule and skip-step is
  the gradient's norm, as on one process), and only then is the Muon update made.
- **clipping applies to gradients**: the held gradients of the Muon matrices are scaled by the clip factor of that
  norm before the momentum sees them (as `clip_grad_norm_` then `Muon.step()` do on one process), and DeepSpeed's
  own clip then leaves those groups alone (an orthogonalised update is not a gradient).

All of it is device work at the accumulation boundary: no host sync, nothing on non-boundary micro steps.
"""

from __future__ import annotations

import math

import torch

from ...errors import PretrainerError
from ...recipe.sections import OptimizerSection
from ..optim import Assignment, split_for_muon
from .deepspeed_grads import clip_scale

NS_STEPS = 5  # DeepSpeed's muon_update is called without ns_steps or nesterov: 5 steps, Nesterov momentum


def lr_factor(shape: torch.Size, adjust_lr: str) -> float:
    """torch's adjusted ratio over DeepSpeed's built-in sqrt(max(1, A/B))."""
    a, b = shape[:2]
    if adjust_lr == "original":
        return 1.0
    return 0.2 * math.sqrt(max(a, b)) / math.sqrt(max(1.0, a / b))


def build_deepspeed_muon(model: torch.nn.Module, section: OptimizerSection, stage: int):
    """DeepSpeed's MuonWithAuxAdam over our split: (optimizer, assignment)."""
    m = section.muon
    if not m.nesterov or m.ns_steps != NS_STEPS:
        raise PretrainerError(
            f"optimizer.type: muon under DeepSpeed ZeRO-{stage}: optimizer.muon.nesterov: {m.nesterov}, ns_steps: "
            f"{m.ns_steps} are not available: DeepSpeed's Muon always runs Nesterov momentum and {NS_STEPS} "
            "Newton-Schulz steps; set nesterov: true, ns_steps: 5"
        )
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    assign = split_for_muon(model)
    if not assign.muon:
        raise PretrainerError("optimizer.type: muon, but the model has no hidden 2-D matrix to put on Muon")
    params = dict(model.named_parameters())
    on_muon = {id(params[n]) for n in assign.muon}
    by_factor: dict[float, list] = {}
    for name in assign.muon:
        p = params[name]
        by_factor.setdefault(lr_factor(p.shape, m.adjust_lr), []).append(p)
    for p in model.parameters():
        p.use_muon = id(p) in on_muon  # what ZeRO reads to orthogonalise a matrix while flattening
    groups = [
        # "standard": the quintic Newton-Schulz torch runs (bf16); DeepSpeed's default "gram" is another iteration
        {"params": ps, "use_muon": True, "lr": section.lr * f, "weight_decay": m.weight_decay / f}
        | {"momentum": m.momentum, "ns_method": "standard"}
        for f, ps in sorted(by_factor.items())
    ]
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in on_muon]
    adam = {"use_muon": False, "lr": section.lr, "betas": section.betas, "eps": section.eps}
    for wd, ps in ((section.weight_decay, [p for p in rest if p.ndim >= 2]), (0.0, [p for p in rest if p.ndim < 2])):
        if ps:  # AdamW's two groups as on one process: matrices decayed, norms' gains and biases not
            groups.append({"params": ps, "weight_decay": wd, **adam})
    fused = section.fused if section.fused is not None else True
    adam_kw = dict(lr=section.lr, betas=section.betas, eps=section.eps, fused=fused or None)
    opt = MuonWithAuxAdam(groups, adam_optimizer=torch.optim.AdamW, adam_optimizer_kwargs=adam_kw)
    return opt, fused, Assignment(assign.muon, assign.adamw)


class GradientFirst:
    """Wraps the ZeRO optimizer so the Muon groups' gradients are normed and clipped as gradients, and only then
    orthogonalised (module docstring). ZeRO-3 runs Muon in one method just before its norm
    (`_apply_muon_to_accumulated_grads`, on whole gathered matrices): that call is deferred to after the norm."""

    def __init__(self, zero_opt, stage: int):
        self.opt = opt = zero_opt
        if stage == 3:
            self._init_stage3()
            return
        for name in ("get_flat_partition", "scaled_global_norm", "unscale_and_clip_grads", "_is_muon_group"):
            if not hasattr(opt, name):
                raise PretrainerError(
                    f"optimizer.type: muon under DeepSpeed: this ZeRO optimizer ({type(opt).__name__}) has no "
                    f"{name}, which the gradient-first order wraps (DeepSpeed 0.19's ZeRO-1/2 has it)"
                )
        if not getattr(opt, "compute_grad_norm", True) or getattr(opt, "cpu_offload", False):
            raise PretrainerError(
                "optimizer.type: muon under DeepSpeed needs the global norm on the device (no optimizer offload, "
                "zero_optimization.compute_grad_norm left on)"
            )
        self.deferred: dict[int, tuple[tuple, dict, list]] = {}
        self._flat, self._norm, self._clip = opt.get_flat_partition, opt.scaled_global_norm, opt.unscale_and_clip_grads
        self.muon_groups = [i for i, g in enumerate(opt.bit16_groups) if g and getattr(g[0], "use_muon", False)]
        opt.get_flat_partition = self.flat_partition
        opt.scaled_global_norm = self.global_norm
        opt.unscale_and_clip_grads = self.clip

    def _init_stage3(self) -> None:
        opt = self.opt
        for name in ("_apply_muon_to_accumulated_grads", "_get_norm_groups", "unscale_and_clip_grads"):
            if not hasattr(opt, name):
                raise PretrainerError(
                    f"optimizer.type: muon under DeepSpeed ZeRO-3: this ZeRO optimizer ({type(opt).__name__}) has no "
                    f"{name}, which the gradient-first order wraps (DeepSpeed 0.19's ZeRO-3 has it)"
                )
        if getattr(opt, "offload_optimizer", False):
            raise PretrainerError("optimizer.type: muon under DeepSpeed ZeRO-3 needs no optimizer offload")
        self.due = False
        self._apply, self._groups, self._clip3 = (
            opt._apply_muon_to_accumulated_grads,
            opt._get_norm_groups,
            opt.unscale_and_clip_grads,
        )
        opt._apply_muon_to_accumulated_grads = self.defer
        opt._get_norm_groups = self.norm_groups
        opt.unscale_and_clip_grads = self.clip3

    def defer(self) -> None:
        self.due = True  # DeepSpeed calls it right before the norm: run it after, on clipped gradients

    def norm_groups(self):
        groups = self._groups()  # over raw gradients
        if not self.due:
            return groups
        self.due = False
        from deepspeed.runtime.utils import combine_grad_norm_groups

        opt = self.opt
        if (scale := clip_scale(opt, combine_grad_norm_groups(groups))) is not None:
            for i, muon in enumerate(opt.sub_groups_using_muon):
                if muon and opt.averaged_gradients[i] is not None:
                    for g in opt.averaged_gradients[i]:
                        g.mul_(scale.to(g.dtype))
        self._apply()
        return groups

    def clip3(self, sub_group_id, total_norm):
        if self.opt.sub_groups_using_muon[sub_group_id]:  # an update made from clipped gradients
            total_norm = torch.zeros_like(torch.as_tensor(total_norm))
        return self._clip3(sub_group_id, total_norm)

    def flat_partition(self, tensor_list, *args, **kw):
        if not self.opt._is_muon_group(tensor_list):
            return self._flat(tensor_list, *args, **kw)
        group = kw.get("param_group_idx", args[4] if len(args) > 4 else None)
        # the accumulated gradients DeepSpeed drops after this call: held for the Muon update after the norm
        self.deferred[group] = ((tensor_list, *args), kw, self.opt.all_grad_tensors[group])
        for p in tensor_list:
            p.use_muon = False
        try:
            return self._flat(tensor_list, *args, **kw)  # raw views of this rank's partition
        finally:
            for p in tensor_list:
                p.use_muon = True

    def global_norm(self, norm_type=2):
        norm = self._norm(norm_type)  # over raw gradients, the Muon groups' included
        if not self.deferred:
            return norm
        opt, scale = self.opt, clip_scale(self.opt, norm)  # DeepSpeed's clip, applied to the gradients
        for group, (args, kw, grads) in self.deferred.items():
            if scale is not None:
                for g in grads:
                    g.mul_(scale.to(g.dtype))
            opt.all_grad_tensors[group] = grads
            opt.averaged_gradients[group] = self._flat(*args, **kw)  # now the Muon update
            opt.all_grad_tensors[group] = None
        self.deferred.clear()
        return norm

    def clip(self, grad_groups_flat, total_norm):
        opt = self.opt
        muon = any(grad_groups_flat[0] is opt.single_partition_of_fp32_groups[i].grad for i in self.muon_groups)
        # an update already made from clipped gradients: only the loss scale comes off (a zero norm clips nothing)
        return self._clip(grad_groups_flat, torch.zeros_like(total_norm) if muon else total_norm)


def probe_items(engine, stage: int) -> list[tuple[torch.Tensor, dict]]:
    """(module parameter, its optimizer group) for the probe: the optimizer holds flat partitions. Under ZeRO-1/2 each
    rank's module holds every whole matrix again after the step's all-gather; under ZeRO-3 the probe gathers the
    sampled ones (`gathered`)."""
    zero = engine.optimizer
    if stage == 3:
        # any group of the parameter's kind: the probe reads only lr x weight_decay, the same in every Muon group
        by_kind = {bool(g.get("use_muon")): g for g in zero.optimizer.param_groups}
        return [(p, by_kind[bool(getattr(p, "use_muon", False))]) for p in engine.module.parameters()]
    return [(p, g) for ps, g in zip(zero.bit16_groups, zero.optimizer.param_groups) for p in ps]


def gathered(stage: int):
    """A context over a list of parameters that makes them whole (ZeRO-3's GatheredParameters), or None."""
    if stage != 3:
        return None
    import deepspeed

    return lambda params: deepspeed.zero.GatheredParameters(params)
