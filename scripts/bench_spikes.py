"""Spike detection on synthetic loss curves (no training): detection rate and false alarms, trend rule vs. level rule.

    python scripts/bench_spikes.py                 # the table for docs/BENCHMARKS.md
    python scripts/bench_spikes.py --json

Curves: a steep power-law descent, a flat plateau and a noisy (heavy-tailed) decay, each also with a stage-boundary
level shift. Spikes of 3, 5 and 10 robust sd of the *noise*, lasting 1 to 10 steps, at early, middle and late
positions. False alarms are counted on 3 x 10,000 healthy steps of each curve. Both rules run with their defaults.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import deque

import numpy as np

from pretrainer.cli import run_main, script_parser
from pretrainer.stability.spikes import SpikeDetector
from pretrainer.stats import MAD_TO_SD

WARMUP, STEPS = 100, 10_000
BOUNDARY = 6_000  # the stage boundary of the shifted curves


def curve(kind: str, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(losses, robust noise sd at each step) of a healthy curve."""
    rng = np.random.default_rng(seed)
    t = np.arange(n, dtype=float)
    if kind.startswith("power"):  # steep early descent, as in the first thousands of steps of a real run
        trend = 2.2 + 9.0 * (1 + t / 30) ** -0.6
        sd = 0.01 * trend
        noise = sd * rng.standard_normal(n)
    elif kind.startswith("plateau"):
        trend = np.full(n, 2.5)
        sd = np.full(n, 0.01)
        noise = sd * rng.standard_normal(n)
    else:  # noisy: multiplicative Gaussian plus heavy-tailed (t, 3 dof) noise
        trend = 2.0 + 8.0 * np.exp(-t / 800)
        sd_g, t3 = 0.02 * trend, 0.03 * rng.standard_t(3, n)
        noise = sd_g * rng.standard_normal(n) + t3
        sd = np.sqrt(sd_g**2 + (0.03 * 1.134) ** 2)  # robust sd of t3 is 1.134
    losses = trend + noise
    if kind.endswith("+shift"):  # a new stage: seq_len / RoPE / mixture move the level
        losses[BOUNDARY:] += 0.3
    return losses, sd


class LevelDetector:
    """The previous rule, kept for comparison: median and MAD of the last `window` raw losses (threshold 6,
    persistence 3, floor 1% of the median)."""

    def __init__(self, window=100, threshold=6.0, persistence=3, min_history=20, grace_steps=50):
        self.history, self.threshold, self.persistence = deque(maxlen=window), threshold, persistence
        self.min_history, self.grace_steps, self.grace_until, self.run = min_history, grace_steps, 0, []

    def start_grace(self, step: int, forget: bool = True) -> None:
        self.grace_until, self.run = step + self.grace_steps, []
        if forget:
            self.history.clear()

    def update(self, step: int, loss: float):
        if step < self.grace_until or len(self.history) < self.min_history:
            self.history.append(loss)
            return "ok", None
        med = statistics.median(self.history)
        scale = max(MAD_TO_SD * statistics.median(abs(x - med) for x in self.history), 0.01 * abs(med), 1e-8)
        if (loss - med) / scale <= self.threshold:
            self.run = []
            self.history.append(loss)
            return "ok", None
        self.run.append(step)
        if len(self.run) >= self.persistence:
            onset, self.run = self.run[0], []
            return "spike", onset
        return "suspect", None


def run_detector(make, losses: np.ndarray, shift_at: int | None, start: int = WARMUP) -> list[int]:
    """Onsets of the spikes a fresh detector reports over a curve from `start` (grace there, as after warmup, and
    at the stage start). After a spike the detector goes on (a real run would roll back)."""
    det = make()
    det.start_grace(start)
    onsets = []
    for i in range(start, len(losses)):
        if shift_at is not None and i == shift_at:
            det.start_grace(i)
        d = det.update(i, float(losses[i]))
        kind, onset = (d.kind, d.onset) if hasattr(d, "kind") else d
        if kind == "spike":
            onsets.append(onset)
            det.start_grace(i, forget=False)
    return onsets


RULES = {"trend (new)": SpikeDetector, "level (old)": LevelDetector}
KINDS = ["power", "plateau", "noisy", "power+shift", "plateau+shift", "noisy+shift"]
POSITIONS = {"early": 400, "middle": 3_000, "late": 8_000, "after shift": BOUNDARY + 60}


def false_alarms(make, seeds=(0, 1, 2), steps: int = STEPS) -> dict[str, int]:
    out = {}
    for kind in KINDS:
        shift = BOUNDARY if kind.endswith("+shift") and steps > BOUNDARY else None
        out[kind] = sum(len(run_detector(make, curve(kind, steps, s)[0], shift)) for s in seeds)
    return out


def detection(make, sizes=(3, 5, 10), lengths=(1, 3, 5, 10), seed: int = 7) -> dict[str, dict]:
    """Found / injected per (size, length): a spike is found when an onset lands within its steps."""
    out = {}
    for size in sizes:
        for length in lengths:
            found = total = 0
            for kind in KINDS:
                shift = BOUNDARY if kind.endswith("+shift") else None
                for name, pos in POSITIONS.items():
                    if name == "after shift" and shift is None:
                        continue
                    losses, sd = curve(kind, pos + length + 40, seed + pos)
                    losses[pos : pos + length] += size * sd[pos : pos + length]
                    # the detector has seen 250 steps of the curve (from warmup, for the early position)
                    onsets = run_detector(make, losses, shift, start=max(WARMUP, pos - 250))
                    found += any(pos - 2 <= o < pos + length for o in onsets)
                    total += 1
            out[f"{size}sd x {length}"] = {"found": found, "total": total}
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = script_parser(__doc__, recipe=False)
    p.add_argument("--json", action="store_true")
    p.add_argument("--steps", type=int, default=STEPS, help="healthy steps per curve and seed for false alarms")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)

    def run() -> int:
        result = {
            name: {"false_alarms": false_alarms(make, steps=args.steps), "detection": detection(make)}
            for name, make in RULES.items()
        }
        if args.json:
            print(json.dumps(result, indent=1))
            return 0
        cells = list(next(iter(result.values()))["detection"])
        print("| rule | " + " | ".join(cells) + f" | false alarms / {3 * args.steps:,} healthy steps |")
        print("|---" * (len(cells) + 2) + "|")
        for name, r in result.items():
            det = " | ".join(f"{v['found']}/{v['total']}" for v in r["detection"].values())
            fa = ", ".join(f"{k} {v}" for k, v in r["false_alarms"].items())
            print(f"| {name} | {det} | {fa} |")
        return 0

    return run_main(run, debug=args.debug)


if __name__ == "__main__":
    raise SystemExit(main())
