"""What the run pays for evaluation beyond its validation loss, at three sizes each, every size in a fresh process
(so its peak RSS is its own); random weights (cost does not depend on them), one process on the CPU.

- Loss by position at three windows: seconds and peak memory of `context.position_table` (one row's forward at a
  time, the loss in chunks of positions) on the tiny recipe's model shape and random tokens.
- lm-eval at three model sizes: the main-process copy ZeRO-3/FSDP runs need (`downstream.copy_holding`: build the
  class in the gathered state's dtype, load it), for an fp32 and a bf16 gather, and the scoring itself
  (`lm_eval_scores` on the local `heldout_python_bpb` task, a BPE trained on it).

    python scripts/bench_eval.py --windows 1024,2048,8192 --docs 4 --models 128x4,512x8,1024x8 --limit 32
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--windows", default="1024,2048,8192")
    p.add_argument("--docs", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--models", default="", help="HIDDENxLAYERS,... for the lm-eval rows (empty: none)")
    p.add_argument("--limit", type=int, default=32, help="lm-eval documents")
    p.add_argument("--dtypes", default="float32,bfloat16", help="dtypes of the gathered state, for the lm-eval rows")
    p.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    p.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    p.add_argument("--model-worker", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def worker(window: int, docs: int, vocab: int) -> dict:
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pretrainer.evaluation.context import position_buckets, position_table

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=window,
    )
    model = LlamaForCausalLM(config).eval()
    rows = [np.random.default_rng(i).integers(0, vocab, window) for i in range(docs)]
    position_table(model, rows[:1], position_buckets(window), "cpu")  # warm-up
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    position_table(model, rows, position_buckets(window), "cpu")
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {
        "window": window,
        "docs": docs,
        "seconds": seconds,
        "tokens_per_s": window * docs / seconds,
        "peak_rss_mb": peak / 1024,
        "rss_growth_mb": (peak - base) / 1024,
        "logits_mb": window * vocab * 4 / 2**20,
    }


def model_worker(shape: str, vocab: int, limit: int, dtype: str) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pretrainer.data.tokenizer import train_bpe
    from pretrainer.evaluation.downstream import copy_holding, lm_eval_scores, task_manager

    hidden, layers = map(int, shape.split("x"))
    root = Path(__file__).resolve().parents[1] / "eval_tasks"
    texts = [json.loads(x)["text"] for x in (root / "heldout_python" / "text.jsonl").read_text().splitlines()]
    tokenizer = train_bpe(texts, vocab)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        max_position_embeddings=1024,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    # what `get_state_dict` hands the main process
    state = {k: v.to(getattr(torch, dtype)).clone() for k, v in model.state_dict().items()}
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    copy = copy_holding(model, state, "cpu")  # as `Downstream._scored_model` builds it
    copy_s = time.perf_counter() - t0
    copy_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
    manager = task_manager(["heldout_python_bpb"], str(root))
    t0 = time.perf_counter()
    lm_eval_scores(copy, tokenizer, ["heldout_python_bpb"], limit=limit, include_path=str(root), manager=manager)
    return {
        "shape": shape,
        "dtype": dtype,
        "params": sum(p.numel() for p in model.parameters()),
        "copy_s": copy_s,
        "copy_rss_mb": copy_mb,
        "score_s": time.perf_counter() - t0,
        "docs": limit,
    }


def run_worker(*args: str) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], check=True, capture_output=True, text=True).stdout
    return json.loads(out.splitlines()[-1])


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.docs, args.vocab)))
        return 0
    if args.model_worker:
        print(json.dumps(model_worker(args.model_worker, args.vocab, args.limit, args.dtype)))
        return 0
    rows = [
        run_worker("--worker", str(w), "--docs", str(args.docs), "--vocab", str(args.vocab))
        for w in map(int, args.windows.split(","))
    ]
    print(
        "| window | docs | seconds | tokens/s | peak RSS (MB) | growth past warm-up (MB) | one row's fp32 logits (MB) |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['window']:,} | {r['docs']} | {r['seconds']:.2f} | {r['tokens_per_s']:,.0f} | {r['peak_rss_mb']:,.0f} "
            f"| {r['rss_growth_mb']:,.0f} | {r['logits_mb']:,.0f} |"
        )
    models = [
        run_worker("--model-worker", m, "--vocab", str(args.vocab), "--limit", str(args.limit), "--dtype", d)
        for m in filter(None, args.models.split(","))
        for d in args.dtypes.split(",")
    ]
    if models:
        print(
            "\n| model | parameters | gathered dtype | main-process copy (s) | copy RSS (MB) | lm-eval scoring (s) "
            "| documents |"
        )
        print("|---|---|---|---|---|---|---|")
        for r in models:
            print(
                f"| {r['shape']} | {r['params'] / 1e6:.1f}M | {r['dtype']} | {r['copy_s']:.2f} | {r['copy_rss_mb']:,.0f} "
                f"| {r['score_s']:.2f} | {r['docs']} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
