"""The run plan: every quantity derived from a recipe's stages, batch and schedule, computed once.

Stage spans (where each stage starts and how many steps it has), the batch size at every step (`batch.schedule`),
total steps, tokens per micro batch, the WSD decay window and the clipping norm are pure functions of the recipe. `Recipe.plan` holds the one `RunPlan` built during
validation; the schedules, the trainer, the linter and `inspect_recipe.py` read it, and nothing re-derives it.

It reads only the sections it is given (batch, stages, schedule, clipping), so the recipe's own validation can
build the plan.

A batch schedule is a map from tokens to sizes; the plan turns it into phases of steps once: a change applies at the
first step that starts at or after its `from_tokens`, and a stage given in tokens ends at the first step boundary at
or past them, whatever the sizes on the way. The LR schedule reads the run's token clock (`clock`), in steps of the
first size, so a constant batch is the plain step count.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import numpy as np

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
    """At the stage's first step (a batch schedule may change it inside the stage: `RunPlan.batch_at`)."""
    tokens: int
    """Tokens the stage trains on."""

    @property
    def end_step(self) -> int:
        """First step after this stage."""
        return self.start_step + self.steps


@dataclass(frozen=True)
class BatchPhase:
    """Steps of one global batch size."""

    start_step: int
    start_tokens: int
    """Tokens trained before `start_step`."""
    tokens_per_step: int

    def tokens_before(self, step: int) -> int:
        return self.start_tokens + (step - self.start_step) * self.tokens_per_step


@dataclass(frozen=True)
class RunPlan:
    spans: tuple[StageSpan, ...]
    total_steps: int
    micro_tokens: int
    """Tokens per micro batch (micro_batch_size x the first stage's seq_len), the same in every stage."""
    global_batch_tokens: int
    """The first (for a constant batch, the only) global batch size."""
    batches: tuple[BatchPhase, ...]
    """The batch phases that start inside the run (one for a constant batch)."""
    lr_power: float
    """LR x (batch / first batch) ** lr_power: the recipe's `batch.lr_scaling`."""
    warmup_steps: int
    decay_start: int | None
    """WSD: the first decay step (None for cosine)."""
    decay_steps: int | None
    """WSD: the length of the decay (None for cosine)."""
    max_grad_norm: float | None
    """The clipping norm; None means no clipping (the one encoding of "off")."""

    @property
    def total_tokens(self) -> int:
        return self.tokens_before(self.total_steps)

    def batch_at(self, step: int) -> BatchPhase:
        """The batch phase that optimizer step `step` (0-based) belongs to."""
        starts = [b.start_step for b in self.batches]
        return self.batches[max(0, bisect.bisect_right(starts, step) - 1)]

    def tokens_before(self, step: int) -> int:
        """Tokens trained before optimizer step `step`."""
        return self.batch_at(step).tokens_before(step)

    def clock(self, steps):
        """The run's token clock at `steps` (an int or an array), in steps of the first batch size: what the LR
        schedule reads. The step itself for a constant batch."""
        if len(self.batches) == 1:
            return steps
        if isinstance(steps, int | np.integer):  # the loop's LR, once per step: no arrays
            return self.tokens_before(int(steps)) / self.global_batch_tokens
        arr = np.asarray(steps)
        starts = np.array([b.start_step for b in self.batches])
        i = np.maximum(0, np.searchsorted(starts, arr, side="right") - 1)
        st, tok = starts[i], np.array([b.start_tokens for b in self.batches])[i]
        size = np.array([b.tokens_per_step for b in self.batches])[i]
        out = (tok + (arr - st) * size) / self.global_batch_tokens
        return float(out) if out.ndim == 0 else out

    def lr_scale(self, step: int) -> float:
        """The LR factor of the batch at `step` (1 for the first size)."""
        return (self.batch_at(step).tokens_per_step / self.global_batch_tokens) ** self.lr_power

    def stage_at(self, step: int) -> StageSpan:
        return stage_at(self.spans, step)

    def micro_batches(self, step: int = 0) -> int:
        """Micro batches (over all processes) in optimizer step `step`."""
        return self.batch_at(step).tokens_per_step // self.micro_tokens

    @property
    def micro_batches_per_step(self) -> int:
        return self.micro_batches(0)

    def grad_accum(self, world_size: int, step: int = 0) -> int:
        """Micro batches per device in optimizer step `step` (the same in every stage).

        Raises:
            RecipeError: a global batch of the run does not divide over `world_size` processes.
        """
        for b in self.batches:
            per_step = b.tokens_per_step // self.micro_tokens
            if per_step % world_size:
                valid = ", ".join(str(n) for n in self.valid_world_sizes())
                field = "batch.global_batch_tokens" if len(self.batches) == 1 else "batch.schedule"
                raise RecipeError(
                    f"{field}: {b.tokens_per_step} tokens = {per_step} micro batches of {self.micro_tokens} tokens, "
                    f"which does not divide over {world_size} processes (valid counts: {valid})"
                )
        return self.micro_batches(step) // world_size

    def valid_world_sizes(self) -> list[int]:
        """The process counts every global batch of the run divides over."""
        per_step = math.gcd(*(b.tokens_per_step // self.micro_tokens for b in self.batches))
        return [n for n in range(1, per_step + 1) if per_step % n == 0]


def stage_at(spans, step: int) -> StageSpan:
    """The stage that optimizer step `step` (0-based) belongs to; steps past the end belong to the last stage."""
    starts = [s.start_step for s in spans]
    return spans[max(0, bisect.bisect_right(starts, step) - 1)]


LR_POWER = {"sqrt": 0.5, "linear": 1.0, "none": 0.0}


def batch_phases(sizes: list[tuple[int, int]]) -> list[BatchPhase]:
    """(from_tokens, size) -> phases of steps: a change applies at the first step that starts at or after its
    tokens (a size whose window a step jumps over entirely never runs)."""
    phases = [BatchPhase(0, 0, sizes[0][1])]
    for at, size in sizes[1:]:
        last = phases[-1]
        k = -(-(at - last.start_tokens) // last.tokens_per_step)  # steps of the last size before the change
        phase = BatchPhase(last.start_step + k, last.start_tokens + k * last.tokens_per_step, size)
        if k == 0:
            phases[-1] = phase
        elif size != last.tokens_per_step:
            phases.append(phase)
    return phases


def _step_at_tokens(phases: list[BatchPhase], tokens: int) -> int:
    """The first step that starts at or after `tokens`."""
    starts = [b.start_tokens for b in phases]
    b = phases[max(0, bisect.bisect_right(starts, tokens) - 1)]
    return b.start_step + -(-(tokens - b.start_tokens) // b.tokens_per_step)


def build_plan(
    batch: BatchSection,
    stages: list[StageSection],
    schedule: ScheduleSection,
    clipping: ClippingSection,
    lr_scaling: str = "sqrt",
) -> RunPlan:
    """The plan of sections that are individually valid (the recipe's validator calls this)."""
    gbt = batch.global_batch_tokens
    micro_tokens = batch.micro_batch_size * stages[0].seq_len
    phases = batch_phases(batch.sizes)
    spans, start = [], 0
    for i, st in enumerate(stages):
        before = _tokens_before(phases, start)
        end = start + st.steps if st.steps is not None else _step_at_tokens(phases, before + st.tokens)
        size = _phase_at(phases, start).tokens_per_step
        spans.append(
            StageSpan(
                index=i,
                name=st.name,
                start_step=start,
                steps=end - start,
                seq_len=st.seq_len,
                sequences_per_step=size // st.seq_len,
                micro_batch_size=micro_tokens // st.seq_len,
                tokens_per_step=size,
                tokens=_tokens_before(phases, end) - before,
            )
        )
        start = end
    total = start
    sched = schedule
    decay_start = decay_steps = None
    if sched.type == "wsd":
        pinned = next((s for s in spans if s.name == sched.decay_stage), None)
        if pinned is not None:
            decay_start, decay_steps = pinned.start_step, pinned.steps
        else:  # the last `decay_fraction` of the run's tokens (of its steps, for a constant batch)
            clock_total = _tokens_before(phases, total) / gbt
            decay_clock = max(1, round(sched.decay_fraction * clock_total))
            decay_start = _step_at_tokens(phases, round((clock_total - decay_clock) * gbt))
            decay_steps = total - decay_start
    return RunPlan(
        spans=tuple(spans),
        total_steps=total,
        micro_tokens=micro_tokens,
        global_batch_tokens=gbt,
        batches=tuple(b for b in phases if b.start_step < total or b.start_step == 0),
        lr_power=LR_POWER[lr_scaling],
        warmup_steps=sched.warmup_steps,
        decay_start=decay_start,
        decay_steps=decay_steps,
        max_grad_norm=clipping.max_grad_norm or None,
    )


def _phase_at(phases: list[BatchPhase], step: int) -> BatchPhase:
    starts = [b.start_step for b in phases]
    return phases[max(0, bisect.bisect_right(starts, step) - 1)]


def _tokens_before(phases: list[BatchPhase], step: int) -> int:
    return _phase_at(phases, step).tokens_before(step)
