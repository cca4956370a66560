"""Measure the critical batch size at a checkpoint: short branches at k times the run's batch (the LR by the
recipe's `batch.lr_scaling`), the same tokens each, compared on the fixed held-out batches. Prints the estimate with
its 90% interval and a `batch.schedule` override to grow the batch to it.

    python scripts/critical_batch.py runs/tiny/checkpoints/step_00000150 --factors 1 2 4 --tokens 131072
    python scripts/critical_batch.py RUN/checkpoints/step_N --json        # cbs_tokens, lo, hi, suggested

The branches go to --out (default: RUN/critical_batch/step_N/x<k>), the parent run is only read; the result is
appended to RUN/critical_batch.jsonl, which check_run.py reports. The recipe is the run's recipe.resolved.yaml with
the --set overrides (the branches log to no tracker unless one is set).
"""

from __future__ import annotations

import argparse

from pretrainer.cli import add_overrides, emit_json, run_main, script_parser


def parse_args(argv=None) -> argparse.Namespace:
    p = script_parser(__doc__, recipe=False)
    p.add_argument("checkpoint", help="a checkpoint directory of the run (RUN/checkpoints/step_N)")
    add_overrides(p, "a field of the run's recipe")
    p.add_argument("--factors", type=int, nargs="+", default=[1, 2, 4, 8], help="batch multiples to branch")
    p.add_argument("--tokens", type=int, help="tokens per branch (default: 16 steps at the largest size)")
    p.add_argument("--tolerance", type=float, default=0.01, help="relative loss within which a size passes")
    p.add_argument("--out", help="where the branches go (default: RUN/critical_batch/step_N)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)

    def run() -> int:
        from pathlib import Path

        from pretrainer.errors import PretrainerError
        from pretrainer.recipe.loading import load_recipe
        from pretrainer.train.batch_branches import format_result, measure, record

        ckpt = Path(args.checkpoint)
        run_dir = ckpt.parent.parent
        resolved = run_dir / "recipe.resolved.yaml"
        if not (ckpt / "meta.json").exists() or not resolved.exists():
            raise PretrainerError(f"{ckpt}: not a checkpoint of a run directory (RUN/checkpoints/step_N)")
        recipe = load_recipe(resolved, ["logging.report_to=[]", *args.overrides], check_model=False)
        out = Path(args.out) if args.out else run_dir / "critical_batch" / ckpt.name
        result, main = measure(ckpt, recipe, out, args.factors, args.tokens, args.tolerance)
        if main:  # every rank has the result; one writes and prints it
            record(result, run_dir, out)
            emit_json(result) if args.json else print("\n".join(format_result(result)))
        return 0

    return run_main(run, debug=args.debug, json_out=args.json)


if __name__ == "__main__":
    raise SystemExit(main())
