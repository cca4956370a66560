"""What a part may ask of the loop after a step. Parts decide; only the loop acts (restores, skips, stops).

The ladder, cheapest first: `Ok` (nothing to do), `Rollback` (restore `target`, add `skips` to the ledger, replay),
`Abort` (stop with `exit_code`, checkpoints intact). The loop performs each in one place (`Trainer._act`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple


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
