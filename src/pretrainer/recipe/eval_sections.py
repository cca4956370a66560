"""Typed recipe sections of evaluation: held-out loss, the fixed reference loss, loss by position, and downstream
tasks through lm-evaluation-harness."""

from __future__ import annotations

from pydantic import Field

from ..strict import Section


class ContextEvalSection(Section):
    """Loss by position on held-out long documents: does the model use its advertised context window?"""

    enabled: bool = True
    """Evaluate at each eval of the longest-context stage(s) and at the end of the run (`val_pos/<from>-<to>`)."""
    sources: list[str] | None = None
    """Sources whose held-out documents are read; default: the sources of the stages with `long_docs` (all used
    sources when no stage has them)."""
    max_docs: int = Field(default=16, ge=1)
    """Held-out documents at least as long as the window, each evaluated from its first token."""
    first_bucket: int = Field(default=256, ge=2)
    """Width of the first position bucket; then powers of two (256-512, 512-1024, ...) up to the window."""


class LmEvalSection(Section):
    """Downstream tasks through lm-evaluation-harness (`pip install -e .[eval]`), run on the live model."""

    tasks: list[str] = Field(min_length=1)
    """lm-eval task names: hub tasks (online), or tasks defined by YAML files under `include_path` (offline)."""
    every_steps: int = Field(default=0, ge=0)
    """0: only at initialisation and at the end of the run; else also every N optimizer steps."""
    limit: int | None = Field(default=None, ge=1)
    """Documents per task (None: all)."""
    num_fewshot: int | None = Field(default=None, ge=0)
    """Few-shot examples per prompt (None: the task's default)."""
    include_path: str | None = None
    """A folder of local task YAMLs, relative to the working directory (e.g. `eval_tasks`)."""
    batch_size: int = Field(default=8, ge=1)
    """Requests per forward pass."""
    at_start: bool = True
    """Score the untrained model too: the baseline every later score is read against."""


class ForecastSection(Section):
    """The loss curve forecast from the LR schedule (analysis/forecast.py), fitted on `val/ref` at every eval."""

    enabled: bool = True
    """Fit at each eval once there are 4 `val/ref` points; log `forecast/final` (+ `_lo`, `_hi`) and an event."""
    calibrate: list[str] = Field(default_factory=list)
    """Run directories or `step,lr,loss` CSV files whose decays calibrate the decay gain (a branch decay, an
    earlier run of the same recipe family). Without any, a WSD run's forecast is stable-phase only until its own
    decay starts."""


class EvalSection(Section):
    """Held-out evaluation: per-source loss, `val/ref`, loss by position, downstream tasks."""

    every_steps: int = Field(default=100, ge=0)
    """0 disables periodic evaluation (the final evaluation still runs)."""
    max_batches: int = Field(default=8, ge=1)
    """Validation micro batches per source."""
    at_stage_end: bool = True
    """Also evaluate at the last step of every stage: each stage's result, and the long stage's context verdict."""
    ref_seq_len: int | None = Field(default=None, ge=2)
    """`val/ref`: one fixed context length and fixed held-out batches for the whole run, every used source
    weighted equally, so curves compare across stages and recipes. Default: the first stage's seq_len."""
    context: ContextEvalSection = Field(default_factory=ContextEvalSection)
    lm_eval: LmEvalSection | None = None
    """Downstream tasks through lm-evaluation-harness (off unless given)."""
    forecast: ForecastSection = Field(default_factory=ForecastSection)
