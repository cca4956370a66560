"""Resume policy: which checkpoint `--resume` continues from, and whether this recipe may continue it. The store
(checkpoint/manager.py) lists and verifies; this module decides; the loop loads."""

from __future__ import annotations

from pathlib import Path

import yaml

from ..checkpoint import CheckpointManager, list_checkpoints, read_meta
from ..checkpoint.identity import check_resume
from ..errors import PretrainerError
from ..observe import events as ev
from ..recipe.loading import flatten, training_diff
from ..recipe.plan import RunPlan, batch_phases
from ..recipe.schema import Recipe
from ..recipe.sections import BatchSection
from ..recipe.stages import continued_recipe
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


def likely_checkpoint(output_dir: Path, spec: str) -> tuple[Path, dict] | None:
    """The checkpoint `--resume spec` will most likely continue, and its meta, read before anything is built (the
    plan the run builds depends on it). Unverified: the loop's choice verifies, and `check_position` checks the
    plan against the checkpoint it chose."""
    if spec == "none":
        return None
    if spec != "auto":
        try:
            return Path(spec), read_meta(spec)
        except PretrainerError:  # the loop's choice names what is wrong with it
            return None
    found = list_checkpoints(Path(output_dir) / "checkpoints")
    return (found[-1].path, found[-1].meta) if found else None


def trained_batches(meta: dict) -> list[tuple[int, int, int]] | None:
    """The batch phases that trained a checkpoint, as (start_step, start_tokens, tokens_per_step): saved in its meta
    (`batches`), else those of the recipe it was saved with; None when neither can be read."""
    if isinstance(saved := meta.get("batches"), list):
        return [tuple(int(x) for x in p) for p in saved]
    try:
        sizes = BatchSection.model_validate(meta["recipe"]["batch"]).sizes
    except (KeyError, TypeError, ValueError):
        return None
    return [(b.start_step, b.start_tokens, b.tokens_per_step) for b in batch_phases(sizes)]


def continues_plan(allow_change: bool | tuple[str, ...]) -> bool:
    """Whether a resume may change the batch plan (any change allowed, or the batch's keys)."""
    return allow_change is True or any(p.startswith("batch") for p in allow_change or ())


def continue_plan(recipe: Recipe, found: tuple[Path, dict] | None, allow_change: bool | tuple[str, ...]) -> Recipe:
    """The recipe this resume trains: with `--allow-recipe-change` and another batch plan than the checkpoint's, its
    batch schedule continued from the checkpoint's tokens (`stages.continued_recipe`): a changed plan never replays
    or skips tokens. Any other recipe is returned as it is (an unallowed change is refused by `recipe_changes`).
    `found`: the checkpoint `likely_checkpoint` found, and its meta."""
    if found is None or not continues_plan(allow_change):
        return recipe
    path, meta = found
    if (trained := trained_batches(meta)) is None:
        return recipe
    step, tokens = int(meta["step"]), int(meta["tokens"])
    return continued_recipe(recipe, step, tokens, trained, f"--resume {path} (step {step}, {tokens:,} tokens)")


def check_position(path: Path, meta: dict, plan: RunPlan, names: list[str], continued: bool = False) -> None:
    """Refuse a checkpoint this run's plan cannot continue: its step past the plan's end, another token count at its
    step, or its step inside another stage than the one it was trained in (its data cursor belongs to that stage; a
    new stage may start exactly at it, as a branch's decay does).

    Raises:
        PretrainerError: one line, before anything of the run is written.
    """
    step, tokens, stage = int(meta["step"]), int(meta["tokens"]), int(meta["stage_index"])
    where = f"--resume {path}: the checkpoint is at step {step:,} ({tokens:,} tokens)"
    if step > plan.total_steps:
        raise PretrainerError(
            f"{where}, past the end of this recipe's run ({plan.total_steps:,} steps, {plan.total_tokens:,} tokens): "
            "lengthen the stages, or branch from an earlier checkpoint"
        )
    if plan.tokens_before(step) != tokens:
        fix = (
            "run the same command again: the plan is continued from the checkpoint --resume finds first, and this "
            "one (a remote copy) is now the one it will find"
            if continued
            else "resume with the checkpoint's batch sizes, or pass --allow-recipe-change to continue them from its "
            "tokens"
        )
        raise PretrainerError(
            f"{where}, but this recipe's plan has trained {plan.tokens_before(step):,} tokens at that step; {fix}"
        )
    span = plan.stage_at(step)
    if step < plan.total_steps and span.index != stage and not (span.index > stage and span.start_step == step):
        was = names[stage] if stage < len(names) else f"#{stage}"
        raise PretrainerError(
            f"{where} in stage {was!r}, but this recipe's plan puts that step inside stage {span.name!r} (steps "
            f"{span.start_step:,}-{span.end_step:,}): its data position belongs to the stage it was trained in; keep "
            "the stages before it as they were"
        )


def check_optimizer(path: Path, meta: dict, recipe: dict) -> None:
    """Refuse a checkpoint whose optimizer state is another optimizer's: AdamW's moments are not Muon's momentum (nor
    laid out like them), whatever `--allow-recipe-change` allows.

    Raises:
        PretrainerError: one line naming both and what can be done."""
    was = flatten(meta.get("recipe") or {}).get("optimizer.type")
    now = flatten(recipe).get("optimizer.type")
    if was is None or was == now:
        return
    raise PretrainerError(
        f"--resume {path}: the checkpoint's optimizer state is {was}'s and this recipe's optimizer.type is {now}: "
        f"one cannot continue the other; resume with --set optimizer.type={was}, or start a new run (a new "
        "--output-dir) with the new optimizer"
    )


def data_changes(path: Path, meta: dict, keys: dict[str, str], allow_change: bool) -> list[str]:
    """What changed in the data since a checkpoint (a file edited, added or removed, or the tokenizer changed: the
    content keys differ); refused unless allowed. Sources only one side has are a recipe change, judged by
    `recipe_changes`. Checkpoints from before data keys were saved pass.

    Raises:
        PretrainerError: one line naming the sources, without `--allow-data-change`.
    """
    saved = meta.get("data") or {}
    diffs = [f"{n}: {saved[n]} -> {keys[n]}" for n in sorted(set(saved) & set(keys)) if saved[n] != keys[n]]
    if diffs and not allow_change:
        raise PretrainerError(
            f"--resume {path}: the data changed since this checkpoint (a source file edited, added or removed, or "
            f"another tokenizer), so the run would continue on other samples; pass --allow-data-change to accept: "
            + "; ".join(diffs)
        )
    return diffs


def recipe_changes(path: Path, meta: dict, recipe: dict, allow_change: bool | tuple[str, ...]) -> list[str]:
    """What the current recipe changes of the checkpoint's in what is trained; refused unless the change is allowed
    (True: any; a tuple of key prefixes: those only, as a branch decay may change its stages and schedule and
    nothing else).

    Raises:
        PretrainerError: the recipe changed what is trained beyond what is allowed.
    """
    if not (diffs := training_diff(meta["recipe"], recipe)) or allow_change is True:
        return diffs
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
    return diffs


def check_resumable(path: Path, meta: dict, recipe: Recipe, plain: dict, keys: dict[str, str], allow) -> tuple:
    """Every reason this run cannot continue the checkpoint, checked before anything of the run is written (on the
    checkpoint `--resume` will likely choose) and again on the one it chose: the optimizer, the recipe, the plan's
    position, the data. `allow` is (recipe changes allowed, data changes allowed).

    Returns:
        (recipe differences, data differences), for `record_changes`.
    """
    allow_recipe, allow_data = allow
    check_optimizer(path, meta, plain)
    diffs = recipe_changes(path, meta, plain, allow_recipe)
    check_position(path, meta, recipe.plan, [s.name for s in recipe.stages], continues_plan(allow_recipe))
    return diffs, data_changes(path, meta, keys, allow_data)


def record_changes(meta: dict, changes: tuple, log, run_dir: Path, is_main: bool) -> None:
    """An allowed change, logged; the checkpoint's recipe kept beside the run's as `recipe.step_N.yaml`."""
    recipe_diffs, data_diffs = changes
    if recipe_diffs:
        log.event(ev.RECIPE_CHANGE, meta["step"], differences=recipe_diffs)
        if is_main:
            (Path(run_dir) / f"recipe.step_{meta['step']:08d}.yaml").write_text(yaml.safe_dump(meta["recipe"]))
    if data_diffs:
        log.event(ev.DATA_CHANGE, meta["step"], differences=data_diffs)
