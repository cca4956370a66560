"""Two CPU processes under DeepSpeed ZeRO-3 through `accelerate launch`: the same script, the same recipe."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import step_losses
from transformers import AutoModelForCausalLM

from pretrainer.tracking import read_jsonl

ROOT = Path(__file__).resolve().parents[1]


def launch(config: str, out: Path, cache_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", f"accelerate_configs/{config}",
        "--num_processes", "2", "--mixed_precision", "no",
        "scripts/run_recipe.py", "tests/fixtures/micro.yaml", "--output-dir", str(out),
        "--set", "precision.mixed=no", "--set", f"data.cache_dir={cache_dir}", *extra,
    ]  # fmt: skip
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.distributed
def test_zero3_two_processes(tmp_path, cache_dir):
    out = tmp_path / "z3"
    proc = launch("zero3.yaml", out, cache_dir)
    assert proc.returncode == 0, proc.stderr[-4000:]
    start = read_jsonl(out / "events.jsonl")[0]
    assert start["event"] == "run_start" and start["world"] == 2  # accelerator.num_processes == 2
    assert proc.stdout.count("run micro:") == 1 and proc.stdout.count("done.") == 1  # the main process alone
    assert "2 process(es)" in proc.stdout
    val = [m["val/avg"] for m in read_jsonl(out / "metrics.jsonl") if "val/avg" in m]
    assert val[-1] < val[0] - 0.5
    model = AutoModelForCausalLM.from_pretrained(out / "final")  # gathered from ZeRO-3 shards
    assert sum(p.numel() for p in model.parameters()) > 0


@pytest.mark.distributed
def test_zero3_save_kill_resume_export(tmp_path, cache_dir):
    ckpt = ["--set", "checkpoint.every_tokens=8192", "--set", "eval.every_steps=0"]
    ref, out = tmp_path / "ref", tmp_path / "run"
    assert launch("zero3.yaml", ref, cache_dir, *ckpt).returncode == 0
    os.environ["PRETRAINER_KILL_AT"] = "step:13"  # both ranks die by SIGKILL after step 13
    try:
        proc = launch("zero3.yaml", out, cache_dir, *ckpt)
    finally:
        del os.environ["PRETRAINER_KILL_AT"]
    assert proc.returncode != 0
    proc = launch("zero3.yaml", out, cache_dir, *ckpt, "--resume", "auto")
    assert proc.returncode == 0, proc.stderr[-4000:]
    resume = [e for e in read_jsonl(out / "events.jsonl") if e["event"] == "resume"]
    assert resume and resume[0]["step"] == 8
    a, b = step_losses(ref), step_losses(out)
    assert a.keys() == b.keys() and max(abs(a[k] - b[k]) for k in a) <= 1e-6

    from pretrainer.checkpoint import list_checkpoints
    from pretrainer.export import export_checkpoint

    last = list_checkpoints(out / "checkpoints")[-1].path
    assert any(last.rglob("*optim_states.pt")), "expected DeepSpeed ZeRO shards"
    export_checkpoint(last, tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    final = AutoModelForCausalLM.from_pretrained(out / "final")
    for k, v in final.state_dict().items():
        assert torch.allclose(model.state_dict()[k], v), k


@pytest.mark.distributed
def test_crafted_deepspeed_checkpoint_never_runs_code(tmp_path, cache_dir):
    """A ZeRO shard replaced by a pickle that runs a command, with a manifest that matches it: --resume and export
    refuse it (exit 2, one line) and the command never runs."""
    import pickle

    from pretrainer import checkpoint as ck

    out = tmp_path / "z3"
    short = ["--set", "stages.0.steps=8", "--set", "eval.every_steps=0", "--set", "checkpoint.every_tokens=8192"]
    assert launch("zero3.yaml", out, cache_dir, *short).returncode == 0
    last = ck.list_checkpoints(out / "checkpoints")[-1].path
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    shard = next(last.glob("pytorch_model/*optim_states.pt"))
    shard.write_bytes(pickle.dumps({"optimizer_state_dict": Payload()}))
    (last / ck.MANIFEST).unlink()
    ck.write_manifest(last)  # a consistent manifest: only the loader can refuse it
    assert ck.verify(last, deep=False) == []
    proc = launch("zero3.yaml", out, cache_dir, *short, "--resume", str(last), "--allow-recipe-change")
    # each rank exits 2 with one line; the launcher (torch elastic) reports any failed rank as exit 1
    assert proc.returncode != 0 and "exitcode  : 2" in proc.stderr, proc.stderr[-3000:]
    assert "refused to unpickle code" in proc.stderr
    assert not marker.exists()
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    exp = subprocess.run([sys.executable, "scripts/export_checkpoint.py", str(last), str(tmp_path / "hf")], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert exp.returncode == 2 and "cannot be read without unpickling" in exp.stderr, exp.stderr[-3000:]
    assert "Traceback" not in exp.stderr
    assert not marker.exists()
