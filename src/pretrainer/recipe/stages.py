"""The stage map, read off the recipe's run plan: which stage step N is in never depends on trainer state.

The global batch (one size or a schedule in tokens) is part of the recipe, so a stage's steps, tokens and
sequences per step follow from the recipe alone (see plan.py, where they are derived once). Branches of a run
(a decay, a batch) are recipes derived from it here.
"""

from __future__ import annotations

from ..errors import RecipeError
from .loading import validate_derived
from .plan import StageSpan, stage_at
from .schema import Recipe

__all__ = [
    "StageSpan",
    "stage_at",
    "stage_spans",
    "total_steps",
    "grad_accum_steps",
    "branch_decay_recipe",
    "branch_batch_recipe",
    "continued_recipe",
    "BRANCH_CHANGES",
    "BATCH_BRANCH_CHANGES",
]

BRANCH_CHANGES = (
    "stages",
    "schedule.decay_fraction",
    "schedule.decay_stage",
    "schedule.decay_shape",
    "schedule.min_lr_ratio",
)
"""What a branch decay may change of its parent's recipe: where the run ends and how it decays. Anything else (the
LR, the model, the data) would branch another run than the checkpoint's, silently."""


BATCH_BRANCH_CHANGES = ("batch.schedule", "batch.global_batch_tokens", "stages", "run.seed")
"""What a batch branch (`critical_batch.py`) may change: the batch from the branch point on, the stages restated in
tokens (so that no boundary moves with the batch), and the seed (another data order from the branch point: the
branches' own training noise)."""


def stage_spans(recipe: Recipe) -> list[StageSpan]:
    """All stages with their step ranges, in order."""
    return list(recipe.plan.spans)


def total_steps(recipe: Recipe) -> int:
    return recipe.plan.total_steps


def grad_accum_steps(recipe: Recipe, world_size: int) -> int:
    """Micro batches per device per optimizer step; the same in every stage."""
    return recipe.plan.grad_accum(world_size)


def branch_decay_recipe(recipe: Recipe, from_step: int, decay_steps: int) -> Recipe:
    """A recipe that ends `decay_steps` after `from_step`, decaying (WSD) over exactly those steps.

    The stage holding `from_step` is cut to end there plus the decay; later stages are dropped. Used to branch an
    anneal off any stable-phase checkpoint without touching the original run.
    """
    if recipe.schedule.type != "wsd":
        raise RecipeError("--branch-decay-from: only a WSD schedule has a stable phase to branch a decay from")
    if recipe.schedule.min_lr_ratio >= 1.0:  # a constant-LR recipe: its "decay" would hold the LR where it is
        raise RecipeError(
            f"--branch-decay-from: schedule.min_lr_ratio is {recipe.schedule.min_lr_ratio:g}, so the branch would not "
            "decay; give the decay's floor (--set schedule.min_lr_ratio=0)"
        )
    span = recipe.plan.stage_at(from_step)
    data = recipe.model_dump(mode="json")
    stage = dict(data["stages"][span.index], steps=from_step - span.start_step + decay_steps, tokens=None)
    data["stages"] = data["stages"][: span.index] + [stage]
    total = span.start_step + stage["steps"]
    data["schedule"].update(decay_stage=None, decay_fraction=decay_steps / total)
    out = validate_derived(data, f"--decay-steps {decay_steps} from step {from_step}")
    if out.plan.decay_steps != decay_steps:  # float rounding must not move the decay by a step
        raise RecipeError(f"--decay-steps: {decay_steps} cannot be represented over {total} steps")
    return out


def branch_batch_recipe(recipe: Recipe, from_step: int, factor: int) -> Recipe:
    """The recipe with the global batch `factor` times the batch at `from_step`, from that step on (no later change
    of the parent's schedule), on the same token clock: every stage restated in tokens, so the LR at a token count,
    the stage boundaries and the decay stay where the parent has them, and the LR gets the recipe's
    `batch.lr_scaling` factor for the new size."""
    plan = recipe.plan
    if not 0 < from_step < plan.total_steps:
        raise RecipeError(f"a batch branch starts inside the run (step 1..{plan.total_steps - 1}), not at {from_step}")
    at = plan.tokens_before(from_step)
    sizes = [(b.start_tokens, b.tokens_per_step) for b in plan.batches if b.start_step < from_step]
    sizes.append((at, factor * plan.batch_at(from_step).tokens_per_step))
    data = recipe.model_dump(mode="json")
    data["batch"].update(
        global_batch_tokens=None,
        schedule=[{"from_tokens": t, "global_batch_tokens": b} for t, b in sizes],
    )
    data["stages"] = [dict(st, steps=None, tokens=span.tokens) for st, span in zip(data["stages"], plan.spans)]
    out = validate_derived(data, f"a batch branch x{factor} at step {from_step}")
    if out.plan.tokens_before(from_step) != at:  # the branch point is the same step of the same tokens
        raise RecipeError(f"a batch branch at step {from_step} would start at another token count")
    return out


def continued_recipe(
    recipe: Recipe, step: int, tokens: int, trained: list[tuple[int, int, int]], origin: str
) -> Recipe:
    """The recipe that continues a checkpoint at `step` after `tokens`, whose batches were `trained` (phases as
    (start_step, start_tokens, tokens_per_step)), under this recipe's batch sizes: the steps before `step` are the
    ones trained, the recipe's size at `tokens` applies from `step`, its later changes at their tokens. A stage given
    in tokens then ends where the recipe says in tokens, whatever sizes trained the first part of it. The recipe
    itself when its plan already agrees with what was trained (any unchanged resume).

    Raises:
        RecipeError: the continued schedule is not a valid one (`origin` names where it comes from).
    """
    plan = recipe.plan
    before = [p for p in trained if p[0] < step]
    mine = [(b.start_step, b.start_tokens, b.tokens_per_step) for b in plan.batches if b.start_step < step]
    if plan.tokens_before(step) == tokens and mine == before:
        return recipe
    sizes = [(t, size) for _, t, size in before]
    sizes.append((tokens, next(size for t, size in reversed(recipe.batch.sizes) if t <= tokens)))
    sizes += [(t, size) for t, size in recipe.batch.sizes if t > tokens]
    kept = [sizes[0]] + [b for a, b in zip(sizes, sizes[1:]) if b[1] != a[1]]  # a size that does not change is none
    data = recipe.model_dump(mode="json")
    if len(kept) == 1:
        data["batch"].update(global_batch_tokens=kept[0][1], schedule=None)
    else:
        schedule = [{"from_tokens": t, "global_batch_tokens": b} for t, b in kept]
        data["batch"].update(global_batch_tokens=None, schedule=schedule)
    out = validate_derived(data, origin)
    if out.plan.tokens_before(step) != tokens:  # the trained phases did not add up to the checkpoint's tokens
        raise RecipeError(
            f"{origin}: step {step} holds {tokens:,} tokens, but its recorded batch sizes add up to "
            f"{out.plan.tokens_before(step):,}: resume with the recipe the checkpoint was trained with"
        )
    return out
