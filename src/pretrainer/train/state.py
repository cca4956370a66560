"""The run's own state (what exact resume needs besides model, optimizer and RNG), and the registry of the loop's
parts (`stability/decisions.py` `Part`): the moments the loop tells them of, and what a checkpoint carries of them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ..stability.decisions import OK, Decision, Ok, Part, StepReport


class Stateful(Protocol):
    """What a checkpoint carries of an object that takes no part in the loop's moments (the LR schedule, the loss
    statistics, the noise scale, the forecast): torch's Stateful, JSON-ready. `Parts.register_state` holds it as a
    `Part` that does nothing else."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class StateOnly(Part):
    """A `Stateful` as a part: its state saved and restored, no moments."""

    def __init__(self, inner: Stateful):
        self.inner = inner

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)


@dataclass
class RunState:
    """Where the run is: step, tokens, stage, the stage's data cursor and the skip ledger. The loop is its only
    writer; parts read it and return decisions."""

    step: int = 0
    tokens: int = 0
    stage_index: int = 0
    cursor: int = 0
    """The stage's next global sample index (the sampler maps it to data in O(1))."""
    skips: list[list[int]] = field(default_factory=list)
    """The skip ledger: [stage, first_sample, last_sample] ranges excluded from training."""

    def skips_for(self, stage: int) -> list[tuple[int, int]]:
        return [(a, b) for s, a, b in self.skips if s == stage]

    def add_skip(self, stage: int, first: int, last: int) -> None:
        self.merge_skips([[stage, first, last]])

    def merge_skips(self, skips: list[list[int]]) -> None:
        """Union with another ledger (the run directory's may be newer than a checkpoint's)."""
        self.skips = sorted([list(x) for x in {tuple(x) for x in self.skips + [list(s) for s in skips]}])

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k in ("step", "tokens", "stage_index", "cursor"):
            setattr(self, k, state[k])
        self.skips = [list(x) for x in state["skips"]]

    def rewind(self, state: dict[str, Any]) -> None:
        """A rollback: back to the checkpoint's position, keeping every skip known now (the ledger is history)."""
        skips = self.skips
        self.load_state_dict(state)
        self.merge_skips(skips)


class Parts:
    """The loop's parts, by name, in registration order: the loop tells them of its moments through here, and a
    checkpoint carries `meta[name] = part.state_dict()`."""

    def __init__(self) -> None:
        self._parts: dict[str, Part] = {}

    def register(self, name: str, part: Part) -> None:
        if not isinstance(part, Part):
            raise TypeError(f"{name}: {type(part).__name__} is no Part; an object with state only: register_state")
        if name in self._parts:
            raise ValueError(f"a part named {name!r} is already registered")
        self._parts[name] = part

    def register_all(self, parts: dict[str, Part | None]) -> None:
        """Each part by its name; None (a part the recipe turned off) is left out."""
        for name, part in parts.items():
            if part is not None:
                self.register(name, part)

    def register_state(self, parts: dict[str, Stateful | None]) -> None:
        """State the checkpoint carries, of objects with no moments of their own (`StateOnly`)."""
        self.register_all({name: StateOnly(obj) if obj is not None else None for name, obj in parts.items()})

    def __contains__(self, name: str) -> bool:
        return name in self._parts

    # ------------------------------------------------------------------ the loop's moments

    def stage_start(self, step: int, tokens: int) -> None:
        for part in self._parts.values():
            part.stage_start(step, tokens)

    def batch_change(self, step: int) -> None:
        for part in self._parts.values():
            part.batch_change(step)

    def after_step(self, report: StepReport) -> Decision:
        """Every part reads the step; the first decision other than carrying on is the loop's to act on."""
        decision: Decision = OK
        for part in self._parts.values():
            d = part.after_step(report)
            if d is not None and not isinstance(d, Ok) and isinstance(decision, Ok):
                decision = d
        return decision

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, dict[str, Any]]:
        return {name: part.state_dict() for name, part in self._parts.items()}

    def load_state_dict(self, meta: dict[str, Any], directory: Path, rollback: bool = False) -> None:
        """Each part from `meta[name]` (absent in an older checkpoint: left as it is), through `rewind` on a
        rollback. A part with files of its own reads them first, from `directory/name` (the checkpoint restored),
        whether or not the meta names it: no files there resets it."""
        for name, part in self._parts.items():
            part.load_files(Path(directory) / name)
            if meta.get(name) is None:
                continue
            if rollback:
                part.rewind(meta[name])
            else:
                part.load_state_dict(meta[name])
