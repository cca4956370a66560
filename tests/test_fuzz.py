"""Every file the tools read, damaged at random, and every flag of the scripts that read or start runs, given a
hostile value (`scripts/fuzz_inputs.py`): each tool answers with its exit code and at most its `error:` line, never a
traceback, and nothing allocates past a gigabyte (the process's address space is capped while the damaged files
are read). 1,000 cases per reader are the script's (docs/BENCHMARKS.md); this runs 10."""

import pytest
from conftest import run_micro


@pytest.mark.slow  # a trained run, 10 damaged copies of each of 12 readers, 170 argument values (~20 s)
def test_damaged_inputs_and_hostile_arguments_never_raise(tmp_path, cache_dir):
    import fuzz_inputs

    run = tmp_path / "micro"
    proc = run_micro(run, cache_dir, "eval.every_steps=3")
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = fuzz_inputs.fuzz(run, cases=10, seed=1)
    assert len(result["readers"]) == 12
    failures = {name: r["failures"] for name, r in result["readers"].items() if r["tracebacks"]}
    assert result["tracebacks"] == 0, failures
    for name, r in result["readers"].items():
        assert sum(r["exit_codes"].values()) == 10, name
    args = fuzz_inputs.fuzz_arguments(run)
    assert args["cases"] >= 170 and args["tracebacks"] == 0, args["failures"]
    assert args["exit_codes"].get("2", 0) >= 150  # refused in one line, not accepted: nonsense is not a run
