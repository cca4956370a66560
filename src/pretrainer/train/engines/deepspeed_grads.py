"""The gradients DeepSpeed ZeRO hides, read where they still exist: per-layer norms and the noise scale's small batch.

ZeRO reduces the gradients into per-rank partitions inside the engine, so after `backward` no rank holds a
parameter's whole gradient (`p.grad` is cleared at the step; ZeRO-2/3 clear it after every micro batch's reduce).
ZeRO-3's groups hold one partition per parameter (`fp16_groups`, its norm `_get_norm_groups`); the names below are
ZeRO-1/2's.

**Per-layer gradient norms** (`PartitionLayerGrads`): the gradients exist, as one fragment per parameter
overlapping the rank's partition, in the ZeRO optimizer's `averaged_gradients[group]` at the moment it computes the
global norm (its `scaled_global_norm`; the same lists, pads skipped, that its `get_grad_norm_direct` pairs with
`params_in_partition`). On an armed (logging) step the wrapper squares each fragment there, adds the squares per
decoder layer, sums the [layers] vector over ranks (one all-reduce of a few floats), and scales it by the step's
clip factor (DeepSpeed's formula, from the norm it just computed), so the per-layer gradient norm is the clipped
gradient's, as `LayerStats` measures on one process. Every element of every parameter lies in exactly one rank's
partition, so the sum is the whole gradient's. Under Muon (ds_muon.GradientFirst) the Muon groups still hold their
raw gradient fragments here: the update is made after the norm, inside the function this one calls.

**The small batch's norm** (`SmallBatchNorm`): the noise scale needs one micro batch's own gradient before any
reduce. ZeRO calls its gradient hook (`process_gradients`) for each parameter as its gradient is ready, before it
reduces or moves it (ZeRO-3: `reduce_ready_partitions_and_remove_grads`); on the first micro batch of an armed step
the wrapper adds that gradient's squared norm there.

Cost: only on armed steps, one norm per parameter (fragment) and, for the layers, one all-reduce; nothing on other
steps and no host read (the hooks read the values at logging, as before).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def clip_scale(zero_opt, norm: torch.Tensor) -> torch.Tensor | None:
    """The factor DeepSpeed's clip multiplies the gradients by (its `unscale_and_clip_grads` formula, on the device),
    from the step's global norm; None when clipping is off."""
    if zero_opt.clip_grad <= 0:
        return None
    return 1.0 / torch.clamp(((norm.float() / zero_opt.loss_scale) + 1e-6) / zero_opt.clip_grad, min=1.0)


class PartitionLayerGrads:
    def __init__(self, zero_opt, layer_of: dict[int, int], n_layers: int, stage: int):
        """layer_of: id(module parameter) -> its decoder layer; other parameters (embeddings, head, final norm) are
        summed into a slot that is dropped. Stage 3: each group's gradients are one partition per parameter
        (`fp16_groups`), the norm is `_get_norm_groups`, and the sum over ranks is left to LayerStats (which sums
        its parameter shards too)."""
        self.opt, self.n, self.stage = zero_opt, n_layers, stage
        groups = zero_opt.fp16_groups if stage == 3 else zero_opt.params_in_partition
        self.params = list(groups)
        self.slots = {
            i: torch.tensor([layer_of.get(id(p), n_layers) for p in params], dtype=torch.long)
            for i, params in enumerate(groups)
        }
        self.armed = False
        self.g2: torch.Tensor | None = None
        name = "_get_norm_groups" if stage == 3 else "scaled_global_norm"
        self._inner = getattr(zero_opt, name)
        setattr(zero_opt, name, self.norm_groups if stage == 3 else self.global_norm)

    def arm(self) -> None:
        self.armed, self.g2 = True, None

    def take(self) -> torch.Tensor | None:
        """The last armed step's squared gradient norm per layer (summed over ranks, clipped); None if none."""
        out, self.g2 = self.g2, None
        return out

    def _squares(self) -> torch.Tensor | None:
        """This rank's squared gradient fragments summed per layer (+ one dropped slot)."""
        opt, sq = self.opt, None
        grads_of = opt.averaged_gradients
        for i in range(len(self.params)):
            grads = grads_of.get(i) if isinstance(grads_of, dict) else grads_of[i]
            if grads is None:
                continue
            fragments = [g for g in grads if not getattr(g, "_zero_padding", False)][: len(self.params[i])]
            if not fragments:
                continue
            norms = torch.stack(torch._foreach_norm([g.float() for g in fragments]))
            if sq is None:
                sq = torch.zeros(self.n + 1, device=norms.device)
            sq.index_add_(0, self.slots[i][: len(fragments)].to(norms.device), norms.square())
        return sq

    def _keep(self, sq: torch.Tensor | None, norm: torch.Tensor) -> None:
        opt = self.opt
        if sq is None:
            sq = torch.zeros(self.n + 1, device=norm.device)
        if self.stage != 3:  # ZeRO-3: LayerStats sums over ranks with its parameter shards
            dist.all_reduce(sq, group=opt.dp_process_group)
        if (scale := clip_scale(opt, norm)) is not None:
            sq = sq * scale.square()
        self.g2 = sq[: self.n]

    @torch.no_grad()
    def global_norm(self, norm_type=2):
        """ZeRO-1/2's `scaled_global_norm`."""
        if not self.armed:
            return self._inner(norm_type)
        self.armed = False
        sq = self._squares()
        norm = self._inner(norm_type)  # reads the same fragments (a Muon group is orthogonalised after this)
        self._keep(sq, norm)
        return norm

    @torch.no_grad()
    def norm_groups(self):
        """ZeRO-3's `_get_norm_groups`: the global norm is these groups' norms combined (as DeepSpeed combines them
        for its clip)."""
        if not self.armed:
            return self._inner()
        self.armed = False
        sq = self._squares()
        groups = self._inner()
        stacked = torch.stack([torch.as_tensor(g, dtype=torch.float32) for g in groups])
        self._keep(sq, stacked.norm().to(sq.device if sq is not None else stacked.device))
        return groups


class SmallBatchNorm:
    """The squared norm of this rank's first micro-batch gradient, read in ZeRO's gradient hook before its reduce."""

    def __init__(self, zero_opt, stage: int):
        self.armed = False
        self.sq: torch.Tensor | None = None
        name = "reduce_ready_partitions_and_remove_grads" if stage == 3 else "process_gradients"
        inner = getattr(zero_opt, name)

        def hook(param, *args):
            if self.armed and param.grad is not None:
                s = param.grad.detach().float().square().sum()
                self.sq = s if self.sq is None else self.sq + s
            return inner(param, *args)

        setattr(zero_opt, name, hook)

    def arm(self) -> None:
        self.armed, self.sq = True, None

    def take(self) -> torch.Tensor | None:
        """After the first micro batch's backward: its squared gradient norm (this rank's, still scaled by the
        engine's 1/accumulation); disarms."""
        out, self.sq, self.armed = self.sq, None, False
        return out
