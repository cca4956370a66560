"""The forecast against real runs (numbers for docs/BENCHMARKS.md, not a timed test): micro-recipe runs under
constant, cosine and WSD schedules, a short branch decay, a slow LR drift, and the fitter's cost.

    python scripts/bench_forecast.py --steps 600 --out runs/bench_forecast      (about 10 minutes on 2 CPU cores)

1. Fit on a constant-LR run and a cosine run; predict a WSD (1-sqrt, 20% decay) run's whole val/ref curve.
2. Fit on the WSD run's stable phase plus a branch decay of 5% of the steps; predict the full decay's final val/ref.
3. Fit each cosine seed on its first half; is the final val/ref inside the band?
4. Drifts (`debug.inject.lr_drift`, the LR x (1 + rate (step - start)), rates 0.02 and 0.004): the first eval at
   which the check says off track (replayed eval by eval, and as the loop logged it), the first at which the trend
   verdicts leave `healthy`, and what `check_run.py` says at the end; and healthy runs: never off track.
5. Fit time at 10, 100 and 1,000 points.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from pretrainer.observe.forecast import Curve, fit, predict
from pretrainer.observe.health import load_run, verdict
from pretrainer.observe.outlook import MIN_POINTS, calibration_curve, forecast_report, outlook, run_curve

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


def first_off_track(run_dir: Path) -> int | None:
    curve = run_curve(run_dir)
    for k in range(MIN_POINTS + 4, len(curve.steps) + 1):
        part = Curve(curve.lr, curve.steps[:k], curve.loss[:k], curve.warmup)
        if outlook(part).off_track:
            return int(curve.steps[k - 1])
    return None


def first_unhealthy(run_dir: Path) -> int | None:
    run = load_run(run_dir)
    val = [(m["step"], m.get("val/ref")) for m in run["evals"]]
    for m in run["evals"]:
        s = m["step"]
        losses = [x for x in run["losses"] if x[0] <= s]
        v, _ = verdict(losses, [x for x in val if x[0] <= s], [], finished=False, idle_s=0.0)
        if v not in ("healthy",) and s > 0 and len(losses) > 20:
            return s
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--every", type=int, default=20)
    p.add_argument("--out", type=Path, default=Path("runs/bench_forecast"))
    p.add_argument("--seeds", type=int, default=3)
    a = p.parse_args(argv)
    n, res = a.steps, {}
    const = train(a.out / "const", n, a.every, SCHEDULES["const"])
    wsd = train(a.out / "wsd", n, a.every, SCHEDULES["wsd"])
    cos = [train(a.out / f"cosine{s}", n, a.every, SCHEDULES["cosine"], seed=1234 + s) for s in range(a.seeds)]
    # 1. constant + cosine -> the WSD curve
    f = fit([run_curve(const), run_curve(cos[0])])
    w = run_curve(wsd)
    v, lo, hi = predict(f, w.lr, w.steps, w.warmup)
    used = w.steps >= w.fit_from  # the early transient is outside the law (and outside every fit)
    res["wsd_from_const_cosine"] = {
        "mae": float(np.mean(np.abs(v - w.loss)[used])),
        "mae_from_step": w.fit_from,
        "final_pred": float(v[-1]),
        "final_band": [float(lo[-1]), float(hi[-1])],
        "final_true": float(w.loss[-1]),
        "final_rel_err": float((v[-1] - w.loss[-1]) / w.loss[-1]),
    }
    # 2. stable phase + a 5% branch decay -> the full 20% decay's final
    start = int(0.75 * n)
    ckpt = sorted((const / "checkpoints").glob("step_*"))
    base = next(c for c in ckpt if int(c.name.split("_")[1]) == start)
    br = train(a.out / "branch", n, a.every, SCHEDULES["const"], branch=(base, max(1, n // 20)))
    stable = run_curve(const, fit_until=start)
    f2 = fit([stable, calibration_curve(br, 3.0e-3)])
    v2, lo2, hi2 = predict(f2, w.lr, [len(w.lr)], w.warmup)
    res["wsd_final_from_stable_and_branch"] = {
        "branch_steps": n // 20,
        "stable_until": start,
        "final_pred": float(v2[0]),
        "final_band": [float(lo2[0]), float(hi2[0])],
        "final_true": float(w.loss[-1]),
        "final_rel_err": float((v2[0] - w.loss[-1]) / w.loss[-1]),
    }
    # 3. cosine seeds fitted on the first half
    res["cosine_first_half"] = []
    for run in cos:
        c = run_curve(run)
        half = run_curve(run, fit_until=n // 2)
        fh = fit([half])
        v3, lo3, hi3 = predict(fh, c.lr, [len(c.lr)], c.warmup)
        res["cosine_first_half"].append(
            {
                "pred": float(v3[0]),
                "band": [float(lo3[0]), float(hi3[0])],
                "true": float(c.loss[-1]),
                "inside": bool(lo3[0] <= c.loss[-1] <= hi3[0]),
            }
        )
    # 4. drift vs healthy
    for name, rate in (("drift", 0.02), ("slow_drift", 0.004)):
        run = train(a.out / name, n, a.every, SCHEDULES["const"] + [f"debug.inject.lr_drift=[{n // 3},{rate}]"])
        logged = [e["step"] for e in load_run(run)["events"] if e["event"] == "off_track"]
        res[name] = {
            "lr_drift": [n // 3, rate],
            "first_off_track": first_off_track(run),
            "logged_off_track": logged,
            "first_unhealthy": first_unhealthy(run),
            "check_run_at_end": forecast_report(run)["lines"][0],
        }
    res["healthy_off_track"] = {r.name: first_off_track(r) for r in [const, wsd, *cos]}
    res["healthy_first_unhealthy"] = {r.name: first_unhealthy(r) for r in [const, wsd, *cos]}
    # 5. fit time
    rng = np.random.default_rng(0)
    res["fit_seconds"] = {}
    for m in (10, 100, 1000):
        steps = np.linspace(1, len(w.lr), m).astype(int)
        curve = Curve(w.lr, steps, 3 + steps**-0.3 + 0.01 * rng.standard_normal(m), w.warmup)
        t0 = time.perf_counter()
        fit([curve])
        res["fit_seconds"][m] = round(time.perf_counter() - t0, 4)
    print(json.dumps(res, indent=1))
    (a.out / "results.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
