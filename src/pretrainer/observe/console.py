"""What the main process prints at the start and the end of a run: the story in a few lines."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from ..checkpoint import list_checkpoints
from ..recipe.loading import dump_recipe
from . import events as ev


def announce(recipe, output_dir: Path, findings: list) -> None:
    """Write the resolved recipe into the run directory and warn about the linter's findings."""
    dump_recipe(recipe, Path(output_dir) / "recipe.resolved.yaml")
    for f in findings:
        print(f"warning: {f}", file=sys.stderr)


def start_block(recipe, n_params: int, world: int, trackers: list[str], output_dir: Path, resumed: str | None) -> str:
    plan = recipe.plan
    lines = [
        f"run {recipe.run.name}: {n_params:,} parameters, {plan.total_steps:,} steps, {plan.total_tokens:,} tokens, "
        f"{world} process(es), {plan.global_batch_tokens:,} tokens per step",
    ]
    for span, stage in zip(plan.spans, recipe.stages):
        rope = f", rope {stage.rope.model_dump(exclude_none=True)}" if stage.rope else ""
        lines.append(
            f"  stage {span.name:<10} steps {span.start_step:>8,}-{span.end_step:<8,} {span.tokens:>16,} tokens"
            f" at seq_len {span.seq_len}{rope}"
        )
    where = {
        "wandb": f"W&B ({'offline' if _offline() else 'online'}) in {output_dir}/wandb",
        "tensorboard": f"TensorBoard in {output_dir}/{recipe.logging.project}",
    }
    lines.append("trackers: metrics.jsonl + events.jsonl" + "".join(f", {where[t]}" for t in trackers))
    lines.append(f"output: {output_dir}" + (f" (resumed from {resumed})" if resumed else ""))
    return "\n".join(lines)


def end_block(
    output_dir: Path, val: dict[int, Any], counts: dict[str, int], trackers: list[str], context: dict | None = None
) -> str:
    checkpoints = [c.path.name for c in list_checkpoints(Path(output_dir) / "checkpoints")]
    finite = {s: v for s, v in val.items() if isinstance(v, int | float)}
    lines = ["done."]
    if finite:
        last = max(finite)
        best = min(finite, key=finite.get)
        lines.append(
            f"validation loss (val/ref): final {finite[last]:.4f} (step {last:,}), best {finite[best]:.4f} "
            f"(step {best:,})"
        )
    if context:  # the latest loss-by-position verdict
        lines.append(f"context (step {context['step']:,}): {context['verdict']}")
    shown = (ev.SPIKE, ev.ROLLBACK, ev.SKIP, ev.TRANSIENT, ev.SKIPPED_UPDATE, ev.RESUME)
    lines.append("incidents: " + ", ".join(f"{k} {counts.get(k, 0)}" for k in shown))
    lines.append(f"checkpoints kept: {', '.join(checkpoints) or 'none'}")
    lines.append(f"model: {output_dir}/final (AutoModelForCausalLM.from_pretrained)")
    if (Path(output_dir) / "merged").is_dir():
        lines.append(f"       {output_dir}/merged (the averaged weights)")
    lines.append(f"next: python scripts/check_run.py {output_dir} --plot report.png")
    if "wandb" in trackers and _offline():
        lines.append(f"      wandb sync {output_dir}/wandb/offline-run-*")
    return "\n".join(lines)


def _offline() -> bool:
    return os.environ.get("WANDB_MODE") in ("offline", "disabled")
