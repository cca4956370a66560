"""Resume policy: which checkpoint `--resume` continues from, and whether this recipe may continue it. The store
(checkpoint/manager.py) lists and verifies; this module decides; the loop loads."""

from __future__ import annotations

from pathlib import Path

import yaml

from ..checkpoint import CheckpointManager, read_meta
from ..checkpoint.identity import check_resume
from ..errors import PretrainerError
from ..observe import events as ev
from ..recipe.loading import training_diff
from ..stability.recovery import episode_target


def choose_checkpoint(store: CheckpointManager, spec: str, ledger: dict | None) -> Path | None:
    """Clean up dead saves, then the checkpoint `spec` names (`none`, `auto` or a path); with `auto`, an open spike
    episode's target when a process died during its replay. None: start from scratch."""
    store.clean_incomplete()
    if spec == "none" or (path := store.find(spec)) is None:
        return None
    if spec == "auto":
        path = episode_target(path, read_meta(path)["step"], ledger, store.verify)
    if store.identity is not None:
        check_resume(path, read_meta(path), store.identity, store.root.parent, store.acc.is_main_process)
    return path


def check_data(path: Path, keys: dict[str, str], allow_change: bool, log) -> None:
    """Refuse a checkpoint trained on other data than the sources hold now (a file edited, added or removed, or the
    tokenizer changed: the content keys differ) unless allowed; sources only one side has are a recipe change,
    judged by `check_compatible`. Checkpoints from before data keys were saved pass.

    Raises:
        PretrainerError: one line naming the sources, without `--allow-data-change`.
    """
    meta = read_meta(path)
    saved = meta.get("data") or {}
    diffs = [f"{n}: {saved[n]} -> {keys[n]}" for n in sorted(set(saved) & set(keys)) if saved[n] != keys[n]]
    if not diffs:
        return
    if not allow_change:
        raise PretrainerError(
            f"--resume {path}: the data changed since this checkpoint (a source file edited, added or removed, or "
            f"another tokenizer), so the run would continue on other samples; pass --allow-data-change to accept: "
            + "; ".join(diffs)
        )
    log.event(ev.DATA_CHANGE, meta["step"], differences=diffs)


def check_compatible(
    path: Path, recipe: dict, allow_change: bool | tuple[str, ...], log, run_dir: Path, is_main: bool
) -> None:
    """Refuse a checkpoint that the current recipe cannot continue, unless the change is allowed (True: any; a tuple
    of key prefixes: those only, as a branch decay may change its stages and schedule and nothing else); an allowed
    change is logged and the checkpoint's recipe kept beside the run's as `recipe.step_N.yaml`.

    Raises:
        PretrainerError: the recipe changed what is trained beyond what is allowed.
    """
    meta = read_meta(path)
    if not (diffs := training_diff(meta["recipe"], recipe)):
        return
    if allow_change is not True:
        allowed = tuple(allow_change or ())
        refused = [d for d in diffs if not (allowed and d.startswith(allowed))]
        if refused and allowed:
            raise PretrainerError(
                f"branch from {path}: the branch changes more than it may ({', '.join(allowed)}); run it with the "
                "parent run's recipe and overrides, or pass --allow-recipe-change:\n  " + "\n  ".join(refused)
            )
        if refused:
            raise PretrainerError(
                f"--resume {path}: the recipe changed since this checkpoint; pass --allow-recipe-change to accept:\n  "
                + "\n  ".join(diffs)
            )
    log.event(ev.RECIPE_CHANGE, meta["step"], differences=diffs)
    if is_main:
        (Path(run_dir) / f"recipe.step_{meta['step']:08d}.yaml").write_text(yaml.safe_dump(meta["recipe"]))
