"""Token arrays in memory: the dtype of a vocabulary, the tokenizer's fingerprint, and `tokenize` for small
document lists (tests, tools). Sources are prepared into token files by `prepare.py` instead."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # annotations only: keeps transformers (and torch) out of the preparation workers
    from transformers import PreTrainedTokenizerBase


def long_bounds(bounds: np.ndarray, min_tokens: int) -> np.ndarray:
    """(start, end) of the documents of at least `min_tokens` tokens among consecutive ones, given their boundaries
    (the first start, then each end): shape (k, 2)."""
    keep = np.flatnonzero(np.diff(bounds) >= min_tokens)
    return np.stack([bounds[keep], bounds[keep + 1]], axis=1)


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

    def long_docs(self, min_tokens: int) -> np.ndarray:
        """(start, end) of each document of at least `min_tokens` tokens, in order: shape (k, 2)."""
        return long_bounds(np.asarray(self.doc_offsets, dtype=np.int64), min_tokens)

    def window(self, j: int, seq_len: int) -> np.ndarray:
        """The j-th packed sequence: contiguous tokens, crossing document boundaries at EOS."""
        return self.tokens[j * seq_len : (j + 1) * seq_len]


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def tokenizer_fingerprint(tok: PreTrainedTokenizerBase) -> str:
    state = tok.backend_tokenizer.to_str() if hasattr(tok, "backend_tokenizer") else repr(tok.get_vocab())
    return hashlib.sha256(state.encode()).hexdigest()[:16]


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
