"""Two CPU processes under DeepSpeed ZeRO-3 through `accelerate launch`: the same script, the same recipe."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
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
    val = [m["val/avg"] for m in read_jsonl(out / "metrics.jsonl") if "val/avg" in m]
    assert val[-1] < val[0] - 0.5
    model = AutoModelForCausalLM.from_pretrained(out / "final")  # gathered from ZeRO-3 shards
    assert sum(p.numel() for p in model.parameters()) > 0
