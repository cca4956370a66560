"""The training loss with a z-loss: cross-entropy plus coef * mean(logsumexp(logits)^2), the penalty that keeps the
softmax normaliser near 1 (PaLM; OLMo 3 trains with 1e-5), installed as the model's `loss_function` so every backend
(one process, DDP, FSDP, DeepSpeed) runs it inside the model's own forward.

Memory: transformers' own loss casts the whole logits tensor to fp32 and keeps its log-softmax for backward (tokens x
vocab x 4 bytes each: 3.2 GB for 16k tokens of a 49k vocabulary). Here the logits are read in chunks of `CHUNK_ROWS`
rows, each cast to fp32 and reduced to its cross-entropy and squared log-normaliser; backward recomputes one chunk's
softmax from the kept row normalisers. The fp32 copy that exists at any time is one chunk: `CHUNK_ROWS` x vocab x 4
bytes (0.8 GB at a 49k vocabulary), plus 4 bytes per token."""

from __future__ import annotations

import torch
from torch.nn import functional as F

CHUNK_ROWS = 4096


class _ChunkTerms(torch.autograd.Function):
    """(sum of cross-entropies, sum of squared log-normalisers) over a chunk's labelled rows, with the gradient
    written by hand: d/dx = keep * ((g_ce + 2 g_z lse) softmax(x) - g_ce onehot). Forward keeps only the row
    normalisers (fp32, one per row) besides the logits it was given; backward recomputes the softmax of one chunk."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
        x = logits.float()
        lse = torch.logsumexp(x, dim=-1)
        keep = labels != ignore_index
        target = x.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        ctx.save_for_backward(logits, labels, lse)
        ctx.ignore_index = ignore_index
        return torch.stack([((lse - target) * keep).sum(), (lse.square() * keep).sum()])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, labels, lse = ctx.saved_tensors
        keep = (labels != ctx.ignore_index).float()
        probs = (logits.float() - lse.unsqueeze(-1)).exp_()
        probs.mul_(((grad[0] + 2 * grad[1] * lse) * keep).unsqueeze(-1))
        rows = torch.arange(len(labels), device=labels.device)
        probs[rows, labels.clamp(min=0)] -= grad[0] * keep
        return probs.to(logits.dtype), None, None


class ZLossLM:
    """A `loss_function` for a Hugging Face causal LM (same signature as transformers' `ForCausalLMLoss`): in training,
    cross-entropy + coef * z; in evaluation, the cross-entropy alone, so validation losses stay comparable."""

    def __init__(self, model: torch.nn.Module, coef: float):
        self.model, self.coef = model, coef
        self.last_z: torch.Tensor | None = None
        """The last training forward's z term (coefficient included, detached): the loop logs it and subtracts it
        from the loss it reports."""

    def __call__(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        vocab_size: int,
        num_items_in_batch: torch.Tensor | None = None,
        ignore_index: int = -100,
        shift_labels: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        if shift_labels is None:  # tokens < n predict n
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        logits = logits.reshape(-1, vocab_size)
        shift_labels = shift_labels.reshape(-1).to(logits.device)
        sums = torch.zeros(2, device=logits.device)
        for start in range(0, logits.shape[0], CHUNK_ROWS):
            rows = slice(start, start + CHUNK_ROWS)
            sums = sums + _ChunkTerms.apply(logits[rows], shift_labels[rows], ignore_index)
        count = num_items_in_batch if num_items_in_batch is not None else (shift_labels != ignore_index).sum()
        ce, z = sums[0] / count, self.coef * sums[1] / count
        if not self.model.training:
            return ce
        self.last_z = z.detach()
        return ce + z


def install_z_loss(model: torch.nn.Module, coef: float) -> ZLossLM | None:
    """Make `coef` > 0 the model's z-loss (None and the model's own loss when 0)."""
    if coef <= 0:
        return None
    model.loss_function = loss = ZLossLM(model, coef)
    return loss
