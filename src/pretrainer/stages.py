"""The stage map: where each stage sits in the run, as pure functions of the recipe.

The global batch is fixed in tokens for the whole run, so a stage's steps, tokens and sequences per step follow
from the recipe alone: which stage step N is in never depends on trainer state.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from .sections import Recipe


@dataclass(frozen=True)
class StageSpan:
    index: int
    name: str
    start_step: int
    steps: int
    seq_len: int
    sequences_per_step: int
    """Sequences in one global batch (over all devices and accumulation steps)."""
    micro_batch_size: int
    """Sequences per device per forward pass: tokens per micro batch stay fixed across stages."""
    tokens_per_step: int

    @property
    def end_step(self) -> int:
        """First step after this stage."""
        return self.start_step + self.steps

    @property
    def tokens(self) -> int:
        return self.steps * self.tokens_per_step


def stage_spans(recipe: Recipe) -> list[StageSpan]:
    """All stages with their step ranges, in order."""
    gbt = recipe.batch.global_batch_tokens
    micro_tokens = recipe.batch.micro_batch_size * recipe.stages[0].seq_len
    spans, start = [], 0
    for i, st in enumerate(recipe.stages):
        steps = st.steps if st.steps is not None else math.ceil(st.tokens / gbt)
        spans.append(
            StageSpan(
                index=i,
                name=st.name,
                start_step=start,
                steps=steps,
                seq_len=st.seq_len,
                sequences_per_step=gbt // st.seq_len,
                micro_batch_size=micro_tokens // st.seq_len,
                tokens_per_step=gbt,
            )
        )
        start += steps
    return spans


def total_steps(recipe: Recipe) -> int:
    return sum(s.steps for s in stage_spans(recipe))


def stage_at(spans: list[StageSpan], step: int) -> StageSpan:
    """The stage that optimizer step `step` (0-based) belongs to; steps past the end belong to the last stage."""
    starts = [s.start_step for s in spans]
    return spans[max(0, bisect.bisect_right(starts, step) - 1)]


def grad_accum_steps(recipe: Recipe, world_size: int) -> int:
    """Micro batches per device per optimizer step; the same in every stage."""
    micro_tokens = recipe.batch.micro_batch_size * recipe.stages[0].seq_len
    per_step = recipe.batch.global_batch_tokens // micro_tokens
    if per_step % world_size:
        raise ValueError(
            f"batch.global_batch_tokens: {recipe.batch.global_batch_tokens} tokens = {per_step} micro batches of "
            f"{micro_tokens} tokens, which does not divide over {world_size} processes"
        )
    return per_step // world_size


def branch_decay_recipe(recipe: Recipe, from_step: int, decay_steps: int) -> Recipe:
    """A recipe that ends `decay_steps` after `from_step`, decaying (WSD) over exactly those steps.

    The stage holding `from_step` is cut to end there plus the decay; later stages are dropped. Used to branch an
    anneal off any stable-phase checkpoint without touching the original run.
    """
    from .errors import RecipeError

    if recipe.schedule.type != "wsd":
        raise RecipeError("--branch-decay-from: only a WSD schedule has a stable phase to branch a decay from")
    spans = stage_spans(recipe)
    span = stage_at(spans, from_step)
    data = recipe.model_dump(mode="json")
    stage = dict(data["stages"][span.index], steps=from_step - span.start_step + decay_steps, tokens=None)
    data["stages"] = data["stages"][: span.index] + [stage]
    total = span.start_step + stage["steps"]
    data["schedule"].update(decay_stage=None, decay_fraction=decay_steps / total)
    out = Recipe.model_validate(data)
    from .schedules import wsd_decay_steps

    if wsd_decay_steps(out.schedule, total) != decay_steps:  # float rounding must not move the decay by a step
        raise RecipeError(f"--decay-steps: {decay_steps} cannot be represented over {total} steps")
    return out
