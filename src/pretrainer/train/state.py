"""The run's own state (what exact resume needs besides model, optimizer and RNG), the protocol of every part that a
checkpoint carries, and the registry the loop saves and restores them through."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol


class Stateful(Protocol):
    """A part of the run that a checkpoint saves into meta.json and restores (torch's Stateful, JSON-ready).

    A part may also define `rewind(state)`, used instead of `load_state_dict` on a rollback: what it keeps there is
    history that must outlive the rollback (the spike handler's open episode, the skip ledger); and
    `load_files(directory)`, for state too large for meta.json that the store wrote into the checkpoint's
    sub-directory of the part's name (the averaged weights): read before `load_state_dict`, in one place."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


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
    """The stateful parts a checkpoint carries, by name: `meta[name] = part.state_dict()`."""

    def __init__(self) -> None:
        self._parts: dict[str, Stateful] = {}

    def register(self, name: str, part: Stateful) -> None:
        if name in self._parts:
            raise ValueError(f"a part named {name!r} is already registered")
        self._parts[name] = part

    def register_all(self, parts: dict[str, Stateful | None]) -> None:
        """Each part by its name; None (a part the recipe turned off) is left out."""
        for name, part in parts.items():
            if part is not None:
                self.register(name, part)

    def __contains__(self, name: str) -> bool:
        return name in self._parts

    def state_dict(self) -> dict[str, dict[str, Any]]:
        return {name: part.state_dict() for name, part in self._parts.items()}

    def load_state_dict(self, meta: dict[str, Any], directory: Path, rollback: bool = False) -> None:
        """Each part from `meta[name]` (absent in an older checkpoint: left as it is); on a rollback through the
        part's `rewind` where it has one. A part with files of its own reads them first, from `directory/name`
        (the checkpoint restored), whether or not the meta names it: no files there resets it."""
        for name, part in self._parts.items():
            if (load_files := getattr(part, "load_files", None)) is not None:
                load_files(Path(directory) / name)
            if meta.get(name) is None:
                continue
            load = getattr(part, "rewind", None) if rollback else None
            (load or part.load_state_dict)(meta[name])
