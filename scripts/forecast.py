"""Forecast a run's loss curve from its LR schedule (the LR-annealing law, docs/FORECAST.md): the observed val/ref
points, the fitted curve and its band, and the final loss under other schedules of the same run.

    python scripts/forecast.py runs/tiny                                  # table of schedules and their final loss
    python scripts/forecast.py runs/tiny --fit-until 100 --plot fc.png    # fit on evals up to step 100 only
    python scripts/forecast.py runs/tiny --calibrate runs/tiny-decay      # a branch decay calibrates the decay gain
    python scripts/forecast.py runs/tiny --json --at 150,200              # {"final": {value, lo, hi}, "at": {...}}
    python scripts/forecast.py --curve run.csv --calibrate old.csv        # step,lr,loss rows from W&B or elsewhere
    python scripts/forecast.py runs/tiny --train-loss                     # the per-step training loss beside val/ref

The law (power, annealing, multi-power) is the one that predicted the run's own later points best (`law`,
`validation` in --json); docs/FORECAST.md.
"""

from __future__ import annotations

import argparse

from pretrainer.cli import emit_json, output_file, run_main, script_parser


def parse_args(argv=None) -> argparse.Namespace:
    p = script_parser(__doc__, recipe=False)
    p.add_argument("run_dir", nargs="?", help="a run directory (its recipe.resolved.yaml and metrics.jsonl)")
    p.add_argument("--curve", help="a step,lr,loss CSV instead of a run directory (empty loss: planned steps)")
    p.add_argument("--calibrate", action="append", default=[], help="run directory or CSV with a decay (repeatable)")
    p.add_argument("--fit-until", type=int, help="fit only on evals up to this step")
    p.add_argument("--train-loss", action="store_true", help="also fit the run's per-step training loss (own level)")
    p.add_argument("--law", choices=("power", "annealing", "multipower"), help="this law only (no choice)")
    p.add_argument("--at", help="also forecast at these steps: 28000,29000")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", metavar="PNG", help="observed points, the fit and its band, alternative schedules")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)

    def run() -> int:
        from pathlib import Path

        import numpy as np

        from pretrainer.analysis import outlook as ol
        from pretrainer.analysis.forecast import fit, predict
        from pretrainer.errors import PretrainerError
        from pretrainer.recipe.loading import load_recipe

        output_file(args.plot, "--plot")
        if bool(args.run_dir) == bool(args.curve):
            raise PretrainerError("give a run directory or --curve FILE.csv (one of them)")
        if args.run_dir and not (Path(args.run_dir) / "recipe.resolved.yaml").is_file():
            raise PretrainerError(f"{args.run_dir}: not a run directory (no recipe.resolved.yaml)")
        if args.curve:
            curve, recipe = ol.csv_curve(args.curve), None
            peak = None
        else:
            recipe = load_recipe(f"{args.run_dir}/recipe.resolved.yaml")
            curve, peak = ol.run_curve(args.run_dir, recipe), recipe.optimizer.lr
        observed = (curve.steps.copy(), curve.loss.copy())
        if args.fit_until is not None:
            keep = curve.steps <= args.fit_until
            curve.steps, curve.loss = curve.steps[keep], curve.loss[keep]
        calibration = [ol.calibration_curve(c, peak) for c in args.calibrate]
        if args.train_loss:
            if not args.run_dir:
                raise PretrainerError("--train-loss reads a run directory's per-step losses (a --curve is one curve)")
            calibration.insert(0, ol.train_curve(args.run_dir, recipe, args.fit_until))
        own = ol.usable(curve) + (ol.usable(calibration[0]) if args.train_loss else 0)
        if own < ol.MIN_POINTS or not ol.usable(curve):
            raise PretrainerError(
                f"{ol.usable(curve)} evals from step {curve.fit_from} on to fit; the forecast needs {ol.MIN_POINTS} "
                "(with --train-loss: one eval and the training losses)"
            )
        f = fit([curve, *calibration], laws=(args.law,) if args.law else None)
        total = len(curve.lr)
        value, lo, hi = predict(f, curve.lr, [total], curve.warmup)
        out = {
            "final": {"value": float(value[0]), "lo": float(lo[0]), "hi": float(hi[0]), "step": total},
            "law": f.law,
            "validation": f.as_dict()["validation"],
            "fit": f.as_dict(),
        }
        if args.at:
            steps = at_steps(args.at, total)
            v, a, b = predict(f, curve.lr, steps, curve.warmup)
            out["at"] = {
                str(s): {"value": float(x), "lo": float(y), "hi": float(z)} for s, x, y, z in zip(steps, v, a, b)
            }
        alts = ol.alternatives(recipe, int(curve.steps.max())) if recipe is not None else {}
        out["schedules"] = {}
        for name, lr in alts.items():
            v, a, b = predict(f, lr, [total], curve.warmup)
            out["schedules"][name] = {"value": float(v[0]), "lo": float(a[0]), "hi": float(b[0])}
        if args.plot:
            fv = out["final"]
            name = Path(args.run_dir).resolve().name if args.run_dir else Path(args.curve).name
            title = (
                f"{name}: final val/ref at step {total:,} {fv['value']:.4f} [{fv['lo']:.4f}, {fv['hi']:.4f}] (90%)\n"
                f"{f.law} law, {f.mode}, fitted on {f.points} evals up to step {f.fit_step:,}"
            )
            out["plot"] = str(plot(args.plot, f, curve, observed, alts, np, title))
        if args.json:
            emit_json(out)
            return 0
        fv = out["final"]
        print(f"fit on {f.points} points up to step {f.fit_step}: {f.mode}, residual sd {f.sigma:.4f}")
        print(ol.law_line(f))
        print(f"final val/ref at step {total}: {fv['value']:.4f} [{fv['lo']:.4f}, {fv['hi']:.4f}] (90% band)")
        for step, r in out.get("at", {}).items():
            print(f"  at step {step}: {r['value']:.4f} [{r['lo']:.4f}, {r['hi']:.4f}]")
        if out["schedules"]:
            print("the same run under other schedules (final val/ref):")
            for name, r in out["schedules"].items():
                print(f"  {name:<24} {r['value']:.4f} [{r['lo']:.4f}, {r['hi']:.4f}]")
        for note in f.notes:
            print(f"note: {note}")
        if args.plot:
            print(f"plot: {out['plot']}")
        return 0

    return run_main(run, debug=args.debug, json_out=args.json)


def at_steps(text: str, total: int) -> list[int]:
    """`--at 28000,29000` (1e3 is read as 1000): whole steps within the run's schedule.

    Raises:
        PretrainerError: one line naming the value."""
    import math

    from pretrainer.errors import PretrainerError

    out = []
    for item in text.split(","):
        try:
            value = float(item)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value == int(value) and 1 <= value <= total):
            raise PretrainerError(f"--at: {item.strip()!r} is not a step in 1..{total:,} (the schedule's length)")
        out.append(int(value))
    return out


def plot(path, f, curve, observed, alts, np, title=""):
    """The observed points, the fit under the run's own schedule with its 90% band, the alternatives. Drawn from
    the first eval after step 0: the law is fitted there and says nothing about the untrained start (where its band
    blew up), and the y-axis holds every point drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pretrainer.analysis.forecast import predict

    seen_steps, seen = np.asarray(observed[0], float), np.asarray(observed[1], float)
    first = int(seen_steps[seen_steps > 0].min()) if (seen_steps > 0).any() else 1
    steps = np.unique(np.linspace(max(first, 1), len(curve.lr), 400).astype(int))
    fig, ax = plt.subplots(figsize=(9, 5.5))
    v, lo, hi = predict(f, curve.lr, steps, curve.warmup)
    ax.fill_between(steps, lo, hi, alpha=0.2, color="C0", label="90% band")
    ax.plot(steps, v, color="C0", label="fit (own schedule)")
    drawn = [v, lo, hi]
    for i, (name, lr) in enumerate(alts.items()):
        alt = predict(f, lr, steps, curve.warmup)[0]
        ax.plot(steps, alt, lw=0.8, ls="--", color=f"C{i + 2}", label=name)
        drawn.append(alt)
    shown = seen_steps >= first
    fitted = shown & (seen_steps <= f.fit_step)
    ax.scatter(seen_steps[fitted], seen[fitted], s=14, color="k", label="val/ref (fitted)", zorder=3)
    if (held := shown & (seen_steps > f.fit_step)).any():  # what --fit-until held back: the forecast's check
        ax.scatter(seen_steps[held], seen[held], s=22, facecolors="none", edgecolors="k", label="val/ref (held out)")
    ax.axvline(f.fit_step, color="grey", lw=0.8, ls=":", label=f"fitted up to step {f.fit_step:,}")
    values = np.concatenate([*drawn, seen[shown]])
    values = values[np.isfinite(values)]
    if len(values):
        pad = 0.05 * max(float(values.max() - values.min()), 1e-3)
        ax.set_ylim(float(values.min()) - pad, float(values.max()) + pad)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("val/ref")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    raise SystemExit(main())
