"""Tokens/s, MFU, peak memory and data wait of the real trainer (`run_recipe.py`, through `Trainer`), one run per
variant, read from each run's own metrics.jsonl. Skips (exit 0) where no CUDA GPU is present, unless --cpu.

    python scripts/bench_gpu.py recipes/1b_wsd.yaml --steps 30 --peak-tflops 989     # H100/H200 SXM dense bf16

Variants: eager, compile (`model.compile`), liger (`model.kernels: liger`), compile+liger, masking
(`data.document_masking`, with flash attention where flash-attn is installed), fp8 (`precision.mixed: fp8`, where the
GPU has fp8 tensor cores). A variant that cannot run here (liger-kernel not installed...) is reported with its error,
and the others go on.

Offline by default: the recipe's sources become the local Python standard library and its tokenizer one trained on
it (cached, the recipe's vocabulary size), one stage of --steps at the first stage's seq_len and micro batch; with
--recipe-data the recipe's own (prepared) data is used. The first logged window (compilation, warm-up) is dropped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from pretrainer.cli import run_main, script_parser

VARIANTS = {  # every variant says compile on or off: the GPU recipes compile by default
    "eager": ["model.compile=false"],
    "compile": ["model.compile=true"],
    "liger": ["model.compile=false", "model.kernels=liger"],
    "compile+liger": ["model.compile=true", "model.kernels=liger"],
    "masking": ["model.compile=true", "data.document_masking=true"],
    "fp8": ["model.compile=true", "precision.mixed=fp8"],
}


def parse_args(argv=None) -> argparse.Namespace:
    p = script_parser(__doc__, recipe="recipes/1b_wsd.yaml")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="the GPU's dense bf16 peak, for MFU")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per variant")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {','.join(VARIANTS)}")
    p.add_argument("--recipe-data", action="store_true", help="use the recipe's own (prepared) data and tokenizer")
    p.add_argument("--work-dir", type=Path, default=Path("runs/bench_gpu"))
    p.add_argument("--timeout", type=int, default=900, help="seconds per variant")
    p.add_argument("--cpu", action="store_true", help="run even without a GPU (a smoke test of the plumbing)")
    p.add_argument("--out", help="also write the JSON result here")
    return p.parse_args(argv)


def overrides(args, recipe) -> list[str]:
    """The --set list every variant shares: one short stage, metrics every few steps, no periodic eval or saves."""
    stage = recipe.stages[0]
    seq_len = stage.seq_len
    every = max(1, args.steps // 6)
    out = [
        f"logging.every_steps={every}",
        f"logging.peak_tflops={args.peak_tflops}",
        "eval.every_steps=0",
        "checkpoint.every_minutes=null",
        "checkpoint.at_stage_end=false",
        "spikes.enabled=false",
        "logging.report_to=[]",
        "schedule.decay_stage=null",
        "schedule.warmup_steps=0",
    ]
    if args.recipe_data:
        mixture = json.dumps(stage.mixture)
    else:
        vocab = recipe.model.config.get("vocab_size", 32000)
        out += [
            'data.sources={stdlib: {type: python_stdlib, include: ["**/*.py"]}}',
            "tokenizer.path=null",
            f"tokenizer.train={{vocab_size: {vocab}}}",
        ]
        mixture = "{stdlib: 1.0}"
    out.append(f"stages=[{{name: bench, steps: {args.steps}, seq_len: {seq_len}, mixture: {mixture}}}]")
    return out


def summarize(run_dir: Path) -> dict:
    """Medians over the logged windows after the first (warm-up, compilation)."""
    from pretrainer.observe.tracking import read_jsonl

    rows = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "tokens_per_s" in m][1:]
    if not rows:
        return {"error": "no metrics after the first window (raise --steps)"}

    def med(key):
        vals = [r[key] for r in rows if isinstance(r.get(key), int | float)]
        return statistics.median(vals) if vals else None

    peak = [r["mem/peak_gb"] for r in rows if "mem/peak_gb" in r]
    return {
        "tokens_per_s": med("tokens_per_s"),
        "mfu": med("mfu"),
        "data_wait": med("data_wait"),
        "peak_memory_gb": max(peak) if peak else None,
        "windows": len(rows),
    }


def run_variant(args, name: str, shared: list[str]) -> dict:
    out = args.work_dir / name.replace("+", "_")
    extra = list(VARIANTS[name])
    if name == "masking":
        try:
            import flash_attn  # noqa: F401

            extra.append("model.attn_implementation=flash_attention_2")
        except ImportError:
            pass  # sdpa with a [B, 1, T, T] mask: measured as it is
    cmd = [
        sys.executable,
        str(Path(__file__).with_name("run_recipe.py")),
        args.recipe,
        "--output-dir",
        str(out),
        "--overwrite",
        *(x for s in [*shared, *args.overrides, *extra] for x in ("--set", s)),
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"variant": name, "error": f"timed out after {args.timeout} s"}
    if proc.returncode != 0:
        lines = [x for x in proc.stderr.strip().splitlines() if x.strip()]
        return {"variant": name, "error": (lines or [f"exit {proc.returncode}"])[-1][:300]}
    return {"variant": name, "overrides": extra, **summarize(out)}


def main(argv=None) -> int:
    args = parse_args(argv)

    def run() -> int:
        import torch

        from pretrainer.errors import PretrainerError
        from pretrainer.recipe.loading import load_recipe

        if not torch.cuda.is_available() and not args.cpu:
            print("bench_gpu: no CUDA GPU here; skipped")
            return 0
        names = [v.strip() for v in args.variants.split(",") if v.strip()]
        if unknown := [v for v in names if v not in VARIANTS]:
            raise PretrainerError(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
        recipe = load_recipe(args.recipe, args.overrides)
        shared = overrides(args, recipe)
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        out = {
            "gpu": gpu,
            "torch": torch.__version__,
            "peak_tflops": args.peak_tflops,
            "recipe": args.recipe,
            "steps": args.steps,
            "variants": [],
        }
        for name in names:
            result = run_variant(args, name, shared)
            out["variants"].append(result)
            print(json.dumps(result), flush=True)
        text = json.dumps(out, indent=1)
        if args.out:
            Path(args.out).write_text(text)
        print("\n| variant | tokens/s | MFU | peak memory | data wait |\n|---|---|---|---|---|")
        for v in out["variants"]:
            if "error" in v:
                print(f"| {v['variant']} | not run: {v['error']} | | | |")
            else:
                mfu = f"{v['mfu']:.1%}" if v["mfu"] is not None else "n/a"
                mem = f"{v['peak_memory_gb']:.1f} GB" if v["peak_memory_gb"] is not None else "n/a"
                print(f"| {v['variant']} | {v['tokens_per_s']:,.0f} | {mfu} | {mem} | {v['data_wait']:.1%} |")
        return 0

    return run_main(run, debug=args.debug)


if __name__ == "__main__":
    raise SystemExit(main())
