"""The gradients DeepSpeed ZeRO-1/2 hide, read where they still exist: per-layer norms and the noise scale's small
batch.

ZeRO-1/2 reduce the gradients into flat per-rank partitions inside the engine, so after `backward` no rank holds a
parameter's whole gradient (`p.grad` is cleared at the step; ZeRO-2 clears it after every micro batch's reduce).

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
reduces or moves it; on the first micro batch of an armed step the wrapper adds that gradient's squared norm there.

Cost: only on armed steps, one norm per parameter (fragment) and, for the layers, one all-reduce; nothing on other
steps and no host read (the hooks read the values at logging, as before).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class PartitionLayerGrads:
    def __init__(self, zero_opt, layer_of: dict[int, int], n_layers: int):
        """layer_of: id(module parameter) -> its decoder layer; other parameters (embeddings, head, final norm) are
        summed into a slot that is dropped."""
        self.opt, self.n = zero_opt, n_layers
        self.slots = {
            i: torch.tensor([layer_of.get(id(p), n_layers) for p in params], dtype=torch.long)
            for i, params in enumerate(zero_opt.params_in_partition)
        }
        self.armed = False
        self.g2: torch.Tensor | None = None
        self._inner = zero_opt.scaled_global_norm
        zero_opt.scaled_global_norm = self.global_norm

    def arm(self) -> None:
        self.armed, self.g2 = True, None

    def take(self) -> torch.Tensor | None:
        """The last armed step's squared gradient norm per layer (summed over ranks, clipped); None if none."""
        out, self.g2 = self.g2, None
        return out

    @torch.no_grad()
    def global_norm(self, norm_type=2):
        if not self.armed:
            return self._inner(norm_type)
        self.armed = False
        opt = self.opt
        sq = None
        for i, grads in opt.averaged_gradients.items():
            if grads is None:
                continue
            fragments = [g for g in grads if not getattr(g, "_zero_padding", False)][: len(opt.params_in_partition[i])]
            if not fragments:
                continue
            norms = torch.stack(torch._foreach_norm([g.float() for g in fragments]))
            if sq is None:
                sq = torch.zeros(self.n + 1, device=norms.device)
            sq.index_add_(0, self.slots[i][: len(fragments)].to(norms.device), norms.square())
        norm = self._inner(norm_type)  # reads the same fragments (a Muon group is orthogonalised after this)
        if sq is None:
            sq = torch.zeros(self.n + 1, device=norm.device)
        dist.all_reduce(sq, group=opt.dp_process_group)
        if opt.clip_grad > 0:  # DeepSpeed's clip factor (unscale_and_clip_grads), squared
            sq = sq / torch.clamp(((norm.float() / opt.loss_scale) + 1e-6) / opt.clip_grad, min=1.0).square()
        self.g2 = sq[: self.n]
        return norm


class SmallBatchNorm:
    """The squared norm of this rank's first micro-batch gradient, read in ZeRO's gradient hook before its reduce."""

    def __init__(self, zero_opt):
        self.armed = False
        self.sq: torch.Tensor | None = None
        inner = zero_opt.process_gradients

        def process_gradients(param, i):
            if self.armed and param.grad is not None:
                s = param.grad.detach().float().square().sum()
                self.sq = s if self.sq is None else self.sq + s
            return inner(param, i)

        zero_opt.process_gradients = process_gradients

    def arm(self) -> None:
        self.armed, self.sq = True, None

    def take(self) -> torch.Tensor | None:
        """After the first micro batch's backward: its squared gradient norm (this rank's, still scaled by the
        engine's 1/accumulation); disarms."""
        out, self.sq, self.armed = self.sq, None, False
        return out
