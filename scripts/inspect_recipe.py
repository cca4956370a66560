"""Resolve a recipe without training: parameters, stages, LR at given steps, tokens drawn vs. prepared per source,
and with --gpus the wall time and each sharding option's memory per GPU and communication per step.

python scripts/inspect_recipe.py recipes/1b_wsd.yaml --lr-at 500,1000,26000
python scripts/inspect_recipe.py recipes/1b_wsd.yaml --gpus 8 --sharding zero3 --gpu-memory 80
python scripts/inspect_recipe.py recipes/1b_wsd.yaml --json
"""

from __future__ import annotations

import argparse

from pretrainer.cli import emit_json, output_file, run_main, script_parser


def parse_args(argv=None) -> argparse.Namespace:
    p = script_parser(__doc__)
    p.add_argument("--lr-at", default="", help="comma-separated global steps")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", metavar="PNG", help="LR over the run with stages, seq_len, RoPE and tokens annotated")
    p.add_argument("--strict", action="store_true", help="lint findings are errors")
    p.add_argument(
        "--check-model",
        action="store_true",
        help="also build model.config through transformers on the meta device, as a launch does (seconds of imports; "
        "automatic for a model type whose size is not computed from the config alone)",
    )
    p.add_argument("--gpus", type=int, help="estimate wall time and memory per GPU on this many GPUs")
    p.add_argument("--gpu-memory", type=float, default=80.0, help="GiB per GPU (default 80: H100; H200: 141)")
    p.add_argument(
        "--sharding",
        choices=("ddp", "zero1", "zero2", "zero3", "fsdp2"),
        help="the launch's sharding, judged by the linter (PT020: will not fit, PT021: shards more than needed)",
    )
    p.add_argument("--mfu", type=float, default=0.4, help="assumed model FLOPs utilization (default 0.4)")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak per GPU (H100/H200 SXM: 989)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)

    def run() -> int:
        from pretrainer.analysis.summary import (
            estimate_wall_time,
            format_summary,
            model_shape,
            sharding_summary,
            summarize,
        )
        from pretrainer.data.sources import prepared_tokens
        from pretrainer.errors import PretrainerError
        from pretrainer.recipe.loading import load_recipe

        try:
            steps = [int(s) for s in args.lr_at.split(",") if s.strip()]
        except ValueError:
            raise PretrainerError(f"--lr-at: expected comma-separated integers, got {args.lr_at!r}") from None
        output_file(args.plot, "--plot")
        if args.gpus is not None and args.gpus < 1:
            raise PretrainerError(f"--gpus: a GPU count of at least 1, not {args.gpus}")
        for flag, value, top in (("--mfu", args.mfu, 1.0), ("--gpu-memory", args.gpu_memory, None)):
            if not (value > 0 and (top is None or value <= top) and value != float("inf")):
                raise PretrainerError(f"{flag}: a positive number{' up to 1' if top else ''}, not {value}")
        if not 0 < args.peak_tflops < float("inf"):
            raise PretrainerError(f"--peak-tflops: a positive number, not {args.peak_tflops}")
        recipe = load_recipe(args.recipe, args.overrides, check_model=False)
        if outside := [s for s in steps if not 0 <= s < recipe.plan.total_steps]:
            raise PretrainerError(f"--lr-at: step {outside[0]} is outside the run (0..{recipe.plan.total_steps - 1})")
        if args.check_model or model_shape(recipe)[0] is None:
            recipe = load_recipe(args.recipe, args.overrides)
        info = summarize(recipe, steps, available=prepared_tokens(recipe))
        if args.gpus:
            try:  # the launch would stop on it: refuse before the estimate, not after the job is queued
                info["grad_accum"] = recipe.plan.grad_accum(args.gpus)
            except PretrainerError as e:
                raise PretrainerError(f"--gpus {args.gpus}: {e}") from None
            info["wall_time"] = estimate_wall_time(info["total_flops"], args.gpus, args.mfu, args.peak_tflops)
            info["sharding"] = sharding_summary(recipe, args.gpus, args.gpu_memory, args.sharding)
            info["findings"] += info["sharding"].pop("findings")
        elif args.sharding:
            raise PretrainerError("--sharding: give --gpus too (the sharding is judged at a GPU count)")
        if args.plot:
            from pretrainer.analysis.plots import plot_schedule

            plot_schedule(recipe, info, args.plot)
        emit_json(info) if args.json else print(format_summary(info))
        if args.strict and info["findings"]:
            raise PretrainerError(f"{args.recipe}: {len(info['findings'])} lint finding(s) under --strict")
        return 0

    return run_main(run, debug=args.debug, json_out=args.json)


if __name__ == "__main__":
    raise SystemExit(main())
