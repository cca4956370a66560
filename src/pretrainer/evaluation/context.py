"""Loss by position on held-out long documents, and the context verdict: does the model use the window it advertises?

Each document is read from its first token, so position p is "p tokens of context". Positions are grouped in
buckets (0-256, 256-512, 512-1024, ... up to the window). A model that uses its context has a loss that falls, then
holds flat, to the end of the window; one trained only at a shorter context has a loss that rises past it (RoPE
positions it never saw). Cost: `max_docs` forwards of one window each (the logits of one row at a time, the loss
computed in chunks of positions, so memory is one row's logits in the model dtype); statistics are O(buckets).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch is imported where losses are computed: the verdict on logged numbers (check_run) needs none
    import torch

FLAT_RATIO = 0.02
"""A bucket whose mean loss is this much (relative) above the best earlier bucket, and more than two standard errors
above it, is a rise: the context up to that bucket is earned, past it is not."""
CHUNK = 1024
"""Positions per cross-entropy call: bounds the fp32 copy of the logits."""


def position_buckets(window: int, first: int = 256) -> list[tuple[int, int]]:
    """[lo, hi) position ranges: [0, first), then doubling widths' edges up to `window` (the last one ends at it).
    A window of at most `first` starts at window / 4 rounded down to a power of two, so it still has buckets."""
    if window <= first:
        first = max(2, 1 << max(1, (window // 4).bit_length() - 1))
    edges = [0, first]
    while edges[-1] * 2 < window:
        edges.append(edges[-1] * 2)
    edges.append(window)
    return list(zip(edges[:-1], edges[1:]))


def bucket_name(lo: int, hi: int) -> str:
    return f"val_pos/{lo}-{hi}"


def token_losses(model, ids: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each next token of one row `ids` [1, L]: a [L - 1] float tensor; entry t is the loss of token
    t + 1, predicted from t + 1 tokens of context."""
    import torch
    import torch.nn.functional as F

    logits = model(input_ids=ids, use_cache=False).logits
    n = ids.shape[1] - 1
    out = [
        F.cross_entropy(
            logits[0, s : min(n, s + CHUNK)].float(), ids[0, s + 1 : min(n, s + CHUNK) + 1], reduction="none"
        )
        for s in range(0, n, CHUNK)
    ]
    return torch.cat(out)


def bucket_sums(losses: torch.Tensor, buckets: list[tuple[int, int]]) -> torch.Tensor:
    """[buckets, 3]: this document's mean loss in each bucket, its square, and 1 (a document count), so sums over
    documents (and ranks) give the mean over documents and its standard error. Loss index t is position t + 1."""
    import torch

    rows = []
    for lo, hi in buckets:
        m = losses[max(0, lo - 1) : hi - 1].mean()
        rows.append(torch.stack([m, m * m, torch.ones_like(m)]))
    return torch.stack(rows)


def bucket_table(sums: torch.Tensor, buckets: list[tuple[int, int]]) -> list[dict]:
    """Summed `bucket_sums` -> [{lo, hi, loss, se, docs}]: mean over documents and its standard error."""
    out = []
    for (lo, hi), (s, s2, n) in zip(buckets, sums.tolist()):
        mean = s / n if n else math.nan
        var = max(0.0, s2 / n - mean * mean) * n / (n - 1) if n > 1 else 0.0
        out.append({"lo": lo, "hi": hi, "loss": mean, "se": math.sqrt(var / n) if n else math.nan, "docs": int(n)})
    return out


def context_verdict(table: list[dict], advertised: int) -> dict:
    """The longest range from position 0 where the loss keeps falling or holds flat, against the advertised window.

    Returns:
        {advertised, earned (the end of that range), rises_at (the first rising bucket's start, or None), verdict}.
    """
    earned, rises_at = 0, None
    best, best_se = math.inf, 0.0
    for b in table:
        if not math.isfinite(b["loss"]):
            rises_at = b["lo"]
            break
        if b["loss"] - best > max(FLAT_RATIO * abs(best), 2 * math.hypot(b["se"], best_se)):
            rises_at = b["lo"]
            break
        earned = b["hi"]
        if b["loss"] < best:
            best, best_se = b["loss"], b["se"]
    if rises_at is None and earned >= advertised:
        text = f"context window earned: loss falls or holds flat to {advertised:,} tokens"
    else:
        text = f"advertised {advertised:,} but loss rises past {earned:,}"
    return {"advertised": advertised, "earned": earned, "rises_at": rises_at, "verdict": text}


def round_robin(per_source: list[list], limit: int) -> list:
    """The first item of every source, then the second of every source, ... until `limit` items."""
    rows = [docs[k] for k in range(limit) for docs in per_source if k < len(docs)]
    return rows[:limit]


def long_rows(splits: dict[str, object], window: int, max_docs: int) -> list[np.ndarray]:
    """The first `window` tokens of held-out documents at least that long, taken round-robin over the sources (each
    source's documents in order) until `max_docs`. Reads only the chosen documents' tokens."""
    per_source = []
    for split in splits.values():
        starts = split.long_docs(window)[:max_docs, 0]
        per_source.append([split.tokens[int(s) : int(s) + window] for s in starts])
    return round_robin(per_source, max_docs)


def padded_share(n: int, rank: int, world: int) -> list[tuple[int, bool]]:
    """This rank's share of `n` items as (index, real) pairs, the same count on every rank: ZeRO-3 gathers parameters
    inside forward, so an uneven number of forwards would hang; a rank short of an item repeats item 0, unreal
    (weight 0)."""
    out = []
    for j in range(math.ceil(n / world)):
        k = j * world + rank
        out.append((k if k < n else 0, k < n))
    return out


def position_table(
    model, rows: list[np.ndarray], buckets: list[tuple[int, int]], device, rank: int = 0, world: int = 1, reduce=None
) -> list[dict]:
    """Loss by position over `rows`, split over ranks. Every rank runs the same number of forwards (ZeRO-3 gathers
    parameters inside forward; an uneven count would hang): a rank without a row of its own repeats row 0 with
    weight 0. `reduce`: sums a tensor over ranks (Accelerate's `reduce`), None in one process."""
    import torch

    sums = torch.zeros(len(buckets), 3, device=device)
    with torch.no_grad():
        for k, real in padded_share(len(rows), rank, world):
            ids = torch.from_numpy(np.asarray(rows[k], dtype=np.int64))[None].to(device)
            sums += bucket_sums(token_losses(model, ids), buckets) * real
    if reduce is not None:
        sums = reduce(sums)
    return bucket_table(sums.cpu(), buckets)
