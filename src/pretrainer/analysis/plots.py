"""Pictures: the LR schedule of a recipe, and the health of a run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

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


def plot_run(output_dir: str | Path, path: str | Path) -> Path:
    """Four panels: train and per-source validation loss (stage boundaries, spikes, rollbacks, skips marked), LR,
    gradient norm, tokens/s."""

    run = load_run(output_dir)
    fig, axes = plt.subplots(4, 1, figsize=(11, 11), sharex=True, gridspec_kw={"height_ratios": [3, 1, 1, 1]})
    ax = axes[0]
    if len(run.losses):
        ax.plot(run.losses.steps, run.losses.values, lw=0.8, color="C0", label="train")
    sources = sorted({k for m in run.evals for k in m if k.startswith("val/")})
    for i, key in enumerate(sources):
        pts = [(m["step"], as_float(m[key])) for m in run.evals if key in m]
        ax.plot(*zip(*pts), marker="o", ms=3, lw=1.2 if key == "val/avg" else 0.8, color=f"C{i + 1}", label=key)
    marks = {ev.SPIKE: ("red", "x"), ev.ROLLBACK: ("purple", "v"), ev.SKIP: ("black", "s")}
    for kind, (color, marker) in marks.items():
        steps = [e["step"] for e in run.events if e["event"] == kind]
        if steps:
            top = ax.get_ylim()[1]
            ax.scatter(steps, [top] * len(steps), color=color, marker=marker, label=kind, zorder=5)
    for e in run.events:
        if e["event"] == ev.STAGE_START:
            for a in axes:
                a.axvline(e["step"], color="grey", lw=0.8, ls="--")
            ax.text(e["step"], ax.get_ylim()[1], f" {e['stage']} ({e.get('seq_len')})", fontsize=8, va="top")
    ax.set_ylabel("loss")
    ax.legend(fontsize=8, ncol=3)
    for a, key, label in zip(axes[1:], ["lr", "grad_norm", "tokens_per_s"], ["lr", "grad norm", "tokens/s"]):
        if len(run.train["step"]):
            a.plot(run.train["step"], run.train[key], lw=1.0)
        a.set_ylabel(label)
    axes[-1].set_xlabel("optimizer step")
    axes[0].set_title(f"{Path(output_dir).name}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
