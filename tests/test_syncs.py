"""One host synchronisation per optimizer step, counted on every backend we can launch on CPU processes
(tests/fixtures/count_syncs.py counts tensor-to-host reads and device synchronisations during one step, per rank).
One process: tests/test_stability.py."""

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT

FIXTURE = "tests/fixtures/count_syncs.py"


def counted(tmp_path, cache_dir, launcher: list[str]) -> list[dict]:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, *launcher, FIXTURE, str(tmp_path), str(cache_dir)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((tmp_path / f"syncs_rank{r}.json").read_text()) for r in (0, 1)]


def ours(record: dict) -> int:
    return sum(n for site, n in record["sites"].items() if "pretrainer" in site)


@pytest.mark.distributed
def test_ddp_step_reads_the_host_once(tmp_path, cache_dir):
    ranks = counted(tmp_path, cache_dir, ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"])
    for r in ranks:
        assert r["world"] == 2 and r["micro_batches"] == 2
        assert r["reads"] == 1 and r["synchronize"] == 0, r["sites"]


def deepspeed(config: str) -> list[str]:
    accelerate = ["-m", "accelerate.commands.launch", "--config_file", f"accelerate_configs/{config}"]
    return [*accelerate, "--num_processes", "2", "--mixed_precision", "no"]


@pytest.mark.distributed
@pytest.mark.parametrize("config", ["zero3.yaml", pytest.param("zero2.yaml", marks=pytest.mark.slow)])
def test_deepspeed_step_reads_the_host_once_besides_deepspeeds_own_checks(tmp_path, cache_dir, config):
    """Ours: the guard's one read. DeepSpeed's: its gradient-norm validity checks (ZeRO-3 one per step, ZeRO-1/2
    three); its throughput timer, which synchronised at every forward and step, is off in the config we write."""
    for r in counted(tmp_path, cache_dir, deepspeed(config)):
        assert r["world"] == 2 and ours(r) == 1 and r["synchronize"] == 0, r["sites"]
        assert r["reads"] <= (2 if config == "zero3.yaml" else 4), r["sites"]  # none per micro batch
