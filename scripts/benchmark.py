"""Benchmarks: step time versus a plain PyTorch loop and the HF Trainer (same model, data, optimizer, precision and
threads, interleaved), data headroom, checkpoint stall, resume cost. Writes docs/benchmarks.json and
docs/BENCHMARKS.md.

    make bench          (= python scripts/benchmark.py recipes/tiny.yaml)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from pretrainer.cli import run_main, script_parser


def parse_args(argv=None) -> argparse.Namespace:
    p = script_parser(__doc__, recipe="recipes/tiny.yaml")
    p.add_argument("--rounds", type=int, default=8, help="measured rounds after one warm-up round")
    p.add_argument("--chunk", type=int, default=5, help="optimizer steps per framework per round")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--json-out", default="docs/benchmarks.json")
    p.add_argument("--md-out", default="docs/BENCHMARKS.md")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)

    def run() -> int:
        import torch
        from benchkit.harness import run_all
        from benchkit.report import environment, machine_speed, speed_line, write_markdown

        torch.set_num_threads(args.threads)
        before = machine_speed()
        with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
            result = run_all(args.recipe, args.rounds, args.chunk, args.threads, tmp, args.overrides)
        result["machine_speed"] = {"before": before, "after": machine_speed()}
        result["environment"] = environment()
        result["command"] = "python scripts/benchmark.py " + " ".join(sys.argv[1:] if argv is None else argv)
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)
        write_markdown(result, args.md_out)
        keys = ("step_time", "data", "checkpoint_stall", "resume", "machine_speed")
        print(json.dumps({k: result[k] for k in keys}, indent=1))
        print(speed_line(result))
        return 0

    return run_main(run, debug=args.debug)


if __name__ == "__main__":
    raise SystemExit(main())
