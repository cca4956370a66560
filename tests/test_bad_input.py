"""Bad input to the tools of the last rounds is one line, never a traceback (issue 57's one-line classes): a curve CSV
and the forecast's flags, a damaged per-step record, a torn or damaged jsonl, a Hub upload that cannot reach the Hub,
the launcher's missing files, a recipe a tool builds. `scripts/fuzz_inputs.py` damages every reader at random."""

import json
import os
import struct
import subprocess

import numpy as np
import pytest
from conftest import FIXTURES, ROOT

from pretrainer.errors import PretrainerError, RecipeError
from pretrainer.observe.steprecord import DIR, _Stream, read_record, row_schema, step_schema
from pretrainer.observe.tracking import read_events, read_jsonl

MICRO = FIXTURES / "micro.yaml"


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def curve_rows(n: int = 400) -> list[str]:
    """A WSD-like schedule with a loss for the first 300 steps (the rest is planned)."""
    rows = []
    for s in range(1, n + 1):
        lr = 1e-3 * min(1.0, s / 10) * (1.0 if s < 300 else 1 - (s - 300) / 101)
        loss = f"{4 + 3 / s**0.3:.4f}" if s <= 300 else ""
        rows.append(f"{s},{lr:.6g},{loss}")
    return rows


def test_the_same_curve_in_any_row_order_gives_the_same_forecast(tmp_path, capsys):
    import forecast

    rows = curve_rows()
    answers = []
    for name, order in (
        ("up", rows),
        ("down", rows[::-1]),
        ("shuffled", list(np.random.default_rng(0).permutation(rows))),
    ):
        path = tmp_path / f"{name}.csv"
        path.write_text("step,lr,loss\n" + "\n".join(order) + "\n")
        assert forecast.main(["--curve", str(path), "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        answers.append((out["law"], out["final"]))
    assert answers[0] == answers[1] == answers[2]  # before: 4.049, 4.019, 4.020 with different laws


@pytest.mark.parametrize(
    ("content", "args", "message"),
    [
        (None, [], "no such file"),
        ("DIR", [], "a directory"),
        ("", [], "empty"),
        ('"Step","my-run - train/loss","my-run - train/loss__MIN"\n1,5.0,4.9\n', [], "needs the columns step,lr,loss"),
        ("step,lr,loss\n1,0.001,4.5\n2,abc,4.4\n", [], "row 3, column lr: 'abc' is not a finite number"),
        ("step,lr,loss\n1,0.001,4.5\n1,0.001,4.4\n", [], "step 1 is given twice"),
        (b"step,lr,loss\n1,0.001,4.5\xff\n", [], "not UTF-8"),
        ("step,lr,loss\n1e30,0.001,4.5\n", [], "not a step number"),
        ("GOOD", ["--at", "1e9"], "--at: '1e9' is not a step in 1..400"),
        ("GOOD", ["--at", "abc"], "--at: 'abc' is not a step"),
        ("GOOD", ["--calibrate", "CAL"], "row 2, column loss"),
        ("GOOD", ["--calibrate", "NOWHERE"], "neither a step,lr,loss .csv nor a run directory"),
    ],
    ids=[
        "missing",
        "directory",
        "empty",
        "wandb-header",
        "non-numeric",
        "duplicate",
        "non-utf8",
        "huge-step",
        "at-out-of-range",
        "at-not-a-number",
        "bad-calibration-csv",
        "calibration-missing",
    ],
)
def test_a_bad_curve_or_flag_is_one_line(tmp_path, capsys, content, args, message):
    import forecast

    path = tmp_path / "curve.csv"
    if content == "DIR":
        path.mkdir()
    elif content == "GOOD":
        path.write_text("step,lr,loss\n" + "\n".join(curve_rows()) + "\n")
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    (tmp_path / "cal.csv").write_text("step,lr,loss\n1,0.001,x\n")
    args = [a.replace("NOWHERE", str(tmp_path / "nowhere")).replace("CAL", str(tmp_path / "cal.csv")) for a in args]
    assert forecast.main(["--curve", str(path), "--json", *args]) == 2
    assert message in one_error_line(capsys)


def write_record(run, n: int = 60) -> None:
    steps = _Stream(run / DIR / "steps-0000.arrows", step_schema())
    rows = _Stream(run / DIR / "rows-0000.arrows", row_schema())
    for start in (1, n // 2 + 1):
        steps.write([(s, 0, 5.0 - s / 100, 1.0) for s in range(start, start + n // 2)])
        rows.write([(s, 0, 0, s * 1024, True, 1.0, 5.0, 1e-3, 1e4, np.nan) for s in range(start, start + n // 2, 5)])
    steps.close()
    rows.close()


def test_a_damaged_record_is_read_up_to_the_damage_and_named(tmp_path):
    """A compressed buffer that claims a terabyte (a damaged length byte), and a stream of another schema (a damaged
    field name): the reader refuses both before Arrow allocates, keeps what came before, and names the file."""
    write_record(tmp_path)
    damaged = []
    whole = read_record(tmp_path, damaged)
    assert len(whole) == 60 and damaged == []
    path = tmp_path / DIR / "steps-0000.arrows"
    data = path.read_bytes()
    second = data.index(struct.pack("<q", 30 * 8), len(data) // 2)  # the step column of the second batch
    path.write_bytes(data[:second] + struct.pack("<q", 1 << 40) + data[second + 8 :])
    rec = read_record(tmp_path, damaged)
    assert len(rec) == 30 and len(damaged) == 1 and damaged[0].startswith("steps-0000.arrows: a buffer")
    # a field name damaged: the schema is not the record's, the file is left out and named
    path.write_bytes(data.replace(b"grad_norm", b"grad_nprm", 1))
    damaged.clear()
    assert read_record(tmp_path, damaged) is None and damaged == ["steps-0000.arrows: not the record's schema"]


def test_a_torn_or_damaged_jsonl_line_is_skipped_by_every_reader(tmp_path):
    path = tmp_path / "events.jsonl"
    good = {"event": "run_end", "step": 5, "time": 1.0, "tokens": 10}
    lines = [
        json.dumps(good),
        json.dumps({**good, "step": "5"}),  # a step that is not a number
        json.dumps({"event": "run_end", "step": 6, "time": 1.0, "tokfns": 10}),  # a damaged key
        "[1, 2]",
        "1" * 5000,  # a number too long for Python to convert
        '{"event": "run_end", "st',  # torn
    ]
    path.write_bytes("\n".join(lines).encode() + b"\n\xff\xfe\n")
    assert read_jsonl(path)[0] == good and len(read_jsonl(path)) == 2  # the damaged key still parses as a row
    assert read_events(path) == [good]  # ...but not as an event of its kind


def test_a_hub_upload_that_cannot_reach_the_hub_is_one_line_and_the_export_stays(tmp_path, monkeypatch):
    import huggingface_hub.constants as hub_constants

    from pretrainer.publishing.hub import push_to_hub

    model = tmp_path / "final"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "model.safetensors").write_bytes(b"x" * 16)
    monkeypatch.setattr(hub_constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_token")
    with pytest.raises(PretrainerError, match=r"^--push-to-hub me/model: .*local export in .* is complete"):
        push_to_hub(model, "me/model")
    with pytest.raises(PretrainerError, match=r"^--push-to-hub 'me/bad\*id': not a Hub repo id"):
        push_to_hub(model, "me/bad*id")
    assert (model / "model.safetensors").read_bytes() == b"x" * 16 and (model / "config.json").exists()


def test_the_launchers_check_their_files_before_starting(tmp_path):
    from pretrainer.train.launcher import launch_problem

    assert "no such file" in launch_problem(["--config_file", str(tmp_path / "nope.yaml"), "scripts/run_recipe.py"])
    assert "no such script" in launch_problem(["--config_file=accelerate_configs/zero1.yaml", "scripts/nope.py"])
    assert launch_problem(["--config_file", "accelerate_configs/zero1.yaml", "scripts/run_recipe.py"]) is None
    env = {**os.environ, "ACCELERATE_CONFIG": str(tmp_path / "nope.yaml"), "SLURM_JOB_ID": "1"}
    proc = subprocess.run(
        ["bash", "scripts/slurm/train.sbatch", "recipes/tiny.yaml"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: ACCELERATE_CONFIG {tmp_path / 'nope.yaml'}: no such file (submit from the repository root, or give "
        "its path)"
    ]


def test_a_recipe_a_tool_builds_is_validated_in_one_line(capsys):
    import run_recipe

    from pretrainer.recipe.loading import load_recipe
    from pretrainer.recipe.stages import branch_decay_recipe

    argv = [str(MICRO), "--branch-decay-from", "x", "--decay-steps", "-5", "--output-dir", "/nonexistent/branch"]
    assert run_recipe.main(argv) == 2
    assert "--decay-steps: a decay of at least 1 step, not -5" in one_error_line(capsys)
    recipe = load_recipe(MICRO, ["stages.0.steps=30"], check_model=False)
    with pytest.raises(RecipeError, match=r"^--decay-steps 0 from step 10: "):
        branch_decay_recipe(recipe, 10, 0)
    # a schedule whose first size is 0: one line, for the field the user gave
    sets = ["batch.global_batch_tokens=null", "batch.schedule=[{from_tokens: 0, global_batch_tokens: 0}]"]
    with pytest.raises(RecipeError) as err:
        load_recipe(MICRO, sets, check_model=False)
    assert str(err.value).splitlines() == [
        f"--set {sets[1]}: batch.schedule.0.global_batch_tokens: Input should be greater than or equal to 1"
    ]
