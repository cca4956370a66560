"""What the stability ladder costs per step, at three model sizes (64x apart in parameters), on this machine:

- the per-layer statistics on a logging step (norms, sampled update, one transfer: their own calls timed inside the
  step; the q/k hooks are in the whole-step difference, also recorded), and amortised over `--every` steps (the
  logging cadence);
- the skip rule's verdict on the host (a deque of 128 floats);
- the chunked z-loss against transformers' own loss, in the same training step.

    python scripts/bench_stability.py [--json out.json] [--steps 8] [--every 10]

Each size: a Llama of (hidden, layers) = (128, 4), (256, 8), (512, 16), vocab 4096, batch 4 x 256 tokens, AdamW,
fp32 on the CPU; medians over `--steps` timed steps after one warm-up step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pretrainer.model.losses import install_z_loss
from pretrainer.recipe.stability import SkipStepSection
from pretrainer.stability.skip_step import SkipStep
from pretrainer.train.measures.layers import LayerStats

SIZES = ((128, 4), (256, 8), (512, 16))


def model_of(hidden: int, layers: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=4096,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(2, hidden // 64),
        max_position_embeddings=256,
    )
    return LlamaForCausalLM(cfg)


def timed(fn, steps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(hidden: int, layers: int, steps: int, every: int) -> dict:
    model = model_of(hidden, layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, 4096, (4, 256), generator=torch.Generator().manual_seed(0))
    stats = LayerStats(model, every_steps=every)

    direct: list[float] = []

    def step(watch: bool = False) -> None:
        t = time.perf_counter()
        if watch:
            stats.arm()
        spent = time.perf_counter() - t
        model(input_ids=x, labels=x).loss.backward()
        t = time.perf_counter()
        if watch:
            stats.before()
        spent += time.perf_counter() - t
        opt.step()
        t = time.perf_counter()
        if watch:
            stats.after(True)
            stats.take(1)
            direct.append(spent + time.perf_counter() - t)
        opt.zero_grad(set_to_none=True)

    plain = timed(step, steps)
    watched = timed(lambda: step(True), steps)
    own = statistics.median(direct[1:])  # the statistics' own calls, timed inside the step (the hooks: in watched)
    rule = SkipStep(SkipStepSection())
    for k in range(128):
        rule.judge(3.0 + 0.01 * (k % 7), 0.5)
    t0 = time.perf_counter()
    for _ in range(1000):
        rule.judge(3.0, 0.5)
    judge = (time.perf_counter() - t0) / 1000
    install_z_loss(model, 1e-4)
    zloss = timed(step, steps)
    params = sum(p.numel() for p in model.parameters())
    return {
        "hidden": hidden,
        "layers": layers,
        "params": params,
        "step_s": plain,
        "layer_stats_logging_step_s": own,
        "layer_stats_step_difference_s": watched - plain,
        "layer_stats_per_step_ratio": 1 + own / every / plain,
        "skip_rule_s": judge,
        "z_loss_step_ratio": zloss / plain,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--every", type=int, default=10, help="logging cadence the layer statistics run at")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = [measure(h, n, args.steps, args.every) for h, n in SIZES]
    print(
        "| params | step (s) | layer stats on a logging step (s) | per step, every 10 | skip rule (us) | z-loss step |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['params'] / 1e6:.1f}M | {r['step_s']:.3f} | {r['layer_stats_logging_step_s']:.4f} | "
            f"{r['layer_stats_per_step_ratio']:.4f}x | {r['skip_rule_s'] * 1e6:.1f} | {r['z_loss_step_ratio']:.3f}x |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
