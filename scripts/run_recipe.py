"""Train a recipe.

    python scripts/run_recipe.py recipes/tiny.yaml
    accelerate launch --config_file accelerate_configs/zero3.yaml scripts/run_recipe.py recipes/1b_wsd.yaml \
        --set run.name=my-exp --output-dir runs/my-exp
"""

from __future__ import annotations

import argparse

from pretrainer.cli import run_main


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", help="recipe YAML file")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a recipe field, value parsed as YAML (repeatable)",
    )
    p.add_argument("--output-dir", help="run directory (default: run.output_dir or runs/<run.name>)")
    p.add_argument("--overwrite", action="store_true", help="start over in an output dir that holds a run")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)

    def run() -> int:
        from pretrainer.recipe import load_recipe
        from pretrainer.trainer import Trainer

        recipe = load_recipe(args.recipe, args.overrides)
        Trainer(recipe, output_dir=args.output_dir, overwrite=args.overwrite).train()
        return 0

    return run_main(run, debug=args.debug)


if __name__ == "__main__":
    raise SystemExit(main())
