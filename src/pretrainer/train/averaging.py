"""Weight averaging (recipe `averaging`): a merged copy of the weights beside the live model.

Each rank averages the weights it holds, in fp32, with no communication: its ZeRO-3 partitions, its FSDP2 row
shards, or, where every rank holds the whole model (one process, DDP, ZeRO-1/2), the whole model. The update is one
or two foreach kernels after an applied step (no host sync, no allocation). For an eval or an export the merged
weights are copied into the live tensors and back (`swapped()`): every backend's forward, gather and save then see
them with no code of its own (ZeRO-3's small persistent parameters are re-gathered from their partitions, as
DeepSpeed does after a step).

Checkpoints carry the accumulators as flat pieces per rank (`checkpoint.pieces`), so a resume at another world size
reads its own share and `export_checkpoint.py --merged` rebuilds the full model one parameter at a time.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate.utils import DistributedType

from ..checkpoint import pieces
from ..errors import PretrainerError
from ..recipe.averaging import AveragingSection
from ..stability.decisions import Part, StepReport

MERGED, SUM = "merged", "sum"
"""Sub-directories of a checkpoint's `averaging/`: the merged weights (the EMA itself), the window's running sum."""


@dataclass
class Local:
    """The run of one parameter's flattened elements that this rank holds."""

    name: str
    tensor: torch.Tensor
    """A 1-D view of the live elements (the model's own storage)."""
    offset: int
    shape: tuple[int, ...]
    replicated: bool
    """Every rank holds the same elements: only rank 0 writes them."""


def local_pieces(module: torch.nn.Module, rank: int) -> list[Local]:
    """This rank's share of every parameter of the unwrapped model (tied weights once)."""
    out = []
    for name, p in module.named_parameters():
        shape = tuple(getattr(p, "ds_shape", p.shape))
        if hasattr(p, "ds_tensor"):  # a ZeRO-3 partition: rank r owns [r*size, (r+1)*size)
            size = p.ds_tensor.ds_numel
            n = max(0, min(size, p.ds_numel - rank * size))
            out.append(Local(name, p.ds_tensor.data.view(-1)[:n], rank * size, shape, False))
        elif hasattr(p, "to_local"):  # FSDP2: a DTensor sharded along dim 0
            out.append(_dtensor_piece(name, p))
        else:
            out.append(Local(name, p.data.view(-1), 0, shape, True))
    return out


def zero3_persistent(module: torch.nn.Module) -> list:
    """The parameters ZeRO-3 keeps gathered on every rank (small ones): forward reads their full copy, which
    DeepSpeed refreshes from the partitions after each step; a swap of the partitions must refresh it too."""
    return [p for p in module.parameters() if getattr(p, "ds_persist", False)]


def _dtensor_piece(name: str, p) -> Local:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if any(not isinstance(pl, Shard | Replicate) or (isinstance(pl, Shard) and pl.dim != 0) for pl in p.placements):
        raise PretrainerError(f"averaging: {name} is sharded as {p.placements}; only dim-0 shards are averaged")
    _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    row = math.prod(p.shape[1:]) if p.dim() > 1 else 1
    replicated = all(isinstance(pl, Replicate) for pl in p.placements)
    return Local(name, p.to_local().data.view(-1), (offset[0] if p.dim() else 0) * row, tuple(p.shape), replicated)


class WeightAverage(Part):
    """The `averaging` part. `update` after each applied update (`after_step`); `swapped()` around an eval or export;
    `save` of the accumulators with each checkpoint (the store calls it), `load_files` of them on a resume or
    rollback (the loop calls it, through `Parts`, before `load_state_dict`); `state_dict` for meta.json."""

    def __init__(self, section: AveragingSection, module: torch.nn.Module, rank: int, start_step: int, every: int):
        """Args:
        module: the unwrapped model (its parameters are the live tensors).
        start_step: the first step averaged (the recipe's, or the end of warmup).
        every: updates (EMA) or steps between merge points (window)."""
        self.section, self.module, self.rank = section, module, rank
        self.start_step, self.every = start_step, every
        self.pieces = local_pieces(module, rank)
        self.merged: list[torch.Tensor] | None = None
        self.sum: list[torch.Tensor] | None = None
        self._reset_counters()

    @classmethod
    def for_section(
        cls, sec: AveragingSection, accelerator, model, warmup_steps: int, eval_every: int
    ) -> WeightAverage | None:
        """The part for the recipe's `averaging` section (None when off).

        Args:
            warmup_steps: where averaging starts unless the section says.
            eval_every: the window's merge interval unless the section says."""
        if not sec.enabled:
            return None
        if accelerator.distributed_type == DistributedType.FSDP and not _fsdp2(accelerator):
            raise PretrainerError("averaging: FSDP1 keeps flat parameters; use fsdp_version: 2 or DeepSpeed")
        start = warmup_steps if sec.start_step is None else sec.start_step
        every = sec.ema.every if sec.method == "ema" else (sec.window.every or eval_every)
        module = accelerator.unwrap_model(model)
        return cls(sec, module, accelerator.process_index, start, every)

    def _reset_counters(self) -> None:
        self.origin_tokens = 0  # tokens at the start of the average (the EMA's relative half-life counts from it)
        self.last_tokens = 0
        self.count = 0  # steps in the merged weights (EMA) or in the running sum (window)
        self.merged_step: int | None = None  # the step whose weights the merged copy is (window: the merge point)

    @property
    def ready(self) -> bool:
        return self.merged is not None and self.merged_step is not None

    def _live(self) -> list[torch.Tensor]:
        return [p.tensor for p in self.pieces]

    # ------------------------------------------------------------------ the update

    def after_step(self, report: StepReport) -> None:
        if report.applied:
            self.update(report.step, report.tokens)

    def update(self, step: int, tokens: int) -> None:
        """After an applied optimizer step (`tokens`: the run's total after it)."""
        if step < self.start_step:
            return
        if self.merged is None:
            self._begin(step, tokens)
            return
        if self.section.method == "ema":
            if step % self.every == 0:
                self._ema(step, tokens)
            return
        self._window(step)

    def _begin(self, step: int, tokens: int) -> None:
        self.merged = [t.detach().float().clone() for t in self._live()]
        self.sum = [torch.zeros_like(m) for m in self.merged] if self.section.method == "window" else None
        self.origin_tokens = self.last_tokens = tokens
        if self.section.method == "ema":
            self.count, self.merged_step = 1, step
        else:
            self.merged_step = None
            self._window(step)

    def _ema(self, step: int, tokens: int) -> None:
        ema = self.section.ema
        half = ema.half_life_tokens or ema.half_life * (tokens - self.origin_tokens)
        weight = 1.0 - 0.5 ** ((tokens - self.last_tokens) / max(half, 1.0))
        live = self._live()
        if all(t.dtype == torch.float32 for t in live):
            torch._foreach_lerp_(self.merged, live, weight)
        else:  # bf16 live weights: no fp32 temporary, the add promotes element-wise
            torch._foreach_mul_(self.merged, 1.0 - weight)
            torch._foreach_add_(self.merged, live, alpha=weight)
        self.count, self.last_tokens, self.merged_step = self.count + 1, tokens, step

    def _window(self, step: int) -> None:
        """Add the step's weights to the sum when it is one of the last `steps` before a merge point; at the merge
        point the mean becomes the merged copy and the sum starts again."""
        until = (-step) % self.every  # steps to the next merge point (0: this is one)
        if until >= self.section.window.steps:
            return
        torch._foreach_add_(self.sum, self._live())
        self.count += 1
        if until == 0:
            torch._foreach_mul_(self.sum, 1.0 / self.count)
            self.merged, self.sum = self.sum, self.merged  # the old merged copy becomes the next sum
            torch._foreach_zero_(self.sum)
            self.count, self.merged_step = 0, step

    def stage_start(self, step: int, tokens: int) -> None:
        """A stage begins: with `stages: reset` the average restarts from the live weights."""
        if self.section.stages == "reset" and self.merged is not None:
            self.merged = self.sum = None
            self._reset_counters()
            if step >= self.start_step:
                self._begin(step, tokens)

    # ------------------------------------------------------------------ using the merged weights

    @contextmanager
    def swapped(self):
        """The merged weights in the live tensors for the body (an eval, an export), the live ones back after.
        Yields False (and swaps nothing) while there is no merged copy yet."""
        if not self.ready:
            yield False
            return
        live = self._live()
        backup = [t.clone() for t in live]
        torch._foreach_copy_(live, self.merged)
        self._refresh()
        try:
            yield True
        finally:
            torch._foreach_copy_(live, backup)
            self._refresh()

    def with_merged(self, fn) -> None:
        """Call `fn` (an export) with the merged weights in place; not at all while there are none."""
        with self.swapped() as ready:
            if ready:
                fn()

    def _refresh(self) -> None:
        """ZeRO-3: re-gather the persistent parameters from their (swapped) partitions, on every rank at once, as
        DeepSpeed does after a step."""
        if persistent := zero3_persistent(self.module):
            persistent[0].partition(persistent)  # drop the full copies (the partitions hold the truth) ...
            persistent[0].all_gather(persistent)  # ... and gather them again

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        return {
            "active": self.merged is not None,
            "origin_tokens": self.origin_tokens,
            "last_tokens": self.last_tokens,
            "count": self.count,
            "merged_step": self.merged_step,
        }

    def load_state_dict(self, state: dict) -> None:
        """The counters; `load_files` (called first, by `Parts.load_state_dict`) read the accumulators."""
        if state["active"] and self.merged is None:
            raise PretrainerError("averaging: the checkpoint's state says averaged, but it holds no averaging/ files")
        self.origin_tokens, self.last_tokens = state["origin_tokens"], state["last_tokens"]
        self.count, self.merged_step = state["count"], state["merged_step"]

    def _tensors(self, buffers: list[torch.Tensor]) -> tuple[dict, dict]:
        mine = [(p, b) for p, b in zip(self.pieces, buffers) if (not p.replicated or self.rank == 0) and b.numel()]
        tensors = {p.name: b for p, b in mine}
        return tensors, {p.name: pieces.Layout(p.offset, p.shape) for p, _ in mine}

    def save(self, directory: Path) -> None:
        """This rank's accumulators into `directory` (the checkpoint's `averaging/`); nothing before averaging began."""
        for sub, buffers in ((MERGED, self.merged), (SUM, self.sum)):
            if buffers is not None:
                tensors, layout = self._tensors(buffers)
                if tensors:
                    pieces.write(Path(directory) / sub, self.rank, tensors, layout)

    def snapshot(self, directory: Path):
        """A CPU copy now, written later by the background checkpoint writer (one process / DDP, `async`)."""
        copies = [
            (sub, [b.detach().to("cpu", copy=True) for b in buffers])
            for sub, buffers in ((MERGED, self.merged), (SUM, self.sum))
            if buffers is not None
        ]

        def write() -> None:
            for sub, buffers in copies:
                tensors, layout = self._tensors(buffers)
                if tensors:
                    pieces.write(Path(directory) / sub, self.rank, tensors, layout)

        return write

    def load_files(self, directory: Path) -> None:
        """The accumulators of a checkpoint (resume or rollback), whatever world size wrote them; none (averaging
        had not begun, or an older checkpoint) resets the average."""
        self.pieces = local_pieces(self.module, self.rank)  # a load may have replaced the live storage
        self.merged = self.sum = None
        self._reset_counters()
        directory = Path(directory)
        if not (directory / MERGED).is_dir():
            return
        self.merged = self._read(directory / MERGED)
        if self.section.method == "window":
            has_sum = (directory / SUM).is_dir()
            self.sum = self._read(directory / SUM) if has_sum else [torch.zeros_like(m) for m in self.merged]

    def _read(self, directory: Path) -> list[torch.Tensor]:
        reader = pieces.Reader(directory)
        device = self.pieces[0].tensor.device if self.pieces else torch.device("cpu")
        return [reader.read(p.name, p.offset, p.offset + p.tensor.numel()).to(device) for p in self.pieces]


def _fsdp2(accelerator) -> bool:
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    return getattr(plugin, "fsdp_version", 1) == 2
