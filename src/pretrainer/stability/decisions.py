"""The one protocol between the loop and its parts: what a part reads of a step (`StepReport`), what it may ask of
the loop after it (a `Decision`), and the moments the loop tells it of (`Part`). Parts decide; only the loop acts
(restores, skips, stops).

The ladder, cheapest first: `Ok` (nothing to do), `Rollback` (restore `target`, measure the spike's samples under
the restored weights, skip those blamed, replay), `Abort` (stop with `exit_code`, checkpoints intact). The loop
performs each in one place (`Trainer._act`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple


@dataclass(frozen=True)
class Ok:
    pass


class StepAt(NamedTuple):
    """A past step and what rebuilds its batches: its stage and the stage's data cursor before it."""

    step: int
    stage: int
    cursor: int


@dataclass(frozen=True)
class Measure:
    """The steps whose samples a rollback measures under the restored weights: the spike's (`first..last`) and the
    reference steps before it, in step order."""

    first: int
    last: int
    steps: tuple[StepAt, ...]
    excess: float | None = None
    """The spike's excess over its trend: the data must reproduce half of it to be blamed."""


@dataclass(frozen=True)
class Rollback:
    target: Path
    """The checkpoint to restore (verified, from before the spike's onset)."""
    step: int
    """The step at which the decision was taken (the replay starts from the target's step)."""
    blame: Measure | None = None
    """What to measure once the target is restored (the pre-spike weights): the loop computes the per-sample losses
    of these steps and hands them to the spike handler, which says which samples to skip before the replay
    (`SpikeHandler.blame`)."""
    evidence: dict = field(default_factory=dict, compare=False)
    """What the decision acted on (the spike's z-score and persistence, or the blame), for the rollback event."""


@dataclass(frozen=True)
class Abort:
    message: str
    exit_code: int


Decision = Ok | Rollback | Abort
OK = Ok()


class Observed(NamedTuple):
    """A step's values on the host: the loss averaged over ranks and the global pre-clip gradient norm."""

    loss: float
    grad_norm: float | None


class Skipped(NamedTuple):
    """Why an update was held back (`non_finite`, `loss`, `grad_norm`, `limit`) and the limit it crossed."""

    reason: str
    limit: float


class StepReport(NamedTuple):
    """What a part reads of a finished optimizer step: host values only (no part may sync with the device)."""

    step: int
    """The step count after it (1-based)."""
    stage: int
    cursor: int
    """The stage's data cursor before the step: with `stage` it rebuilds the step's batches."""
    tokens: int
    """The run's tokens after the step."""
    batch_tokens: int
    """The step's own tokens (the batch phase's global batch)."""
    observed: Observed | None
    """The loss and gradient norm on the host when the guard is on (the step's one host sync), else None."""
    applied: bool
    """Whether the update reached the weights."""
    skipped: Skipped | None
    """Why it did not (skip-step or the NaN guard)."""


class Part:
    """A part of the loop: the loop tells it of the run's moments, in registration order (`train/state.py`
    `Parts`), and a checkpoint carries its state under its name (torch's Stateful, JSON-ready). Every method has a
    default that does nothing, so a part defines the moments it uses and nothing is looked up by name."""

    def stage_start(self, step: int, tokens: int) -> None:
        """A stage began live at `step` (not re-entered after a rollback or a resume)."""

    def batch_change(self, step: int) -> None:
        """A `batch.schedule` change was met live at `step`."""

    def after_step(self, report: StepReport) -> Decision | None:
        """A step finished; a part that judges returns its decision (None or `OK`: carry on)."""
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A resume: the state as saved."""

    def rewind(self, state: dict[str, Any]) -> None:
        """A rollback: by default the same as a resume; a part whose state holds history that must outlive the
        rollback (an open spike episode, the counts of skipped updates) restores only the rest."""
        self.load_state_dict(state)

    def load_files(self, directory: Path) -> None:
        """Before `load_state_dict`/`rewind`: state too large for meta.json, from the checkpoint's sub-directory of
        the part's name (the averaged weights); absent files reset it."""
