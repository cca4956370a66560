"""The forecast against real runs (numbers for docs/BENCHMARKS.md, not a timed test): micro-recipe runs under
constant, cosine and WSD schedules, a 5% branch decay, the tiny recipe from its half-way point, the band's coverage
over many cut points, slow LR drifts, and the fitter's cost at three sizes.

    python scripts/bench_forecast.py --steps 600 --out runs/bench_forecast      (about 15 minutes on 2 CPU cores)
    python scripts/bench_forecast.py --runs /tmp/jcorpus/seed_0 ...             (more curves for the coverage)

1. Cosine seeds fitted on their first half: alone, and with an earlier run of the recipe (the WSD run) as the
   calibration of the decay gain.
2. The constant run's stable phase to step 450 plus a branch decay of 5% of the steps (`val/ref` every 3 steps in
   the branch): the WSD run's final `val/ref`.
3. The tiny recipe fitted at its 50% point (its `val/ref` evals, its per-step training loss, a 5% branch decay from
   that checkpoint): the final `val/ref`.
4. Coverage: every healthy run (this bench's and `--runs`) cut at 30-90% of its steps, the final forecast from each
   cut, alone and with a sibling run (same recipe, another seed) as calibration; and each run's per-step training
   loss written as a `step,lr,loss` CSV and forecast the same way. A forecast with an identified decay gain, or with
   no decay ahead, claims a two-sided 90% band; a stable-phase-only forecast before a decay claims an upper estimate.
5. Drifts (`debug.inject.lr_drift`): the first eval at which the check says off track, the first at which the trend
   verdicts leave `healthy`, what `check_run.py` says at the end; and healthy runs: never off track.
6. Cost: fit + final forecast on 10,000 points of a cosine run of 10^4, 10^5 and 10^6 steps, and the schedule's
   handling alone (LR array, areas, the multi-power law's groups) at the same sizes.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from pretrainer.analysis.forecast import Curve, fit, predict
from pretrainer.analysis.laws import LAWS, LawFit, basis
from pretrainer.analysis.outlook import (
    MIN_POINTS,
    calibration_curve,
    csv_curve,
    forecast_report,
    outlook,
    run_curve,
    run_recipe,
    train_curve,
)
from pretrainer.analysis.runfiles import load_run
from pretrainer.analysis.verdicts import verdict
from pretrainer.recipe.schedules import cosine_array

ROOT = Path(__file__).resolve().parents[1]
SCHEDULES = {
    "const": ["schedule.type=wsd", "schedule.min_lr_ratio=1.0"],
    "cosine": ["schedule.type=cosine", "schedule.min_lr_ratio=0.0"],
    "wsd": [
        "schedule.type=wsd",
        "schedule.decay_fraction=0.2",
        "schedule.decay_shape=1-sqrt",
        "schedule.min_lr_ratio=0",
    ],
}
CUTS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def train(out: Path, steps: int, every: int, extra: list[str], seed: int = 1234, branch: tuple | None = None) -> Path:
    if (out / "final").exists():
        return out
    args = [sys.executable, str(ROOT / "scripts/run_recipe.py"), "tests/fixtures/micro.yaml", "--output-dir", str(out)]
    sets = [
        f"stages.0.steps={steps}",
        f"eval.every_steps={every}",
        "schedule.warmup_steps=20",
        "optimizer.lr=3.0e-3",
        f"run.seed={seed}",
        f"checkpoint.every_tokens={1024 * steps // 4}",
        "checkpoint.keep_last=8",
        "spikes.enabled=false",
        *extra,
    ]
    if branch is not None:
        args += ["--branch-decay-from", str(branch[0]), "--decay-steps", str(branch[1])]
    for s in sets:
        args += ["--set", s]
    subprocess.run(args + ["--overwrite"], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return out


def train_tiny(out: Path) -> tuple[Path, Path]:
    """The tiny recipe with a checkpoint every 10 steps, and a 5% decay branched from its 50% point (`val/ref` at
    every branch step)."""
    run, branch = out / "tiny", out / "tiny-decay-110"
    base = [sys.executable, str(ROOT / "scripts/run_recipe.py"), "recipes/tiny.yaml", "--overwrite"]
    if not (run / "final").exists():
        sets = ["--set", "checkpoint.every_tokens=81920", "--set", "checkpoint.keep_last=30"]
        subprocess.run(base + ["--output-dir", str(run), *sets], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    if not (branch / "final").exists():
        ckpt = ["--branch-decay-from", str(run / "checkpoints" / "step_00000110"), "--decay-steps", "11"]
        sets = ["--output-dir", str(branch), "--set", "eval.every_steps=1"]
        subprocess.run(base + ckpt + sets, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return run, branch


def forecast_final(curves: list[Curve], full: Curve) -> dict:
    """Fit on `curves` (the first cut from `full`), forecast `full`'s last step; what came true."""
    f = fit(curves)
    n = len(full.lr)
    v, lo, hi = (float(x[0]) for x in predict(f, full.lr, [n], full.warmup))
    true = float(full.loss[-1]) if int(full.steps[-1]) == n else float("nan")
    decay_ahead = bool(full.lr[f.fit_step :].min() < 0.999 * full.lr.max())
    claim = "two-sided" if f.calibrated or not decay_ahead else "upper"
    return {
        "law": f.law,
        "mode": f.mode,
        "claim": claim,
        "pred": v,
        "band": [lo, hi],
        "true": true,
        "rel_err": (v - true) / true,
        "inside": bool(lo <= true <= hi),
        "below_hi": bool(true <= hi),
        "validation": f.validation,
        "at_bound": f.at_bound,
    }


def cut(curve: Curve, step: int) -> Curve:
    keep = curve.steps <= step
    return Curve(curve.lr, curve.steps[keep], curve.loss[keep], curve.warmup, offset=curve.offset)


def write_csv(run: Path, path: Path) -> Path:
    """The run's per-step training loss as `step,lr,loss` rows (absolute LRs), as a W&B export would give it."""
    recipe = run_recipe(run)
    c = train_curve(run, recipe)
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["step", "lr", "loss"])
        w.writerows(zip(c.steps.tolist(), (c.lr[c.steps - 1] * recipe.optimizer.lr).tolist(), c.loss.tolist()))
    return path


def coverage(runs: list[Path], siblings: dict[Path, Path], csv_dir: Path) -> dict:
    rows = []
    for run in runs:
        full = run_curve(run)
        sources = [("val/ref", full, [])]
        if run in siblings:
            sources.append(
                ("val/ref + sibling", full, [calibration_curve(siblings[run], run_recipe(run).optimizer.lr)])
            )
        sources.append(("train csv", csv_curve(write_csv(run, csv_dir / f"{run.name}.csv")), []))
        for label, curve, calibration in sources:
            for frac in CUTS:
                part = cut(curve, int(frac * len(curve.lr)))
                if np.sum(part.steps >= part.fit_from) < MIN_POINTS:
                    continue
                r = forecast_final([part, *calibration], curve)
                rows.append({"run": run.name, "source": label, "cut": frac, **r})
    two = [r for r in rows if r["claim"] == "two-sided"]
    upper = [r for r in rows if r["claim"] == "upper"]
    by_source = {}
    for label in ("val/ref", "val/ref + sibling", "train csv"):
        sel = [r for r in two if r["source"] == label]
        if sel:
            by_source[label] = {
                "cut_points": len(sel),
                "inside": float(np.mean([r["inside"] for r in sel])),
                "median_abs_err": float(np.median([abs(r["rel_err"]) for r in sel])),
            }
    return {
        "two_sided": {
            "cut_points": len(two),
            "curves": len({(r["run"], r["source"]) for r in two}),
            "inside": float(np.mean([r["inside"] for r in two])) if two else None,
            "median_abs_err": float(np.median([abs(r["rel_err"]) for r in two])) if two else None,
            "median_half_width": float(np.median([(r["band"][1] - r["pred"]) / r["pred"] for r in two]))
            if two
            else None,
            "by_source": by_source,
        },
        "upper_estimates": {
            "cut_points": len(upper),
            "below_hi": float(np.mean([r["below_hi"] for r in upper])) if upper else None,
            "median_rel_err": float(np.median([r["rel_err"] for r in upper])) if upper else None,
        },
        "laws_chosen": {n: sum(r["law"] == n for r in rows) for n in LAWS},
        "rows": rows,
    }


def first_off_track(run_dir: Path) -> int | None:
    curve = run_curve(run_dir)
    for k in range(MIN_POINTS + 4, len(curve.steps) + 1):
        part = Curve(curve.lr, curve.steps[:k], curve.loss[:k], curve.warmup)
        if outlook(part).off_track:
            return int(curve.steps[k - 1])
    return None


def first_unhealthy(run_dir: Path) -> int | None:
    run = load_run(run_dir)
    val = [(m["step"], m.get("val/ref")) for m in run.evals]
    for m in run.evals:
        s = m["step"]
        losses = [x for x in run.losses if x[0] <= s]
        v, _ = verdict(losses, [x for x in val if x[0] <= s], [], finished=False, idle_s=0.0)
        if v not in ("healthy",) and s > 0 and len(losses) > 20:
            return s
    return None


def cost() -> dict:
    """Fit + forecast on 10,000 points of a cosine run's first half (drawn from the multi-power law), and the
    schedule's handling alone, at 10^4, 10^5 and 10^6 steps."""
    law = LawFit.of("multipower", [0.4, 0.0, 0.6, 0.6], [2.0, 3.0, 0.4])
    out = {}
    for n in (10_000, 100_000, 1_000_000):
        w = n // 100
        t0 = time.perf_counter()
        lr = cosine_array(np.arange(n), warmup_steps=w, total_steps=n, min_lr_ratio=0.1)
        steps = np.linspace(2 * w, n // 2, 10_000).astype(int)
        basis(lr, w, steps)
        schedule_s = time.perf_counter() - t0
        y = law.predict(basis(lr, w, steps)) + 0.01 * np.random.default_rng(0).standard_normal(len(steps))
        t0 = time.perf_counter()
        f = fit([Curve(lr, steps, y, w, first=1)])
        v, lo, hi = predict(f, lr, [n], w)
        total_s = time.perf_counter() - t0
        true = float(law.predict(basis(lr, w, [n]))[0])
        out[n] = {
            "schedule_s": round(schedule_s, 4),
            "fit_and_forecast_s": round(total_s, 3),
            "law": f.law,
            "rel_err": (float(v[0]) - true) / true,
            "inside": bool(lo[0] <= true <= hi[0]),
        }
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--every", type=int, default=20)
    p.add_argument("--out", type=Path, default=Path("runs/bench_forecast"))
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--runs", type=Path, nargs="*", default=[], help="more healthy run directories for the coverage")
    p.add_argument("--no-tiny", action="store_true", help="leave out the tiny recipe (3 minutes of training)")
    a = p.parse_args(argv)
    n, res = a.steps, {}
    const = train(a.out / "const", n, a.every, SCHEDULES["const"])
    wsd = train(a.out / "wsd", n, a.every, SCHEDULES["wsd"])
    cos = [train(a.out / f"cosine{s}", n, a.every, SCHEDULES["cosine"], seed=1234 + s) for s in range(a.seeds)]
    peak = 3.0e-3
    # 1. cosine seeds from their first half, alone and with the WSD run as an earlier run of the recipe
    res["cosine_first_half"] = [
        {
            "run": run.name,
            "alone": forecast_final([run_curve(run, fit_until=n // 2)], run_curve(run)),
            "with_wsd_run": forecast_final(
                [run_curve(run, fit_until=n // 2), calibration_curve(wsd, peak)], run_curve(run)
            ),
        }
        for run in cos
    ]
    # 2. stable phase + a 5% branch decay -> the full 20% decay's final
    start, length = int(0.75 * n), max(1, n // 20)
    base = const / "checkpoints" / f"step_{start:08d}"
    floor = SCHEDULES["const"][:1] + ["schedule.min_lr_ratio=0"]  # the constant run's recipe, with a floor to decay to
    every = max(1, length // 10)
    br = train(a.out / "branch", n, every, floor, branch=(base, length))
    res["wsd_final_from_stable_and_branch"] = {
        "branch_steps": length,
        "stable_until": start,
        **forecast_final([run_curve(const, fit_until=start), calibration_curve(br, peak)], run_curve(wsd)),
    }
    # 3. the tiny recipe from its 50% point
    if not a.no_tiny:
        tiny, tiny_branch = train_tiny(a.out)
        full, half = run_curve(tiny), len(run_curve(tiny).lr) // 2
        own = [run_curve(tiny, fit_until=half), train_curve(tiny, fit_until=half)]
        res["tiny_from_half"] = {
            "val_and_train": forecast_final(own, full),
            "val_train_and_branch": forecast_final([*own, calibration_curve(tiny_branch, None)], full),
        }
    # 4. coverage
    healthy = [const, wsd, *cos, *a.runs]
    siblings = {cos[i]: cos[(i + 1) % len(cos)] for i in range(len(cos))} if len(cos) > 1 else {}
    siblings.update(_siblings(a.runs))
    (a.out / "csv").mkdir(parents=True, exist_ok=True)
    res["coverage"] = coverage(healthy, siblings, a.out / "csv")
    # 5. drift vs healthy
    for name, rate in (("drift", 0.02), ("slow_drift", 0.004)):
        run = train(a.out / name, n, a.every, SCHEDULES["const"] + [f"debug.inject.lr_drift=[{n // 3},{rate}]"])
        logged = [e["step"] for e in load_run(run).events if e["event"] == "off_track"]
        res[name] = {
            "lr_drift": [n // 3, rate],
            "first_off_track": first_off_track(run),
            "logged_off_track": logged,
            "first_unhealthy": first_unhealthy(run),
            "check_run_at_end": forecast_report(run)["lines"][0],
        }
    res["healthy_off_track"] = {r.name: first_off_track(r) for r in [const, wsd, *cos]}
    res["healthy_first_unhealthy"] = {r.name: first_unhealthy(r) for r in [const, wsd, *cos]}
    # 6. cost
    res["cost"] = cost()
    summary = {k: v for k, v in res.items() if k != "coverage"}
    summary["coverage"] = {k: v for k, v in res["coverage"].items() if k != "rows"}
    print(json.dumps(summary, indent=1, default=float))
    (a.out / "results.json").write_text(json.dumps(res, indent=1, default=float))
    return 0


def _siblings(runs: list[Path]) -> dict[Path, Path]:
    """Runs of one recipe (same resolved recipe but the seed): each calibrated by the next."""
    groups: dict[str, list[Path]] = {}
    for run in runs:
        text = (run / "recipe.resolved.yaml").read_text()
        key = "\n".join(line for line in text.splitlines() if not line.strip().startswith(("seed:", "output_dir:")))
        groups.setdefault(key, []).append(run)
    out = {}
    for group in groups.values():
        for i, run in enumerate(group):
            if len(group) > 1:
                out[run] = group[(i + 1) % len(group)]
    return out


if __name__ == "__main__":
    sys.exit(main())
