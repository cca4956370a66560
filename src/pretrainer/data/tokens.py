"""Tokenize a source once into flat token arrays (EOS after every document), split train/validation by document,
and cache them as .npy files that later runs memory-map."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from transformers import PreTrainedTokenizerBase

from ..errors import DataError


@dataclass
class TokenArrays:
    """One split of one source: tokens of all documents back to back, each followed by EOS."""

    tokens: np.ndarray
    doc_offsets: np.ndarray
    """Start of each document in `tokens`, plus the end: length n_docs + 1."""

    @property
    def n_docs(self) -> int:
        return len(self.doc_offsets) - 1

    def num_windows(self, seq_len: int) -> int:
        return len(self.tokens) // seq_len

    def window(self, j: int, seq_len: int) -> np.ndarray:
        """The j-th packed sequence: contiguous tokens, crossing document boundaries at EOS."""
        return self.tokens[j * seq_len : (j + 1) * seq_len]


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def tokenizer_fingerprint(tok: PreTrainedTokenizerBase) -> str:
    state = tok.backend_tokenizer.to_str() if hasattr(tok, "backend_tokenizer") else repr(tok.get_vocab())
    return hashlib.sha256(state.encode()).hexdigest()[:16]


def validation_mask(n_docs: int, fraction: float) -> np.ndarray:
    """Every k-th document (k = 1/fraction) is held out, at least one; the same documents on every machine."""
    k = max(2, round(1 / fraction))
    mask = np.zeros(n_docs, dtype=bool)
    mask[k - 1 :: k] = True
    if not mask.any():
        mask[-1] = True
    return mask


def tokenize(docs: list[str], tok: PreTrainedTokenizerBase, batch: int = 256) -> TokenArrays:
    eos = tok.eos_token_id
    dtype = token_dtype(len(tok))
    chunks, lengths = [], []
    for i in range(0, len(docs), batch):
        for ids in tok(docs[i : i + batch], add_special_tokens=False)["input_ids"]:
            ids.append(eos)
            chunks.append(np.asarray(ids, dtype=dtype))
            lengths.append(len(ids))
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.concatenate(chunks) if chunks else np.zeros(0, dtype=dtype)
    return TokenArrays(tokens, offsets)


def select_docs(arr: TokenArrays, mask: np.ndarray) -> TokenArrays:
    starts, ends = arr.doc_offsets[:-1][mask], arr.doc_offsets[1:][mask]
    parts = [arr.tokens[s:e] for s, e in zip(starts, ends)]
    offsets = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum(ends - starts, out=offsets[1:])
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=arr.tokens.dtype)
    return TokenArrays(tokens, offsets)


def split(arr: TokenArrays, fraction: float) -> tuple[TokenArrays, TokenArrays]:
    mask = validation_mask(arr.n_docs, fraction)
    if arr.n_docs < 2:
        raise DataError("needs at least 2 documents to hold one out for validation")
    return select_docs(arr, ~mask), select_docs(arr, mask)


def save_arrays(arr: TokenArrays, directory: Path, meta: dict) -> None:
    """Write tokens + index + meta.json into a temporary directory, then rename: readers never see half a cache."""
    tmp = directory.with_name(f"{directory.name}.tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    np.save(tmp / "tokens.npy", arr.tokens)
    np.save(tmp / "doc_offsets.npy", arr.doc_offsets)
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    try:
        tmp.rename(directory)
    except OSError:  # written concurrently by another process: keep theirs
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


def load_arrays(directory: Path) -> TokenArrays | None:
    if not (directory / "meta.json").exists():
        return None
    return TokenArrays(
        np.load(directory / "tokens.npy", mmap_mode="r"), np.load(directory / "doc_offsets.npy", mmap_mode="r")
    )
