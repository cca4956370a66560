"""Every fenced shell command in README.md and docs/*.md names things that exist and flags its script accepts: make
targets of the Makefile, scripts under scripts/ whose own argument parser takes the command's arguments (a Slurm job
script's arguments are run_recipe.py's), Accelerate
configs and recipes that are files, and checkpoints of `runs/tiny` that `make run` leaves (the tiny recipe's saves:
stage ends and token triggers, its `keep_last`). None is skipped silently: each command is one of those kinds or
the test fails on it. Training commands are checked, not run (the runs they start take minutes to days); the cheap
ones (the offline tools on recipes and on `runs/tiny`) also run as written, in the slow suite. A `runs/X` a command
reads must be one a documented command writes (`make run`, an `--output-dir`): the chained follow-ups hold together."""

import importlib
import re
import shlex
from pathlib import Path

import pytest

from pretrainer.recipe.loading import load_recipe

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"```(?:bash|sh|shell)\n(.*?)```", re.S)


def commands() -> list[tuple[str, str]]:
    out = []
    for path in DOCS:
        for block in FENCE.findall(path.read_text()):
            for line in block.replace("\\\n", " ").splitlines():
                line = re.sub(r"\s+#.*$", "", line.strip())
                if line and not line.startswith("#"):
                    out.append((path.name, line))
    return out


def tiny_checkpoints() -> set[str]:
    """The checkpoint names `make run` leaves: saves at stage ends and token triggers (the wall-clock trigger, 30
    minutes, does not fire in a run of minutes), the newest `keep_last` of them."""
    recipe = load_recipe(ROOT / "recipes" / "tiny.yaml")
    ck, steps, tokens = recipe.checkpoint, set(), 0
    for span in recipe.plan.spans:
        for step in range(span.start_step + 1, span.end_step + 1):
            before, tokens = tokens, tokens + span.tokens_per_step
            if ck.every_tokens and tokens // ck.every_tokens > before // ck.every_tokens:
                steps.add(step)
        if ck.at_stage_end:
            steps.add(span.end_step)
    return {f"step_{s:08d}" for s in sorted(steps)[-ck.keep_last :]}


def produced_runs(cmds: list[tuple[str, str]]) -> set[str]:
    """The run directories the documented commands write (`runs/tiny` by `make run`, each `--output-dir runs/X`):
    the only `runs/...` a documented command may read, so a follow-up names what an earlier step made."""
    out = {"runs/tiny"}
    for _, cmd in cmds:
        words = shlex.split(cmd)
        out.update(words[i + 1] for i, w in enumerate(words[:-1]) if w == "--output-dir")
    return {w for w in out if w.startswith("runs/")}


def makefile_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))


def script_args(words: list[str]) -> tuple[str, list[str]] | None:
    """(script path, its arguments) of a `python scripts/X.py ...` or `accelerate launch ... scripts/X.py ...`."""
    for i, w in enumerate(words):
        if w.startswith("scripts/") and w.endswith(".py"):
            return w, words[i + 1 :]
    return None


def check(command: str, tiny: set[str], targets: set[str], runs: frozenset[str] = frozenset({"runs/tiny"})) -> str:
    """What the command is (for the count); raises AssertionError naming what does not exist or parse, or a
    `runs/X` it reads that no documented command writes (`runs`: those that are)."""
    words = shlex.split(command)
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # environment assignments
        words = words[1:]
    for i, w in enumerate(words):  # files the command names
        if w.startswith(("recipes/", "accelerate_configs/", "tests/fixtures/", "eval_tasks/")):
            assert (ROOT / w).exists(), f"{w} does not exist"
        if m := re.match(r"runs/tiny/checkpoints/(step_\d+)", w):
            assert m.group(1) in tiny, f"{w}: `make run` leaves only {sorted(tiny)}"
        if w.startswith("runs/") and words[i - 1] != "--output-dir":
            root = "/".join(w.split("/")[:2])
            assert root in runs, f"{w}: no documented command writes {root} (those that do: {sorted(runs)})"
    if words[0] == "make":
        assert set(words[1:]) <= targets, f"no Makefile target {set(words[1:]) - targets}"
        return "make"
    if words[0] in ("sbatch", "bash") and any(w.endswith(".sbatch") for w in words):  # RECIPE [args] after it
        i = next(k for k, w in enumerate(words) if w.endswith(".sbatch"))
        assert (ROOT / words[i]).exists(), f"{words[i]} does not exist"
        words = ["python", "scripts/run_recipe.py", *words[i + 1 :]]
    found = script_args(words)
    if found is None:
        raise AssertionError("not a make target or a script of this repository: extend check() for it")
    script, args = found
    assert (ROOT / script).exists(), f"{script} does not exist"
    module = importlib.import_module(Path(script).stem)
    parse = getattr(module, "parse_args", None)
    if parse is None:
        return "script (no parser)"
    try:
        parse(args)
    except SystemExit as e:
        raise AssertionError(f"{script} does not accept {args}") from e
    return "script"


def test_every_fenced_command_names_what_exists(capsys):
    cmds = commands()
    tiny, targets, runs = tiny_checkpoints(), makefile_targets(), frozenset(produced_runs(cmds))
    kinds, failures = {}, []
    for doc, cmd in cmds:
        try:
            kind = check(cmd, tiny, targets, runs)
            kinds[kind] = kinds.get(kind, 0) + 1
        except AssertionError as e:
            failures.append(f"{doc}: {cmd[:100]}: {e}")
    with capsys.disabled():
        print(f"\ndoc commands: {len(cmds)} checked ({kinds})")
    assert len(cmds) >= 30 and not failures, "\n".join(failures)


def test_a_follow_up_of_a_run_no_command_writes_is_caught():
    runs = frozenset(produced_runs(commands()))
    assert "runs/tiny-decay" in runs  # the README's branch decay
    with pytest.raises(AssertionError, match="no documented command writes runs/tiny-decay-100"):
        check("python scripts/forecast.py runs/tiny --calibrate runs/tiny-decay-100", set(), set(), runs)


@pytest.mark.parametrize("name", ["step_00000100"])
def test_a_checkpoint_make_run_does_not_leave_is_caught(name):
    with pytest.raises(AssertionError, match="leaves only"):
        check(f"python scripts/export_checkpoint.py runs/tiny/checkpoints/{name} out", tiny_checkpoints(), set())


OFFLINE_TOOLS = {
    f"scripts/{n}.py"
    for n in ("check_run", "inspect_recipe", "export_checkpoint", "eval_checkpoint", "forecast", "wandb_workspace")
}
"""The scripts that read a run or a recipe and train nothing."""


def cheap(command: str) -> bool:
    """A documented command that runs in minutes on what `make run` leaves: its inputs are recipes and `runs/tiny`,
    nothing from a cluster, a GPU, another run or the Hub."""
    words = shlex.split(command)
    if len(words) < 2 or words[0] != "python" or words[1] not in OFFLINE_TOOLS:
        return False
    if "--push-to-hub" in words or "--entity" in words:  # the Hub, W&B: the network
        return False
    runs = [w for w in words if w.startswith(("runs/", "/", "some/")) or w.endswith(".csv")]
    return all(w == "runs/tiny" or w.startswith("runs/tiny/") for w in runs)


def test_the_workspace_layout_runs_with_the_cheap_commands_and_its_upload_does_not():
    assert cheap("python scripts/wandb_workspace.py runs/tiny --json")
    assert not cheap("python scripts/wandb_workspace.py runs/tiny --entity my-team")  # W&B, over the network


@pytest.mark.slow  # every cheap documented command run as written on a trained tiny run
def test_the_cheap_documented_commands_run(tmp_path, tiny_run):
    """Every cheap command of the docs, run as written in a directory that looks like the repository after `make run`
    (the repository's folders linked, `runs/tiny` a copy of the session's trained tiny run): exit 0 each. The rest
    are checked above."""
    import shutil
    import subprocess
    import sys

    work = tmp_path / "repo"
    work.mkdir()
    for name in ("scripts", "recipes", "eval_tasks", "docs", "accelerate_configs", "tests"):
        (work / name).symlink_to(ROOT / name)
    shutil.copytree(tiny_run, work / "runs" / "tiny", symlinks=True)
    ran, failed = [], []
    for doc, cmd in commands():
        if not cheap(cmd) or " ".join(shlex.split(cmd)) in ran:  # a command two docs show runs once
            continue
        words = [sys.executable if w == "python" else w for w in shlex.split(cmd)]
        proc = subprocess.run(words, cwd=work, capture_output=True, text=True, timeout=600)
        ran.append(" ".join(shlex.split(cmd)))
        if proc.returncode != 0:
            failed.append(f"{doc}: {cmd}: exit {proc.returncode}: {proc.stderr.strip()[-500:]}")
    print(f"\ncheap doc commands run: {len(ran)}")
    assert len(ran) >= 12 and not failed, "\n".join(failed)
