"""A batch that grows in tokens (`batch.schedule`): the plan's phases, the LR on the token clock, the loop across a
change (accumulation, events, metrics, resume, rollback), and the critical batch measured by branching."""

import json
import math
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from conftest import FIXTURES, ROOT, step_losses

from pretrainer.analysis.critical_batch import estimate, passing, schedule_line, suggested_size
from pretrainer.errors import RecipeError
from pretrainer.observe.tracking import read_jsonl
from pretrainer.recipe.lint import lint
from pretrainer.recipe.loading import load_recipe
from pretrainer.recipe.schedules import lr_array, lr_lambda
from pretrainer.recipe.stages import branch_batch_recipe

MICRO = FIXTURES / "micro.yaml"
GROW = "batch.schedule=[{from_tokens: 0, global_batch_tokens: 1024}, {from_tokens: 20000, global_batch_tokens: 2048}]"


def recipe(*sets):
    return load_recipe(MICRO, list(sets), check_model=False)


def test_a_constant_batch_is_one_phase_and_the_plan_it_always_was():
    r = recipe("stages.0.steps=40")
    p = r.plan
    assert len(p.batches) == 1 and p.batches[0].tokens_per_step == 1024
    assert p.total_tokens == 40 * 1024 and p.clock(17) == 17 and p.lr_scale(30) == 1.0
    f = lr_lambda(r)
    assert np.array_equal(lr_array(r), np.array([f(i) for i in range(40)]))


def test_a_change_applies_at_the_first_step_at_or_past_its_tokens_and_stages_keep_their_tokens():
    r = recipe("stages.0.steps=null", "stages.0.tokens=61440", GROW)
    p = r.plan
    # 20,000 tokens is inside step 19 (19,456 before it): the change applies at step 20, 20,480 tokens in
    assert [(b.start_step, b.start_tokens, b.tokens_per_step) for b in p.batches] == [(0, 0, 1024), (20, 20480, 2048)]
    assert p.total_steps == 20 + 20 and p.total_tokens == 61440 == p.spans[0].tokens
    assert [p.batch_at(s).tokens_per_step for s in (0, 19, 20, 39)] == [1024, 1024, 2048, 2048]
    assert p.tokens_before(25) == 20480 + 5 * 2048 and p.clock(25) == 30.0
    assert p.grad_accum(1, 0) == 4 and p.grad_accum(1, 20) == 8 and p.grad_accum(2, 20) == 4
    assert p.valid_world_sizes() == [1, 2, 4]  # the sizes every phase divides over
    with pytest.raises(
        RecipeError, match=r"batch.schedule: .* does not divide over 3 processes \(valid counts: 1, 2, 4"
    ):
        p.grad_accum(3)


def test_the_lr_reads_the_token_clock_and_scales_by_the_square_root_of_the_batch():
    r = recipe("stages.0.steps=null", "stages.0.tokens=61440", GROW, "schedule.type=cosine")
    p, f = r.plan, lr_lambda(r)
    lr = lr_array(r)
    assert np.allclose(lr, [f(i) for i in range(p.total_steps)], rtol=1e-12)
    same = recipe("stages.0.steps=60", "schedule.type=cosine")  # the same tokens at the first size throughout
    g = lr_lambda(same)
    for step in (5, 19, 20, 33, 39):  # the cosine at the same tokens, times sqrt(2) once the batch doubled
        factor = math.sqrt(2) if step >= 20 else 1.0
        assert f(step) == pytest.approx(g(p.clock(step)) * factor, rel=1e-12)
    assert recipe("stages.0.steps=60", GROW, "batch.lr_scaling=none").plan.lr_scale(40) == 1.0


@pytest.mark.parametrize(
    "sets, message",
    [
        (["batch.schedule=[{from_tokens: 10, global_batch_tokens: 1024}]"], "schedule.0.from_tokens"),
        (
            [
                "batch.schedule=[{from_tokens: 0, global_batch_tokens: 1024}, {from_tokens: 900, global_batch_tokens: 1536}]"
            ],
            "not an integer multiple",
        ),
        (
            [
                "batch.schedule=[{from_tokens: 0, global_batch_tokens: 1024}, {from_tokens: 0, global_batch_tokens: 2048}]"
            ],
            "is not after",
        ),
        (["batch.global_batch_tokens=2048", GROW], "differs from the schedule's first size"),
        ([GROW, "optimizer.type=muon"], "batch.lr_scaling: name how Muon's LR follows"),
    ],
)
def test_a_bad_schedule_is_one_line_naming_its_field(sets, message):
    with pytest.raises(RecipeError, match=message):
        recipe(*sets)


def run(out, cache_dir, *sets, kill_at=None, args=(), base=True):
    cmd = [sys.executable, "scripts/run_recipe.py", str(MICRO), "--output-dir", str(out)]
    for s in (f"data.cache_dir={cache_dir}", *(BASE if base else ()), *sets):
        cmd += ["--set", s]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **({"PRETRAINER_KILL_AT": kill_at} if kill_at else {})}
    return subprocess.run([*cmd, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


BASE = ["stages.0.steps=32", GROW, "checkpoint.every_tokens=4096", "checkpoint.keep_last=20", "eval.every_steps=0"]


@pytest.fixture(scope="module")
def grown(tmp_path_factory, cache_dir):
    out = tmp_path_factory.mktemp("grown") / "run"
    proc = run(out, cache_dir)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


def test_the_loop_changes_the_accumulation_logs_the_change_and_resumes_bitwise_across_it(grown, tmp_path, cache_dir):
    rows = [m for m in read_jsonl(grown / "metrics.jsonl") if "loss" in m]
    assert {m["step"]: m["batch_tokens"] for m in rows if m["step"] in (20, 25, 30)} == {20: 1024, 25: 2048, 30: 2048}
    assert rows[-1]["tokens"] == 20 * 1024 + 12 * 2048
    events = read_jsonl(grown / "events.jsonl")
    change = [e for e in events if e["event"] == "batch_change"]
    assert [(e["step"], e["global_batch_tokens"], e["grad_accum"]) for e in change] == [(20, 2048, 8)]
    assert change[0]["lr_factor"] == pytest.approx(math.sqrt(2))
    # killed after the change, resumed from a checkpoint before it: the same per-step losses to the last bit
    out = tmp_path / "run"
    assert run(out, cache_dir, kill_at="step:27").returncode == -signal.SIGKILL
    proc = run(out, cache_dir, args=["--resume", "auto"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    resumed = [e for e in read_jsonl(out / "events.jsonl") if e["event"] == "resume"]
    assert resumed and resumed[0]["step"] >= 20  # a checkpoint after the change (every 4,096 tokens)
    assert step_losses(out) == step_losses(grown)


@pytest.mark.slow  # a rollback across a batch change; the default set crosses one live and on resume
def test_a_rollback_to_before_a_change_replays_the_change(tmp_path, cache_dir):
    """The spike rule at its defaults. Two stages, the batch doubling at the second (512 -> 1,024 tokens), saved only
    at stage ends: the Adam moments corrupted at step 64 make a spike, rolled back to step 20, before the change; the
    replay changes the batch again at the same step and ends as a run that was never corrupted."""
    late = "{name: late, steps: 50, seq_len: 64, mixture: {stdlib: 1.0}}"
    sets = [
        "stages=[{name: main, steps: 20, seq_len: 64, mixture: {stdlib: 1.0}}, " + late + "]",
        "batch.micro_batch_size=2",
        "batch.global_batch_tokens=null",
        "batch.schedule=[{from_tokens: 0, global_batch_tokens: 512}, {from_tokens: 10240, global_batch_tokens: 1024}]",
        "checkpoint.every_tokens=null",
        "checkpoint.every_minutes=null",
        "eval.every_steps=0",
    ]
    clean, out = tmp_path / "clean", tmp_path / "run"
    assert run(clean, cache_dir, *sets, base=False).returncode == 0
    proc = run(out, cache_dir, *sets, "debug.inject.corrupt_optimizer_step=64", base=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    events = read_jsonl(out / "events.jsonl")
    rollbacks = [e for e in events if e["event"] == "rollback"]
    assert len(rollbacks) == 1 and rollbacks[0]["to_step"] == 20, rollbacks
    assert [e["step"] for e in events if e["event"] == "batch_change"] == [20, 20]
    rows = [m for m in read_jsonl(out / "metrics.jsonl") if "loss" in m]
    assert rows[-1]["tokens"] == 20 * 512 + 50 * 1024 and rows[-1]["batch_tokens"] == 1024
    assert step_losses(out)[70] == step_losses(clean)[70]  # the replay is the clean run, to the last bit


def test_passing_and_the_bootstrap_interval():
    assert passing(np.array([3.0, 3.01, 3.02, 3.2]), 0.01) == 3  # the 4th is 6% worse than the best before it
    assert passing(np.array([3.0, 2.9, 2.92]), 0.01) == 3  # within 1% of the best of the smaller sizes (2.9)
    assert passing(np.array([3.0, 2.9, 2.95]), 0.01) == 2  # 1.7% above 2.9, though below 3.0
    rng = np.random.default_rng(0)
    base = 3.0 + rng.normal(0, 0.3, 64)  # batch-to-batch spread much larger than the branches' differences
    losses = [base, base + 0.005, base + 0.01, base + 0.2]
    est = estimate([1024, 2048, 4096, 8192], losses)
    assert (est.cbs_tokens, est.bounded) == (4096, True) and est.lo <= 4096 <= est.hi
    # paired: the spread between batches cancels, so the interval is tight where the differences are clear
    assert est.lo == est.hi == 4096
    unclear = [base, base + 0.03 + rng.normal(0, 0.1, 64)]  # 1% on average, with a lot of pair noise
    est = estimate([1024, 2048], unclear)
    assert est.lo == 1024 and est.hi == 2048
    assert suggested_size(1024, estimate([1024, 2048, 4096, 8192], losses)) == 4096
    assert suggested_size(1024, est) == 1024  # the lower end is not 2x the batch: keep it
    line = schedule_line([(0, 1024)], 51200, 4096)
    assert (
        line
        == "batch.schedule=[{from_tokens: 0, global_batch_tokens: 1024}, {from_tokens: 51200, global_batch_tokens: 4096}]"
    )
    with pytest.raises(ValueError, match="ascend"):
        estimate([2048, 1024], losses[:2])


def test_a_batch_branch_keeps_the_parents_tokens_and_lr_up_to_its_point():
    parent = recipe("stages.0.steps=40", "schedule.type=cosine")
    branch = branch_batch_recipe(parent, 16, 4)
    p, b = parent.plan, branch.plan
    assert b.tokens_before(16) == p.tokens_before(16) and b.batch_at(16).tokens_per_step == 4096
    assert b.total_tokens == p.total_tokens  # the stages restated in tokens: the same run length
    f, g = lr_lambda(parent), lr_lambda(branch)
    assert all(f(s) == g(s) for s in range(16))
    assert g(17) == pytest.approx(f(16 + 4) * 2.0, rel=1e-12)  # 4x the tokens per step, LR x sqrt(4)
    with pytest.raises(RecipeError, match="inside the run"):
        branch_batch_recipe(parent, 40, 2)


def test_critical_batch_measures_branches_and_check_run_reports_them(grown, tmp_path, cache_dir, capsys):
    """Two branches from the grown run's checkpoint at step 12, each through the trainer in its own directory; the
    parent run is only read, and check_run shows the measurement."""
    import check_run
    import critical_batch

    ckpt = grown / "checkpoints" / "step_00000012"
    before = {p: p.stat().st_mtime_ns for p in (grown / "checkpoints").rglob("*") if p.is_file()}
    out = tmp_path / "cbs"
    argv = [str(ckpt), "--set", f"data.cache_dir={cache_dir}", "--factors", "1", "4", "--tokens", "8192"]
    assert critical_batch.main([*argv, "--out", str(out), "--json"]) == 0
    printed = capsys.readouterr().out
    r = json.loads(printed.strip().splitlines()[-1])  # after the branches' progress lines
    # each branch says where it is, and the parent's whole plan is not printed again per branch
    assert "branch 1 of 2 (x1): 8 steps of 1,024 tokens from step 12" in printed and "branch 2 of 2 (x4)" in printed
    assert " stage main " not in printed
    assert r["sizes"] == [1024, 4096] and r["branch_tokens"] == 8192 and r["step"] == 12
    assert r["lo"] <= r["cbs_tokens"] <= r["hi"] and r["suggested"].startswith("batch.schedule=[")
    for k, steps in ((1, 8), (4, 2)):  # the same tokens: 8 steps of 1,024, 2 of 4,096
        rows = [m for m in read_jsonl(out / f"x{k}" / "metrics.jsonl") if "loss" in m]
        assert rows and max(m["step"] for m in rows) <= 12 + steps
    assert json.loads((out / "result.json").read_text())["cbs_tokens"] == r["cbs_tokens"]
    assert r["trained_tokens"] == [8192, 8192]  # equal tokens is the method: counted, not assumed
    assert {p: p.stat().st_mtime_ns for p in (grown / "checkpoints").rglob("*") if p.is_file()} == before
    assert check_run.main([str(grown), "--json", "--verify", "fast"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["critical_batch"]["measured"][0]["cbs_tokens"] == r["cbs_tokens"]
    assert report["critical_batch"]["lines"][0].startswith("critical batch at step 12:")
    assert report["critical_batch"]["lines"][-1].startswith("  the batch ")  # what to do, said once
    # a torn last line (a kill mid-append) is skipped by every reader of the file, not a JSONDecodeError
    with open(grown / "critical_batch.jsonl", "a") as f:
        f.write('{"checkpoint": "x", "step": 1')
    assert check_run.main([str(grown), "--json", "--verify", "fast"]) == 0
    assert json.loads(capsys.readouterr().out)["critical_batch"]["measured"][0]["cbs_tokens"] == r["cbs_tokens"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tokens", "-5"], "--tokens: a positive token count per branch, not -5"),
        (["--tolerance", "nan"], "--tolerance: a relative loss difference between 0 and 1"),
        (["--factors", "1", "2", "--tokens", "3072"], "use a multiple of 2,048 (nearest: 2,048 or 4,096)"),
        ([], None),  # the default length rounds up to a whole number of steps at every size
    ],
    ids=["negative-tokens", "nan-tolerance", "unequal-tokens", "default-length"],
)
def test_critical_batch_refuses_what_it_cannot_measure_in_one_line_before_writing(
    grown, args, message, tmp_path, capsys
):
    import critical_batch

    from pretrainer.train.batch_branches import branch_tokens

    if message is None:
        want = branch_tokens(recipe("stages.0.steps=200"), 12, [3, 5], None)  # 16 steps of 5,120 = 81,920 tokens
        assert want == 92160 and want % (3 * 1024) == 0 == want % (5 * 1024)  # rounded up: 30 and 18 whole steps
        return
    results = grown / "critical_batch.jsonl"
    before = results.read_bytes() if results.exists() else None
    argv = [str(grown / "checkpoints" / "step_00000012"), "--out", str(tmp_path / "cbs"), *args]
    assert critical_batch.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert (results.read_bytes() if results.exists() else None) == before and not (tmp_path / "cbs").exists()


def test_critical_batch_never_replaces_another_run_under_its_out(grown, tmp_path, capsys):
    import critical_batch

    other = tmp_path / "cbs" / "x1"
    other.mkdir(parents=True)
    (other / "run.json").write_text('{"run_id": "someone-else"}')
    (other / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    argv = [str(grown / "checkpoints" / "step_00000012"), "--out", str(tmp_path / "cbs"), "--factors", "1", "2"]
    assert critical_batch.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds another run" in err[0], err
    assert (other / "metrics.jsonl").read_text() == '{"step": 1, "loss": 5.0}\n'


def launch2(config: str | None, out, cache_dir, *sets, kill_at=None, args=()):
    """Two processes: DDP through torchrun (`config` None) or DeepSpeed through `accelerate launch`."""
    if config is None:
        head = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    else:
        head = ["-m", "accelerate.commands.launch", "--config_file", f"accelerate_configs/{config}"]
        head += ["--num_processes", "2", "--mixed_precision", "no"]
    cmd = [sys.executable, *head, "scripts/run_recipe.py", str(MICRO), "--output-dir", str(out)]
    for s in (f"data.cache_dir={cache_dir}", *BASE, *sets):
        cmd += ["--set", s]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    env.update({"PRETRAINER_KILL_AT": kill_at} if kill_at else {})
    return subprocess.run([*cmd, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory, cache_dir):
    """The uninterrupted two-process runs, DDP and ZeRO-1/2/3, once for the tests below."""
    refs = {}
    for config in (None, "zero1.yaml", "zero2.yaml", "zero3.yaml"):
        out = tmp_path_factory.mktemp(str(config)) / "ref"
        proc = launch2(config, out, cache_dir)
        assert proc.returncode == 0, proc.stderr[-3000:]
        refs[config] = out
    return refs


@pytest.mark.slow  # a batch change on every two-process launch (the default set runs one process)
@pytest.mark.distributed
@pytest.mark.parametrize(
    "config", [None, "zero1.yaml", "zero2.yaml", "zero3.yaml"], ids=["ddp", "zero1", "zero2", "zero3"]
)
def test_two_processes_resume_bitwise_across_a_change(config, two_processes, tmp_path, cache_dir):
    """The accumulation per rank doubles at step 20 (2 -> 4 micro batches; DeepSpeed's engine told through
    `set_train_batch_size`); killed at step 27, resumed: the same per-step losses as the uninterrupted run."""
    ref, out = two_processes[config], tmp_path / "run"
    change = [e for e in read_jsonl(ref / "events.jsonl") if e["event"] == "batch_change"]
    assert [(e["step"], e["grad_accum"]) for e in change] == [(20, 4)]
    assert launch2(config, out, cache_dir, kill_at="step:27").returncode != 0
    proc = launch2(config, out, cache_dir, args=["--resume", "auto"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert any(e["event"] == "resume" for e in read_jsonl(out / "events.jsonl"))
    assert step_losses(out) == step_losses(ref)


@pytest.mark.slow  # DeepSpeed's own loss scaling after an accumulation change
@pytest.mark.distributed
def test_deepspeed_scales_the_loss_by_the_new_accumulation(two_processes):
    """Under ZeRO-1 the engine divides each micro batch's loss by its own accumulation count: after the change the
    gradient norm DeepSpeed reports is DDP's (a stale count of 2 would double it), and so are the losses."""
    rows = {
        c: {m["step"]: m for m in read_jsonl(d / "metrics.jsonl") if "loss" in m} for c, d in two_processes.items()
    }
    for step in (15, 25, 30):
        ddp, zero = rows[None][step], rows["zero1.yaml"][step]
        assert zero["grad_norm"] == pytest.approx(ddp["grad_norm"], rel=1e-3), step
        assert zero["loss"] == pytest.approx(ddp["loss"], rel=1e-3), step


def test_lint_warns_when_the_schedule_grows_past_the_measured_critical_batch():
    grow = recipe("stages.0.steps=60", GROW, "batch.critical_batch_tokens=1536")
    assert [f.field for f in lint(grow) if f.id == "PT022"] == ["batch.schedule.1.global_batch_tokens"]
    assert not [
        f for f in lint(recipe("stages.0.steps=60", GROW, "batch.critical_batch_tokens=4096")) if f.id == "PT022"
    ]
    # warmup and decay are judged on the token clock: a branch at 4x the batch does not make warmup "15% of the run"
    branch = branch_batch_recipe(recipe("stages.0.steps=60"), 12, 4)
    assert branch.plan.total_steps == 12 + 12 and not [f for f in lint(branch) if f.id == "PT002"]


@pytest.mark.slow  # critical_batch.py's branches under a two-process launch
@pytest.mark.distributed
def test_critical_batch_runs_its_branches_on_two_processes(two_processes, cache_dir):
    """Under `accelerate launch` (ZeRO-1) every rank trains each branch in turn, through one process group for all of
    them; the main process alone records and prints the result."""
    ref = two_processes["zero1.yaml"]
    head = [
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        "accelerate_configs/zero1.yaml",
        "--num_processes",
        "2",
    ]
    cmd = [
        sys.executable,
        *head,
        "--mixed_precision",
        "no",
        "scripts/critical_batch.py",
        str(ref / "checkpoints" / "step_00000012"),
    ]
    cmd += ["--set", f"data.cache_dir={cache_dir}", "--factors", "1", "2", "--tokens", "4096", "--json"]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    assert len(lines) == 1 and json.loads(lines[0])["sizes"] == [1024, 2048]
    assert len((ref / "critical_batch.jsonl").read_text().splitlines()) == 1


@pytest.mark.slow  # noise scale and layer statistics read inside ZeRO's hooks, against DDP
@pytest.mark.distributed
def test_noise_scale_and_layer_statistics_under_zero_equal_ddp_and_one_process(two_processes, grown):
    """The small batch is each rank's first micro batch (their squared norms averaged over ranks): under ZeRO-1/2/3
    it is read in the engine's gradient hook before the reduce, and the noise scale equals DDP's. The per-layer
    statistics read the gradients from ZeRO's partitions (summed over ranks, clipped; ZeRO-3's parameters from
    their partitions too) and equal one process's on the same batches, as DDP's do. (At 256-token micro batches |G|^2 is sometimes negative, and then no value is
    logged.)"""
    gns = {
        c: {m["step"]: m["gns/b_simple"] for m in read_jsonl(d / "metrics.jsonl") if "gns/b_simple" in m}
        for c, d in two_processes.items()
    }
    assert gns[None] and all(v > 0 for v in gns[None].values()), gns
    layers = {c: {r["step"]: r for r in read_jsonl(d / "layers.jsonl")} for c, d in two_processes.items()}
    one = {r["step"]: r for r in read_jsonl(grown / "layers.jsonl")}
    for config in (None, "zero1.yaml", "zero2.yaml", "zero3.yaml"):
        assert gns[config].keys() == gns[None].keys(), config
        assert all(gns[config][k] == pytest.approx(gns[None][k], rel=1e-3) for k in gns[None]), (config, gns)
        assert layers[config].keys() == one.keys() and len(one) >= 6
        for step, row in one.items():
            for stat in ("grad_norm", "update_ratio", "param_norm", "attn_logit_bound"):
                assert layers[config][step][stat] == pytest.approx(row[stat], rel=1e-3), (config, step, stat)


def test_inspect_recipe_shows_the_batch_phases(capsys):
    import inspect_recipe

    grow = "batch.schedule=[{from_tokens: 0, global_batch_tokens: 8192}, {from_tokens: 600000, global_batch_tokens: 32768}]"
    assert inspect_recipe.main(["recipes/tiny.yaml", "--set", grow, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert [(b["start_step"], b["global_batch_tokens"]) for b in info["batches"]] == [(0, 8192), (74, 32768)]
    assert info["batches"][1]["lr_factor"] == pytest.approx(2.0)  # sqrt(4)
    assert inspect_recipe.main(["recipes/tiny.yaml", "--set", grow]) == 0
    text = capsys.readouterr().out
    assert "from step         74 (         606,208 tokens):       32,768 tokens per step, LR x 2.000" in text
    # a launch the sizes do not all divide over: refused, naming the counts every size divides over
    assert inspect_recipe.main(["recipes/tiny.yaml", "--set", grow, "--gpus", "4"]) == 2
    assert "valid counts: 1, 2" in capsys.readouterr().err
