"""Pictures: the LR schedule of a recipe, and the health of a run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib
import numpy as np

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

from ..observe import events as ev  # noqa: E402
from ..recipe.schedules import lr_lambda  # noqa: E402
from ..recipe.schema import Recipe  # noqa: E402
from .runfiles import as_float, load_run  # noqa: E402


def _rope_label(stage) -> str:
    if stage.rope is None:
        return ""
    parts = []
    if stage.rope.theta is not None:
        parts.append(f"θ={stage.rope.theta:g}")
    if stage.rope.yarn is not None:
        parts.append(f"YaRN x{stage.rope.yarn.factor:g}")
    return ", ".join(parts)


def plot_schedule(recipe: Recipe, info: dict[str, Any], path: str | Path) -> Path:
    """LR over the whole run; each stage shaded and annotated with its seq_len, RoPE change and tokens."""
    total = recipe.plan.total_steps
    fn, peak = lr_lambda(recipe), recipe.optimizer.lr
    n = min(total, 4000)
    steps = [round(i * (total - 1) / max(1, n - 1)) for i in range(n)]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    ax.plot(steps, [peak * fn(s) for s in steps], color="C0", lw=1.8)
    rope = ""
    for k, span in enumerate(recipe.plan.spans):
        stage = recipe.stages[span.index]
        rope = _rope_label(stage) or rope  # RoPE changes persist into later stages
        ax.axvspan(span.start_step, span.end_step, color=f"C{k + 1}", alpha=0.12)
        ax.axvline(span.start_step, color="grey", lw=0.8, ls="--")
        label = (
            f"{span.name}\nseq {span.seq_len}\n{span.tokens / 1e9:.3g}B tok"
            if span.tokens >= 1e8
            else (f"{span.name}\nseq {span.seq_len}\n{span.tokens:,} tok")
        )
        if rope:
            label += f"\n{rope}"
        # narrow stages sit side by side: stagger the labels so they don't overlap
        ax.text(span.start_step + 0.005 * total, peak * (1.03 + 0.3 * (k % 2)), label, va="bottom", fontsize=8)
    ax.set_xlim(0, total)
    ax.set_ylim(0, peak * 1.75)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("learning rate")
    title = f"{recipe.run.name}: {recipe.schedule.type}, peak {peak:g}, {total:,} steps"
    if "total_flops" in info:
        title += f", {info['total_flops']:.2e} FLOPs"
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def eval_curves(evals: list[dict]) -> list[str]:
    """The validation losses a run's picture draws: `val/ref`, `val/avg`, then each source. Not the standard errors
    (`val/ref_se`, ~0.05): drawn as losses they pinned the y-axis at 0."""
    keys = {k for m in evals for k in m if k.startswith("val/") and not k.endswith("_se")}
    return [ev.VAL_REF, ev.VAL_AVG] + sorted(keys - {ev.VAL_REF, ev.VAL_AVG})


def loss_limits(series: list) -> tuple[float, float] | None:
    """y-limits that show the curves a person reads: the training loss after its first tenth (the untrained start,
    ~2x the rest, would squash the whole run into the top third) and every eval point after step 0."""
    values = [np.array([])]
    for steps, vals in series:
        steps, vals = np.asarray(steps, float), np.asarray(vals, float)
        if len(steps):
            values.append(vals[np.isfinite(vals) & (steps >= 0.1 * max(steps.max(), 1))])
    values = np.concatenate(values)
    if not len(values):
        return None
    lo, hi = float(values.min()), float(np.percentile(values, 99.5))
    pad = 0.08 * max(hi - lo, 1e-3)
    return lo - pad, hi + pad


def _loss_at(losses, step: int, default: float) -> float:
    """The training loss logged at `step` (the series is sorted by step: a lookup, not a table of the whole run)."""
    i = int(np.searchsorted(losses.steps, step))
    found = i < len(losses.steps) and losses.steps[i] == step and np.isfinite(losses.values[i])
    return float(losses.values[i]) if found else default


def plot_run(output_dir: str | Path, path: str | Path, report: dict[str, Any] | None = None) -> Path:
    """The run at a glance. Top: training loss, `val/ref` (the run-long comparable curve) and the per-source
    validation losses, the forecast's final value with its 90% band, stage boundaries, and incidents (spikes,
    rollbacks, data skips, skipped updates) on the curve; the title carries the verdict. Below: LR, gradient norm,
    tokens/s. `report`: check_run's report (verdict, forecast), when the caller has it."""

    run = load_run(output_dir)
    report = report or {}
    fig, axes = plt.subplots(4, 1, figsize=(11, 11), sharex=True, gridspec_kw={"height_ratios": [3, 1, 1, 1]})
    ax = axes[0]
    series = []
    if len(run.losses):
        ax.plot(run.losses.steps, run.losses.values, lw=0.7, color="C0", alpha=0.8, label="train loss")
        series.append((run.losses.steps, run.losses.values))
    styles = {ev.VAL_REF: ("black", "-", 1.8, "o"), ev.VAL_AVG: ("C1", "--", 1.4, "s")}
    styles.update({k: (f"C{i + 2}", "-", 0.8, ".") for i, k in enumerate(eval_curves(run.evals)[2:])})
    for key, (color, ls, lw, marker) in styles.items():
        pts = [(m["step"], as_float(m[key])) for m in run.evals if key in m]
        if pts:
            ax.plot(*zip(*pts), color=color, ls=ls, lw=lw, marker=marker, ms=3.5, label=key, zorder=4)
            series.append(tuple(zip(*pts)))
    if limits := loss_limits(series):
        ax.set_ylim(*limits)
    fc = (report.get("forecast") or {}).get("final")
    if fc:
        err = [[fc["value"] - fc["lo"]], [fc["hi"] - fc["value"]]]
        ax.errorbar(
            [fc["step"]],
            [fc["value"]],
            yerr=err,
            fmt="D",
            color="black",
            mfc="white",
            capsize=5,
            zorder=6,
            label=f"forecast at step {fc['step']:,}: {fc['value']:.3f} [{fc['lo']:.3f}, {fc['hi']:.3f}]",
        )
    marks = {
        ev.SPIKE: ("red", "x"),
        ev.ROLLBACK: ("purple", "v"),
        ev.SKIP: ("black", "s"),
        ev.SKIPPED_UPDATE: ("orange", "|"),
    }
    top = ax.get_ylim()[1]
    for kind, (color, marker) in marks.items():
        steps = [e["step"] for e in run.events if e["event"] == kind]
        if steps:  # on the curve where it is known and in range, else at the top edge
            ys = [min(_loss_at(run.losses, s, top), top) for s in steps]
            ax.scatter(steps, ys, color=color, marker=marker, s=40, label=f"{kind} ({len(steps)})", zorder=7)
    for e in run.events:
        if e["event"] == ev.STAGE_START and e["step"] > 0:
            for a in axes:
                a.axvline(e["step"], color="grey", lw=0.8, ls="--")
        if e["event"] == ev.STAGE_START:
            ax.text(e["step"], top, f" {e['stage']} ({e.get('seq_len')})", fontsize=8, va="top", color="dimgrey")
    ax.set_ylabel("loss (nats/token)")
    ax.legend(fontsize=8, ncol=2, loc="lower left")
    ax.grid(alpha=0.3)
    for a, key, label in zip(axes[1:], ["lr", "grad_norm", "tokens_per_s"], ["LR", "grad norm", "tokens/s"]):
        if len(run.train["step"]):
            a.plot(run.train["step"], run.train[key], lw=1.0)
        a.set_ylabel(label)
        a.grid(alpha=0.3)
    if len(run.train["step"]) and (run.train["grad_norm"] > 0).any():
        axes[2].set_yscale("log")  # a spike's norm is 10-1000x the rest
    axes[-1].set_xlabel("optimizer step")
    verdict = report.get("verdict")
    why = "; ".join(report.get("reasons") or [])
    title = f"{Path(output_dir).resolve().name}" + (f": {verdict}" if verdict else "")
    ax.set_title(title + (f"\n{why[:140]}" if why else ""), fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
