"""What a person reads: the run's closing block with its downstream scores, the progress lines that say what a long
quiet stretch waits on, a branch's own progress, and the report's advice said once and consistently."""

import io

from pretrainer.analysis.critical_batch import batch_advice
from pretrainer.analysis.report import gap_reading, gns_advice
from pretrainer.analysis.verdicts import add_downstream
from pretrainer.recipe.lint import Finding
from pretrainer.train.console import Progress, announce, end_block


def test_end_block_shows_the_downstream_scores_it_computed(tmp_path):
    scores: dict = {}
    for step, value in ((0, 4.4007), (100, 3.5), (220, 3.0033)):  # the live monitor's fold, row by row
        add_downstream(scores, step, {"eval/bpb/bits_per_byte": value, "eval/lm_eval_seconds": 9.0, "val/ref": 5.0})
    assert list(scores) == ["bpb/bits_per_byte"]  # one entry per score, not per eval: the timings are not scores
    text = end_block(tmp_path, {0: 8.3, 220: 5.35}, {}, [], downstream=scores)
    assert "downstream bpb/bits_per_byte: 3.0033 (step 220) (4.4007 at step 0)" in text
    assert "downstream" not in end_block(tmp_path, {220: 5.35}, {}, [])  # none computed, none shown


def test_progress_lines_in_a_file_name_the_wait_and_the_branch():
    out = io.StringIO()  # not a terminal: timestamped lines, no bar
    p = Progress(166, 150, enabled=True, stream=out, label="branch 2 of 3 (x2)")
    p.note("evaluating at step 0: held-out losses and lm-eval (heldout_python_bpb)")
    p.logged(160, {"loss": 5.4, "tokens_per_s": 8000.0, "step_time_s": 1.0}, 1e-3)
    p.close()
    lines = out.getvalue().splitlines()
    assert lines[0].endswith("evaluating at step 0: held-out losses and lm-eval (heldout_python_bpb)")
    assert "branch 2 of 3 (x2), step 160/166 loss 5.4000" in lines[1] and lines[1].endswith("eta 0:00:06")
    assert "\r" not in out.getvalue()


def test_a_branch_names_its_parents_lint_findings_once(tmp_path, capsys):
    from conftest import FIXTURES

    from pretrainer.recipe.loading import load_recipe

    warmup = Finding("PT002", "schedule.warmup_steps", "warmup is 12% of the run.", "keep warmup under ~5%.")
    announce(load_recipe(FIXTURES / "micro.yaml"), tmp_path, [], inherited=[warmup])
    err = capsys.readouterr().err
    assert "warning:" not in err and "lint findings PT002 are the parent recipe's" in err


def test_advice_is_consistent():
    measured = {"batch_tokens": 8192, "lo": 16384, "hi": 32768, "suggested": "batch.schedule=[0: 8192, x: 16384]"}
    assert batch_advice(measured).startswith("the batch can grow without costing tokens: --set 'batch.schedule=")
    assert batch_advice({**measured, "batch_tokens": 65536}).startswith("the batch is past the critical batch")
    assert batch_advice({**measured, "batch_tokens": 16384}).endswith("keep it")
    assert "branching measurement below" in gns_advice(True) and "critical_batch.py" in gns_advice(False)
    widening = {"first": 0.07, "last": 0.24, "trend": "widening"}
    assert "not overfitting while validation still falls" in gap_reading(widening, "healthy")
    assert gap_reading(widening, "overfitting") == "" == gap_reading({**widening, "trend": "stable"}, "healthy")
