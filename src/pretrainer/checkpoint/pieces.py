"""Flat pieces of parameters, one safetensors file per rank: how a per-rank copy of the weights (the averaged
weights) is stored whatever the sharding, and read back at any world size, or whole for an export.

Each rank's file holds, per parameter, the contiguous run of the flattened parameter that the rank owns (a ZeRO-3
partition, an FSDP2 row shard, or all of it when replicated) and, in the file's metadata, where that run starts and
the parameter's full shape. Reading a range pulls only the overlapping slices (safetensors reads lazily), so a rank
of a new world size reads its own share and an export holds one parameter at a time beyond what it returns.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import PretrainerError

LAYOUT_KEY = "pieces"


@dataclass(frozen=True)
class Layout:
    offset: int
    """Where this rank's run starts in the flattened parameter."""
    shape: tuple[int, ...]
    """The full parameter's shape."""


def rank_file(directory: Path, rank: int) -> Path:
    return Path(directory) / f"rank_{rank:05d}.safetensors"


def write(directory: Path, rank: int, tensors: dict[str, torch.Tensor], layout: dict[str, Layout]) -> None:
    """This rank's pieces (1-D, any device) into `directory/rank_NNNNN.safetensors`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    meta = {LAYOUT_KEY: json.dumps({n: [lay.offset, list(lay.shape)] for n, lay in layout.items()})}
    save_file(
        {n: t.detach().reshape(-1).contiguous().cpu() for n, t in tensors.items()}, rank_file(directory, rank), meta
    )


class Reader:
    """Every rank file of one directory; `read(name, lo, hi)` assembles a range of a flattened parameter."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        files = sorted(self.directory.glob("rank_*.safetensors"))
        if not files:
            raise PretrainerError(f"{self.directory}: no rank_*.safetensors files")
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._index: dict[str, list[tuple[int, int, object]]] = {}
        for f in files:
            handle = safe_open(str(f), framework="pt")
            try:
                layout = json.loads((handle.metadata() or {})[LAYOUT_KEY])
            except (KeyError, ValueError):
                raise PretrainerError(f"{f}: no '{LAYOUT_KEY}' layout in its metadata") from None
            for name, (offset, shape) in layout.items():
                n = handle.get_slice(name).get_shape()[0]
                self._index.setdefault(name, []).append((int(offset), int(n), handle))
                self.shapes[name] = tuple(shape)

    def names(self) -> list[str]:
        return list(self.shapes)

    def read(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of the flattened parameter `name`, in fp32."""
        if name not in self._index:
            raise PretrainerError(f"{self.directory}: no pieces of {name!r}")
        out = torch.empty(hi - lo, dtype=torch.float32)
        filled = 0
        for offset, n, handle in self._index[name]:
            a, b = max(lo, offset), min(hi, offset + n)
            if a < b:
                out[a - lo : b - lo] = handle.get_slice(name)[a - offset : b - offset].float()
                filled += b - a
        if filled != hi - lo:
            raise PretrainerError(f"{self.directory}: {name!r} elements {lo}-{hi} are not all in the rank files")
        return out

    def full(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        return self.read(name, 0, int(torch.Size(shape).numel())).view(shape)
