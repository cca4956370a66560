"""The `averaging` recipe section: a merged copy of the weights (an EMA, or the mean of the last steps before each
merge point), kept beside the live model in fp32, shard-local, evaluated at every eval and exported as `merged/`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from ..strict import Section


class EmaSection(Section):
    """An exponential moving average of the weights, updated after every `every`-th applied step."""

    half_life: float = Field(default=0.05, gt=0, le=1)
    """The half-life as a fraction of the tokens averaged so far (since `averaging.start_step`, or the stage start
    with `stages: reset`): the average forgets at a pace that grows with the run, so one value serves a 1,000-step
    and a 1,000,000-step run (Karras et al. 2024's power-function EMA; their sigma_rel 0.05 and 0.1 are half-lives of
    about 4% and 9%)."""
    half_life_tokens: int | None = Field(default=None, ge=1)
    """A fixed half-life in tokens instead (levanter and composer use a fixed decay); overrides `half_life`."""
    every: int = Field(default=1, ge=1)
    """Update every N optimizer steps (the decay compounded over the N steps' tokens): cheaper, nearly the same."""


class WindowSection(Section):
    """The mean of the weights of the last `steps` steps before each merge point (OLMo-core's model merging)."""

    steps: int = Field(default=10, ge=1)
    """Steps averaged before each merge point."""
    every: int | None = Field(default=None, ge=1)
    """Steps between merge points; None: the eval cadence (`eval.every_steps`), so each eval sees a fresh merge."""


class AveragingSection(Section):
    """Weight averaging: a merged model evaluated beside the live one (`val/ref_merged`), saved in checkpoints and
    exported as `merged/` beside `final/`. Memory: one fp32 copy of each rank's own weights for `ema`, two for
    `window` (the running sum and the last merge); no communication."""

    method: Literal["none", "ema", "window"] = "none"
    """`none`: off. `ema`: exponential moving average. `window`: mean of the last steps before each merge point."""
    ema: EmaSection = Field(default_factory=EmaSection)
    window: WindowSection = Field(default_factory=WindowSection)
    start_step: int | None = Field(default=None, ge=0)
    """The first step averaged; None: the end of warmup (the warmup's weights are far from where the run goes)."""
    stages: Literal["carry", "reset"] = "reset"
    """At each stage start: `reset` restarts the average from the live weights (a new context length or mixture
    moves the weights somewhere the old average is not); `carry` keeps averaging across the boundary."""

    @model_validator(mode="after")
    def _window_fits(self) -> AveragingSection:
        w = self.window
        if self.method == "window" and w.every is not None and w.steps > w.every:
            raise ValueError(f"averaging.window.steps: {w.steps} is more than the {w.every} steps between merges")
        return self

    @property
    def enabled(self) -> bool:
        return self.method != "none"
