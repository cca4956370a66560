"""What a part may ask of the loop after a step. Parts decide; only the loop acts (restores, skips, stops).

The ladder, cheapest first: `Ok` (nothing to do), `Rollback` (restore `target`, add `skips` to the ledger, replay),
`Abort` (stop with `exit_code`, checkpoints intact). The loop performs each in one place (`Trainer._act`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Ok:
    pass


@dataclass(frozen=True)
class Rollback:
    target: Path
    """The checkpoint to restore (verified, from before the spike's onset)."""
    step: int
    """The step at which the decision was taken (the replay starts from the target's step)."""
    blame: tuple[int, int] | None = None
    """(first, last) steps of the spike: once the target is restored (the pre-spike weights), the loop asks the
    spike handler which of their samples to skip before replaying (`SpikeHandler.blame_restored`)."""
    evidence: dict = field(default_factory=dict, compare=False)
    """What the decision acted on (the spike's z-score and persistence, or the blame), for the rollback event."""


@dataclass(frozen=True)
class Abort:
    message: str
    exit_code: int


Decision = Ok | Rollback | Abort
OK = Ok()
