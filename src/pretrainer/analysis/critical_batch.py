"""The critical batch size measured by branching (Merrill et al. 2025, arXiv 2505.23971).

From one checkpoint, short branches train the same tokens at k times the run's batch (the LR by the recipe's
`batch.lr_scaling`, sqrt(k) for AdamW). Up to the critical batch a bigger batch loses nothing per token; past it, the
loss after the same tokens is worse. The estimate is the largest size whose held-out loss stays within `tolerance`
(relative) of the best loss of every smaller size, each smaller size passing too.

The branches are evaluated on the same fixed held-out batches (`val/ref`'s), so their losses are paired: the spread is
a paired bootstrap over those batches (every branch resampled with the same draw). It measures the evaluation's
noise, not the noise of the branches' own training (the same data in another order); one more seed of branches
measures that, at the cost of the branches again.

Pure functions of the losses; `train/batch_branches.py` trains the branches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..observe.tracking import read_jsonl

TOLERANCE = 0.01
"""A branch within 1% of the best loss of the smaller batches counts as "no worse per token"."""
RESULTS = "critical_batch.jsonl"
"""A run's record of its measurements (in the run directory), one JSON object per checkpoint measured."""
RESAMPLES = 1000
"""Bootstrap draws of the held-out batches for the estimate's 90% interval."""


@dataclass(frozen=True)
class CbsEstimate:
    sizes: list[int]
    """The branches' global batch sizes, in tokens, ascending."""
    losses: list[float]
    """Each branch's mean held-out loss."""
    cbs_tokens: int
    """The largest size within tolerance (a lower bound when `bounded` is False)."""
    lo: int
    hi: int
    """The 5th and 95th percentiles of the estimate over the bootstrap."""
    bounded: bool
    """False when even the largest branch passed: the critical batch is at least `cbs_tokens`."""
    tolerance: float

    def as_dict(self) -> dict:
        return {
            "cbs_tokens": self.cbs_tokens,
            "lo": self.lo,
            "hi": self.hi,
            "bounded": self.bounded,
            "sizes": self.sizes,
            "losses": self.losses,
            "tolerance": self.tolerance,
        }


def passing(means: np.ndarray, tolerance: float) -> int:
    """How many sizes, from the smallest, keep their loss within `tolerance` of the best of the smaller ones (at
    least 1: the smallest is the reference)."""
    for i in range(1, len(means)):
        if not means[i] <= means[:i].min() * (1.0 + tolerance):
            return i
    return len(means)


def estimate(sizes: list[int], losses, tolerance: float = TOLERANCE, seed: int = 0) -> CbsEstimate:
    """The critical batch from `losses[i][j]`: the loss of the branch at `sizes[i]` on held-out batch j.

    Raises:
        ValueError: fewer than two sizes, unsorted sizes, or branches evaluated on different batches.
    """
    x = np.asarray(losses, dtype=float)
    if len(sizes) < 2 or x.ndim != 2 or x.shape[0] != len(sizes) or x.shape[1] < 1:
        raise ValueError(f"need two or more branches evaluated on the same batches, got {x.shape} for {sizes}")
    if list(sizes) != sorted(set(sizes)):
        raise ValueError(f"branch sizes must ascend: {sizes}")
    n = passing(x.mean(axis=1), tolerance)
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, x.shape[1], size=(RESAMPLES, x.shape[1]))
    counts = np.array([passing(x[:, d].mean(axis=1), tolerance) for d in draws])
    lo, hi = np.percentile(counts, [5, 95], method="nearest").astype(int)
    return CbsEstimate(
        sizes=list(sizes),
        losses=[float(v) for v in x.mean(axis=1)],
        cbs_tokens=int(sizes[n - 1]),
        lo=int(sizes[lo - 1]),
        hi=int(sizes[hi - 1]),
        bounded=n < len(sizes),
        tolerance=tolerance,
    )


def suggested_size(current: int, est: CbsEstimate) -> int:
    """The batch to grow to: the largest power-of-two multiple of `current` not above the estimate's lower end
    (Merrill et al. double when the critical batch passes twice the batch; the lower end keeps the step safe)."""
    if est.lo < 2 * current:
        return current
    return current * 2 ** int(math.floor(math.log2(est.lo / current)))


def schedule_line(before: list[tuple[int, int]], at_tokens: int, size: int) -> str:
    """A `--set batch.schedule=...` override: the sizes already run before `at_tokens`, then `size` from there."""
    entries = [(t, b) for t, b in before if t < at_tokens]
    if size != entries[-1][1]:
        entries.append((at_tokens, size))
    body = ", ".join(f"{{from_tokens: {t}, global_batch_tokens: {b}}}" for t, b in entries)
    return f"batch.schedule=[{body}]"


def read_results(run_dir: str | Path) -> list[dict]:
    """The run's critical-batch measurements, in the order they were made (empty when none)."""
    return [r for r in read_jsonl(Path(run_dir) / RESULTS) if _complete(r)]


def _complete(r: dict) -> bool:
    """A record with what the report reads, of the right types (a damaged line that still parses is skipped)."""
    ints = ("step", "tokens", "batch_tokens", "cbs_tokens", "lo", "hi", "branch_tokens")
    return (
        all(isinstance(r.get(k), int) for k in ints)
        and isinstance(r.get("bounded"), bool)
        and isinstance(r.get("suggested"), str)
        and isinstance(r.get("sizes"), list)
        and isinstance(r.get("losses"), list)
        and len(r["sizes"]) == len(r["losses"])
        and all(isinstance(v, int | float) for v in r["sizes"] + r["losses"])
        and isinstance(r.get("tolerance"), int | float)
    )


def measured_lines(results: list[dict], gns_steps, gns_values) -> list[str]:
    """check_run's lines: each measurement (latest per step) beside the noise scale the run logged at or before it
    (B_simple monitors the critical batch; the branches measure it)."""
    latest = {r["step"]: r for r in results}
    lines = []
    for step in sorted(latest):
        r = latest[step]
        before = [v for s, v in zip(gns_steps, gns_values) if s <= step and math.isfinite(v)]
        noise = f"; gns/b_simple there {before[-1]:,.0f}" if before else ""
        low = "" if r["bounded"] else ">= "
        lines.append(
            f"critical batch at step {step:,}: {low}{r['cbs_tokens']:,} tokens [{r['lo']:,}, {r['hi']:,}] by branching "
            f"(the run's batch {r['batch_tokens']:,}){noise}"
        )
    if latest:
        lines.append("  " + batch_advice(latest[max(latest)]))
    return lines


def batch_advice(r: dict) -> str:
    """What the latest measurement says to do with the batch."""
    size = r["batch_tokens"]
    if size < r["lo"]:
        return f"the batch can grow without costing tokens: --set '{r['suggested']}'"
    if size > r["hi"]:
        return "the batch is past the critical batch: each token trains the model less than at a smaller batch"
    return "the batch is within the measured critical range: keep it"
