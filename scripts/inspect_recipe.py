"""Resolve a recipe without training: parameters, stages, LR at given steps.

python scripts/inspect_recipe.py recipes/1b_wsd.yaml --lr-at 500,1000,26000
python scripts/inspect_recipe.py recipes/1b_wsd.yaml --json
"""

from __future__ import annotations

import argparse
import json

from pretrainer.cli import run_main


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--lr-at", default="", help="comma-separated global steps")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--debug", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)

    def run() -> int:
        from pretrainer.errors import PretrainerError
        from pretrainer.recipe import load_recipe
        from pretrainer.summary import format_summary, summarize

        try:
            steps = [int(s) for s in args.lr_at.split(",") if s.strip()]
        except ValueError:
            raise PretrainerError(f"--lr-at: expected comma-separated integers, got {args.lr_at!r}") from None
        info = summarize(load_recipe(args.recipe, args.overrides), steps)
        print(json.dumps(info) if args.json else format_summary(info))
        return 0

    return run_main(run, debug=args.debug)


if __name__ == "__main__":
    raise SystemExit(main())
