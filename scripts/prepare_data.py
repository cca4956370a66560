"""Tokenize every source of a recipe once into memory-mapped token files (resumable, idempotent, parallel).

    python scripts/prepare_data.py recipes/tiny.yaml --workers 2

The trainer then memory-maps these files instead of tokenizing at start-up. Re-running skips finished sources
and, for an interrupted source, finished shards.
"""

from __future__ import annotations

import argparse
import json
import os

from pretrainer.cli import run_main, script_parser


def parse_args(argv=None) -> argparse.Namespace:
    p = script_parser(__doc__)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizer processes")
    p.add_argument("--shard-docs", type=int, default=2000, help="documents per shard (the unit of resumption)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)

    def run() -> int:
        from pretrainer.data.pipeline import get_tokenizer, source_dir, used_sources
        from pretrainer.data.shards import prepare_source
        from pretrainer.data.sources import iter_documents
        from pretrainer.recipe import load_recipe

        recipe = load_recipe(args.recipe, args.overrides)
        tokenizer = get_tokenizer(recipe)
        for name in used_sources(recipe):
            out = source_dir(recipe, name, tokenizer)
            if (out / "manifest.json").exists():
                print(f"{name}: already prepared in {out}")
                continue
            docs = iter_documents(name, recipe.data.sources[name])
            m = prepare_source(
                name, docs, tokenizer, out, recipe.data.validation_fraction, args.workers, args.shard_docs, True
            )
            print(json.dumps({"source": name, "dir": str(out), **m}))
        return 0

    return run_main(run, debug=args.debug)


if __name__ == "__main__":
    raise SystemExit(main())
