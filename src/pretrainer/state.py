"""The run's own state: what exact resume needs besides model, optimizer and RNG, and the protocol of every part
that a checkpoint carries."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Protocol


class Stateful(Protocol):
    """A part of the run that a checkpoint saves into meta.json and restores (torch's Stateful, JSON-ready)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class RunState:
    """Where the run is: step, tokens, stage, the stage's data cursor and the skip ledger."""

    step: int = 0
    tokens: int = 0
    stage_index: int = 0
    cursor: int = 0
    """The stage's next global sample index (the sampler maps it to data in O(1))."""
    skips: list[list[int]] = field(default_factory=list)
    """The skip ledger: [stage, first_sample, last_sample] ranges excluded from training."""
    train_seconds: float = 0.0

    def skips_for(self, stage: int) -> list[tuple[int, int]]:
        return [(a, b) for s, a, b in self.skips if s == stage]

    def add_skip(self, stage: int, first: int, last: int) -> None:
        self.skips.append([stage, first, last])

    def merge_skips(self, skips: list[list[int]]) -> None:
        """Union with another ledger (the run directory's may be newer than a checkpoint's)."""
        self.skips = sorted([list(x) for x in {tuple(x) for x in self.skips + [list(s) for s in skips]}])

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k in ("step", "tokens", "stage_index", "cursor", "train_seconds"):
            setattr(self, k, state[k])
        self.skips = [list(x) for x in state["skips"]]
