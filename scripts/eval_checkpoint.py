"""Evaluate an HF model directory (a run's `final/`, an export, any other project's model) or one of our checkpoints:
loss by position and the context verdict, and downstream tasks through lm-evaluation-harness. Run it in its own
process, beside or after training.

    python scripts/eval_checkpoint.py runs/tiny/final --context
    python scripts/eval_checkpoint.py runs/tiny/checkpoints/step_00000220 --tasks heldout_python_bpb \\
        --include-path eval_tasks
    python scripts/eval_checkpoint.py other/model --context --text some/long/files --json

Held-out documents for --context: the run's own recipe when MODEL is inside a run directory, else --recipe or --text.
"""

from __future__ import annotations

import argparse
import json

from pretrainer.cli import emit_json, run_main, script_parser


def parse_args(argv=None) -> argparse.Namespace:
    p = script_parser(__doc__, recipe=False)
    p.add_argument("model", help="an HF model directory or a checkpoint directory (checkpoints/step_N)")
    p.add_argument("--context", action="store_true", help="loss by position and the context verdict")
    p.add_argument("--recipe", help="read held-out documents from this recipe's validation split")
    p.add_argument("--text", nargs="+", help="read held-out documents from these files or directories instead")
    p.add_argument("--window", type=int, help="positions to measure (default: the model's max_position_embeddings)")
    p.add_argument("--max-docs", type=int, default=16)
    p.add_argument("--first-bucket", type=int, default=256)
    p.add_argument("--tasks", nargs="+", default=[], help="lm-eval task names")
    p.add_argument("--include-path", help="a folder of local lm-eval task YAMLs (e.g. eval_tasks)")
    p.add_argument("--limit", type=int, help="documents per task")
    p.add_argument("--num-fewshot", type=int)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", help="also write the JSON object to this file")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)

    def run() -> int:
        from pathlib import Path

        from pretrainer.errors import PretrainerError
        from pretrainer.evaluation.downstream import lm_eval_scores
        from pretrainer.evaluation.offline import context_report, file_texts, loaded_model, recipe_texts, run_recipe_of
        from pretrainer.noise import quiet_bars_in_files

        if not (args.context or args.tasks):
            raise PretrainerError("nothing to do: give --context and/or --tasks")
        if not Path(args.model).is_dir():
            raise PretrainerError(f"{args.model}: not a model or checkpoint directory")
        out: dict = {"model": args.model}
        quiet_bars_in_files()  # transformers' weight-loading bar, in a file, is a line of carriage returns
        with loaded_model(args.model, args.device, args.dtype) as (model, tokenizer, _):
            if args.context:
                recipe = args.recipe or (None if args.text else run_recipe_of(Path(args.model).resolve()))
                if not (recipe or args.text):
                    raise PretrainerError(f"{args.model}: not inside a run directory; give --recipe or --text")
                texts = file_texts(args.text) if args.text else recipe_texts(recipe)
                out["context"] = context_report(model, tokenizer, texts, args.max_docs, args.first_bucket, args.window)
            if args.tasks:
                out["scores"] = lm_eval_scores(
                    model, tokenizer, args.tasks, args.limit, args.num_fewshot, args.include_path, args.batch_size
                )
        if args.out:
            Path(args.out).write_text(json.dumps(out, indent=1))
        emit_json(out) if args.json else print(format_result(out))
        return 0

    return run_main(run, debug=args.debug, json_out=args.json)


def format_result(out: dict) -> str:
    lines = [f"model: {out['model']}"]
    if c := out.get("context"):
        lines.append(f"context: {c['verdict']} ({c['docs']} documents of {c['window']:,} tokens)")
        lines += [
            f"  positions {b['lo']:>6,}-{b['hi']:<6,} loss {b['loss']:.4f} ± {b['se']:.4f}" for b in c["buckets"]
        ]
    for k, v in (out.get("scores") or {}).items():
        lines.append(f"{k}: {v:.4f}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
