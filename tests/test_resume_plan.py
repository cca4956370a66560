"""A resume or a branch never loses training or a run: a changed batch plan continues from the checkpoint's tokens,
a branch never writes into the run it starts from, and what a resume cannot honour is refused in one line before
anything of the run is written (issue 57's silent-loss classes)."""

import hashlib
import os
import shutil
import signal
import subprocess
import sys

import pytest
from conftest import FIXTURES, ROOT

from pretrainer.errors import RecipeError
from pretrainer.observe.tracking import read_jsonl
from pretrainer.recipe.loading import load_recipe
from pretrainer.recipe.stages import continued_recipe

MICRO = FIXTURES / "micro.yaml"
STAGE = "stages=[{name: main, tokens: 20480, seq_len: 64, mixture: {stdlib: 1.0}}]"
"""One stage of 20,480 tokens: 20 steps of the micro recipe's 1,024-token batch."""
SAVES = ["checkpoint.every_tokens=4096", "checkpoint.keep_last=10", "eval.every_steps=0"]
GROWN = (
    "batch.schedule=[{from_tokens: 0, global_batch_tokens: 1024}, {from_tokens: 4096, global_batch_tokens: 2048}, "
    "{from_tokens: 8192, global_batch_tokens: 4096}]"
)
"""The kind of schedule critical_batch.py suggests, written from an earlier checkpoint's tokens: its own plan is at
20,480 tokens by step 9."""


def recipe(*sets):
    return load_recipe(MICRO, list(sets), check_model=False)


def phases(r):
    return [(b.start_step, b.start_tokens, b.tokens_per_step) for b in r.plan.batches]


def test_a_changed_schedule_continues_from_the_checkpoints_tokens_and_stages_keep_theirs():
    trained = phases(recipe(STAGE))  # constant 1,024: step 12 holds 12,288 tokens
    grown = recipe(STAGE, "batch.global_batch_tokens=null", GROWN)
    assert grown.plan.total_steps == 9  # alone, the new plan is over at step 9: a resume at 12 would train nothing
    out = continued_recipe(grown, 12, 12288, trained, "--resume x")
    assert phases(out) == [(0, 0, 1024), (12, 12288, 4096)]
    assert out.plan.total_tokens == 20480 and out.plan.total_steps == 14  # the stage's tokens, not a step count
    # a change moved later than the checkpoint: the sizes trained stay, the new one applies at its own tokens
    trained = phases(recipe(STAGE, "batch.global_batch_tokens=null", GROWN))  # 4,096 from step 6 (8,192 tokens)
    later = recipe(
        STAGE,
        "batch.global_batch_tokens=null",
        "batch.schedule=[{from_tokens: 0, global_batch_tokens: 1024}, {from_tokens: 16384, global_batch_tokens: 4096}]",
    )
    out = continued_recipe(later, 7, 12288, trained, "--resume x")
    assert phases(out) == [(0, 0, 1024), (4, 4096, 2048), (6, 8192, 4096), (7, 12288, 1024), (11, 16384, 4096)]
    assert out.plan.total_tokens == 20480  # not 22,528: the stage ends at its tokens
    # an unchanged plan is the recipe itself (every ordinary resume)
    same = recipe(STAGE)
    assert continued_recipe(same, 12, 12288, phases(same), "--resume x") is same
    # a schedule that cannot continue what was trained is one line naming the checkpoint
    with pytest.raises(RecipeError, match=r"^--resume x: batch: schedule.1.global_batch_tokens: 1536 .*multiple"):
        continued_recipe(recipe(STAGE, "batch.global_batch_tokens=1536"), 4, 8192, [(0, 0, 2048)], "--resume x")


def micro(out, *sets, args=(), kill_at=None):
    cmd = [sys.executable, "scripts/run_recipe.py", str(MICRO), "--output-dir", str(out)]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **({"PRETRAINER_KILL_AT": kill_at} if kill_at else {})}
    return subprocess.run([*cmd, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def killed(tmp_path_factory, cache_dir):
    """A constant-batch run of the 20,480-token stage, killed after step 13 (checkpoints at steps 4, 8 and 12)."""
    out = tmp_path_factory.mktemp("killed") / "run"
    proc = micro(out, f"data.cache_dir={cache_dir}", STAGE, *SAVES, kill_at="step:13")
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    return out


def digest(run) -> dict[str, str]:
    """Every file of a run directory by content (the lock file aside: it is the lock, not the run)."""
    return {
        str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(run.rglob("*"))
        if p.is_file() and not p.name.startswith(".lock")
    }


def test_a_resume_under_a_grown_schedule_trains_the_stages_tokens(killed, tmp_path, cache_dir):
    out = tmp_path / "run"
    shutil.copytree(killed, out)
    sets = [f"data.cache_dir={cache_dir}", STAGE, *SAVES, "batch.global_batch_tokens=null", GROWN]
    proc = micro(out, *sets, args=["--resume", "auto", "--allow-recipe-change"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    events = read_jsonl(out / "events.jsonl")
    resume = next(e for e in events if e["event"] == "resume")
    assert (resume["step"], resume["tokens"]) == (12, 12288)
    end = next(e for e in events if e["event"] == "run_end")
    assert (end["step"], end["tokens"]) == (14, 20480)  # before: step 12, 12,288 tokens, 40% of the stage untrained
    rows = [m for m in read_jsonl(out / "metrics.jsonl") if "loss" in m and m["step"] > 12]
    assert [(m["step"], m["batch_tokens"]) for m in rows] == [(13, 4096), (14, 4096)]
    # the resolved recipe says what was trained: the sizes before the checkpoint, the new ones after
    resolved = load_recipe(out / "recipe.resolved.yaml", check_model=False)
    assert phases(resolved) == [(0, 0, 1024), (12, 12288, 4096)]


def test_a_branch_into_the_run_it_starts_from_is_refused_and_the_run_is_untouched(killed, capsys):
    import run_recipe

    before = digest(killed)
    ckpt = killed / "checkpoints" / "step_00000008"
    for target in (killed, killed / "checkpoints", killed.parent):
        argv = [str(MICRO), "--set", STAGE, *sum((["--set", s] for s in SAVES), [])]
        argv += ["--branch-decay-from", str(ckpt), "--decay-steps", "4", "--output-dir", str(target)]
        assert run_recipe.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "a branch writes a new run" in err[0], err
    assert digest(killed) == before  # hashes before and after: nothing written, not even the recipe


@pytest.mark.parametrize(
    ("sets", "args", "message"),
    [
        (["optimizer.type=muon", "batch.lr_scaling=sqrt"], ["--allow-recipe-change"], "optimizer state is adamw's"),
        (
            ["stages=[{name: main, tokens: 8192, seq_len: 64, mixture: {stdlib: 1.0}}]"],
            ["--allow-recipe-change"],
            "past the end",
        ),
        ([STAGE, "optimizer.lr=0.02"], [], "pass --allow-recipe-change"),
        (
            [
                "stages=[{name: warm, steps: 4, seq_len: 64, mixture: {stdlib: 1.0}}, "
                "{name: main, steps: 16, seq_len: 64, mixture: {stdlib: 1.0}}]"
            ],
            ["--allow-recipe-change"],
            "inside stage 'main'",
        ),
    ],
    ids=["optimizer", "past-the-end", "unallowed", "another-stage"],
)
def test_a_resume_the_recipe_cannot_honour_is_one_line_and_writes_nothing(
    killed, cache_dir, sets, args, message, capsys
):
    import run_recipe

    before = digest(killed)
    argv = [str(MICRO), "--output-dir", str(killed), "--resume", "auto", *args]
    for s in (f"data.cache_dir={cache_dir}", *SAVES, *sets):
        argv += ["--set", s]
    assert run_recipe.main(argv) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("  ")]
    assert len(err) == 1 and err[0].startswith("error: --resume") and message in err[0], err
    assert digest(killed) == before
