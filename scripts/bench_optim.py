"""Muon against the shipped AdamW on the tiny recipe (val/ref at equal tokens, an LR sweep for each), and the
optimizer step's cost at three model sizes. Numbers for docs/BENCHMARKS.md, not a timed test.

    python scripts/bench_optim.py --out runs/bench_optim                      (about 20 minutes on 2 CPU cores)
    python scripts/bench_optim.py --cost-only                                 (the step-time table alone)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pretrainer.analysis.runfiles import load_run
from pretrainer.recipe.sections import OptimizerSection
from pretrainer.train.optim import build_optimizer

ROOT = Path(__file__).resolve().parents[1]
FAST = ["eval.context.enabled=false", "eval.lm_eval=null", "logging.report_to=[]", "checkpoint.every_minutes=null"]
RUNS = {
    "adamw lr 3e-3 (shipped)": [],
    "adamw lr 6e-3": ["optimizer.lr=6e-3"],
    "muon lr 3e-3": ["optimizer.type=muon"],
    "muon lr 6e-3": ["optimizer.type=muon", "optimizer.lr=6e-3"],
}
SIZES = {"1.3M (tiny)": (128, 4, 4096), "4M": (256, 4, 4096), "11M": (384, 6, 8192)}


def curve(run_dir: Path) -> list[tuple[int, float]]:
    return [(m["step"], m["val/ref"]) for m in load_run(run_dir).evals if "val/ref" in m]


def train(out: Path, sets: list[str]) -> Path:
    if not (out / "final").exists():
        cmd = [sys.executable, str(ROOT / "scripts/run_recipe.py"), "recipes/tiny.yaml", "--output-dir", str(out)]
        for s in FAST + sets:
            cmd += ["--set", s]
        subprocess.run(
            cmd + ["--overwrite"], check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
    return out


def step_cost(kind: str, hidden: int, layers: int, vocab: int, repeats: int = 3) -> float:
    """Median seconds of one optimizer step (gradients already in place) on a Llama of this size."""
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128),
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt, _, _ = build_optimizer(model, OptimizerSection(type=kind, lr=1e-3))
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    times = sorted(times[1:])
    return times[len(times) // 2]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("runs/bench_optim"))
    p.add_argument("--cost-only", action="store_true")
    p.add_argument("--runs-only", action="store_true", help="skip the step-time table")
    a = p.parse_args(argv)
    res: dict = {"cost": {}}
    for name, (hidden, layers, vocab) in ({} if a.runs_only else SIZES).items():
        adam, muon = step_cost("adamw", hidden, layers, vocab), step_cost("muon", hidden, layers, vocab)
        res["cost"][name] = {"adamw_s": round(adam, 5), "muon_s": round(muon, 5), "ratio": round(muon / adam, 2)}
        print(name, res["cost"][name], flush=True)
    if not a.cost_only:
        res["runs"] = {}
        for name, sets in RUNS.items():
            c = curve(train(a.out / name.split(" (")[0].replace(" ", "_"), sets))
            res["runs"][name] = {"final": c[-1][1], "curve": c}
            print(name, "final val/ref", round(c[-1][1], 4), flush=True)
    print(json.dumps(res, indent=1))
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "results.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
