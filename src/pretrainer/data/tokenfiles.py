"""A prepared source's token files, memory-mapped in place and addressed as one array (no merge, no copy).

A split of a source is the concatenation, in input-file order, of every file's `<split>.ds`. Slicing it costs
O(log files) to find the file (a table of cumulative token counts) plus the copy of the slice itself; only a slice
that straddles two files is assembled. Document boundaries (`*.ds.index`) are read only when a long-document stage
asks for them, at 8 bytes per document.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from ..errors import DataError
from .tokens import long_bounds


class TokenFiles:
    """Several memory-mapped token files as one read-only 1-D array (slicing with step 1 and len only)."""

    def __init__(self, paths: list[Path], dtype: np.dtype):
        self.dtype = np.dtype(dtype)
        self.maps = [np.memmap(p, dtype=self.dtype, mode="r") for p in paths if p.stat().st_size > 0]
        self.starts = np.zeros(len(self.maps) + 1, dtype=np.int64)
        np.cumsum([len(m) for m in self.maps], out=self.starts[1:])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, key: slice) -> np.ndarray:
        if not isinstance(key, slice):
            raise TypeError("TokenFiles supports slices only")
        start, stop, step = key.indices(len(self))
        if step != 1:
            raise ValueError("TokenFiles supports step-1 slices only")
        if stop <= start:
            return np.zeros(0, dtype=self.dtype)
        i = int(np.searchsorted(self.starts, start, side="right")) - 1
        pieces = []
        while start < stop:
            lo = start - int(self.starts[i])
            hi = min(stop, int(self.starts[i + 1])) - int(self.starts[i])
            pieces.append(self.maps[i][lo:hi])
            start += hi - lo
            i += 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def file_of(self, pos: int) -> tuple[str, int]:
        """The token file holding token `pos` of the whole array, and its position in that file."""
        i = int(np.searchsorted(self.starts, pos, side="right")) - 1
        return str(self.maps[i].filename), pos - int(self.starts[i])


def check_sizes(paths: list[Path], split: str, manifest: dict) -> None:
    """Each token file and its document index against the manifest's per-file counts (a stat per file: no read), so
    a truncated or replaced file is one line naming it, not a traceback in the middle of training."""
    per_file, itemsize = manifest.get("per_file"), np.dtype(manifest["dtype"]).itemsize
    for i, p in enumerate(paths):
        want = per_file[i][f"{split}_tokens"] * itemsize if per_file else None
        size = p.stat().st_size
        if size % itemsize or (want is not None and size != want):
            raise DataError(f"{p}: {size} bytes, the manifest says {want}: truncated or replaced; prepare it again")
        index = Path(f"{p}.index")
        docs = per_file[i][f"{split}_docs"] if per_file else None
        if docs is not None and index.exists() and index.stat().st_size != 8 * docs:
            raise DataError(
                f"{index}: {index.stat().st_size} bytes for {docs} documents (8 each): cut or replaced; prepare it again"
            )


INDEX_CHUNK = 1 << 20
"""Document-index entries read at once when scanning for long documents: 8 MB, whatever the source's size."""


class SplitTokens:
    """One split (train or val) of a prepared source: the interface of `tokens.TokenArrays`, backed by files."""

    def __init__(self, source_dir: Path, split: str, manifest: dict):
        files = Path(source_dir) / "files"
        self.token_paths = [files / f"{i:05d}" / f"{split}.ds" for i in range(manifest["files"])]
        missing = [p for p in self.token_paths if not p.exists()]
        if missing:
            raise DataError(f"{source_dir}: prepared data is incomplete ({missing[0]} is missing); prepare it again")
        check_sizes(self.token_paths, split, manifest)
        self.tokens = TokenFiles(self.token_paths, np.dtype(manifest["dtype"]))
        self.n_docs = int(manifest[f"{split}_docs"])
        if len(self.tokens) != manifest[f"{split}_tokens"]:
            raise DataError(
                f"{source_dir}: {split} holds {len(self.tokens)} tokens, the manifest says "
                f"{manifest[f'{split}_tokens']}; prepare it again"
            )

    @functools.cached_property
    def doc_offsets(self) -> np.ndarray:
        """Start of each document in `tokens`, plus the end (n_docs + 1 entries): held in memory (8 bytes per
        document), for tools and tests; the training path reads `long_docs` instead."""
        ends, base = [np.zeros(1, dtype=np.int64)], 0
        for p in self.token_paths:
            idx = Path(f"{p}.index")
            e = np.fromfile(idx, dtype="<u8").astype(np.int64) if idx.stat().st_size else np.zeros(0, np.int64)
            ends.append(e + base)
            base += p.stat().st_size // self.tokens.dtype.itemsize
        return np.concatenate(ends)

    def long_docs(self, min_tokens: int) -> np.ndarray:
        """(start, end) of each document of at least `min_tokens` tokens, in order: shape (k, 2). Each file's index is
        read memory-mapped, `INDEX_CHUNK` entries at a time, so a rank holds the long documents only, never a table
        of every document (8 bytes each: 0.8 GB at 100M documents, on every rank)."""
        out, base = [], 0
        for p in self.token_paths:
            idx = Path(f"{p}.index")
            if idx.stat().st_size:
                ends = np.memmap(idx, dtype="<u8", mode="r")
                for lo in range(0, len(ends), INDEX_CHUNK):
                    bounds = np.empty(min(INDEX_CHUNK, len(ends) - lo) + 1, dtype=np.int64)
                    bounds[0] = int(ends[lo - 1]) if lo else 0  # a file's documents end where the next begins
                    bounds[1:] = ends[lo : lo + INDEX_CHUNK]
                    out.append(long_bounds(bounds, min_tokens) + base)
                del ends
            base += p.stat().st_size // self.tokens.dtype.itemsize
        return np.concatenate(out) if out else np.zeros((0, 2), dtype=np.int64)

    def num_windows(self, seq_len: int) -> int:
        return len(self.tokens) // seq_len

    def window(self, j: int, seq_len: int) -> np.ndarray:
        return self.tokens[j * seq_len : (j + 1) * seq_len]
