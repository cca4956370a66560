"""Learning-rate schedules as pure functions of the global optimizer step: f(step) -> multiplier of the peak LR.

The formulas read the run's token clock (`RunPlan.clock`: the step itself for a constant batch; under a batch
schedule, tokens so far in steps of the first size), so a batch change moves no warmup, decay or cosine in tokens;
the batch's own LR factor (`batch.lr_scaling`) multiplies the result.

Cosine comes from transformers (`get_cosine_with_min_lr_schedule_with_warmup`); WSD is written here. Both are wrapped
in `LambdaLR`, so only the step is checkpointed and the LR is recomputed on resume.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from .schema import Recipe


def wsd(
    step: int,
    *,
    warmup_steps: int,
    total_steps: int,
    decay_steps: int,
    decay_shape: str,
    min_lr_ratio: float,
    decay_start: int | None = None,
) -> float:
    """Warmup-stable-decay: linear warmup from 0, flat at the peak, then decay over `decay_steps` steps.

    Args:
        step: global optimizer step (0-based).
        decay_shape: `linear`, `cosine` or `1-sqrt` (Hägele et al. 2024 found 1-sqrt best).
        decay_start: first decay step; default: the decay is the last `decay_steps` steps of the run.

    Returns:
        The LR multiplier; `min_lr_ratio` from the end of the decay on.
    """
    if step < warmup_steps:
        return step / warmup_steps
    if decay_start is None:
        decay_start = total_steps - decay_steps
    if step < decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start) / max(1, decay_steps))
    if decay_shape == "linear":
        f = 1.0 - progress
    elif decay_shape == "cosine":
        f = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif decay_shape == "1-sqrt":
        f = 1.0 - math.sqrt(progress)
    else:
        raise ValueError(f"unknown decay_shape {decay_shape!r}")
    return min_lr_ratio + (1.0 - min_lr_ratio) * f


def cosine(step: int, *, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Linear warmup then cosine to `min_lr_ratio`, exactly as transformers computes it."""
    return _transformers_cosine(warmup_steps, total_steps, min_lr_ratio)(step)


def _transformers_cosine(warmup_steps: int, total_steps: int, min_lr_ratio: float) -> Callable[[int], float]:
    # transformers exposes the schedule only as a LambdaLR; take its lambda from a throwaway optimizer. Imported here:
    # reading a recipe (check_run, inspect_recipe) should not pay for torch and transformers.
    import torch
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = get_cosine_with_min_lr_schedule_with_warmup(
        opt, num_warmup_steps=warmup_steps, num_training_steps=total_steps, min_lr_rate=min_lr_ratio
    )
    return sched.lr_lambdas[0]


def lr_lambda(recipe: Recipe) -> Callable[[int], float]:
    """The recipe's schedule as f(step) -> multiplier, over the whole run (the decay window from its run plan)."""
    s, plan = recipe.schedule, recipe.plan
    if s.type == "cosine":
        f = _transformers_cosine(s.warmup_steps, _clock_total(plan), s.min_lr_ratio)
    else:
        kw = _wsd_args(recipe)
        f = lambda step: wsd(step, **kw)  # noqa: E731
    if len(plan.batches) == 1:
        return f
    return lambda step: f(plan.clock(step)) * plan.lr_scale(step)


def _clock_total(plan) -> float:
    """The run's length on its token clock (its steps, for a constant batch)."""
    return plan.clock(plan.total_steps)


def _wsd_args(recipe: Recipe) -> dict:
    """`wsd`'s arguments for a recipe: its schedule section and the decay window from its run plan, on the token
    clock."""
    s, plan = recipe.schedule, recipe.plan
    start = plan.clock(plan.decay_start)
    return dict(
        warmup_steps=s.warmup_steps,
        total_steps=_clock_total(plan),
        decay_steps=plan.clock(plan.decay_start + plan.decay_steps) - start,
        decay_shape=s.decay_shape,
        min_lr_ratio=s.min_lr_ratio,
        decay_start=start,
    )


def wsd_array(
    steps: np.ndarray,
    *,
    warmup_steps: int,
    total_steps: int,
    decay_steps: int,
    decay_shape: str,
    min_lr_ratio: float,
    decay_start: int | None = None,
) -> np.ndarray:
    """`wsd` at many steps at once (same arguments), for schedules over a whole run."""
    warmup, decay, shape, floor = warmup_steps, decay_steps, decay_shape, min_lr_ratio
    start = total_steps - decay if decay_start is None else decay_start
    t = np.asarray(steps, float)
    progress = np.clip((t - start) / max(1, decay), 0.0, 1.0)
    f = {
        "linear": lambda x: 1.0 - x,
        "cosine": lambda x: 0.5 * (1.0 + np.cos(np.pi * x)),
        "1-sqrt": lambda x: 1.0 - np.sqrt(x),
    }
    if shape not in f:
        raise ValueError(f"unknown decay_shape {shape!r}")
    out = np.where(t < start, 1.0, floor + (1.0 - floor) * f[shape](progress))
    return np.where(t < warmup, t / max(1, warmup), out)


def cosine_array(steps: np.ndarray, *, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> np.ndarray:
    """`cosine` at many steps at once: transformers' formula (warmup, then half a cosine to `min_lr_ratio`)."""
    t = np.asarray(steps, float)
    progress = (t - warmup_steps) / max(1, total_steps - warmup_steps)
    f = 0.5 * (1.0 + np.cos(np.pi * 2.0 * 0.5 * progress))
    f = np.maximum(0.0, f * (1 - min_lr_ratio) + min_lr_ratio)
    return np.where(t < warmup_steps, t / max(1, warmup_steps), f)


def lr_array(recipe: Recipe) -> np.ndarray:
    """The recipe's LR multiplier at steps 0 .. total_steps - 1, vectorised (`lr_lambda` at each step; a run of a
    million steps takes milliseconds, not a second of Python calls)."""
    s, plan = recipe.schedule, recipe.plan
    out = np.empty(plan.total_steps)
    for a in range(0, plan.total_steps, LR_CHUNK):  # in pieces: the formulas' temporaries stay small
        steps = np.arange(a, min(a + LR_CHUNK, plan.total_steps))
        clock = plan.clock(steps)
        if s.type == "cosine":
            kw = dict(warmup_steps=s.warmup_steps, total_steps=_clock_total(plan), min_lr_ratio=s.min_lr_ratio)
            out[a : a + len(steps)] = cosine_array(clock, **kw)
        else:
            out[a : a + len(steps)] = wsd_array(clock, **_wsd_args(recipe))
    return _scaled(plan, out)


def _scaled(plan, out: np.ndarray) -> np.ndarray:
    """`out` times each batch phase's LR factor."""
    for b in plan.batches[1:]:
        end = next((c.start_step for c in plan.batches if c.start_step > b.start_step), len(out))
        out[b.start_step : end] *= plan.lr_scale(b.start_step)
    return out


LR_CHUNK = 1 << 20
"""Steps of the schedule computed at once by `lr_array` (~8 MB per temporary)."""


def lr_at(recipe: Recipe, step: int) -> float:
    """The absolute LR at a global optimizer step."""
    return recipe.optimizer.lr * lr_lambda(recipe)(step)
