"""Tokens per second the token files + mixture sampler deliver, per stage, on one core (no training).

python scripts/bench_data.py recipes/tiny.yaml --steps 200
"""

from __future__ import annotations

import argparse
import json
import time

from pretrainer.cli import run_main, script_parser


def parse_args(argv=None) -> argparse.Namespace:
    p = script_parser(__doc__)
    p.add_argument("--steps", type=int, default=200, help="optimizer steps of batches to build per stage")
    p.add_argument("--start", type=int, default=0, help="sample cursor to start from (e.g. 1000000000)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)

    def run() -> int:
        import torch

        from pretrainer.data.pipeline import StageBatches, get_tokenizer, load_sources
        from pretrainer.recipe.loading import load_recipe
        from pretrainer.recipe.stages import stage_spans

        torch.set_num_threads(1)
        recipe = load_recipe(args.recipe, args.overrides)
        sources = load_sources(recipe, get_tokenizer(recipe))
        for span in stage_spans(recipe):
            batches = StageBatches(recipe.stages[span.index], span, sources, recipe.run.seed)
            cursor, t0 = args.start, time.perf_counter()
            for _ in range(args.steps):
                _, cursor, _ = batches.step_batches(cursor, 0, 1)
            dt = time.perf_counter() - t0
            tokens = args.steps * span.tokens_per_step
            print(
                json.dumps(
                    {
                        "stage": span.name,
                        "seq_len": span.seq_len,
                        "tokens": tokens,
                        "seconds": round(dt, 4),
                        "tokens_per_s": round(tokens / dt),
                    }
                )
            )
        return 0

    return run_main(run, debug=args.debug)


if __name__ == "__main__":
    raise SystemExit(main())
