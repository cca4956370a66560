"""Leading indicators per decoder layer, measured on logging steps (`stability.layer_stats`).

Per layer: the gradient norm (exact), the parameter norm (exact), the update size (RMS of the applied update over the
RMS of the parameters, on a fixed sample of `SAMPLE` entries of every matrix: an unbiased estimate that needs no copy
of the weights), and the attention-logit bound max|q| * max|k| / sqrt(head_dim) over the step's first micro batch,
read after QK-norm where the model has it (RoPE rotates q and k without changing their norms, so no logit of that
batch exceeds the bound; growing q/k norms are what QK-norm and z-loss are there to stop). Summaries go to the
metrics (`layers/<stat>_max`, `layers/<stat>_argmax`), the vectors to layers.jsonl, and `leaders(onset)` names
the layers that moved first before a spike (marin issue 1368: update-norm spikes in the lower layers came first).

Cost: on logging steps only: one fused norm pass over the gradients and the parameters, two gathers of the samples,
one [layers x 4] transfer. Under FSDP and ZeRO-3 each rank measures its shards and one all-reduce sums them (ZeRO-3
samples the same entries as one process, each rank those in its partition). Under DeepSpeed the gradients are read
from the engine's partitions inside its step (ds_grads.py); under ZeRO-1/2 every rank holds the whole weights.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from functools import partial

import torch
from accelerate.utils import DistributedType

from ...model.build import decoder_layers
from ..engines.deepspeed_grads import PartitionLayerGrads

SAMPLE = 256
"""Entries sampled per matrix for the update size."""
STATS = ("grad_norm", "update_ratio", "param_norm", "attn_logit_bound")
LEAD_RECORDS = 5
"""Logging records before a spike's onset searched for the layers that moved first."""
LEAD_FACTOR = 3.0
"""A layer has moved when a statistic exceeds this multiple of its median over the earlier records."""


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part: FSDP2's DTensor shard, ZeRO-3's flat partition (`ds_tensor`), else the tensor."""
    if hasattr(t, "ds_tensor"):
        return t.ds_tensor
    return t.to_local() if hasattr(t, "to_local") else t


def _sample(p: torch.Tensor, gen: torch.Generator, device) -> torch.Tensor | None:
    """The entries of `p` this rank reads for the update size (flat indices into `_local(p)`); None for a vector.
    Under ZeRO-3 the indices are drawn over the whole matrix, as one process draws them, and each rank keeps those in
    its partition (rank r holds the flat range [r x part, (r + 1) x part)), so the sums over ranks are one process's."""
    shape, numel = getattr(p, "ds_shape", None), getattr(p, "ds_numel", None)
    whole = numel if numel is not None else _local(p).numel()
    if len(shape if shape is not None else p.shape) < 2 or not whole:
        return None
    idx = torch.randint(0, whole, (min(SAMPLE, whole),), generator=gen)
    if numel is not None:
        part = p.ds_tensor.numel()
        rank = torch.distributed.get_rank(group=getattr(p, "ds_process_group", None))
        idx = idx[idx // part == rank] - rank * part
    return idx.to(device)


class LayerStats:
    def __init__(
        self, model: torch.nn.Module, every_steps: int, reduce_sum=None, logits: bool = True, grad_source=None
    ):
        """Args:
        model: the unwrapped model.
        reduce_sum: sums a device tensor over ranks (FSDP: each rank holds shards); None on one process or DDP.
        logits: measure the attention-logit bound (off for compiled layers: a hook would recompile them).
        grad_source: where the per-layer squared gradient norms come from when no parameter holds its gradient
            (DeepSpeed ZeRO-1/2: ds_grads.PartitionLayerGrads, armed with the step, read after it)."""
        self.every, self.reduce_sum, self.grad_source = every_steps, reduce_sum, grad_source
        layers = decoder_layers(model)
        self.n = len(layers)
        self.params, owner = [], []
        for i, layer in enumerate(layers):
            for p in layer.parameters():
                if p.requires_grad:
                    self.params.append(p)
                    owner.append(i)
        device = self.params[0].device if self.params else torch.device("cpu")
        self.owner = torch.tensor(owner, device=device)
        gen = torch.Generator().manual_seed(0)  # the same entries on every rank and every launch
        self.samples = []
        for p, i in zip(self.params, owner):
            if (idx := _sample(p, gen, device)) is not None:
                self.samples.append((p, idx, i))
        self.sample_owner = (
            torch.cat([torch.full((len(idx),), i, device=device) for _, idx, i in self.samples])
            if self.samples
            else torch.zeros(0, dtype=torch.long, device=device)
        )
        self.head_dim = getattr(model.config, "head_dim", None) or (
            model.config.hidden_size // model.config.num_attention_heads
        )
        self.qk = [_qk_modules(layer) if logits else (None, None) for layer in layers]
        self._hooks: dict[int, list] = {}
        self._qk_max = torch.zeros(self.n, 2, device=device)
        self._before: torch.Tensor | None = None
        self._vectors: torch.Tensor | None = None
        self.history: deque[tuple[int, dict[str, list[float]]]] = deque(maxlen=32)

    def due(self, step: int) -> bool:
        return step % self.every == 0

    # ------------------------------------------------------------------ during the step

    def arm(self) -> None:
        """Before the forward of a logging step: read q and k of the first micro batch (then the hooks go)."""
        self._qk_max.zero_()
        if self.grad_source is not None:
            self.grad_source.arm()
        for i, (q, k) in enumerate(self.qk):
            if q is not None:
                self._hooks[i] = [
                    q.register_forward_hook(self._reader(i, 0)),
                    k.register_forward_hook(self._reader(i, 1)),
                ]

    def _reader(self, layer: int, col: int):
        def hook(module, args, out):
            vec = out.detach().reshape(-1, self.head_dim).float()
            self._qk_max[layer, col] = vec.norm(dim=-1).amax()
            if col == 1:  # the layer's q and k are read: done for this step
                for h in self._hooks.pop(layer, []):
                    h.remove()

        return hook

    @torch.no_grad()
    def before(self) -> None:
        """After clipping, before the update: gradient and parameter norms, and the sampled entries (with a
        `grad_source`, the gradients are read inside the engine's step and taken in `after`)."""
        p2 = torch.stack(torch._foreach_norm([_local(p) for p in self.params])).square()
        self._vectors = torch.zeros(self.n, 2, device=p2.device)
        if self.grad_source is None:
            grads = [_local(p.grad) if p.grad is not None else torch.zeros(1, device=p.device) for p in self.params]
            self._vectors[:, 0].index_add_(0, self.owner, torch.stack(torch._foreach_norm(grads)).square())
        self._vectors[:, 1].index_add_(0, self.owner, p2)
        self._before = self._gather()

    @torch.no_grad()
    def after(self, applied: bool) -> None:
        """After the update (or after a skipped one): the sampled entries' change per layer."""
        for hooks in self._hooks.values():  # a layer that never ran its forward
            for h in hooks:
                h.remove()
        self._hooks.clear()
        new = self._gather()
        if self.grad_source is not None and (g2 := self.grad_source.take()) is not None:
            self._vectors[:, 0] = g2  # already summed over ranks: the packed sum below is for FSDP's shards only
        sums = torch.zeros(self.n, 3, device=new.device)  # (sum d^2, sum p^2, count) per layer
        d2 = (new - self._before).square() if applied else torch.zeros_like(new)
        sums[:, 0].index_add_(0, self.sample_owner, d2)
        sums[:, 1].index_add_(0, self.sample_owner, self._before.square())
        sums[:, 2].index_add_(0, self.sample_owner, torch.ones_like(new))
        packed = torch.cat([self._vectors, sums], dim=1)
        if self.reduce_sum is not None:
            packed = self.reduce_sum(packed)
        bound = self._qk_max[:, 0] * self._qk_max[:, 1] / math.sqrt(self.head_dim)
        ratio = (packed[:, 2] / packed[:, 3].clamp(min=1e-30)).sqrt()
        self._vectors = torch.stack([packed[:, 0].sqrt(), ratio, packed[:, 1].sqrt(), bound], dim=1)

    def _gather(self) -> torch.Tensor:
        if not self.samples:
            return torch.zeros(0, device=self.owner.device)
        return torch.cat([_local(p).detach().reshape(-1)[idx].float() for p, idx, _ in self.samples])

    # ------------------------------------------------------------------ on the host, at logging

    def take(self, step: int) -> tuple[dict[str, float], dict[str, list[float]]] | None:
        """(summary metrics, the per-layer vectors) of the last measured step; one transfer. None if none."""
        if self._vectors is None:
            return None
        rows = self._vectors.tolist()
        self._vectors = None
        vectors = {name: [r[k] for r in rows] for k, name in enumerate(STATS)}
        if not any(self.qk_supported()):
            vectors.pop("attn_logit_bound")
        self.history.append((step, vectors))
        summary = {}
        for name, values in vectors.items():
            top = max(range(self.n), key=values.__getitem__)
            summary[f"layers/{name}_max"] = values[top]
            summary[f"layers/{name}_argmax"] = top
        return summary, vectors

    def qk_supported(self) -> list[bool]:
        return [q is not None for q, _ in self.qk]

    def leaders(self, onset: int) -> dict | None:
        """The layers that moved first before a spike dated `onset`: among the last `LEAD_RECORDS` records up to the
        onset, the earliest in which a layer's statistic exceeds `LEAD_FACTOR` x its median over the (up to 20)
        records before them; which layers and statistics, and how many steps before the onset. None when nothing
        moved, or too little history. A replayed step's record replaces the abandoned timeline's."""
        latest = dict(self.history)  # step -> vectors; later (replayed) records win
        records = sorted((s, v) for s, v in latest.items() if s <= onset)
        recent, base = records[-LEAD_RECORDS:], records[:-LEAD_RECORDS][-20:]
        if len(base) < 3:
            return None
        for step, now in recent:
            moved = {}
            for name, values in now.items():
                for layer, v in enumerate(values):
                    median = statistics.median(r[name][layer] for _, r in base)
                    if median > 0 and v > LEAD_FACTOR * median:
                        moved.setdefault(name, []).append(layer)
            if moved:
                return {"step": step, "steps_before": onset - step, "moved": moved}
        return None


def _qk_modules(layer: torch.nn.Module) -> tuple[torch.nn.Module | None, torch.nn.Module | None]:
    """The modules whose outputs are q and k as the attention sees them before RoPE: the QK-norms where the model
    has them, else the projections (Llama-family names); (None, None) for other layouts (no bound measured)."""
    attn = getattr(layer, "self_attn", None)
    for q_name, k_name in (("q_norm", "k_norm"), ("q_proj", "k_proj")):
        q, k = getattr(attn, q_name, None), getattr(attn, k_name, None)
        if isinstance(q, torch.nn.Module) and isinstance(k, torch.nn.Module):
            return q, k
    return None, None


def layer_stats_for(recipe, accelerator, model) -> LayerStats | None:
    """The recipe's layer statistics for this backend: None when off and for a model without decoder layers we
    recognise; under FSDP and ZeRO-3 each rank's shard sums are added over ranks; under DeepSpeed the gradients are
    read from the engine's partitions (ds_grads.py)."""
    if not recipe.stability.layer_stats:
        return None
    layers = decoder_layers(accelerator.unwrap_model(model))
    if not layers:  # a model type without transformers' layer class
        return None
    kind, source, stage = accelerator.distributed_type, None, None
    if kind == DistributedType.DEEPSPEED:
        stage = int(accelerator.state.deepspeed_plugin.zero_stage)
        layer_of = {id(p): i for i, layer in enumerate(layers) for p in layer.parameters()}
        source = PartitionLayerGrads(model.optimizer, layer_of, len(layers), stage)
    sharded = kind == DistributedType.FSDP or stage == 3
    return LayerStats(
        accelerator.unwrap_model(model),
        recipe.logging.every_steps,
        reduce_sum=partial(accelerator.reduce, reduction="sum") if sharded else None,
        logits=not recipe.model.compile,
        grad_source=source,
    )
