"""A deterministic, index-based mixture sampler.

Sample i of stage s maps to (source, sample) from (seed, s, i) alone, so resuming at any position costs O(1):

1. The index space is cut into blocks of `block` samples. Each block holds a fixed quota of every source (largest
   remainder apportionment of the weights), shuffled by a generator seeded with (seed, stage, block). So realized
   proportions match the weights to within 1/block, everywhere in the stream.
2. Sample i is the k-th draw from its source, where k = block * quota + rank inside the block: O(block) once per
   block, cached.
3. A source is walked without repetition: draw k is position k mod N of a pseudo-random permutation of the
   source's N samples for epoch k // N. The permutation is a keyed Feistel network with cycle walking, so it needs
   no O(N) table and a new epoch is a new key (re-permuted, not replayed in the same order).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ..recipe.sections import MIXTURE_BLOCK

_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64 finalizer: a cheap, well-mixed 64-bit hash."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def feistel_permute(i: int, n: int, key: int, rounds: int = 4) -> int:
    """Position i of a pseudo-random permutation of range(n), keyed by `key`. O(1) memory, ~O(1) time."""
    if n <= 1:
        return 0
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = (1 << half) - 1
    x = i
    while True:  # cycle walking: the domain 4**half is < 4n, so this loops ~once on average
        left, right = x >> half, x & mask
        for r in range(rounds):
            left, right = right, left ^ (_mix64(key ^ (r << 56) ^ right) & mask)
        x = (left << half) | right
        if x < n:
            return x


def apportion(weights: list[float], total: int) -> list[int]:
    """Largest-remainder apportionment: integer counts summing to `total`, proportional to `weights`."""
    w = np.asarray(weights, dtype=np.float64)
    exact = w / w.sum() * total
    counts = np.floor(exact).astype(np.int64)
    order = np.argsort(-(exact - counts), kind="stable")
    counts[order[: total - counts.sum()]] += 1
    return counts.tolist()


@dataclass(frozen=True)
class Draw:
    source: str
    sample: int
    """Index of the sample (packed sequence) within its source."""
    epoch: int
    """How many times this source had been exhausted before this draw (0 = first pass)."""


class MixtureSampler:
    """Maps a stage's global sample index to a source sample. Stateless apart from a cache."""

    def __init__(
        self, weights: dict[str, float], sizes: dict[str, int], seed: int, stage: int, block: int = MIXTURE_BLOCK
    ):
        names = [n for n in weights if weights[n] > 0]
        for n in names:
            if sizes.get(n, 0) <= 0:
                raise ValueError(f"source {n!r} has no samples")
        self.names = names
        self.sizes = [sizes[n] for n in names]
        self.seed, self.stage, self.block = seed, stage, block
        self.quota = apportion([weights[n] for n in names], block)
        for n, q in zip(names, self.quota):
            if q == 0:
                raise ValueError(f"source {n!r}: weight {weights[n]} is below 1/{block}; raise it or drop the source")
        self._key = _mix64(_mix64(seed) ^ stage)

    @functools.lru_cache(maxsize=8)  # noqa: B019  (few samplers live at once; the cache holds recent blocks)
    def _block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        slots = np.repeat(np.arange(len(self.names)), self.quota)
        rng = np.random.default_rng([self.seed, self.stage, b])
        rng.shuffle(slots)
        ranks = np.zeros(self.block, dtype=np.int64)
        for k in range(len(self.names)):
            where = np.flatnonzero(slots == k)
            ranks[where] = np.arange(len(where))
        return slots, ranks

    def __call__(self, i: int) -> Draw:
        b, r = divmod(i, self.block)
        slots, ranks = self._block(b)
        k = int(slots[r])
        draw = b * self.quota[k] + int(ranks[r])
        epoch, pos = divmod(draw, self.sizes[k])
        key = _mix64(self._key ^ _mix64((k << 40) ^ epoch))
        return Draw(self.names[k], feistel_permute(pos, self.sizes[k], key), epoch)


def next_indices(cursor: int, n: int, skips: list[tuple[int, int]]) -> tuple[list[int], int]:
    """The next `n` sample indices at or after `cursor` that fall in no skipped range, and the new cursor.

    Args:
        skips: inclusive (first, last) ranges of this stage, excluded deterministically.
    """
    out: list[int] = []
    i = cursor
    ranges = sorted(skips)
    while len(out) < n:
        hit = next(((a, b) for a, b in ranges if a <= i <= b), None)
        if hit:
            i = hit[1] + 1
            continue
        out.append(i)
        i += 1
    return out, i
