"""Which weight average helps, and when: merged `val/ref` against the live model's at each eval of a stable phase,
for EMAs of several half-lives and windows of several lengths, all from one training run.

    python scripts/bench_averaging.py [--recipe recipes/tiny.yaml] [--until 150] [--json out.json]
    python scripts/bench_averaging.py --cost [--json out.json]

Trains the recipe once to step `--until` (its own evals give the live `val/ref`), keeping every step's weights on
the host (steps x parameters floats: a small model only), then replays those weights through the trainer's own
`WeightAverage` for each configuration and evaluates the merged weights on the same reference batches at the same
steps. The recipe's own `averaging` section is ignored (off while training).

`--cost`: the part's own memory (resident memory grown when it starts, and the bytes it holds) and the time of one
update and of one swap in and out, at three model sizes 64x apart (Llamas of (hidden, layers) (128, 4), (256, 8),
(512, 16), vocab 4096, fp32, on the CPU; medians over 20 calls).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

from pretrainer.recipe.averaging import AveragingSection
from pretrainer.recipe.loading import load_recipe
from pretrainer.train.averaging import WeightAverage, local_pieces
from pretrainer.train.trainer import Trainer

CONFIGS = {
    "ema half-life 2% of averaged tokens": {"method": "ema", "ema": {"half_life": 0.02}},
    "ema half-life 5% (default)": {"method": "ema"},
    "ema half-life 10%": {"method": "ema", "ema": {"half_life": 0.1}},
    "ema half-life 2 steps": {"method": "ema", "ema": {"half_life_tokens": 2}},
    "window 3 steps": {"method": "window", "window": {"steps": 3}},
    "window 5 steps": {"method": "window", "window": {"steps": 5}},
    "window 10 steps (default)": {"method": "window"},
    "window 20 steps": {"method": "window", "window": {"steps": 20}},
}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def cost(calls: int = 20) -> list[dict]:
    from bench_stability import SIZES, model_of  # the same three Llamas as the stability costs

    rows = []
    for hidden, layers in SIZES:
        model = model_of(hidden, layers)
        n = sum(p.numel() for p in model.parameters())
        for method in ("ema", "window"):
            before = rss_bytes()
            # EMA: an update every step; window: 10 of every 10 steps averaged (a merge every 10th call)
            avg = WeightAverage(AveragingSection(method=method), model, 0, 0, every=1 if method == "ema" else 10)
            avg.update(0, 0)  # begins: the accumulators are allocated here
            grown = rss_bytes() - before
            held = sum(b.nbytes for b in avg.merged) + (sum(b.nbytes for b in avg.sum) if avg.sum else 0)
            times = []
            for i in range(1, calls + 1):
                t0 = time.perf_counter()
                avg.update(i, i * 1000)
                times.append(time.perf_counter() - t0)
            swaps = []
            for _ in range(5):
                t0 = time.perf_counter()
                with avg.swapped():
                    pass
                swaps.append(time.perf_counter() - t0)
            row = {
                "params": n,
                "method": method,
                "held_mb": held / 2**20,
                "rss_grown_mb": grown / 2**20,
                "update_ms": 1e3 * statistics.median(times),
                "swap_ms": 1e3 * statistics.median(swaps),
            }
            print(json.dumps(row))
            rows.append(row)
            del avg
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="recipes/tiny.yaml")
    p.add_argument("--until", type=int, default=150, help="last step trained (an eval step)")
    p.add_argument("--set", action="append", default=[], help="recipe override a.b=c (repeatable)")
    p.add_argument("--cost", action="store_true", help="memory and time of the part at three model sizes")
    p.add_argument("--json", help="write the results here")
    return p.parse_args(argv)


def train_keeping_weights(recipe, until: int, out: str):
    trainer = Trainer(recipe, output_dir=out, overwrite=True)
    module = trainer.accelerator.unwrap_model(trainer.model)
    weights, live = {}, {}
    for step in trainer.steps():
        weights[step] = [p.tensor.detach().clone() for p in local_pieces(module, 0)]
        if "val/ref" in trainer.last and step % recipe.eval.every_steps == 0:
            live[step] = trainer.last["val/ref"]
        if step >= until:
            break
    return trainer, module, weights, live


def replay(trainer, module, recipe, weights: dict, evals: list[int], spec: dict) -> dict[int, float]:
    section = AveragingSection(**spec)
    if spec.get("ema", {}).get("half_life_tokens"):  # given in steps above: tokens here
        tps = recipe.plan.spans[0].tokens_per_step
        section = AveragingSection(**{**spec, "ema": {"half_life_tokens": spec["ema"]["half_life_tokens"] * tps}})
    every = section.ema.every if section.method == "ema" else (section.window.every or recipe.eval.every_steps)
    avg = WeightAverage(section, module, 0, recipe.schedule.warmup_steps, every)
    tokens, out = 0, {}
    for step in sorted(weights):
        torch._foreach_copy_([p.tensor for p in avg.pieces], weights[step])
        tokens += recipe.plan.stage_at(step - 1).tokens_per_step
        avg.update(step, tokens)
        if step in evals:
            with avg.swapped() as ready:
                out[step] = trainer.evals.evaluate.reference() if ready else float("nan")
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.cost:
        rows = cost()
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return 0
    recipe = load_recipe(args.recipe, args.set)
    recipe.averaging = AveragingSection()
    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        trainer, module, weights, live = train_keeping_weights(recipe, args.until, out)
        print(f"trained to step {max(weights)} in {time.perf_counter() - t0:.0f} s; live val/ref {live}")
        evals = sorted(s for s in live if s > 0)
        rows = {}
        for name, spec in CONFIGS.items():
            merged = replay(trainer, module, recipe, weights, evals, spec)
            rows[name] = {s: {"merged": merged[s], "margin": merged[s] - live[s]} for s in evals}
            cells = "  ".join(f"{s}: {merged[s]:.4f} ({merged[s] - live[s]:+.4f})" for s in evals)
            print(f"{name:38s} {cells}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"recipe": args.recipe, "set": args.set, "live": live, "configs": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
