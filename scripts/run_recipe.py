"""Train a recipe.

    python scripts/run_recipe.py recipes/tiny.yaml
    accelerate launch --config_file accelerate_configs/zero1.yaml scripts/run_recipe.py recipes/1b_wsd.yaml \
        --set run.name=my-exp --output-dir runs/my-exp
    python scripts/run_recipe.py recipes/tiny.yaml --resume auto         # continue after a crash or preemption
    python scripts/run_recipe.py recipes/tiny.yaml --branch-decay-from runs/tiny/checkpoints/step_00000150 \
        --decay-steps 20 --output-dir runs/tiny-decay                   # WSD: a decay branched off the stable phase
                                      # (into a new directory; add --resume auto to continue it after a stop)

Exit codes: 0 done; 2 bad input; 74 a checkpoint could not be written; 75 preempted (SIGTERM/SIGINT) after saving
a checkpoint: run again with --resume auto.
"""

from __future__ import annotations

import argparse
from functools import partial

from pretrainer.cli import run_main, script_parser
from pretrainer.train.launcher import record_exit


def parse_args(argv=None) -> argparse.Namespace:
    p = script_parser(__doc__)
    p.add_argument("--output-dir", help="run directory (default: run.output_dir or runs/<run.name>)")
    p.add_argument(
        "--resume",
        default="none",
        metavar="auto|PATH|none",
        help="auto: the newest checkpoint in the output dir that verifies; PATH: that checkpoint",
    )
    p.add_argument(
        "--allow-recipe-change",
        action="store_true",
        help="resume even though the recipe differs from the checkpoint's (the differences are logged)",
    )
    p.add_argument(
        "--allow-data-change",
        action="store_true",
        help="resume even though a source's prepared data (its files' content, or the tokenizer) differs from the "
        "checkpoint's (the differences are logged)",
    )
    p.add_argument(
        "--verify",
        choices=["fast", "deep"],
        default="fast",
        help="how a checkpoint is checked before resuming or rolling back to it: fast (sizes and hashes, each rank "
        "its share; NaN/Inf was checked on the live state at the save) or deep (also read every tensor back)",
    )
    p.add_argument(
        "--branch-decay-from",
        metavar="CHECKPOINT",
        help="WSD: run a decay of --decay-steps from this stable-phase checkpoint into --output-dir",
    )
    p.add_argument("--decay-steps", type=int, help="length of the branched decay, in steps")
    p.add_argument("--overwrite", action="store_true", help="start over in an output dir that holds a run")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)

    def run() -> int:
        from pretrainer.publishing.hub import publish_run
        from pretrainer.recipe.loading import load_recipe
        from pretrainer.train.trainer import Trainer

        recipe = load_recipe(args.recipe, args.overrides)
        resume, allow, branch = args.resume, args.allow_recipe_change, False
        if args.branch_decay_from:
            from pathlib import Path

            from pretrainer.checkpoint import list_checkpoints, read_meta
            from pretrainer.errors import PretrainerError
            from pretrainer.recipe.stages import BRANCH_CHANGES, branch_decay_recipe

            if not args.decay_steps or not args.output_dir:
                raise PretrainerError("--branch-decay-from needs --decay-steps N and a new --output-dir")
            if args.decay_steps < 1:
                raise PretrainerError(f"--decay-steps: a decay of at least 1 step, not {args.decay_steps}")
            recipe = branch_decay_recipe(recipe, read_meta(args.branch_decay_from)["step"], args.decay_steps)
            allow = args.allow_recipe_change or BRANCH_CHANGES
            # --resume auto continues the branch's own run where it has a checkpoint; else the branch starts
            if not (args.resume == "auto" and list_checkpoints(Path(args.output_dir) / "checkpoints")):
                resume, branch = args.branch_decay_from, True
        trainer = Trainer(
            recipe,
            args.output_dir,
            args.overwrite,
            resume=resume,
            allow_recipe_change=allow,
            allow_data_change=args.allow_data_change,
            deep_verify=args.verify == "deep",
            branch=branch,
            job_type="branch" if args.branch_decay_from else "train",
        )
        trainer.train(after=partial(publish_run, recipe.publish) if recipe.publish.repo else None)
        return 0

    code = run_main(run, debug=args.debug)
    record_exit(code)  # under scripts/launch.py: the wrapper exits with the ranks' code, not the launcher's
    return code


if __name__ == "__main__":
    raise SystemExit(main())
