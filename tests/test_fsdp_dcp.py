"""FSDP2 checkpoints through DCP on 2 CPU processes (gloo), with torch's own `fully_shard`: Accelerate enables FSDP only
on accelerators (`AcceleratorState` sets DistributedType.FSDP only for MULTI_GPU/XPU/NPU/HPU...), so the trainer's
FSDP path runs on GPUs; what it calls (`DcpCheckpointer`, `commit`) is exercised here by tests/fixtures/fsdp_dcp.py."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pretrainer.checkpoint import format as ck
from pretrainer.checkpoint import integrity

ROOT = Path(__file__).resolve().parents[1]


def run(out: Path, procs: int, *extra: str, kill_at: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PRETRAINER_KILL_AT", None)
    if kill_at:
        env["PRETRAINER_KILL_AT"] = kill_at
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(procs),
        "tests/fixtures/fsdp_dcp.py",
        "--out",
        str(out),
        *extra,
    ]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def losses(out: Path) -> dict[int, float]:
    out_ = {}
    for line in (out / "losses.jsonl").read_text().splitlines():
        r = json.loads(line)
        out_[r["step"]] = r["loss"]  # a replayed step replaces the earlier one
    return out_


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp") / "ref"
    proc = run(out, 2, "--async")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.distributed
def test_async_sharded_save_is_per_rank_and_verifies(ref):
    cands = ck.list_checkpoints(ref / "checkpoints")
    assert [c.meta["step"] for c in cands] == [4, 8, 12]
    manifest = json.loads((cands[-1].path / ck.MANIFEST).read_text())["files"]
    assert {"dcp/__0_0.distcp", "dcp/__1_0.distcp", "dcp/.metadata"} <= manifest.keys()  # one shard per rank
    for c in cands:
        assert ck.verify(c.path) == [] and ck.verify(c.path, scan=True) == []


@pytest.mark.distributed
def test_sigkill_during_async_saves_resumes_exactly(ref, tmp_path):
    out = tmp_path / "run"
    assert run(out, 2, "--async", kill_at="step:9").returncode != 0  # the save of step 8 may still be in flight
    proc = run(out, 2, "--async", "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = losses(ref), losses(out)
    assert a.keys() == b.keys() and max(abs(a[k] - b[k]) for k in a) <= 1e-6
    assert ck.newest_valid(out / "checkpoints")[0].meta["step"] == 12


@pytest.mark.distributed
@pytest.mark.parametrize("saved,resumed", [(2, 1), pytest.param(1, 2, marks=pytest.mark.slow)])
def test_resume_on_another_world_size_reshards(ref, tmp_path, saved, resumed):
    src = ref
    if saved != 2:
        src = tmp_path / "src"
        assert run(src, saved).returncode == 0
    out = tmp_path / "run"
    shutil.copytree(src, out)
    shutil.rmtree(out / "checkpoints" / "step_00000012")
    proc = run(out, resumed, "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = losses(src), losses(out)
    assert max(abs(a[k] - b[k]) for k in range(9, 13)) <= 1e-5  # same global batch: the same curve, to rounding


@pytest.mark.distributed
def test_nan_in_one_ranks_shard_flags_the_checkpoint(tmp_path):
    out = tmp_path / "run"
    assert run(out, 2, "--async", "--nan-at", "8").returncode == 0
    bad = out / "checkpoints" / "step_00000008"
    assert ck.read_meta(bad)["state_finite"] is False
    assert "NaN/Inf" in ck.verify(bad)[0]
    ck_meta = json.loads((bad / ck.META).read_text())
    ck_meta.pop("state_finite")  # as if the live check had not run: the deep scan still finds rank 1's shard
    (bad / ck.META).write_text(json.dumps(ck_meta))
    assert any("__1_0.distcp" in p and "exp_avg_sq" in p for p in integrity.scan_files(bad))
    good, _ = ck.newest_valid(out / "checkpoints")
    assert good.meta["step"] == 4


@pytest.mark.distributed
def test_dcp_checkpoint_exports_as_a_hf_model(ref, tmp_path):
    import torch
    from tokenizers import Tokenizer, models
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from pretrainer.checkpoint.export import export_checkpoint

    ckpt = tmp_path / "step_00000012"
    shutil.copytree(ref / "checkpoints" / "step_00000012", ckpt)
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")))
    tok.save_pretrained(ckpt / "tokenizer")
    ck.write_manifest(ckpt)  # the tokenizer is part of the checkpoint, as the trainer writes it
    model = AutoModelForCausalLM.from_pretrained(export_checkpoint(ckpt, tmp_path / "hf"))
    torch.manual_seed(0)
    init = AutoModelForCausalLM.from_config(model.config).state_dict()  # the harness's initial weights (seed 0)
    for name, w in model.state_dict().items():  # whole tensors, gathered from both ranks' shards
        moved = (w - init[name]).abs().max().item()
        # every weight was trained, and by no more than AdamW's bound: 12 steps x lr 3e-3 (plus weight decay)
        assert 0 < moved <= 12 * 3e-3 * 1.1, name
