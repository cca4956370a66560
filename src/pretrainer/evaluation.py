"""Forward passes without gradients: held-out loss per source, and per-sample losses of a past step's batches (for
blaming a recurring spike on its data)."""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from .data.pipeline import SourceData, StageBatches, validation_batches
from .masking import Inputs, plain_inputs


class Evaluator:
    """Mean held-out loss per source, on the same fixed batches at every eval of a given (seq_len, micro batch)."""

    def __init__(self, accelerator, model, sources: dict[str, SourceData], names: list[str], max_batches: int,
                 inputs: Inputs = plain_inputs):  # fmt: skip
        """Args:
        inputs: token rows -> model inputs (document masking, when the recipe asks for it)."""
        self.acc, self.model, self.sources, self.names = accelerator, model, sources, names
        self.max_batches, self.inputs = max_batches, inputs
        self._cache: dict[tuple[int, int], dict[str, list[torch.Tensor]]] = {}

    @torch.no_grad()
    def __call__(self, seq_len: int, micro: int) -> dict[str, float]:
        """`val/<source>`, `val/avg` and `eval/seconds`. Split over ranks; every rank runs the same number of
        forwards (ZeRO-3 gathers parameters inside forward, so an uneven count would hang)."""
        acc, model, t0 = self.acc, self.model, time.perf_counter()
        model.eval()
        if (seq_len, micro) not in self._cache:
            self._cache[(seq_len, micro)] = validation_batches(
                self.sources, self.names, seq_len, micro, self.max_batches
            )
        val = self._cache[(seq_len, micro)]
        out = {}
        for name in self.names:
            batches = val[name]
            per_rank = math.ceil(len(batches) / acc.num_processes)
            total = torch.zeros(2, device=acc.device)
            for j in range(per_rank):
                k = j * acc.num_processes + acc.process_index
                real = k < len(batches)
                mb = batches[k if real else 0].to(acc.device)
                loss = model(**self.inputs(mb), use_cache=False).loss.float()
                total += torch.stack([loss * mb.numel() * real, torch.tensor(mb.numel() * real, device=acc.device)])
            total = acc.reduce(total, reduction="sum")
            out[f"val/{name}"] = (total[0] / total[1]).item()
        out["val/avg"] = sum(out.values()) / len(self.names)
        out["eval/seconds"] = time.perf_counter() - t0
        model.train()
        return out


@torch.no_grad()
def sample_losses(
    accelerator, model, batcher: StageBatches, cursor: int, skips: list[tuple[int, int]], inputs: Inputs = plain_inputs
) -> tuple[list[int], list[float]]:
    """The global sample indices of the step that started at `cursor`, and each sample's mean token loss (gathered
    over ranks: rank order is sample order)."""
    idx, _ = batcher.indices(cursor, skips)
    batches, _, _ = batcher.step_batches(cursor, accelerator.process_index, accelerator.num_processes, skips)
    mine = []
    for mb in batches:
        x = inputs(mb.to(accelerator.device))
        labels = x.pop("labels")[:, 1:]
        logits = model(**x, use_cache=False).logits.float()
        per_tok = F.cross_entropy(logits[:, :-1].transpose(1, 2), labels, reduction="none", ignore_index=-100)
        mine.append(per_tok.sum(dim=1) / (labels != -100).sum(dim=1).clamp(min=1))
    return idx, accelerator.gather(torch.cat(mine)).tolist()
