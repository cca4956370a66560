"""Where the packed sequences of a source start, for one stage's seq_len.

Plain packing cuts the token stream (documents back to back, EOS between them) into consecutive windows. In a
long-context stage, a long document starts its own window, so one that fits in seq_len is never cut in two, and its
windows appear `upweight` times in the table, so the sampler draws them that many times more often.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .tokens import TokenArrays


@dataclass
class WindowTable:
    seq_len: int
    size: int
    """Number of entries the sampler draws from (repeats of upweighted windows included)."""
    starts: np.ndarray | None = None
    """Explicit token offsets of each entry; None means entry j starts at j * seq_len."""
    n_long: int = 0
    """Distinct windows that start inside long documents."""

    def start(self, j: int) -> int:
        return j * self.seq_len if self.starts is None else int(self.starts[j])


def plain_windows(arr: TokenArrays, seq_len: int) -> WindowTable:
    return WindowTable(seq_len, len(arr.tokens) // seq_len)


def long_doc_windows(arr: TokenArrays, seq_len: int, min_tokens: int, upweight: int) -> WindowTable:
    """Windows aligned to the starts of long documents, long ones repeated `upweight` times."""
    total = len(arr.tokens)
    plain, long = [], []
    pos = 0
    for s, e in arr.long_docs(min_tokens).tolist():  # only the long documents' bounds: never a table of all of them
        if s >= pos:
            n_plain = (s - pos) // seq_len
            plain.append(pos + seq_len * np.arange(n_plain, dtype=np.int64))
            pos += n_plain * seq_len
            if pos < s and pos + seq_len <= total:
                # the short documents just before: one window that runs into the long one (overlap, no loss)
                plain.append(np.array([pos], dtype=np.int64))
        # else: the previous long document's last window ran into this one; start this one afresh (overlap)
        n = -(-(e - s) // seq_len)
        ws = s + seq_len * np.arange(n, dtype=np.int64)
        ws = ws[ws + seq_len <= total]
        long.append(ws)
        pos = s + n * seq_len
    if pos < total:
        plain.append(pos + seq_len * np.arange((total - pos) // seq_len, dtype=np.int64))
    plain_arr = np.concatenate(plain) if plain else np.zeros(0, dtype=np.int64)
    long_arr = np.concatenate(long) if long else np.zeros(0, dtype=np.int64)
    starts = np.concatenate([plain_arr] + [long_arr] * upweight)
    return WindowTable(seq_len, len(starts), starts, n_long=len(long_arr))
