"""Tokenize every source of a recipe into token files, on datatrove's executors (resumable, idempotent).

    python scripts/prepare_data.py recipes/tiny.yaml --workers 2
    python scripts/prepare_data.py recipes/1b_wsd.yaml --executor slurm --tasks 256 --slurm partition=cpu

Each source is one datatrove pipeline (reader -> tokenizer -> one pair of train/val token files per input file).
Re-running skips finished sources and, in an interrupted source, finished input files. With `--executor slurm` the
jobs are submitted and the command returns; run it again once they finish, and it writes the manifests.
"""

from __future__ import annotations

import argparse
import json
import os

from pretrainer.cli import run_main, script_parser


def parse_args(argv=None) -> argparse.Namespace:
    p = script_parser(__doc__)
    p.add_argument(
        "--executor",
        choices=["local", "slurm", "inline"],
        default="local",
        help="datatrove executor: local processes (default), Slurm jobs, or this process",
    )
    p.add_argument("--tasks", type=int, help="datatrove tasks per source (default: one per input file)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tasks run at once (local executor)")
    p.add_argument(
        "--slurm",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a SlurmPipelineExecutor setting, e.g. partition=cpu, time=12:00:00, cpus_per_task=4",
    )
    return p.parse_args(argv)


def _slurm_settings(pairs: list[str]) -> dict:
    from pretrainer.errors import PretrainerError

    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise PretrainerError(f"--slurm: expected KEY=VALUE, got {pair!r}")
        out[key] = int(value) if value.isdigit() else value
    return out


def main(argv=None) -> int:
    args = parse_args(argv)

    def run() -> int:
        from pretrainer.data.pipeline import get_tokenizer, source_dir
        from pretrainer.data.prepare import prepare_source
        from pretrainer.data.sources import used_sources
        from pretrainer.recipe.loading import load_recipe

        recipe = load_recipe(args.recipe, args.overrides)
        slurm = _slurm_settings(args.slurm)
        tokenizer = get_tokenizer(recipe)
        pending = 0
        for name in used_sources(recipe):
            out = source_dir(recipe, name, tokenizer)
            src = recipe.data.sources[name]
            m = prepare_source(
                name,
                src,
                tokenizer,
                out,
                recipe.data.validation_fraction,
                args.executor,
                args.tasks,
                args.workers,
                slurm,
            )
            if m is None:
                pending += 1
                print(json.dumps({"source": name, "dir": str(out), "status": "submitted"}))
                continue
            keys = ("files", "docs", "tokens", "train_tokens", "val_tokens", "seconds")
            print(json.dumps({"source": name, "dir": str(out), **{k: m[k] for k in keys}}))
        if pending:
            print(f"{pending} source(s) still running on Slurm: run this command again once the jobs finish")
        return 0

    return run_main(run, debug=args.debug)


if __name__ == "__main__":
    raise SystemExit(main())
