"""What the main process prints: the story at the start and the end of a run, and its progress in between (a bar
on a terminal, timestamped lines in a file)."""

from __future__ import annotations

import datetime
import math
import os
import sys
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from ..checkpoint import list_checkpoints
from ..noise import isatty
from ..observe import events as ev
from ..recipe.loading import dump_recipe


def announce(recipe, output_dir: Path, findings: list, inherited: list = ()) -> None:
    """Write the resolved recipe into the run directory and warn about the linter's findings. `inherited`: a
    branch's (a decay's, a batch branch's) recipe findings, which were its parent's to act on: named in one line
    rather than repeated as warnings the branch cannot follow."""
    dump_recipe(recipe, Path(output_dir) / "recipe.resolved.yaml")
    for f in findings:
        print(f"warning: {f}", file=sys.stderr)
    if inherited:
        ids = ", ".join(sorted({f.id for f in inherited}))
        print(
            f"note: lint findings {ids} are the parent recipe's; the branch continues the parent as trained",
            file=sys.stderr,
        )


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
    output_dir: Path,
    val: dict[int, Any],
    counts: dict[str, int],
    trackers: list[str],
    context: dict | None = None,
    downstream: dict[str, dict] | None = None,
) -> str:
    """The run's closing story. `downstream`: lm-eval's scores, first and latest (`verdicts.add_downstream`)."""
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
    for name, d in sorted((downstream or {}).items()):
        since = f" ({d['first']:.5g} at step {d['first_step']:,})" if d["first_step"] != d["last_step"] else ""
        lines.append(f"downstream {name}: {d['last']:.5g} (step {d['last_step']:,}){since}")
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


class Progress:
    """The run's progress, printed by the global main process only (one voice on any number of nodes).

    On a terminal: tqdm's bar (on stderr), its postfix updated at logging steps, an eval's results as a line above it.
    Anywhere else (a Slurm log, `make run > log.txt`): no bar and no carriage return; one timestamped line per
    logging step (step/total, loss, LR, tokens/s, ETA) and one per eval (its validation losses) on stdout, and the
    libraries' own progress bars (transformers, datasets, the hub) are switched off."""

    def __init__(self, total: int, initial: int, enabled: bool, stream=None, label: str = "train"):
        self.total, self.enabled, self.label = total, enabled, label
        self.stream = stream or sys.stdout
        self.lines = enabled and not isatty(self.stream)
        self.bar = tqdm(total=total, initial=initial, disable=not enabled or self.lines, desc=label)

    def step(self, n: int) -> None:
        """The run is at step `n` (after a step, or back after a rollback): the bar redraws at most 10 times a
        second."""
        self.bar.update(n - self.bar.n)

    def logged(self, step: int, record: dict[str, Any], lr: float) -> None:
        loss, tps = record.get("loss", math.nan), record.get("tokens_per_s", math.nan)
        if not self.lines:
            self.bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tps:.0f}", refresh=False)
            return
        eta = _eta((self.total - step) * record.get("step_time_s", math.nan))
        where = "" if self.label == "train" else f"{self.label}, "
        self._line(f"{where}step {step:,}/{self.total:,} loss {loss:.4f} lr {lr:.2e} tok/s {tps:,.0f} eta {eta}")

    def evaluated(self, step: int, values: dict[str, Any]) -> None:
        keys = [k for k in values if k.startswith("val/") and not k.endswith("_se")]
        first = {"val/ref": 0, "val/avg": 1}  # the run-long comparable loss first, then the mixture's, the sources
        shown = [f"{k} {values[k]:.4f}" for k in sorted(keys, key=lambda k: first.get(k, 2))]
        if self.enabled and shown:
            self._line(f"eval at step {step:,}: " + ", ".join(shown))

    def note(self, text: str) -> None:
        """A line before a long quiet stretch (an lm-eval pass, the first eval), so the log says what it waits on."""
        if self.enabled:
            self._line(text)

    def _line(self, text: str) -> None:
        line = f"{datetime.datetime.now():%Y-%m-%d %H:%M:%S} {text}"
        if self.lines:
            print(line, file=self.stream, flush=True)
        else:
            self.bar.write(line, file=sys.stderr)

    def close(self) -> None:
        self.bar.close()


def _eta(seconds: float) -> str:
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    return str(datetime.timedelta(seconds=round(seconds)))
