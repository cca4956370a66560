"""The run plan: every quantity derived from a recipe's stages, batch and schedule, computed once.

Stage spans (where each stage starts and how many steps it has), total steps, tokens per micro batch, the WSD decay
window and the clipping norm are pure functions of the recipe. `Recipe.plan` holds the one `RunPlan` built during
validation; the schedules, the trainer, the linter and `inspect_recipe.py` read it, and nothing re-derives it.

It reads only the sections it is given (batch, stages, schedule, clipping), so the recipe's own validation can
build the plan.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from ..errors import RecipeError
from .sections import BatchSection, ClippingSection, ScheduleSection, StageSection


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


@dataclass(frozen=True)
class RunPlan:
    spans: tuple[StageSpan, ...]
    total_steps: int
    micro_tokens: int
    """Tokens per micro batch (micro_batch_size x the first stage's seq_len), the same in every stage."""
    global_batch_tokens: int
    warmup_steps: int
    decay_start: int | None
    """WSD: the first decay step (None for cosine)."""
    decay_steps: int | None
    """WSD: the length of the decay (None for cosine)."""
    max_grad_norm: float | None
    """The clipping norm; None means no clipping (the one encoding of "off")."""

    @property
    def total_tokens(self) -> int:
        return sum(s.tokens for s in self.spans)

    @property
    def micro_batches_per_step(self) -> int:
        return self.global_batch_tokens // self.micro_tokens

    def stage_at(self, step: int) -> StageSpan:
        return stage_at(self.spans, step)

    def grad_accum(self, world_size: int) -> int:
        """Micro batches per device per optimizer step; the same in every stage.

        Raises:
            RecipeError: the global batch does not divide over `world_size` processes.
        """
        per_step = self.micro_batches_per_step
        if per_step % world_size:
            valid = ", ".join(str(n) for n in self.valid_world_sizes())
            raise RecipeError(
                f"batch.global_batch_tokens: {self.global_batch_tokens} tokens = {per_step} micro batches of "
                f"{self.micro_tokens} tokens, which does not divide over {world_size} processes (valid counts: "
                f"{valid})"
            )
        return per_step // world_size

    def valid_world_sizes(self) -> list[int]:
        """The process counts the global batch divides over."""
        per_step = self.micro_batches_per_step
        return [n for n in range(1, per_step + 1) if per_step % n == 0]


def stage_at(spans, step: int) -> StageSpan:
    """The stage that optimizer step `step` (0-based) belongs to; steps past the end belong to the last stage."""
    starts = [s.start_step for s in spans]
    return spans[max(0, bisect.bisect_right(starts, step) - 1)]


def build_plan(
    batch: BatchSection, stages: list[StageSection], schedule: ScheduleSection, clipping: ClippingSection
) -> RunPlan:
    """The plan of sections that are individually valid (the recipe's validator calls this)."""
    gbt = batch.global_batch_tokens
    micro_tokens = batch.micro_batch_size * stages[0].seq_len
    spans, start = [], 0
    for i, st in enumerate(stages):
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
    total = start
    sched = schedule
    decay_start = decay_steps = None
    if sched.type == "wsd":
        pinned = next((s for s in spans if s.name == sched.decay_stage), None)
        if pinned is not None:
            decay_start, decay_steps = pinned.start_step, pinned.steps
        else:
            decay_steps = max(1, round(sched.decay_fraction * total))
            decay_start = total - decay_steps
    return RunPlan(
        spans=tuple(spans),
        total_steps=total,
        micro_tokens=micro_tokens,
        global_batch_tokens=gbt,
        warmup_steps=sched.warmup_steps,
        decay_start=decay_start,
        decay_steps=decay_steps,
        max_grad_norm=clipping.max_grad_norm or None,
    )
