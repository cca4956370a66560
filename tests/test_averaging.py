"""Weight averaging (recipe `averaging`): the average's arithmetic, the swap, the per-rank pieces at any world size,
and the run: `val/ref_merged`, `merged/`, export, exact resume; under 2-process ZeRO-3 against one process (slow)."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, run_micro, tiny_llama
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from pretrainer.checkpoint import pieces
from pretrainer.errors import PretrainerError, RecipeError
from pretrainer.observe.tracking import read_jsonl
from pretrainer.recipe.averaging import AveragingSection
from pretrainer.recipe.loading import load_recipe
from pretrainer.train.averaging import WeightAverage


def sequence(model, steps: int, seed: int = 0) -> list[list[torch.Tensor]]:
    """A random walk of the model's weights, one list per step."""
    gen = torch.Generator().manual_seed(seed)
    base = [p.detach().clone() for p in model.parameters()]
    out = []
    for _ in range(steps):
        base = [b + 0.01 * torch.randn(b.shape, generator=gen) for b in base]
        out.append([b.clone() for b in base])
    return out


def feed(avg: WeightAverage, model, weights, tokens_per_step: int = 100, until: int | None = None):
    for step, w in enumerate(weights[:until], start=1):
        with torch.no_grad():
            for p, x in zip(model.parameters(), w):
                p.copy_(x)
        avg.update(step, step * tokens_per_step)


def merged_of(avg: WeightAverage, model) -> list[torch.Tensor]:
    with avg.swapped() as ready:
        assert ready
        return [p.detach().clone() for p in model.parameters()]


def export_merged(ckpt: Path, out: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "scripts/export_checkpoint.py", str(ckpt), str(out), "--merged"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_ema_is_the_closed_form_with_a_relative_half_life():
    model = tiny_llama()
    ws = sequence(model, 12)
    avg = WeightAverage(AveragingSection(method="ema"), model, 0, start_step=3, every=1)  # half-life 5% of tokens
    feed(avg, model, ws)
    expect = [w.double() for w in ws[2]]  # begins at step 3 with the live weights
    for step in range(4, 13):
        half = 0.05 * (step - 3) * 100
        a = 1 - 0.5 ** (100 / half)
        expect = [(1 - a) * e + a * w.double() for e, w in zip(expect, ws[step - 1])]
    for got, want in zip(merged_of(avg, model), expect):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    live = [p.detach().clone() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(live, ws[-1])), "the swap puts the live weights back bitwise"


def test_ema_fixed_half_life_every_k_and_stage_reset():
    model = tiny_llama()
    ws = sequence(model, 9, seed=1)
    sec = AveragingSection(method="ema", ema={"half_life_tokens": 150, "every": 2})
    avg = WeightAverage(sec, model, 0, start_step=1, every=2)
    feed(avg, model, ws)
    expect = [w.double() for w in ws[0]]
    for step in (2, 4, 6, 8):  # every 2nd step, the decay compounded over the tokens since the last update
        a = 1 - 0.5 ** ((100 if step == 2 else 200) / 150)
        expect = [(1 - a) * e + a * w.double() for e, w in zip(expect, ws[step - 1])]
    for got, want in zip(merged_of(avg, model), expect):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    avg.stage_start(9, 900)  # `stages: reset`: the average restarts from the live weights
    assert all(torch.equal(a, b) for a, b in zip(merged_of(avg, model), ws[-1]))


def test_window_is_the_mean_of_the_last_steps_before_each_merge_point():
    model = tiny_llama()
    ws = sequence(model, 12, seed=2)
    avg = WeightAverage(AveragingSection(method="window", window={"steps": 3, "every": 5}), model, 0, 0, 5)
    feed(avg, model, ws, until=4)
    with avg.swapped() as ready:
        assert not ready  # no merge point reached yet: nothing to evaluate
    feed(avg, model, ws, until=12)
    want = [torch.stack([ws[s][i] for s in (7, 8, 9)]).mean(0) for i in range(len(ws[0]))]  # steps 8, 9, 10
    assert avg.merged_step == 10
    for got, w in zip(merged_of(avg, model), want):
        torch.testing.assert_close(got, w, rtol=1e-6, atol=1e-7)


def test_pieces_of_any_world_size_read_back_at_any_other(tmp_path):
    """A ZeRO-3-style layout (10 elements over 3 ranks: partitions of 4, the last holding 2) read back whole and as a
    2-rank share; a range no file holds is one line."""
    full = torch.arange(10, dtype=torch.float32)
    other = torch.arange(6, dtype=torch.float32).view(2, 3)
    for rank in range(3):
        lo, hi = 4 * rank, min(10, 4 * rank + 4)
        tensors, layout = {"w": full[lo:hi]}, {"w": pieces.Layout(lo, (10,))}
        if rank == 0:  # a replicated parameter: rank 0 alone writes it
            tensors["b"], layout["b"] = other, pieces.Layout(0, (2, 3))
        pieces.write(tmp_path, rank, tensors, layout)
    reader = pieces.Reader(tmp_path)
    assert torch.equal(reader.full("w"), full) and torch.equal(reader.full("b"), other)
    assert torch.equal(reader.read("w", 0, 5), full[:5]) and torch.equal(reader.read("w", 5, 10), full[5:])
    pieces.rank_file(tmp_path, 1).unlink()
    with pytest.raises(PretrainerError, match="not all in the rank files"):
        pieces.Reader(tmp_path).read("w", 3, 6)


def test_window_settings_are_checked_against_the_eval_cadence(micro_recipe):
    with pytest.raises(RecipeError, match="averaging.window.steps"):
        load_recipe(micro_recipe, ["averaging.method=window", "averaging.window.steps=20"])  # evals every 15
    with pytest.raises(RecipeError, match="averaging.window.every"):
        load_recipe(micro_recipe, ["averaging.method=window", "eval.every_steps=0"])


AVG = ["averaging.method=ema", "checkpoint.every_tokens=8192", "checkpoint.keep_last=4", "averaging.start_step=10"]


@pytest.fixture(scope="module")
def ema_run(tmp_path_factory, cache_dir):
    out = tmp_path_factory.mktemp("ema") / "run"
    proc = run_micro(out, cache_dir, *AVG)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_merged_weights_are_evaluated_exported_and_loadable(ema_run, tmp_path):
    rows = [m for m in read_jsonl(ema_run / "metrics.jsonl") if "val/ref" in m]
    assert "val/ref_merged" not in rows[0]  # step 0: averaging has not begun
    merged = {m["step"]: m["val/ref_merged"] for m in rows if "val/ref_merged" in m}
    assert sorted(merged) == [15, 30]
    assert all(abs(merged[s] - next(m["val/ref"] for m in rows if m["step"] == s)) > 1e-6 for s in merged)
    model = AutoModelForCausalLM.from_pretrained(ema_run / "merged")
    final = AutoModelForCausalLM.from_pretrained(ema_run / "final")
    assert not torch.equal(model.model.norm.weight, final.model.norm.weight)
    last = sorted((ema_run / "checkpoints").glob("step_*"))[-1]
    proc = export_merged(last, tmp_path / "x")
    assert proc.returncode == 0, proc.stderr[-2000:]
    a, b = (
        load_file(str(tmp_path / "x" / "model.safetensors")),
        load_file(str(ema_run / "merged" / "model.safetensors")),
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    first = sorted((ema_run / "checkpoints").glob("step_*"))[0]  # step 8: before averaging began
    proc = export_merged(first, tmp_path / "y")
    assert proc.returncode == 2 and "no averaged weights" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow  # the average's own files across a kill; the default set resumes the loop bitwise and exports the average
def test_killed_run_resumes_the_average_bitwise(ema_run, tmp_path, cache_dir):
    out = tmp_path / "run"
    proc = run_micro(out, cache_dir, *AVG, env={"PRETRAINER_KILL_AT": "step:21"})
    assert proc.returncode == -signal.SIGKILL
    proc = run_micro(out, cache_dir, *AVG, args=["--resume", "auto"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert any(e["event"] == "resume" and e["step"] == 16 for e in read_jsonl(out / "events.jsonl"))
    a, b = (
        load_file(str(out / "merged" / "model.safetensors")),
        load_file(str(ema_run / "merged" / "model.safetensors")),
    )
    assert all(torch.equal(a[k], b[k]) for k in a), "the resumed average differs from the uninterrupted one"
    vals = [{m["step"]: m.get("val/ref_merged") for m in read_jsonl(d / "metrics.jsonl")} for d in (out, ema_run)]
    assert vals[0][30] == vals[1][30]


@pytest.mark.slow  # ZeRO-3's partitioned averages against one process's
@pytest.mark.distributed
def test_zero3_two_processes_average_as_one_process_does(tmp_path, cache_dir):
    """Each rank averages its own partitions; the merged model of two processes is the one-process run's, to within
    how far the two runs' live weights drift apart (the same recipe and engine, one rank's partitions or two); and
    the export of the ZeRO-3 checkpoint assembles both ranks' pieces into the same merged model."""
    from test_distributed import launch

    sets = [x for s in AVG for x in ("--set", s)]
    out, ema_run = tmp_path / "z3", tmp_path / "z3-one"
    assert launch("zero3.yaml", ema_run, cache_dir, *sets, processes=1).returncode == 0
    proc = launch("zero3.yaml", out, cache_dir, *sets)
    assert proc.returncode == 0, proc.stderr[-4000:]
    last = sorted((out / "checkpoints").glob("step_*"))[-1]
    assert len(list((last / "averaging" / "merged").glob("rank_*.safetensors"))) == 2
    two = load_file(str(out / "merged" / "model.safetensors"))
    one = load_file(str(ema_run / "merged" / "model.safetensors"))
    live2, live1 = (load_file(str(d / "final" / "model.safetensors")) for d in (out, ema_run))

    def rel(a: dict, b: dict) -> float:  # relative Frobenius distance over the whole model
        num = sum(((a[k] - b[k]).double() ** 2).sum() for k in b)
        return float((num / sum((b[k].double() ** 2).sum() for k in b)).sqrt())

    drift, gap = rel(live2, live1), rel(two, one)
    rows = [[m for m in read_jsonl(d / "metrics.jsonl") if "val/ref_merged" in m] for d in (out, ema_run)]
    merged = [{m["step"]: m["val/ref_merged"] for m in r} for r in rows]
    live = [{m["step"]: m["val/ref"] for m in r} for r in rows]
    print(json.dumps({"live_drift": drift, "merged_gap": gap, "merged": merged, "live": live}))
    assert gap <= max(drift, 1e-6)  # the average adds nothing to how far the two runs' weights drift apart
    assert merged[0].keys() == merged[1].keys() == {15, 30}
    assert abs(merged[0][15] - merged[1][15]) < 1e-3  # before the runs' known drift (after ~step 25)
    # after the drift begins the merged evals differ about as much as the live ones: within half again (on an Intel
    # Xeon, same numbers at bdad714: 0.0102 merged vs 0.0091 live at step 30; an AMD EPYC passed with +1e-3)
    assert all(abs(merged[0][s] - merged[1][s]) <= 1.5 * abs(live[0][s] - live[1][s]) + 1e-3 for s in (15, 30))
    proc = export_merged(last, tmp_path / "x")
    assert proc.returncode == 0, proc.stderr[-2000:]
    exported = load_file(str(tmp_path / "x" / "model.safetensors"))
    assert all(torch.allclose(exported[k], two[k], atol=1e-6) for k in two)


def test_check_run_sets_the_merged_weights_against_the_live_ones_before_the_decay(ema_run, capsys):
    import check_run

    assert check_run.main([str(ema_run), "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["merged"]
    assert r["step"] == 15  # the last merged eval before the run's decay (steps 27-30)
    assert r["merged"] != r["live"] and r["line"].startswith("merged weights at step 15: val/ref ")
    assert check_run.main([str(ema_run)]) == 0
    assert "\naveraging: merged weights at step 15" in capsys.readouterr().out


def test_json_is_alone_on_stdout(ema_run):
    """DeepSpeed's accelerator notice (printed to stdout when it is imported) goes to stderr under `--json`, so
    `check_run.py RUN --json | jq` reads one object."""
    proc = subprocess.run(
        [sys.executable, "scripts/check_run.py", str(ema_run), "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["merged"]["step"] == 15
