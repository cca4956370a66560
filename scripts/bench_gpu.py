"""Tokens/s and MFU of the 1B recipe's model on one NVIDIA GPU, bf16 autocast, with and without torch.compile, at
the recipe's micro batch and seq_len. Skips (exit 0) where no CUDA GPU is present.

    python scripts/bench_gpu.py recipes/1b_wsd.yaml --peak-tflops 989      # H100/H200 SXM dense bf16

MFU = tokens/s x FLOPs/token / peak, with FLOPs/token = 6N + 12*L*H*Q*T (N: non-embedding parameters plus the LM
head). The step is the trainer's: autocast forward, backward, clip at the recipe's norm, fused AdamW step.
"""

from __future__ import annotations

import argparse
import json

from pretrainer.cli import run_main, script_parser


def parse_args(argv=None) -> argparse.Namespace:
    p = script_parser(__doc__, recipe="recipes/1b_wsd.yaml")
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--steps", type=int, default=10, help="measured steps per variant")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile variant")
    p.add_argument("--out", help="also write the JSON result here")
    return p.parse_args(argv)


def measure(recipe, compiled: bool, steps: int, warmup: int, peak_tflops: float) -> dict:
    import time

    import torch

    from pretrainer.model import build_config, build_model, flops_per_token, non_embedding_params
    from pretrainer.stages import stage_spans

    span = stage_spans(recipe)[0]
    config = build_config(recipe.model)
    torch.manual_seed(0)
    model = build_model(recipe.model, config).cuda()
    n_non_emb = non_embedding_params(model)
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.optimizer.lr, betas=recipe.optimizer.betas, fused=True)
    fwd = torch.compile(model) if compiled else model
    batch = torch.randint(0, config.vocab_size, (span.micro_batch_size, span.seq_len), device="cuda")
    max_norm = recipe.clipping.max_grad_norm or float("inf")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fwd(input_ids=batch, labels=batch, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / steps
    tokens = span.micro_batch_size * span.seq_len
    fpt = flops_per_token(config, n_non_emb, span.seq_len)
    tps = tokens / dt
    result = {
        "compiled": compiled, "micro_batch": span.micro_batch_size, "seq_len": span.seq_len, "step_s": dt,
        "tokens_per_s": tps, "flops_per_token": fpt, "tflops": tps * fpt / 1e12, "mfu": tps * fpt / (peak_tflops * 1e12),
        "max_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
    }  # fmt: skip
    return result  # model and optimizer go out of scope here; main() frees their memory before the next variant


def main(argv=None) -> int:
    args = parse_args(argv)

    def run() -> int:
        import torch

        if not torch.cuda.is_available():
            print("bench_gpu: no CUDA GPU here; skipped")
            return 0
        from pretrainer.recipe import load_recipe

        recipe = load_recipe(args.recipe, args.overrides)
        out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "peak_tflops": args.peak_tflops,
               "variants": [measure(recipe, False, args.steps, args.warmup, args.peak_tflops)]}  # fmt: skip
        if not args.no_compile:
            import gc

            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            out["variants"].append(measure(recipe, True, args.steps, args.warmup + 2, args.peak_tflops))
        text = json.dumps(out, indent=1)
        print(text)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text)
        return 0

    return run_main(run, debug=args.debug)


if __name__ == "__main__":
    raise SystemExit(main())
