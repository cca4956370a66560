"""What the run pays for loss by position, at three windows: seconds and peak memory of `context.position_table`
(one row's forward at a time, the loss in chunks of positions) on the tiny recipe's model shape, random weights and
tokens (cost does not depend on them). Each window runs in a fresh process, so its peak RSS is its own.

    python scripts/bench_eval.py --windows 1024,2048,8192 --docs 4
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--windows", default="1024,2048,8192")
    p.add_argument("--docs", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def worker(window: int, docs: int, vocab: int) -> dict:
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pretrainer.context import position_buckets, position_table

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=window)  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    rows = [np.random.default_rng(i).integers(0, vocab, window) for i in range(docs)]
    position_table(model, rows[:1], position_buckets(window), "cpu")  # warm-up
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    position_table(model, rows, position_buckets(window), "cpu")
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"window": window, "docs": docs, "seconds": seconds, "tokens_per_s": window * docs / seconds,
            "peak_rss_mb": peak / 1024, "rss_growth_mb": (peak - base) / 1024,
            "logits_mb": window * vocab * 4 / 2**20}  # fmt: skip


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.docs, args.vocab)))
        return 0
    rows = []
    for w in map(int, args.windows.split(",")):
        cmd = [sys.executable, __file__, "--worker", str(w), "--docs", str(args.docs), "--vocab", str(args.vocab)]
        rows.append(
            json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
        )
    print(
        "| window | docs | seconds | tokens/s | peak RSS (MB) | growth past warm-up (MB) | one row's fp32 logits (MB) |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['window']:,} | {r['docs']} | {r['seconds']:.2f} | {r['tokens_per_s']:,.0f} | {r['peak_rss_mb']:,.0f} "
              f"| {r['rss_growth_mb']:,.0f} | {r['logits_mb']:,.0f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
