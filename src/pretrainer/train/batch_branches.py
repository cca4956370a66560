"""The critical batch measured at a checkpoint: one short branch per batch size, through the same trainer.

Each branch is its own run directory (`<out>/x<k>`, like `--branch-decay-from`): the parent's recipe with the batch
`k` times the checkpoint's from that step on (recipe/stages.py `branch_batch_recipe`), resumed from the checkpoint,
trained for the same tokens, then evaluated on the fixed `val/ref` batches. analysis/critical_batch.py turns the paired losses
into the estimate; the result is written beside the branches and appended to the parent run's
`critical_batch.jsonl`, which `check_run.py` reports next to the logged noise scale.

Time: the branches train `tokens` each, so a measurement costs len(factors) x tokens of training; memory: one model
at a time (each branch is built, trained, evaluated and released before the next).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..analysis.critical_batch import RESULTS, TOLERANCE, estimate, schedule_line, suggested_size
from ..checkpoint import read_meta
from ..checkpoint.identity import read_run_file
from ..errors import RecipeError
from ..recipe.schema import Recipe
from ..recipe.stages import BATCH_BRANCH_CHANGES, branch_batch_recipe
from .rundir import holds_run
from .trainer import Trainer

FACTORS = (1, 2, 4, 8)
BRANCH_STEPS = 16
"""Default branch length: this many steps at the largest size (Merrill et al. ran each branch ~2B tokens, a small
fraction of the run; what matters is that every size sees the same tokens)."""


def branch_tokens(recipe: Recipe, step: int, factors, tokens: int | None) -> int:
    """The tokens every branch trains: `tokens`, or about `BRANCH_STEPS` steps at the largest size; a whole number of
    steps at every size (a multiple of the least common multiple of the sizes), so that every branch trains exactly
    the same tokens; checked to fit in what is left of the run.

    Raises:
        RecipeError: `tokens` is not positive or not a whole number of steps at every size (the nearest valid
            values named), or the branches would run past the end of the run.
    """
    plan = recipe.plan
    size = plan.batch_at(step).tokens_per_step
    unit = math.lcm(*factors) * size
    if tokens is not None and tokens < 1:
        raise RecipeError(f"--tokens: a positive token count per branch, not {tokens}")
    if tokens is not None and tokens % unit:
        lo, hi = tokens // unit * unit, (tokens // unit + 1) * unit
        near = f"{lo:,} or {hi:,}" if lo else f"{hi:,}"
        raise RecipeError(
            f"--tokens: {tokens:,} is not a whole number of steps at every branch size ({', '.join(f'{k * size:,}' for k in factors)} "
            f"tokens), so the branches would train unequal tokens: use a multiple of {unit:,} (nearest: {near})"
        )
    want = tokens or -(-BRANCH_STEPS * max(factors) * size // unit) * unit
    left = plan.total_tokens - plan.tokens_before(step)
    if want > left:
        raise RecipeError(
            f"--tokens: branches of {want:,} tokens from step {step} run past the end of the run ({left:,} tokens "
            "left); branch from an earlier checkpoint or pass fewer --tokens"
        )
    return want


def check_branch_dirs(dirs: list[Path], parent_run: str | None) -> None:
    """A branch directory is replaced only when it holds an earlier branch of the same run (a re-measurement), never
    another run that `--out` happens to point at.

    Raises:
        RecipeError: one line naming the directory, before anything is written."""
    for d in dirs:
        if not holds_run(d):
            continue
        ident = read_run_file(d)
        if ident is None or parent_run is None or ident.parent != parent_run:
            raise RecipeError(
                f"--out: {d} holds another run than a branch of {parent_run or 'this checkpoint'}'s run; choose "
                "another --out"
            )


def measure(
    checkpoint: str | Path,
    recipe: Recipe,
    out_dir: str | Path,
    factors=FACTORS,
    tokens: int | None = None,
    tolerance: float = TOLERANCE,
) -> tuple[dict, bool]:
    """Train and evaluate one branch per factor; the estimate, the suggested schedule and where the branches are, and
    whether this is the main process (the one that records and prints it; every rank computes the same).

    Raises:
        RecipeError: the recipe is not the checkpoint's run (its plan puts another token count at the step), or the
            branches do not fit the run.
    """
    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    meta = read_meta(checkpoint)
    step, plan = int(meta["step"]), recipe.plan
    if plan.tokens_before(step) != int(meta["tokens"]):
        raise RecipeError(
            f"{checkpoint}: step {step} holds {meta['tokens']:,} tokens, the recipe's plan {plan.tokens_before(step):,}: "
            "give the parent run's recipe and overrides"
        )
    factors = sorted(set(int(k) for k in factors))
    if len(factors) < 2 or factors[0] < 1:
        raise RecipeError(f"--factors: two or more positive integers, got {factors}")
    if not 0 < tolerance < 1:  # also NaN: no size would ever pass, or every size would
        raise RecipeError(f"--tolerance: a relative loss difference between 0 and 1 (e.g. 0.01), not {tolerance}")
    size = plan.batch_at(step).tokens_per_step
    want = branch_tokens(recipe, step, factors, tokens)
    check_branch_dirs([out_dir / f"x{k}" for k in factors], meta.get("run_id"))
    rows, dirs, trained = [], [], []
    for i, k in enumerate(factors, 1):
        branch = branch_batch_recipe(recipe, step, k)
        steps = want // (k * size)
        where = out_dir / f"x{k}"
        trainer = Trainer(
            branch,
            where,
            overwrite=True,
            resume=str(checkpoint),
            allow_recipe_change=BATCH_BRANCH_CHANGES,
            branch=True,
            job_type="critical-batch",
        )
        trainer.progress_total, trainer.progress_label = step + steps, f"branch {i} of {len(factors)} (x{k})"
        if trainer.accelerator.is_main_process:
            print(
                f"branch {i} of {len(factors)} (x{k}): {steps:,} steps of {k * size:,} tokens from step {step:,} "
                f"into {where}",
                flush=True,
            )
        with trainer.rundir.released_after():
            loop = trainer.steps()
            for done in loop:
                if done >= step + steps:
                    break
            loop.close()
            trainer.ckpt.finish()
            rows.append(trainer.evals.evaluate.batch_losses())
        dirs.append(str(where))
        trained.append(trainer.state.tokens - int(meta["tokens"]))
    main = trainer.accelerator.is_main_process
    trainer.accelerator.end_training()  # once: it ends the process group the next branch's Accelerator reuses
    est = estimate([k * size for k in factors], rows, tolerance)
    grow = suggested_size(size, est)
    sizes = [(b.start_tokens, b.tokens_per_step) for b in plan.batches]
    result = {
        "checkpoint": str(checkpoint),
        "step": step,
        "tokens": int(meta["tokens"]),
        "batch_tokens": size,
        "branch_tokens": want,
        "trained_tokens": trained,
        **est.as_dict(),
        "suggested": schedule_line(sizes, int(meta["tokens"]), grow),
        "suggested_batch_tokens": grow,
        "branches": dirs,
    }
    return result, main


def record(result: dict, run_dir: str | Path, out_dir: str | Path) -> None:
    """The result beside the branches and appended to the parent run's `critical_batch.jsonl`."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    with open(Path(run_dir) / RESULTS, "a") as f:
        f.write(json.dumps(result) + "\n")


def format_result(r: dict) -> list[str]:
    bound = "" if r["bounded"] else " (every size passed: a lower bound)"
    rows = ", ".join(f"{s:,}: {v:.4f}" for s, v in zip(r["sizes"], r["losses"]))
    return [
        f"critical batch at step {r['step']} ({r['tokens']:,} tokens): {r['cbs_tokens']:,} tokens "
        f"[{r['lo']:,}, {r['hi']:,}]{bound}; the run's batch {r['batch_tokens']:,}",
        f"  branches of {r['branch_tokens']:,} tokens, val/ref by size: {rows} (tolerance {r['tolerance']:.1%})",
        f"  suggested: --set '{r['suggested']}'",
    ]
